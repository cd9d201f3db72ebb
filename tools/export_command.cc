// `scalai export`: a stored step as per-rank shards for any config (as
// safetensors or as a Megatron-LM checkpoint), or merged.
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/human_bytes.h"
#include "tools/model_options.h"
#include "tools/progress_bar.h"
#include "transfer/exporter.h"
#include "transfer/step_snapshot.h"

namespace scalai {
namespace {

struct ExportCliOptions {
  std::string store, out, config;
  int64_t step = 0;
  CLI::Option* step_option = nullptr;
  bool merged = false;
  std::string format = "safetensors";
  int64_t max_file_bytes = int64_t{5} << 30;
};

absl::Status RunExport(const ExportCliOptions& o) {
  ExportOptions options;
  options.out = o.out;
  options.merged = o.merged;
  options.megatron = o.format == "megatron";
  if (o.merged && options.megatron)
    return absl::InvalidArgumentError("--merged writes safetensors only");
  options.max_file_bytes = o.max_file_bytes;
  if (!o.merged) {
    if (o.config.empty())
      return absl::InvalidArgumentError("give --config C (or --merged)");
    ASSIGN_OR_RETURN(ParallelConfig config, ParallelConfig::Parse(o.config));
    options.config = config;
  }
  // Taken once the options hold, and beside a mount if one serves the
  // store: the step's blobs stay open for the export however the mount
  // reconfigures.
  ASSIGN_OR_RETURN(
      StepSnapshot step,
      StepSnapshot::Open(o.store, OptionalValue(o.step_option, o.step)));
  ProgressBar bar("export");
  options.progress = bar.Callback();
  auto result = ExportCheckpoint(step, options);
  bar.Finish();
  if (!result.ok()) return result.status();
  std::printf("exported step %lld: %d file%s, %s\n",
              static_cast<long long>(result->step), result->files,
              result->files == 1 ? "" : "s",
              HumanBytes(result->bytes_written).c_str());
  return absl::OkStatus();
}

}  // namespace

Command AddExportCommand(CLI::App& root) {
  auto o = std::make_shared<ExportCliOptions>();
  CLI::App* app = root.add_subcommand(
      "export",
      "Write a step as per-rank shards for a config (safetensors or "
      "Megatron-LM), or merged");
  app->add_option("STORE", o->store, "store directory")->required();
  app->add_option("OUT", o->out, "output directory (new or empty)")->required();
  auto* config =
      app->add_option("--config", o->config, "config of the shards to write");
  auto* merged =
      app->add_flag("--merged", o->merged,
                    "write the full model as a Hugging Face sharded directory");
  config->excludes(merged);
  app->add_option("--format", o->format,
                  "safetensors (rank-NNNNN/model.safetensors, or --merged) or "
                  "megatron (iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt)")
      ->check(CLI::IsMember({"safetensors", "megatron"}))
      ->capture_default_str();
  o->step_option =
      app->add_option("--step", o->step, "step (default: the newest)");
  app->add_option("--max-file-bytes", o->max_file_bytes,
                  "with --merged: bytes per file")
      ->capture_default_str();
  return {app, [o] { return RunExport(*o); }};
}

}  // namespace scalai
