// A rank's shard, read from the mount (or any safetensors file) into one
// device buffer, through two pinned host buffers: while the GPU copies one
// chunk to the device, threads read the next into the other, so the load
// runs at the slower of the file's and the bus's rates rather than their
// sum. Tensors are views into the buffer at their safetensors offsets.
//
//   ASSIGN_OR_RETURN(DeviceShard shard,
//                    LoadShardToDevice("/mnt/ckpt/latest/rank-3/model.safetensors",
//                                      {.device = 0}));
//   for (const DeviceTensor& t : shard.tensors()) use(t.name, t.data, t.shape);
#ifndef SCALAI_TRANSFER_CUDA_DEVICE_LOADER_H_
#define SCALAI_TRANSFER_CUDA_DEVICE_LOADER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/box.h"
#include "ptc/dtype.h"

namespace scalai {

struct DeviceTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::byte* data = nullptr;  // device memory, inside DeviceShard::data()
  int64_t bytes = 0;
};

struct LoadOptions {
  int device = 0;
  // Each of the two pinned buffers; one chunk is read while the other is
  // copied.
  int64_t chunk_bytes = 64 << 20;
  // Threads reading one chunk, each a part (the page cache serves one
  // reader at a fraction of the bus's rate).
  int read_threads = 8;
};

// Owns the device buffer its tensors point into.
class DeviceShard {
 public:
  DeviceShard() = default;
  DeviceShard(DeviceShard&& other) noexcept { *this = std::move(other); }
  DeviceShard& operator=(DeviceShard&& other) noexcept;
  DeviceShard(const DeviceShard&) = delete;
  DeviceShard& operator=(const DeviceShard&) = delete;
  ~DeviceShard();

  const std::vector<DeviceTensor>& tensors() const { return tensors_; }
  std::byte* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  friend absl::StatusOr<DeviceShard> LoadShardToDevice(const std::string&,
                                                       LoadOptions);
  std::vector<DeviceTensor> tensors_;
  std::byte* data_ = nullptr;
  int64_t bytes_ = 0;
  int device_ = 0;
};

// Reads the safetensors file at `path` (header checked as on import) onto
// the device. Errors name the file and the failing call.
absl::StatusOr<DeviceShard> LoadShardToDevice(const std::string& path,
                                              LoadOptions options);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CUDA_DEVICE_LOADER_H_
