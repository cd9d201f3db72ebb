// Exports a stored step as per-rank shards for any config (the bytes the mount
// shows, extra/ files included), as a Megatron-LM checkpoint for any config,
// or as the full model in a Hugging Face sharded directory. The step is read
// from a StepSnapshot, so a mount serving the store may go on beside the
// export. Output files are written under temporary names, fsynced and
// renamed.
//
//   ASSIGN_OR_RETURN(StepSnapshot step, StepSnapshot::Open("/data/job", {}));
//   ExportOptions o{.out = "out", .config = config};
//   ASSIGN_OR_RETURN(ExportResult r, ExportCheckpoint(step, o));
#ifndef SCALAI_TRANSFER_EXPORTER_H_
#define SCALAI_TRANSFER_EXPORTER_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "ptc/parallel_config.h"
#include "transfer/parallel.h"
#include "transfer/step_snapshot.h"

namespace scalai {

struct ExportOptions {
  std::string out;
  // Per-rank shards for this config; ignored with `merged`.
  std::optional<ParallelConfig> config;
  bool merged = false;
  // Megatron-LM's own layout for the config's dp_rank 0 ranks (no fsdp, no
  // distopt): iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt and
  // latest_checkpointed_iteration.txt.
  bool megatron = false;
  // With `merged`: the largest file before the next one starts.
  int64_t max_file_bytes = int64_t{5} << 30;
  ProgressFn progress;
};

struct ExportResult {
  int64_t step = 0;
  int files = 0;
  int64_t bytes_written = 0;
};

absl::StatusOr<ExportResult> ExportCheckpoint(const StepSnapshot& step,
                                              const ExportOptions& options);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_EXPORTER_H_
