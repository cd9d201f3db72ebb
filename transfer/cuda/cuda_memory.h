// A GPU's memory for the live reshard (transfer/live_memory.h): buffers
// from cudaMalloc, box batches run by one kernel launch each on the
// memory's stream, and host copies through that stream. NcclTransport
// posts its sends and receives on the same stream, so packing, exchange
// and unpacking follow each other without a host wait.
//
//   ASSIGN_OR_RETURN(auto memory, CudaMemory::Create(/*device=*/0));
//   NcclTransport transport(comm, memory->stream());
//   RETURN_IF_ERROR(RunLiveReshard(schedule, rank, a, b, transport, *memory));
#ifndef SCALAI_TRANSFER_CUDA_CUDA_MEMORY_H_
#define SCALAI_TRANSFER_CUDA_CUDA_MEMORY_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "transfer/cuda/device_box_copy.h"
#include "transfer/live_memory.h"

namespace scalai {

class CudaMemory final : public LiveMemory {
 public:
  static absl::StatusOr<std::unique_ptr<CudaMemory>> Create(int device);
  CudaMemory(const CudaMemory&) = delete;
  CudaMemory& operator=(const CudaMemory&) = delete;
  ~CudaMemory() override;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  absl::StatusOr<std::byte*> Allocate(int64_t bytes) override;
  void Free(std::byte* buffer) override;
  absl::Status Copy(const BoxBatch& batch) override;
  absl::Status Finish() override;
  absl::Status ToHost(std::byte* host, const std::byte* from,
                      int64_t bytes) override;
  absl::Status FromHost(std::byte* to, const std::byte* host,
                        int64_t bytes) override;

 private:
  explicit CudaMemory(int device) : device_(device) {}

  const int device_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceBoxCopier> copier_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CUDA_CUDA_MEMORY_H_
