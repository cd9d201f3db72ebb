// A ModelSpec is a model described by its sizes (docs/reference.md), the
// `--model layers=2,hidden=64,heads=4,vocab=1000` of `synth` and `plan`. It
// builds the global tensor list that a layout preset's naming implies.
//
//   ASSIGN_OR_RETURN(ModelSpec spec,
//                    ModelSpec::Parse("layers=2,hidden=64,heads=4,vocab=1000"));
//   RETURN_IF_ERROR(spec.ApplyParams(layout));  // gated_linear_unit, vocab_size
//   ASSIGN_OR_RETURN(Model model, spec.Build(layout, DType::kBF16));
#ifndef SCALAI_PTC_MODEL_SPEC_H_
#define SCALAI_PTC_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ptc/dtype.h"
#include "ptc/layout.h"
#include "ptc/model.h"

namespace scalai {

struct ModelSpec {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t groups = 0;  // query groups; 0 = heads
  int64_t ffn = 0;     // 0 = 4 * hidden
  int64_t vocab = 0;
  bool bias = false;
  // "adam" adds optimizer.exp_avg.<name> and optimizer.exp_avg_sq.<name> in F32
  // for every parameter.
  std::string optimizer;
  // Keys that are not sizes: layout parameters such as gated_linear_unit=1.
  std::vector<std::pair<std::string, std::string>> layout_params;

  static absl::StatusOr<ModelSpec> Parse(absl::string_view text);

  // Sets the layout parameters named in the spec, and vocab_size from vocab.
  absl::Status ApplyParams(Layout& layout) const;

  // The global tensors for `layout`'s naming (megatron-core-gpt or hf-llama).
  absl::StatusOr<Model> Build(const Layout& layout, DType dtype) const;
};

}  // namespace scalai

#endif  // SCALAI_PTC_MODEL_SPEC_H_
