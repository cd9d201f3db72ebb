#include "transfer/step_bytes.h"

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::StatusOr<StepBytes> StepBytes::Load(const Store& store,
                                          const StepRecord& step,
                                          const Placement& placement) {
  StepBytes out;
  for (int g = 0; g < step.groups; ++g) {
    ASSIGN_OR_RETURN(ShardRecord record, store.Shard(step.step, g));
    if (record.tensors.size() != placement.shards(g).size()) {
      return absl::DataLossError(
          absl::StrCat("catalog record of step ", step.step, " group ", g,
                       " lists ", record.tensors.size(),
                       " tensors, the placement ", placement.shards(g).size()));
    }
    std::vector<Tensor> tensors;
    for (size_t k = 0; k < record.tensors.size(); ++k) {
      const std::string& name = record.blobs[record.tensors[k].blob];
      auto it = out.blobs_.find(name);
      if (it == out.blobs_.end()) {
        it = out.blobs_.emplace(name, BlobReader::Open(store, name)).first;
      }
      const BlobReader& blob = *it->second;
      // A location past the blob's end fails each read (Verify), like any
      // other damage, rather than the whole step.
      const int64_t offset = record.tensors[k].offset;
      tensors.push_back(
          {&blob, blob.data() != nullptr ? blob.data() + offset : nullptr,
           offset});
    }
    out.tensors_.push_back(std::move(tensors));
  }
  return out;
}

}  // namespace scalai
