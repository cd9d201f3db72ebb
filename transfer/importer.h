// Imports a checkpoint into a store as one new step: per-rank shards
// (SRC/rank-NNNNN/model.safetensors, with the files under rank-NNNNN/extra/
// kept whole), one full .safetensors model, or a Hugging Face sharded
// directory (model.safetensors.index.json). Everything is checked
// before a byte is copied; files are copied verbatim into new blobs, fsynced,
// and committed in one catalog batch, so a failure or a kill leaves no step.
//
//   ImportOptions o{.src = "ckpt", .config = config};
//   ASSIGN_OR_RETURN(ImportResult r, ImportCheckpoint(*store, o));
#ifndef SCALAI_TRANSFER_IMPORTER_H_
#define SCALAI_TRANSFER_IMPORTER_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "ptc/parallel_config.h"
#include "transfer/parallel.h"
#include "transfer/store.h"

namespace scalai {

struct ImportOptions {
  std::string src;
  ParallelConfig config;
  // Default: the shards' "scalai.step" metadata, else 0.
  std::optional<int64_t> step;
  ProgressFn progress;
};

struct ImportResult {
  StepRecord step;
  int files = 0;
  int64_t bytes_copied = 0;
};

absl::StatusOr<ImportResult> ImportCheckpoint(Store& store,
                                              const ImportOptions& options);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_IMPORTER_H_
