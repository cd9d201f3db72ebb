// Runs a BoxBatch (transfer/box_batch.h) on a GPU: every box of the batch,
// copies and zero fills, in one kernel launch on a stream. The batch's
// pointers are device pointers (or any memory the device can address).
// The descriptors travel through a pinned buffer that is reused only once
// the launch that read it has started, so launches can be queued back to
// back without waiting.
//
//   ASSIGN_OR_RETURN(auto copier, DeviceBoxCopier::Create(/*device=*/0));
//   RETURN_IF_ERROR(copier->Launch(batch, stream));
//   RETURN_IF_ERROR(CUDA_CALL(cudaStreamSynchronize(stream)));
#ifndef SCALAI_TRANSFER_CUDA_DEVICE_BOX_COPY_H_
#define SCALAI_TRANSFER_CUDA_DEVICE_BOX_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transfer/box_batch.h"

namespace scalai {

class DeviceBoxCopier {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceBoxCopier>> Create(int device);
  DeviceBoxCopier(const DeviceBoxCopier&) = delete;
  DeviceBoxCopier& operator=(const DeviceBoxCopier&) = delete;
  ~DeviceBoxCopier();

  // Enqueues the batch on `stream` (of this copier's device). A copier
  // serves one stream: its descriptors' device copy is rewritten by the
  // next launch, which the stream orders after this one.
  absl::Status Launch(const BoxBatch& batch, cudaStream_t stream);

 private:
  explicit DeviceBoxCopier(int device) : device_(device) {}
  absl::Status Reserve(int64_t bytes);

  const int device_;
  int blocks_ = 0;                   // per launch: a few per multiprocessor
  std::byte* host_ = nullptr;        // pinned descriptors
  std::byte* device_buf_ = nullptr;  // their device copy
  int64_t capacity_ = 0;
  cudaEvent_t uploaded_ = nullptr;  // the last launch read its descriptors
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CUDA_DEVICE_BOX_COPY_H_
