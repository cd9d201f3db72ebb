// StepBytes holds a stored step's bytes open for reading: every blob as a
// BlobReader, and where each stored shard's tensor lies in them. Exports, the
// materializer and the mount's views read through it, and verify each range
// before touching it. A damaged blob does not stop the load: only the reads
// that need it fail.
//
//   ASSIGN_OR_RETURN(StepBytes bytes, StepBytes::Load(store, step, *p));
//   const StepBytes::Tensor& t = bytes.tensor({group, shard});
//   RETURN_IF_ERROR(t.Verify(offset, n));  // then t.data + offset
#ifndef SCALAI_TRANSFER_STEP_BYTES_H_
#define SCALAI_TRANSFER_STEP_BYTES_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/placement.h"
#include "ptc/reshard_plan.h"
#include "transfer/blob_reader.h"
#include "transfer/store.h"

namespace scalai {

class StepBytes {
 public:
  // `placement` is the one the step is stored under (Store::StepPlacement).
  static absl::StatusOr<StepBytes> Load(const Store& store,
                                        const StepRecord& step,
                                        const Placement& placement);
  // The shards a step retained (StepRecord::retained), under `placement`,
  // the placement of `kept.config`.
  static absl::StatusOr<StepBytes> LoadRetained(const Store& store,
                                                int64_t step,
                                                const RetainedShards& kept,
                                                const Placement& placement);

  // Whether this store holds the group's shards.
  bool holds(int group) const { return held_[group]; }
  bool holds_every_group() const {
    return std::find(held_.begin(), held_.end(), false) == held_.end();
  }

  // A stored tensor: mapped, and as a blob and offset for copies that stay
  // inside the kernel (BlobReader::OpenFd). Bytes may be used only after
  // Verify accepted them, and read only inside ReadMapped.
  struct Tensor {
    const BlobReader* blob;
    const std::byte* data;
    int64_t offset;  // in the blob
    // Bytes [offset, offset + length) of the tensor are the ones recorded.
    absl::Status Verify(int64_t at, int64_t length) const {
      return blob->Verify(offset + at, length);
    }
    // The same, once `unchanged` has looked at the blob in this operation.
    absl::Status Verify(int64_t at, int64_t length,
                        UnchangedBlobs& unchanged) const {
      if (absl::Status s = unchanged.Check(*blob); !s.ok()) return s;
      return blob->VerifyChunks(offset + at, length);
    }
    // Verify(at, length, unchanged), then the bytes copied to `out`; a
    // chunk read from the disk to be checked is copied from where it was
    // checked (BlobReader::ReadChunks).
    absl::Status Read(int64_t at, int64_t length, char* out,
                      UnchangedBlobs& unchanged) const {
      if (absl::Status s = unchanged.Check(*blob); !s.ok()) return s;
      return blob->ReadChunks(out, length, offset + at);
    }
  };
  // Only for a group it holds().
  const Tensor& tensor(ShardRef ref) const {
    return tensors_[ref.group][ref.shard];
  }
  // The blobs whose files were gone when it was loaded.
  std::set<std::string> MissingBlobs() const;

 private:
  // Adds group `g` as `record` locates it, or as not held when null.
  absl::Status AddGroup(const Store& store, int64_t step, int g,
                        const ShardRecord* record, const Placement& placement);

  std::map<std::string, std::shared_ptr<const BlobReader>> blobs_;
  std::vector<std::vector<Tensor>> tensors_;  // [group][shard]
  std::vector<bool> held_;                    // [group]
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_STEP_BYTES_H_
