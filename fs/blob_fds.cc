#include "fs/blob_fds.h"

namespace scalai {

int BlobFds::Get(const BlobReader& blob) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [reader, fd] : open_) {
    if (reader == &blob) return fd.get();
  }
  absl::StatusOr<UniqueFd> fd = blob.OpenFd();
  if (!fd.ok()) return -1;
  open_.emplace_back(&blob, std::move(*fd));
  return open_.back().second.get();
}

}  // namespace scalai
