#include "transfer/extra_copy.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/files.h"

namespace scalai {

absl::StatusOr<CopiedExtra> CopyExtraFile(const Store& store, PeerClient& peer,
                                          const RemoteExtra& extra) {
  CopiedExtra copy;
  copy.file = {extra.path, Store::NewBlobName(), extra.size};
  const std::string path = store.BlobPath(copy.file.blob);
  ASSIGN_OR_RETURN(UniqueFd fd,
                   OpenFile(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC));
  bool kept = false;
  absl::Cleanup remove = [&] {
    if (!kept) unlink(path.c_str());
  };
  ChunkHasher hasher;
  std::string buffer(static_cast<size_t>(kBlobChunkBytes), '\0');
  for (int64_t at = 0; at < extra.size;) {
    const int64_t n = std::min(kBlobChunkBytes, extra.size - at);
    ASSIGN_OR_RETURN(int64_t got,
                     peer.ReadExtra(extra.step, extra.rank, extra.path, at, n,
                                    buffer.data()));
    if (got != n) {
      return absl::DataLossError(
          absl::StrCat("host ", peer.peer().name, " sent ", at + got,
                       " of the ", extra.size, " bytes of rank ", extra.rank,
                       "'s extra/", extra.path, " of step ", extra.step));
    }
    hasher.Update(buffer.data(), n);
    RETURN_IF_ERROR(WriteAll(fd.get(), buffer.data(), n, path));
    at += n;
  }
  copy.record.size = extra.size;
  copy.record.step = extra.step;
  copy.record.chunks = hasher.Finish();
  if (copy.record.chunks != extra.sums) {
    return absl::DataLossError(
        absl::StrCat("rank ", extra.rank, "'s extra/", extra.path, " of step ",
                     extra.step, " from host ", peer.peer().name,
                     " does not match the checksums it was saved with"));
  }
  if (fdatasync(fd.get()) != 0) return ErrnoError(errno, "sync", path);
  kept = true;
  return copy;
}

}  // namespace scalai
