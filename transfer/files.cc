#include "transfer/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::Status ErrnoError(int err, absl::string_view what,
                        absl::string_view path) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, " ", path));
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<UniqueFd> OpenFile(const std::string& path, int flags,
                                  int mode) {
  int fd = open(path.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0) return ErrnoError(errno, "open", path);
  return UniqueFd(fd);
}

absl::StatusOr<MappedFile> MappedFile::Open(const std::string& path) {
  UniqueFd fd;
  {
    auto opened = OpenFile(path, O_RDONLY);
    if (!opened.ok()) return opened.status();
    fd = std::move(*opened);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoError(errno, "stat", path);
  return Map(fd.get(), st.st_size, path);
}

absl::StatusOr<MappedFile> MappedFile::Map(int fd, int64_t size,
                                           absl::string_view path) {
  MappedFile m;
  m.size_ = size;
  if (m.size_ == 0) return m;
  void* p = mmap(nullptr, m.size_, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoError(errno, "mmap", path);
  m.data_ = static_cast<std::byte*>(p);
  return m;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MappedFile::Populate(int64_t offset, int64_t length) const {
#ifdef MADV_POPULATE_READ
  static const int64_t kPage = sysconf(_SC_PAGESIZE);
  const int64_t begin = std::max<int64_t>(offset, 0) / kPage * kPage;
  const int64_t end = std::min(offset + length, size_);
  if (data_ == nullptr || end <= begin) return;
  madvise(data_ + begin, end - begin, MADV_POPULATE_READ);
#endif
}

bool MappedFile::Cached(int64_t offset, int64_t length) const {
  static const int64_t kPage = sysconf(_SC_PAGESIZE);
  const int64_t begin = std::max<int64_t>(offset, 0) / kPage * kPage;
  const int64_t end = std::min(offset + length, size_);
  if (data_ == nullptr || end <= begin) return false;
  const int64_t pages = (end - begin + kPage - 1) / kPage;
  // A chunk's worth fits on the stack; longer ranges are asked in turns.
  unsigned char resident[256];
  for (int64_t at = 0; at < pages; at += 256) {
    const int64_t n = std::min<int64_t>(256, pages - at);
    if (mincore(data_ + begin + at * kPage, n * kPage, resident) != 0) {
      return false;
    }
    for (int64_t i = 0; i < n; ++i) {
      if ((resident[i] & 1) == 0) return false;
    }
  }
  return true;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) munmap(data_, size_);
}

absl::Status WriteAll(int fd, const void* data, int64_t size,
                      absl::string_view path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n =
        write(fd, p, static_cast<size_t>(std::min<int64_t>(size, 1 << 30)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "write", path);
    p += n;
    size -= n;
  }
  return absl::OkStatus();
}

void FreeIoBuffer::operator()(char* p) const { std::free(p); }

IoBuffer NewIoBuffer(size_t bytes) {
  constexpr size_t kPage = 4096;
  void* p = std::aligned_alloc(
      kPage, (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage);
  if (p == nullptr) throw std::bad_alloc();
  return IoBuffer(static_cast<char*>(p));
}

absl::Status ReadChunks(
    const std::string& path,
    const std::function<absl::Status(const char*, int64_t)>& chunk) {
  auto fd = OpenFile(path, O_RDONLY);
  if (!fd.ok()) return fd.status();
  posix_fadvise(fd->get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  constexpr size_t kChunk = 8 << 20;
  IoBuffer buffer = NewIoBuffer(kChunk);
  for (;;) {
    ssize_t n = read(fd->get(), buffer.get(), kChunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "read", path);
    if (n == 0) return absl::OkStatus();
    absl::Status s = chunk(buffer.get(), n);
    if (!s.ok()) return s;
  }
}

absl::StatusOr<int64_t> FileSize(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ErrnoError(errno, "stat", path);
  return static_cast<int64_t>(st.st_size);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path,
                                          int64_t max_bytes) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY | O_CLOEXEC));
  std::string text;
  char buf[4096];
  while (true) {
    const ssize_t n = read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "read", path);
    if (n == 0) return text;
    if (static_cast<int64_t>(text.size()) + n > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": larger than ", max_bytes, " bytes; is it the right file?"));
    }
    text.append(buf, static_cast<size_t>(n));
  }
}

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return ErrnoError(errno, "list", dir);
  std::vector<std::string> names;
  while (struct dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

absl::Status SyncDir(const std::string& dir) {
  auto fd = OpenFile(dir, O_RDONLY | O_DIRECTORY);
  if (!fd.ok()) return fd.status();
  if (fsync(fd->get()) != 0) return ErrnoError(errno, "fsync", dir);
  return absl::OkStatus();
}

}  // namespace scalai

namespace scalai {

absl::StatusOr<bool> SameBytes(const RangeReader& a, int64_t a_offset,
                               const RangeReader& b, int64_t b_offset,
                               int64_t bytes) {
  constexpr int64_t kChunk = 1 << 20;
  std::vector<char> x(std::min(kChunk, bytes)), y(x.size());
  for (int64_t at = 0; at < bytes; at += kChunk) {
    const int64_t n = std::min(kChunk, bytes - at);
    ASSIGN_OR_RETURN(int64_t got_x, a(x.data(), n, a_offset + at));
    ASSIGN_OR_RETURN(int64_t got_y, b(y.data(), n, b_offset + at));
    if (got_x != n || got_y != n || std::memcmp(x.data(), y.data(), n) != 0)
      return false;
  }
  return true;
}

absl::Status SyncFilesystem(const std::string& path) {
  auto fd = OpenFile(path, O_RDONLY);
  if (!fd.ok()) return fd.status();
  if (syncfs(fd->get()) != 0) return ErrnoError(errno, "syncfs", path);
  return absl::OkStatus();
}

std::string MountedDevice(const std::string& path) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line, found;
  while (std::getline(in, line)) {
    // ID PARENT MAJOR:MINOR ROOT MOUNTPOINT ...; the paths escape space,
    // tab, newline and backslash in octal (\040).
    std::istringstream fields(line);
    std::string id, parent, device, root, target;
    fields >> id >> parent >> device >> root >> target;
    std::string unescaped;
    for (size_t i = 0; i < target.size(); ++i) {
      if (target[i] == '\\' && i + 3 < target.size()) {
        unescaped +=
            static_cast<char>(std::stoi(target.substr(i + 1, 3), nullptr, 8));
        i += 3;
      } else {
        unescaped += target[i];
      }
    }
    if (unescaped == path) found = device;  // later lines are later mounts
  }
  return found;
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace scalai
