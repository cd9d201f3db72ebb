// BlobFds keeps open the files of the blobs that one open file's reads come
// from, so that the kernel copies their bytes straight into its reply
// (splice) and they never pass through this process. Each is opened at the
// first read that needs it and closed with the handle: a mount serves far
// more blobs than a process may keep open, but one open file reads few.
//
//   BlobFds fds;
//   int fd = fds.Get(blob);  // -1: the read copies the bytes instead
#ifndef SCALAI_FS_BLOB_FDS_H_
#define SCALAI_FS_BLOB_FDS_H_

#include <mutex>
#include <utility>
#include <vector>

#include "transfer/blob_reader.h"
#include "transfer/files.h"

namespace scalai {

class BlobFds {
 public:
  // The blob's file open for reading, or -1 where it cannot be opened (its
  // name is gone with a retired step: the mapping still has the bytes).
  // Thread-safe; the descriptor stays valid while this object lives.
  int Get(const BlobReader& blob);

 private:
  std::mutex mu_;
  // Few (the blobs of one file): a linear search is fastest.
  std::vector<std::pair<const BlobReader*, UniqueFd>> open_;
};

}  // namespace scalai

#endif  // SCALAI_FS_BLOB_FDS_H_
