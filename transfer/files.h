// Plain-file plumbing for the store: an owning file descriptor, a read-only
// mapping, page-aligned buffers to read into, whole-range reads and writes
// that retry short transfers, and the errno translator. Every error names
// the path.
//
//   ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
//   ASSIGN_OR_RETURN(MappedFile map, MappedFile::Open(path));
//   RETURN_IF_ERROR(WriteAll(out.get(), map.data(), map.size(), out_path));
#ifndef SCALAI_TRANSFER_FILES_H_
#define SCALAI_TRANSFER_FILES_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace scalai {

// errno -> absl::Status, with what was being done to which path.
absl::Status ErrnoError(int err, absl::string_view what,
                        absl::string_view path);

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  ~UniqueFd();
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

absl::StatusOr<UniqueFd> OpenFile(const std::string& path, int flags,
                                  int mode = 0600);

// A buffer for the kernel to read file bytes into, aligned to a page. On
// this project's machines (AMD EPYC) a copy whose destination lies 1 to 31
// bytes past its source within a page runs at a fraction of its speed, the
// kernel's `rep movsb` as much as glibc's (copy_bytes.h): a read of whole
// pages into a buffer that starts 16 bytes past a page, as malloc's large
// blocks do, ran at 2.6 GB/s against 12 (docs/benchmarks.md).
struct FreeIoBuffer {
  void operator()(char* p) const;
};
using IoBuffer = std::unique_ptr<char[], FreeIoBuffer>;
IoBuffer NewIoBuffer(size_t bytes);
// Whether the kernel copies whole pages into `p` at full speed: a cache
// line's start is never 1 to 63 bytes past a page's.
inline bool IoAligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 64 == 0;
}

// A whole file mapped read-only; empty files map to nothing.
class MappedFile {
 public:
  static absl::StatusOr<MappedFile> Open(const std::string& path);
  // The first `size` bytes of an open file, whatever its size now: pages
  // past its end must not be touched (SIGBUS).
  static absl::StatusOr<MappedFile> Map(int fd, int64_t size,
                                        absl::string_view path);
  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  ~MappedFile();
  const std::byte* data() const { return data_; }
  int64_t size() const { return size_; }
  // Maps the pages of bytes [offset, offset + length) that are in the page
  // cache (reading those that are not) in one call, ahead of a pass over
  // them: touching them one by one costs a page fault per 16 pages, each
  // dearer than copying them in a VM. Best effort; failures are left to the
  // pass to find.
  void Populate(int64_t offset, int64_t length) const;
  // Whether the page cache holds every page of bytes [offset, offset +
  // length), as mincore(2) tells it; false when it cannot tell (it tells
  // only a process that owns the file or may write to it).
  bool Cached(int64_t offset, int64_t length) const;

 private:
  std::byte* data_ = nullptr;
  int64_t size_ = 0;
};

absl::Status WriteAll(int fd, const void* data, int64_t size,
                      absl::string_view path);
// Reads the file at `path` front to back in large chunks, calling
// `chunk(data, bytes)` for each; stops at the first error either returns.
absl::Status ReadChunks(
    const std::string& path,
    const std::function<absl::Status(const char*, int64_t)>& chunk);
absl::StatusOr<int64_t> FileSize(const std::string& path);
// The whole of a small file (a config, a key); one larger than `max_bytes`
// is refused, naming it.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path,
                                          int64_t max_bytes);
// Reads up to `size` bytes at `offset` into `out`; returns how many it read.
using RangeReader = std::function<absl::StatusOr<int64_t>(
    char* out, int64_t size, int64_t offset)>;
// Whether `bytes` bytes of `a` from `a_offset` equal those of `b` from
// `b_offset`, compared a MiB at a time; a short read counts as different.
absl::StatusOr<bool> SameBytes(const RangeReader& a, int64_t a_offset,
                               const RangeReader& b, int64_t b_offset,
                               int64_t bytes);
// The names in `dir` but "." and "..", in name order.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir);
// Whether `path` is a directory (following a symbolic link).
bool IsDirectory(const std::string& path);
// The device ("MAJOR:MINOR") of what is mounted at `path` now, the latest
// mount there, from /proc/self/mountinfo; "" if nothing is. `path` must be
// absolute and resolved (realpath): it is compared with mountinfo's as is.
// Reads no file under `path`, so it may ask about a FUSE mount whose
// server does not answer yet.
std::string MountedDevice(const std::string& path);
// fsync of a directory, so that names created in it survive a crash.
absl::Status SyncDir(const std::string& dir);
// Makes everything written to the filesystem holding `path` durable (syncfs).
// After writing many files, one call lets the kernel write them back together,
// which is much faster than an fsync per file (measured: 2x on this machine's
// disk, see tools/bench_store.sh), and it covers their directory entries too.
absl::Status SyncFilesystem(const std::string& path);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_FILES_H_
