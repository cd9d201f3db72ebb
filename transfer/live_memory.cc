#include "transfer/live_memory.h"

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace scalai {

absl::StatusOr<std::byte*> HostMemory::Allocate(int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  auto* buffer = new (std::nothrow) std::byte[bytes > 0 ? bytes : 1];
  if (buffer == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of host memory allocating ", bytes, " bytes"));
  }
  return buffer;
}

void HostMemory::Free(std::byte* buffer) { delete[] buffer; }

absl::Status HostMemory::Copy(const BoxBatch& batch) {
  CopyBatchOnHost(batch);
  return absl::OkStatus();
}

absl::Status HostMemory::ToHost(std::byte* host, const std::byte* from,
                                int64_t bytes) {
  if (bytes > 0) std::memcpy(host, from, bytes);
  return absl::OkStatus();
}

absl::Status HostMemory::FromHost(std::byte* to, const std::byte* host,
                                  int64_t bytes) {
  if (bytes > 0) std::memcpy(to, host, bytes);
  return absl::OkStatus();
}

}  // namespace scalai
