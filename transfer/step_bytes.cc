#include "transfer/step_bytes.h"

#include <fcntl.h>

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
        Blob blob;
        ASSIGN_OR_RETURN(blob.map, MappedFile::Open(store.BlobPath(name)));
        ASSIGN_OR_RETURN(blob.fd, OpenFile(store.BlobPath(name), O_RDONLY));
        it = out.blobs_.emplace(name, std::move(blob)).first;
      }
      const int64_t offset = record.tensors[k].offset;
      if (offset + placement.shards(g)[k].bytes > it->second.map.size()) {
        return absl::DataLossError(
            absl::StrCat("blob ", name, " of step ", step.step,
                         " is shorter than its record says (run "
                         "scalai fsck)"));
      }
      tensors.push_back(
          {it->second.map.data() + offset, it->second.fd.get(), offset});
    }
    out.tensors_.push_back(std::move(tensors));
  }
  return out;
}

}  // namespace scalai
