// StepBytes holds a stored step's bytes open for reading: every blob mapped
// and open, and where each stored shard's tensor lies in them. Exports and the
// mount's views read through it.
//
//   ASSIGN_OR_RETURN(StepBytes bytes, StepBytes::Load(store, step, *p));
//   const StepBytes::Tensor& t = bytes.tensor({group, shard});
#ifndef SCALAI_TRANSFER_STEP_BYTES_H_
#define SCALAI_TRANSFER_STEP_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/placement.h"
#include "ptc/reshard_plan.h"
#include "transfer/files.h"
#include "transfer/store.h"

namespace scalai {

class StepBytes {
 public:
  // `placement` is the one the step is stored under (Store::StepPlacement).
  static absl::StatusOr<StepBytes> Load(const Store& store,
                                        const StepRecord& step,
                                        const Placement& placement);

  // A stored tensor: mapped, and as a descriptor and offset for copies that
  // stay inside the kernel.
  struct Tensor {
    const std::byte* data;
    int fd;
    int64_t offset;
  };
  const Tensor& tensor(ShardRef ref) const {
    return tensors_[ref.group][ref.shard];
  }

 private:
  struct Blob {
    MappedFile map;
    UniqueFd fd;
  };
  std::map<std::string, Blob> blobs_;
  std::vector<std::vector<Tensor>> tensors_;  // [group][shard]
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_STEP_BYTES_H_
