#include "transfer/cuda/device_box_copy.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "ptc/status_macros.h"
#include "transfer/cuda/box_kernel.h"
#include "transfer/cuda/cuda_status.h"

namespace scalai {

absl::StatusOr<std::unique_ptr<DeviceBoxCopier>> DeviceBoxCopier::Create(
    int device) {
  std::unique_ptr<DeviceBoxCopier> copier(new DeviceBoxCopier(device));
  RETURN_IF_ERROR(CUDA_CALL(cudaSetDevice(device)));
  int multiprocessors = 0;
  RETURN_IF_ERROR(CUDA_CALL(cudaDeviceGetAttribute(
      &multiprocessors, cudaDevAttrMultiProcessorCount, device)));
  copier->blocks_ = std::max(1, multiprocessors) * 8;
  RETURN_IF_ERROR(CUDA_CALL(
      cudaEventCreateWithFlags(&copier->uploaded_, cudaEventDisableTiming)));
  RETURN_IF_ERROR(copier->Reserve(64 << 10));
  return copier;
}

DeviceBoxCopier::~DeviceBoxCopier() {
  if (uploaded_ != nullptr) {
    cudaEventSynchronize(uploaded_);
    cudaEventDestroy(uploaded_);
  }
  if (host_ != nullptr) cudaFreeHost(host_);
  if (device_buf_ != nullptr) cudaFree(device_buf_);
}

absl::Status DeviceBoxCopier::Reserve(int64_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  const int64_t grown = std::max(bytes, capacity_ * 2);
  // The old buffers may still be read by a queued upload.
  RETURN_IF_ERROR(CUDA_CALL(cudaEventSynchronize(uploaded_)));
  if (host_ != nullptr) RETURN_IF_ERROR(CUDA_CALL(cudaFreeHost(host_)));
  if (device_buf_ != nullptr) RETURN_IF_ERROR(CUDA_CALL(cudaFree(device_buf_)));
  host_ = nullptr;
  device_buf_ = nullptr;
  capacity_ = 0;
  RETURN_IF_ERROR(
      CUDA_CALL(cudaMallocHost(reinterpret_cast<void**>(&host_), grown)));
  RETURN_IF_ERROR(
      CUDA_CALL(cudaMalloc(reinterpret_cast<void**>(&device_buf_), grown)));
  capacity_ = grown;
  return absl::OkStatus();
}

absl::Status DeviceBoxCopier::Launch(const BoxBatch& batch,
                                     cudaStream_t stream) {
  const std::vector<BoxRuns>& boxes = batch.boxes();
  if (boxes.empty()) return absl::OkStatus();
  std::vector<BoxWork> work(boxes.size());
  int64_t units = 0;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const BoxRuns& r = boxes[i];
    work[i].unit_begin = units;
    if (r.run_bytes > kUnitBytes) {
      work[i].parts_per_run = (r.run_bytes + kUnitBytes - 1) / kUnitBytes;
      units += r.runs * work[i].parts_per_run;
    } else {
      work[i].runs_per_unit = std::max<int64_t>(1, kUnitBytes / r.run_bytes);
      units += (r.runs + work[i].runs_per_unit - 1) / work[i].runs_per_unit;
    }
  }
  const int64_t boxes_bytes = boxes.size() * sizeof(BoxRuns);
  const int64_t work_bytes = work.size() * sizeof(BoxWork);
  RETURN_IF_ERROR(Reserve(boxes_bytes + work_bytes));
  // The pinned buffer is free once the previous upload has run.
  RETURN_IF_ERROR(CUDA_CALL(cudaEventSynchronize(uploaded_)));
  std::memcpy(host_, boxes.data(), boxes_bytes);
  std::memcpy(host_ + boxes_bytes, work.data(), work_bytes);
  RETURN_IF_ERROR(
      CUDA_CALL(cudaMemcpyAsync(device_buf_, host_, boxes_bytes + work_bytes,
                                cudaMemcpyHostToDevice, stream)));
  RETURN_IF_ERROR(CUDA_CALL(cudaEventRecord(uploaded_, stream)));
  const int blocks = static_cast<int>(std::min<int64_t>(blocks_, units));
  RETURN_IF_ERROR(CUDA_CALL(LaunchBoxKernel(
      reinterpret_cast<const BoxRuns*>(device_buf_),
      reinterpret_cast<const BoxWork*>(device_buf_ + boxes_bytes),
      static_cast<int>(boxes.size()), units, blocks, stream)));
  return absl::OkStatus();
}

}  // namespace scalai
