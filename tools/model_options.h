// The options that `synth` and `plan` share to name a model: a layout with
// its parameters, a model description and a dtype, turned into a Layout and
// a Model.
//
//   ModelOptions opts;
//   opts.Register(app);  // --layout --param --model --dtype
//   ASSIGN_OR_RETURN(LoadedModel m, opts.Load());
#ifndef SCALAI_TOOLS_MODEL_OPTIONS_H_
#define SCALAI_TOOLS_MODEL_OPTIONS_H_

#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "ptc/layout.h"
#include "ptc/model.h"

namespace scalai {

struct LoadedModel {
  Layout layout;  // with its parameters set
  std::shared_ptr<const Model> model;
};

struct ModelOptions {
  std::string layout = "megatron-core-gpt";
  std::vector<std::string> params;  // k=v
  std::string model;                // k=v,...
  std::string dtype = "bf16";

  // With `required`, --layout and --model must be given; else a caller that
  // has another source for the model (a store) checks them itself.
  void Register(CLI::App* app, bool required = true);
  absl::StatusOr<LoadedModel> Load() const;
};

}  // namespace scalai

#endif  // SCALAI_TOOLS_MODEL_OPTIONS_H_
