// Checks that a safetensors file holds exactly the tensors a shard group's
// placement gives it: every local name present with the model's dtype and
// the local shape, nothing else. Import and saving through the mount share
// it, so that both refuse the same shards with the same words.
//
//   ASSIGN_OR_RETURN(std::vector<int64_t> at,
//                    MatchShardHeader(model, placement.shards(g), header,
//                                     "rank-00003/model.safetensors",
//                                     "rank 3 (tp_rank 1, pp_rank 1)"));
#ifndef SCALAI_TRANSFER_SHARD_CHECK_H_
#define SCALAI_TRANSFER_SHARD_CHECK_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ptc/model.h"
#include "ptc/placement.h"
#include "ptc/safetensors.h"

namespace scalai {

// The file offset of each of `shards`' tensors in the file, in their order;
// an InvalidArgument error starting with `label` otherwise, naming the
// tensor, what `where` should hold and what the file has.
absl::StatusOr<std::vector<int64_t>> MatchShardHeader(
    const Model& model, const std::vector<TensorShard>& shards,
    const SafetensorsHeader& header, absl::string_view label,
    absl::string_view where);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_SHARD_CHECK_H_
