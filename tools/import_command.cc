// `scalai import`: per-rank shards, a .safetensors model or a Hugging Face
// directory into a store, as one new step.
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/human_bytes.h"
#include "tools/model_options.h"
#include "tools/progress_bar.h"
#include "transfer/importer.h"
#include "transfer/store.h"

namespace scalai {
namespace {

struct ImportCliOptions {
  std::string store, src, config;
  int64_t step = 0;
  CLI::Option* step_option = nullptr;
};

absl::Status RunImport(const ImportCliOptions& o) {
  ASSIGN_OR_RETURN(auto store, Store::Open(o.store));
  ImportOptions options;
  options.src = o.src;
  ASSIGN_OR_RETURN(options.config, ParallelConfig::Parse(o.config));
  if (!options.config.hosts().empty()) {
    return absl::InvalidArgumentError(
        "--config: a checkpoint is saved under tp, pp, dp and stages; hosts= "
        "belongs to a mount's config");
  }
  options.step = OptionalValue(o.step_option, o.step);
  ProgressBar bar("import");
  options.progress = bar.Callback();
  auto result = ImportCheckpoint(*store, options);
  bar.Finish();
  if (!result.ok()) return result.status();
  std::printf("imported step %lld (%s): %d files, %s\n",
              static_cast<long long>(result->step.step),
              result->step.config.c_str(), result->files,
              HumanBytes(result->bytes_copied).c_str());
  return absl::OkStatus();
}

}  // namespace

Command AddImportCommand(CLI::App& root) {
  auto o = std::make_shared<ImportCliOptions>();
  CLI::App* app = root.add_subcommand("import",
                                      "Import per-rank shards, a .safetensors "
                                      "model, a Hugging Face directory or a "
                                      "Megatron-LM checkpoint");
  app->add_option("STORE", o->store, "store directory")->required();
  app->add_option("SRC", o->src, "checkpoint to import")->required();
  app->add_option("--config", o->config,
                  "the config the checkpoint was saved under")
      ->required();
  o->step_option = app->add_option("--step", o->step,
                                   "step number (default: from metadata, or 0)")
                       ->check(CLI::NonNegativeNumber);
  return {app, [o] { return RunImport(*o); }};
}

}  // namespace scalai
