// Where a live reshard's shards and staging buffers live, and the engine
// that copies boxes there. The executor (transfer/live_reshard.h) is written
// once against this interface: HostMemory runs it in host memory (the
// reference, and the tests on machines without a GPU), CudaMemory
// (transfer/cuda/cuda_memory.h) in a GPU's memory with one kernel launch per
// batch. A memory's copies are ordered among themselves and with the
// transport's exchanges that use it; Finish waits for all of them.
//
//   HostMemory memory;
//   ASSIGN_OR_RETURN(std::byte* staging, memory.Allocate(1 << 20));
//   RETURN_IF_ERROR(memory.Copy(batch));
//   RETURN_IF_ERROR(memory.Finish());
//   memory.Free(staging);
#ifndef SCALAI_TRANSFER_LIVE_MEMORY_H_
#define SCALAI_TRANSFER_LIVE_MEMORY_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transfer/box_batch.h"

namespace scalai {

class LiveMemory {
 public:
  virtual ~LiveMemory() = default;
  virtual absl::StatusOr<std::byte*> Allocate(int64_t bytes) = 0;
  virtual void Free(std::byte* buffer) = 0;
  // Starts every copy and fill of `batch`, in order after earlier work.
  virtual absl::Status Copy(const BoxBatch& batch) = 0;
  // Waits for everything started; the first error of any of it.
  virtual absl::Status Finish() = 0;
  // Copies between this memory and host memory, after earlier work; done
  // when they return. HostTransport moves messages with these.
  virtual absl::Status ToHost(std::byte* host, const std::byte* from,
                              int64_t bytes) = 0;
  virtual absl::Status FromHost(std::byte* to, const std::byte* host,
                                int64_t bytes) = 0;
};

class HostMemory final : public LiveMemory {
 public:
  absl::StatusOr<std::byte*> Allocate(int64_t bytes) override;
  void Free(std::byte* buffer) override;
  absl::Status Copy(const BoxBatch& batch) override;
  absl::Status Finish() override { return absl::OkStatus(); }
  absl::Status ToHost(std::byte* host, const std::byte* from,
                      int64_t bytes) override;
  absl::Status FromHost(std::byte* to, const std::byte* host,
                        int64_t bytes) override;
};

// Frees a buffer of `memory` when it goes out of scope.
class LiveBuffer {
 public:
  LiveBuffer(LiveMemory& memory, std::byte* data)
      : memory_(memory), data_(data) {}
  LiveBuffer(const LiveBuffer&) = delete;
  LiveBuffer& operator=(const LiveBuffer&) = delete;
  ~LiveBuffer() {
    if (data_ != nullptr) memory_.Free(data_);
  }
  std::byte* data() const { return data_; }

 private:
  LiveMemory& memory_;
  std::byte* data_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_LIVE_MEMORY_H_
