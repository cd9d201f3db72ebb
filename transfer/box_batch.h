// A batch of box copies and zero fills handed to a copy engine at once: on
// the host a loop of memcpy, on a GPU one kernel launch for all of them
// (transfer/cuda/device_box_copy.h). Boxes are the ones CopyBox and ZeroBox
// take; the batch flattens each into BoxRuns, merging the dimensions that
// lie contiguous in both tensors, so engines see only equal runs.
//
//   BoxBatch batch;
//   RETURN_IF_ERROR(batch.AddCopy(src, {8, 6}, {2, 0}, dst, {4, 6}, {0, 0},
//                                 {4, 6}, /*elem_bytes=*/2));
//   RETURN_IF_ERROR(batch.AddZero(dst, {4, 6}, {0, 0}, {1, 6}, 2));
//   CopyBatchOnHost(batch);
#ifndef SCALAI_TRANSFER_BOX_BATCH_H_
#define SCALAI_TRANSFER_BOX_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "ptc/box.h"
#include "transfer/box_runs.h"

namespace scalai {

class BoxBatch {
 public:
  // The copy CopyBox(src, ..., elem_bytes) makes; the box must lie inside
  // both tensors (an error names the first dimension where it does not).
  absl::Status AddCopy(const std::byte* src, const Shape& src_shape,
                       const Shape& src_origin, std::byte* dst,
                       const Shape& dst_shape, const Shape& dst_origin,
                       const Shape& box_shape, int elem_bytes);
  // The fill ZeroBox(dst, ..., elem_bytes) makes.
  absl::Status AddZero(std::byte* dst, const Shape& dst_shape,
                       const Shape& dst_origin, const Shape& box_shape,
                       int elem_bytes);

  const std::vector<BoxRuns>& boxes() const { return boxes_; }
  // Bytes written by the whole batch.
  int64_t bytes() const { return bytes_; }
  bool empty() const { return boxes_.empty(); }
  void clear() {
    boxes_.clear();
    bytes_ = 0;
  }

 private:
  std::vector<BoxRuns> boxes_;
  int64_t bytes_ = 0;
};

// Executes the batch on the host, run by run: the host's copy engine, and
// the reference the GPU's is checked against.
void CopyBatchOnHost(const BoxBatch& batch);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_BOX_BATCH_H_
