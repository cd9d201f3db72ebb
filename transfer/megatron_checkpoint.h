// A Megatron-LM checkpoint as `torch.save` wrote it:
//   DIR/latest_checkpointed_iteration.txt
//   DIR/iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt       (pp = 1)
//   DIR/iter_NNNNNNN/mp_rank_TT_PPP/model_optim_rng.pt   (pp > 1)
// read without running its pickles (ptc/pickle.h). Each rank file becomes
// one shard of the import config: its `model` tensors under their
// Megatron-Core names, then its optimizer's per-parameter state
// (`optimizer.exp_avg.NAME`, `optimizer.exp_avg_sq.NAME`, the fp32 master
// copy `optimizer.fp32_param.NAME`), which then follows its parameter when
// the config changes. Everything else of the file (args, iteration,
// checkpoint_version, RNG state, param_groups, the grad scaler, the
// scheduler) is its *remainder*, kept as a torch.save file of its own.
//
//   ASSIGN_OR_RETURN(MegatronCheckpoint c, ReadMegatronCheckpoint(dir, config));
//   for (const MegatronRankFile& r : c.ranks)  // by shard group
//     RETURN_IF_ERROR(StreamMegatronShard(r, sink));  // safetensors bytes
#ifndef SCALAI_TRANSFER_MEGATRON_CHECKPOINT_H_
#define SCALAI_TRANSFER_MEGATRON_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/parallel_config.h"
#include "ptc/pickle.h"
#include "ptc/safetensors.h"

namespace scalai {

struct MegatronTensor {
  std::string name;  // as the shard names it
  PickleTensor tensor;
};

struct MegatronRankFile {
  int tp_rank = 0;
  int pp_rank = 0;
  std::string path;
  std::string label;  // "iter_0000100/mp_rank_01_000/model_optim_rng.pt"
  std::vector<MegatronTensor> tensors;
  // The shard Scalai stores: `tensors` in order, with the iteration as
  // its "scalai.step".
  SafetensorsHeader header;
  // The rest of the file, a torch.save zip (its tensors' storages copied).
  std::string remainder;
};

struct MegatronCheckpoint {
  std::string iter_dir;
  int64_t iteration = 0;
  std::vector<MegatronRankFile>
      ranks;  // by shard group: pp_rank * tp + tp_rank
};

// Where a remainder appears among a step's extra files.
inline constexpr char kMegatronRemainderPath[] = "megatron/model_optim_rng.pt";

// Whether `dir` is a Megatron checkpoint: an iter_* directory, or a
// directory with latest_checkpointed_iteration.txt.
bool IsMegatronCheckpoint(const std::string& dir);

// Reads every rank file of `dir` (or of the iteration its
// latest_checkpointed_iteration.txt names) saved under `config`, checking
// each against the config's tp and pp and the others. Errors name the file.
absl::StatusOr<MegatronCheckpoint> ReadMegatronCheckpoint(
    const std::string& dir, const ParallelConfig& config);

// Writes `rank`'s shard as a safetensors file's bytes to `sink`, in order.
absl::Status StreamMegatronShard(
    const MegatronRankFile& rank,
    const std::function<absl::Status(const char*, int64_t)>& sink);

// What the export writes for one rank of another config: the pickle of
// its model_optim_rng.pt, whose tensor i (of `tensors`, a shard's tensors
// in order) is storage "i", and the records of the storages the pickle
// takes from the remainder (RNG state and the like), under new keys.
struct MegatronRankOutput {
  std::string pickle;
  std::vector<std::pair<std::string, std::string>> storages;
};

// Builds a rank's file for `config` at iteration `step`: the remainder
// (a torch.save file's bytes; unset: none, a minimal one is made) with args'
// tensor_model_parallel_size and pipeline_model_parallel_size set to the
// config's, its model the shard's parameters, and its optimizer state
// (`optimizer.KEY.PARAM` tensors) put back where Megatron keeps it, in its
// param groups.
absl::StatusOr<MegatronRankOutput> BuildMegatronRank(
    const std::vector<SafetensorsEntry>& tensors,
    std::optional<std::string> remainder, const ParallelConfig& config,
    int64_t step);

// "iter_0000100/mp_rank_01_002/model_optim_rng.pt".
std::string MegatronRankPath(int64_t iteration, int tp_rank, int pp_rank,
                             int pp);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_MEGATRON_CHECKPOINT_H_
