// `scalai synth`: a random checkpoint as per-rank shards (or one full model),
// deterministic by seed, for demos, tests and benchmarks.
#include <filesystem>
#include <memory>

#include "absl/strings/str_format.h"
#include "ptc/parallel_config.h"
#include "ptc/placement.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/model_options.h"
#include "tools/synth.h"

namespace scalai {
namespace {

struct SynthOptions {
  ModelOptions model;
  std::string out;
  std::string config;
  uint64_t seed = 1;
  bool full = false;
};

absl::Status MakeDirs(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::ErrnoToStatus(ec.value(),
                               absl::StrCat("create directory ", dir.string()));
  }
  return absl::OkStatus();
}

absl::Status RunSynth(const SynthOptions& o) {
  ASSIGN_OR_RETURN(LoadedModel m, o.model.Load());
  const std::filesystem::path out(o.out);
  if (o.full) {
    RETURN_IF_ERROR(MakeDirs(out));
    return WriteSynthFull(*m.model, o.seed,
                          (out / "model.safetensors").string());
  }
  ASSIGN_OR_RETURN(ParallelConfig config, ParallelConfig::Parse(o.config));
  ASSIGN_OR_RETURN(Placement placement,
                   Placement::Create(m.layout, m.model, config));
  // Like Megatron, only data-parallel rank 0 of each shard group saves
  // (under fsdp=S, the first S: one whole copy).
  for (int rank = 0; rank < config.world_size(); ++rank) {
    if (!config.SavesShard(rank)) continue;
    std::filesystem::path dir = out / absl::StrFormat("rank-%05d", rank);
    RETURN_IF_ERROR(MakeDirs(dir));
    RETURN_IF_ERROR(WriteSynthShard(placement, rank, o.seed,
                                    (dir / "model.safetensors").string()));
  }
  return absl::OkStatus();
}

}  // namespace

Command AddSynthCommand(CLI::App& root) {
  auto o = std::make_shared<SynthOptions>();
  CLI::App* app =
      root.add_subcommand("synth",
                          "Write a random checkpoint as per-rank shards "
                          "OUT/rank-NNNNN/model.safetensors");
  app->add_option("OUT", o->out, "output directory")->required();
  o->model.Register(app);
  auto* config = app->add_option("--config", o->config,
                                 "parallel config, e.g. tp=2,pp=2,dp=2");
  auto* full = app->add_flag(
      "--full", o->full,
      "write the unsharded model as OUT/model.safetensors instead");
  config->excludes(full);
  app->add_option("--seed", o->seed, "random seed")->capture_default_str();
  app->callback([config, full] {
    if (config->count() == 0 && full->count() == 0) {
      throw CLI::RequiredError("--config (or --full)");
    }
  });
  return {app, [o] { return RunSynth(*o); }};
}

}  // namespace scalai
