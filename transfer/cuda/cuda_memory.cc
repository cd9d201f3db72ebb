#include "transfer/cuda/cuda_memory.h"

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/cuda/cuda_status.h"

namespace scalai {

absl::StatusOr<std::unique_ptr<CudaMemory>> CudaMemory::Create(int device) {
  std::unique_ptr<CudaMemory> memory(new CudaMemory(device));
  RETURN_IF_ERROR(CUDA_CALL(cudaSetDevice(device)));
  RETURN_IF_ERROR(CUDA_CALL(
      cudaStreamCreateWithFlags(&memory->stream_, cudaStreamNonBlocking)));
  ASSIGN_OR_RETURN(memory->copier_, DeviceBoxCopier::Create(device));
  return memory;
}

CudaMemory::~CudaMemory() {
  copier_.reset();
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

absl::StatusOr<std::byte*> CudaMemory::Allocate(int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  RETURN_IF_ERROR(CUDA_CALL(cudaSetDevice(device_)));
  void* data = nullptr;
  RETURN_IF_ERROR(CUDA_CALL(cudaMalloc(&data, bytes > 0 ? bytes : 1)));
  return static_cast<std::byte*>(data);
}

void CudaMemory::Free(std::byte* buffer) {
  // Work queued on the stream may still read it.
  cudaStreamSynchronize(stream_);
  cudaFree(buffer);
}

absl::Status CudaMemory::Copy(const BoxBatch& batch) {
  RETURN_IF_ERROR(CUDA_CALL(cudaSetDevice(device_)));
  return copier_->Launch(batch, stream_);
}

absl::Status CudaMemory::Finish() {
  return CUDA_CALL(cudaStreamSynchronize(stream_));
}

absl::Status CudaMemory::ToHost(std::byte* host, const std::byte* from,
                                int64_t bytes) {
  RETURN_IF_ERROR(CUDA_CALL(
      cudaMemcpyAsync(host, from, bytes, cudaMemcpyDeviceToHost, stream_)));
  return CUDA_CALL(cudaStreamSynchronize(stream_));
}

absl::Status CudaMemory::FromHost(std::byte* to, const std::byte* host,
                                  int64_t bytes) {
  RETURN_IF_ERROR(CUDA_CALL(
      cudaMemcpyAsync(to, host, bytes, cudaMemcpyHostToDevice, stream_)));
  return CUDA_CALL(cudaStreamSynchronize(stream_));
}

}  // namespace scalai
