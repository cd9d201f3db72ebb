// Synthetic checkpoints: deterministic pseudo-random tensor contents, written
// as per-rank safetensors shards or as one full model. A value depends only on
// (seed, global tensor name, global element index), so shards cut under any
// config agree with each other and with the full model.
//
//   RETURN_IF_ERROR(WriteSynthShard(placement, rank, /*seed=*/1, path));
//   RETURN_IF_ERROR(WriteSynthFull(model, /*seed=*/1, "model.safetensors"));
#ifndef SCALAI_TOOLS_SYNTH_H_
#define SCALAI_TOOLS_SYNTH_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "ptc/dtype.h"
#include "ptc/model.h"
#include "ptc/placement.h"

namespace scalai {

// Writes `count` values of `dtype`, elements [first, first + count) of the
// global tensor `name`, to `out`. Floating-point values are finite.
void FillSynthValues(uint64_t seed, absl::string_view name, DType dtype,
                     int64_t first, int64_t count, std::byte* out);

// The shard of `rank` under `placement` as a safetensors file whose metadata
// holds scalai.rank and scalai.config.
absl::Status WriteSynthShard(const Placement& placement, int rank,
                             uint64_t seed, const std::string& path);

// Every tensor of `model`, unsharded, as one safetensors file.
absl::Status WriteSynthFull(const Model& model, uint64_t seed,
                            const std::string& path);

}  // namespace scalai

#endif  // SCALAI_TOOLS_SYNTH_H_
