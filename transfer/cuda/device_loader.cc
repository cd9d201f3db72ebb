#include "transfer/cuda/device_loader.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "transfer/cuda/cuda_status.h"
#include "transfer/parallel.h"

namespace scalai {
namespace {

// The loader's pinned buffers, events and stream, released however the
// load ends.
struct Staging {
  std::byte* pinned[2] = {nullptr, nullptr};
  cudaEvent_t copied[2] = {nullptr, nullptr};
  cudaStream_t stream = nullptr;
  int fd = -1;
  ~Staging() {
    if (stream != nullptr) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    for (int i = 0; i < 2; ++i) {
      if (copied[i] != nullptr) cudaEventDestroy(copied[i]);
      if (pinned[i] != nullptr) cudaFreeHost(pinned[i]);
    }
    if (fd >= 0) close(fd);
  }
};

absl::Status ReadFully(int fd, std::byte* to, int64_t bytes, int64_t offset,
                       const std::string& path) {
  while (bytes > 0) {
    const ssize_t n = pread(fd, to, bytes, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(absl::StrCat("reading ", path, " at ", offset,
                                              ": ", std::strerror(errno)));
    }
    if (n == 0) {
      return absl::DataLossError(
          absl::StrCat(path, " ends at ", offset, ", before its header's end"));
    }
    to += n;
    bytes -= n;
    offset += n;
  }
  return absl::OkStatus();
}

}  // namespace

DeviceShard& DeviceShard::operator=(DeviceShard&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    tensors_ = std::move(other.tensors_);
    data_ = other.data_;
    bytes_ = other.bytes_;
    device_ = other.device_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

DeviceShard::~DeviceShard() {
  if (data_ != nullptr) cudaFree(data_);
}

absl::StatusOr<DeviceShard> LoadShardToDevice(const std::string& path,
                                              LoadOptions options) {
  if (options.chunk_bytes < 1 || options.read_threads < 1) {
    return absl::InvalidArgumentError(
        "chunk_bytes and read_threads must be positive");
  }
  ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(path));
  RETURN_IF_ERROR(CUDA_CALL(cudaSetDevice(options.device)));
  DeviceShard shard;
  shard.device_ = options.device;
  shard.bytes_ = header.data_bytes();
  RETURN_IF_ERROR(CUDA_CALL(cudaMalloc(reinterpret_cast<void**>(&shard.data_),
                                       std::max<int64_t>(1, shard.bytes_))));
  for (const SafetensorsEntry& e : header.tensors()) {
    shard.tensors_.push_back({e.name, e.dtype, e.shape,
                              shard.data_ + e.data_begin,
                              e.data_end - e.data_begin});
  }
  Staging staging;
  staging.fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (staging.fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("opening ", path, ": ", std::strerror(errno)));
  }
  const int64_t chunk =
      std::min(options.chunk_bytes, std::max<int64_t>(1, shard.bytes_));
  RETURN_IF_ERROR(CUDA_CALL(
      cudaStreamCreateWithFlags(&staging.stream, cudaStreamNonBlocking)));
  for (int i = 0; i < 2; ++i) {
    RETURN_IF_ERROR(CUDA_CALL(
        cudaMallocHost(reinterpret_cast<void**>(&staging.pinned[i]), chunk)));
    RETURN_IF_ERROR(CUDA_CALL(
        cudaEventCreateWithFlags(&staging.copied[i], cudaEventDisableTiming)));
  }
  // Parts of a chunk that threads read at once: page-aligned, so that
  // each read is whole pages of the cache.
  const int64_t part = std::max<int64_t>(
      4096, (chunk / options.read_threads + 4095) / 4096 * 4096);
  int64_t done = 0;
  for (int64_t k = 0; done < shard.bytes_; ++k) {
    const int slot = static_cast<int>(k % 2);
    const int64_t n = std::min(chunk, shard.bytes_ - done);
    // This buffer's previous copy must be over before it is refilled; the
    // other buffer's copy runs meanwhile.
    RETURN_IF_ERROR(CUDA_CALL(cudaEventSynchronize(staging.copied[slot])));
    const int64_t parts = (n + part - 1) / part;
    std::byte* pinned = staging.pinned[slot];
    const int64_t file_at = header.data_start() + done;
    RETURN_IF_ERROR(ParallelFor(parts, options.read_threads, [&](size_t i) {
      const int64_t begin = static_cast<int64_t>(i) * part;
      return ReadFully(staging.fd, pinned + begin, std::min(part, n - begin),
                       file_at + begin, path);
    }));
    RETURN_IF_ERROR(
        CUDA_CALL(cudaMemcpyAsync(shard.data_ + done, pinned, n,
                                  cudaMemcpyHostToDevice, staging.stream)));
    RETURN_IF_ERROR(
        CUDA_CALL(cudaEventRecord(staging.copied[slot], staging.stream)));
    done += n;
  }
  RETURN_IF_ERROR(CUDA_CALL(cudaStreamSynchronize(staging.stream)));
  return shard;
}

}  // namespace scalai
