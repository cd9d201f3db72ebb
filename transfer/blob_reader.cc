#include "transfer/blob_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <optional>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/copy_bytes.h"
#include "transfer/mapping_guard.h"

namespace scalai {
namespace {

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
         st.st_mtim.tv_nsec;
}

// A chunk's worth of this thread's, for chunks read from the disk to be
// checked: a new buffer for each would pay for faulting in its pages.
char* ChunkBuffer() {
  thread_local const IoBuffer buffer = NewIoBuffer(kBlobChunkBytes);
  return buffer.get();
}

}  // namespace

std::shared_ptr<const BlobReader> BlobReader::Open(const Store& store,
                                                   const std::string& name) {
  return Open(store.BlobPath(name), name, store.Blob(name));
}

std::shared_ptr<const BlobReader> BlobReader::Open(
    std::string path, std::string name, absl::StatusOr<BlobRecord> record) {
  std::shared_ptr<BlobReader> blob(new BlobReader());
  blob->name_ = std::move(name);
  blob->path_ = std::move(path);
  blob->hold_id_ = ChunkHold::NewBlobId();
  if (!record.ok()) {
    blob->damage_ = record.status();
    return blob;
  }
  blob->record_ = *std::move(record);
  if (blob->record_.whole_xxh3) {
    blob->chunk_bytes_ = std::max<int64_t>(blob->record_.size, 1);
    if (blob->record_.size > 0) blob->sums_ = {*blob->record_.whole_xxh3};
  } else {
    blob->chunk_bytes_ = kBlobChunkBytes;
    blob->sums_ = blob->record_.chunks;
  }
  const size_t words = (blob->sums_.size() + 63) / 64;
  blob->verified_.reset(new std::atomic<uint64_t>[words]);
  for (size_t i = 0; i < words; ++i) blob->verified_[i] = 0;
  auto fd = OpenFile(blob->path_, O_RDONLY);
  if (!fd.ok()) {
    blob->missing_ = absl::IsNotFound(fd.status());
    blob->damage_ = absl::DataLossError(absl::StrCat(
        blob->Where(), " cannot be opened: ", fd.status().message()));
    return blob;
  }
  struct stat st;
  if (fstat(fd->get(), &st) == 0) {
    blob->mtime_ns_ = MtimeNs(st);
    blob->dev_ = st.st_dev;
    blob->ino_ = st.st_ino;
  }
  // The descriptor closes on return; the mapping keeps the file.
  auto map = MappedFile::Map(fd->get(), blob->record_.size, blob->path_);
  if (!map.ok()) {
    blob->damage_ = absl::DataLossError(absl::StrCat(
        blob->Where(), " cannot be mapped: ", map.status().message()));
    return blob;
  }
  blob->map_ = *std::move(map);
  return blob;
}

std::string BlobReader::Where() const {
  return absl::StrCat("blob ", name_, " of step ", record_.step);
}

absl::StatusOr<UniqueFd> BlobReader::OpenFd(int flags) const {
  if (!damage_.ok()) return damage_;
  ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path_, O_RDONLY | flags));
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoError(errno, "stat", path_);
  if (st.st_dev != dev_ || st.st_ino != ino_) {
    return absl::NotFoundError(
        absl::StrCat(path_, " now names another file than the one in use"));
  }
  return fd;
}

absl::Status BlobReader::CheckUnchanged() const {
  if (!damage_.ok()) return damage_;
  struct stat st;
  if (stat(path_.c_str(), &st) != 0 || st.st_dev != dev_ || st.st_ino != ino_) {
    // The name is gone or names another file (a step retired while this
    // reader had it open): the mapping still holds the file read so far,
    // whose verified chunks stay verified. A fault from a cut made before
    // the name went is caught by ReadMapped.
    return absl::OkStatus();
  }
  if (st.st_size != record_.size) {
    return absl::DataLossError(
        absl::StrCat(Where(), " has ", st.st_size, " bytes, the catalog says ",
                     record_.size, " (run scalai fsck)"));
  }
  const int64_t mtime = MtimeNs(st);
  if (mtime_ns_.exchange(mtime) != mtime) {
    // Written since it was verified (a store's blobs never are): every
    // chunk is checked again, and none held is served.
    for (size_t i = 0; i < (sums_.size() + 63) / 64; ++i) verified_[i] = 0;
    hold_id_ = ChunkHold::NewBlobId();
  }
  return absl::OkStatus();
}

bool BlobReader::IsVerified(int64_t chunk) const {
  return verified_[chunk / 64].load(std::memory_order_acquire) &
         (uint64_t{1} << (chunk % 64));
}

void BlobReader::MarkVerified(int64_t chunk) const {
  verified_[chunk / 64].fetch_or(uint64_t{1} << (chunk % 64),
                                 std::memory_order_release);
}

absl::Status BlobReader::ChunkMismatch(int64_t chunk) const {
  const int64_t begin = chunk * chunk_bytes_;
  const int64_t end = std::min(begin + chunk_bytes_, record_.size);
  return absl::DataLossError(
      absl::StrCat(Where(), ": chunk ", chunk, " (bytes ", begin, "-", end,
                   ") does not match its checksum (run scalai fsck)"));
}

bool BlobReader::FetchFromDisk(int64_t chunk) const {
  const int64_t begin = chunk * chunk_bytes_;
  return !IsVerified(chunk) && chunk_bytes_ <= kBlobChunkBytes &&
         !map_.Cached(begin, std::min(chunk_bytes_, record_.size - begin));
}

absl::Status BlobReader::VerifyChunk(int64_t chunk) const {
  if (IsVerified(chunk)) return absl::OkStatus();
  const int64_t begin = chunk * chunk_bytes_;
  const int64_t bytes = std::min(chunk_bytes_, record_.size - begin);
  if (FetchFromDisk(chunk)) {
    // A chunk the page cache lacks is read with pread into a buffer of this
    // thread's, not faulted in through the mapping, which read the disk
    // slower (docs/benchmarks.md). The bytes land in the page cache all the
    // same, and the caller's use of the mapping that follows finds them.
    if (absl::StatusOr<UniqueFd> fd = OpenFd(); fd.ok()) {
      RETURN_IF_ERROR(FetchChunk(fd->get(), chunk, ChunkBuffer()));
      map_.Populate(begin, bytes);
      return absl::OkStatus();
    }
  }
  // A cached chunk is hashed where it lies (a pread would copy it once
  // more), and so is any chunk of a blob whose name is gone (a step retired
  // while in use): the mapping still holds the file.
  uint64_t sum = 0;
  map_.Populate(begin, bytes);
  if (!ReadMapped([&] { sum = HashChunk(map_.data() + begin, bytes); })) {
    return CutShort();
  }
  if (sum != sums_[chunk]) return ChunkMismatch(chunk);
  MarkVerified(chunk);
  return absl::OkStatus();
}

absl::Status BlobReader::Fetch(int fd, char* out, int64_t bytes,
                               int64_t offset) const {
  if (fd < 0) {
    if (!ReadMapped([&] { CopyBytes(out, map_.data() + offset, bytes); })) {
      return CutShort();
    }
    return absl::OkStatus();
  }
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = pread(fd, out + done, bytes - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "read", path_);
    if (n == 0) {
      return absl::DataLossError(
          absl::StrCat(Where(), " ends at byte ", offset + done,
                       ", the catalog says ", record_.size));
    }
    done += n;
  }
  return absl::OkStatus();
}

absl::Status BlobReader::FetchChunk(
    int fd, int64_t chunk, char* buffer,
    absl::FunctionRef<void(int64_t begin, int64_t end)> fresh) const {
  const int64_t begin = chunk * kBlobChunkBytes;
  return CheckChunk(
      chunk, buffer,
      [&](int64_t at, int64_t n) {
        return Fetch(fd, buffer + (at - begin), n, at);
      },
      fresh);
}

absl::Status BlobReader::CheckChunk(
    int64_t chunk, char* buffer,
    absl::FunctionRef<absl::Status(int64_t at, int64_t n)> fetch,
    absl::FunctionRef<void(int64_t begin, int64_t end)> fresh) const {
  // A quarter of a chunk at a time: the piece is hashed, and handed on,
  // while the CPU's cache still holds it, not after a whole chunk has
  // pushed its start out (the hash ran at a quarter of its speed).
  constexpr int64_t kPiece = kBlobChunkBytes / 4;
  thread_local ChunkHasher hasher;
  hasher.Reset();
  const int64_t begin = chunk * kBlobChunkBytes;
  const int64_t end = std::min(begin + kBlobChunkBytes, record_.size);
  for (int64_t at = begin; at < end; at += kPiece) {
    const int64_t n = std::min(kPiece, end - at);
    RETURN_IF_ERROR(fetch(at, n));
    hasher.Update(buffer + (at - begin), n);
    fresh(at, at + n);
  }
  if (hasher.Finish().front() != sums_[chunk]) return ChunkMismatch(chunk);
  MarkVerified(chunk);
  return absl::OkStatus();
}

absl::Status BlobReader::ReadAround(AroundFd& around, int64_t first,
                                    absl::Span<char* const> buffers) const {
  const int fd = around.fd->get();
  // The length is rounded up to whole pages, as O_DIRECT wants; at the end
  // of the file the read is simply shorter.
  constexpr int64_t kPage = 4096;
  const int64_t begin = first * kBlobChunkBytes;
  const int64_t bytes =
      std::min<int64_t>(buffers.size() * kBlobChunkBytes, record_.size - begin);
  const int64_t rounded = (bytes + kPage - 1) / kPage * kPage;
  for (int64_t done = 0; done < bytes;) {
    std::array<iovec, kChunksAhead> parts;
    int count = 0;
    for (int64_t at = done; at < rounded; ++count) {
      const int64_t i = at / kBlobChunkBytes;
      const int64_t end = std::min(rounded, (i + 1) * kBlobChunkBytes);
      parts[count] = {buffers[i] + (at - i * kBlobChunkBytes),
                      static_cast<size_t>(end - at)};
      at = end;
    }
    const ssize_t n = preadv(fd, parts.data(), count, begin + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL && around.direct) {
      // The filesystem takes O_DIRECT at open but not for this read: the
      // rest through the page cache, and the blob's later reads too.
      no_direct_ = true;
    } else if (n < 0) {
      return ErrnoError(errno, "read", path_);
    } else if (n == 0) {
      return absl::DataLossError(
          absl::StrCat(Where(), " ends at byte ", begin + done,
                       ", the catalog says ", record_.size));
    } else {
      done += n;
      if (done >= bytes || done % kPage == 0 || !around.direct) continue;
    }
    // Stopped short of a page, or refused: O_DIRECT wants reads to start
    // on one. The rest through the page cache.
    const int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0) {
      return ErrnoError(errno, "read", path_);
    }
    around.direct = false;
  }
  return absl::OkStatus();
}

absl::StatusOr<BlobReader::Held> BlobReader::ReadHeld(
    std::optional<AroundFd>& around, const Part& part,
    ChunkHold::Pin& pending) const {
  const int64_t begin = part.chunk * kBlobChunkBytes;
  const int64_t bytes = std::min(kBlobChunkBytes, record_.size - begin);
  const ChunkHold::Key key{hold_id_.load(), part.chunk};
  ChunkHold& hold = ChunkHold::Shared();
  ChunkHold::Pin pin;
  if (held_once_.load(std::memory_order_acquire)) pin = hold.Find(key);
  if (!pin) {
    if (IsVerified(part.chunk) || no_direct_ || hold.page_cache_shared() ||
        map_.Cached(begin, bytes)) {
      return Held::kNotHeld;
    }
    if (!around) {
      around = AroundFd{OpenFd(O_DIRECT)};
      if (!around->fd.ok() && absl::IsInvalidArgument(around->fd.status())) {
        // No O_DIRECT on this filesystem: its page cache it is, for every
        // read of this blob from now on.
        no_direct_ = true;
      }
    }
    if (!around->fd.ok()) return Held::kNotHeld;
    held_once_.store(true, std::memory_order_release);
    pin = hold.Acquire(key, bytes);
    if (!pin) return Held::kNotHeld;
  }
  if (!pin.must_fill()) {
    pending = std::move(pin);
    return Held::kPending;
  }
  // Read ahead, in the same read, the chunks after it that no one holds or
  // has checked: one synchronous read of a chunk at a time kept too little
  // in flight for the disk, against the kernel's 8 MiB read-ahead of a
  // buffered read (docs/benchmarks.md).
  std::array<ChunkHold::Pin, kChunksAhead> pins;
  std::array<char*, kChunksAhead> buffers;
  pins[0] = std::move(pin);
  buffers[0] = pins[0].data();
  size_t count = 1;
  for (; count < kChunksAhead; ++count) {
    const int64_t next = part.chunk + static_cast<int64_t>(count);
    const int64_t next_begin = next * kBlobChunkBytes;
    if (next_begin >= record_.size || IsVerified(next)) break;
    ChunkHold::Pin ahead = hold.Acquire(
        {key.blob, next}, std::min(kBlobChunkBytes, record_.size - next_begin));
    if (!ahead.must_fill()) break;  // held already, or no slot free
    buffers[count] = ahead.data();
    pins[count] = std::move(ahead);
  }
  absl::Status first;
  const absl::Status read =
      ReadAround(*around, part.chunk, absl::MakeSpan(buffers.data(), count));
  for (size_t i = 0; i < count; ++i) {
    absl::Status filled = read;
    if (filled.ok()) {
      filled = CheckChunk(
          part.chunk + static_cast<int64_t>(i), buffers[i],
          [](int64_t, int64_t) { return absl::OkStatus(); },
          [&](int64_t lo, int64_t hi) {
            if (i > 0) return;
            lo = std::max(lo, part.from);
            hi = std::min(hi, part.to);
            if (lo < hi) {
              CopyBytes(part.dst + (lo - part.from), buffers[0] + (lo - begin),
                        hi - lo);
            }
          });
    }
    if (i == 0) first = filled;
    pins[i].Filled(std::move(filled));
  }
  RETURN_IF_ERROR(first);
  pins[0].Served(part.to - part.from);
  return Held::kServed;
}

absl::Status BlobReader::FinishHeld(std::optional<absl::StatusOr<UniqueFd>>& fd,
                                    const Part& part,
                                    ChunkHold::Pin& pending) const {
  pending.Wait();
  if (!pending.status().ok()) {
    // Damage is damage; any other failure of the read that filled it (one
    // abandoned) leaves this read to try for itself.
    if (absl::IsDataLoss(pending.status())) return pending.status();
    return ReadCached(fd, part);
  }
  const int64_t begin = part.chunk * kBlobChunkBytes;
  CopyBytes(part.dst, pending.data() + (part.from - begin),
            part.to - part.from);
  pending.Served(part.to - part.from);
  return absl::OkStatus();
}

absl::Status BlobReader::ReadInto(int64_t offset, int64_t length, char* buffer,
                                  const Sink& sink) const {
  // pread where the file can be opened; the mapping where its name is gone.
  absl::StatusOr<UniqueFd> opened = OpenFd();
  const int fd = opened.ok() ? opened->get() : -1;
  if (chunk_bytes_ > kBlobChunkBytes) {
    // A whole-blob sum (an older record): verified through the mapping.
    RETURN_IF_ERROR(Verify(offset, length));
    for (int64_t at = offset; at < offset + length; at += kBlobChunkBytes) {
      const int64_t n = std::min(kBlobChunkBytes, offset + length - at);
      RETURN_IF_ERROR(Fetch(fd, buffer, n, at));
      RETURN_IF_ERROR(sink(buffer, n));
    }
    return absl::OkStatus();
  }
  if (!damage_.ok()) return damage_;
  if (length <= 0) return absl::OkStatus();
  if (offset < 0 || offset + length > record_.size) {
    return VerifyChunks(offset, length);  // names the range past the end
  }
  RETURN_IF_ERROR(CheckUnchanged());
  const int64_t end = offset + length;
  for (int64_t c = offset / kBlobChunkBytes; c * kBlobChunkBytes < end; ++c) {
    const int64_t chunk_begin = c * kBlobChunkBytes;
    const int64_t from = std::max(offset, chunk_begin);
    const int64_t to = std::min(end, chunk_begin + kBlobChunkBytes);
    if (IsVerified(c)) {
      RETURN_IF_ERROR(Fetch(fd, buffer, to - from, from));
      RETURN_IF_ERROR(sink(buffer, to - from));
      continue;
    }
    RETURN_IF_ERROR(FetchChunk(fd, c, buffer));
    RETURN_IF_ERROR(sink(buffer + (from - chunk_begin), to - from));
  }
  return absl::OkStatus();
}

absl::Status BlobReader::Verify(int64_t offset, int64_t length) const {
  if (length <= 0) return damage_;
  RETURN_IF_ERROR(CheckUnchanged());
  return VerifyChunks(offset, length);
}

absl::Status BlobReader::VerifyChunks(int64_t offset, int64_t length) const {
  if (!damage_.ok()) return damage_;
  if (length <= 0) return absl::OkStatus();
  if (offset < 0 || offset + length > record_.size) {
    return absl::DataLossError(
        absl::StrCat(Where(), ": bytes ", offset, "-", offset + length,
                     " lie past its recorded size ", record_.size));
  }
  const int64_t last = (offset + length - 1) / chunk_bytes_;
  for (int64_t c = offset / chunk_bytes_; c <= last; ++c) {
    RETURN_IF_ERROR(VerifyChunk(c));
  }
  return absl::OkStatus();
}

absl::Status BlobReader::Read(char* out, int64_t length, int64_t offset) const {
  if (length <= 0) return damage_;
  RETURN_IF_ERROR(CheckUnchanged());
  return ReadChunks(out, length, offset);
}

absl::Status BlobReader::ReadChunks(char* out, int64_t length,
                                    int64_t offset) const {
  if (!damage_.ok()) return damage_;
  if (length <= 0) return absl::OkStatus();
  if (offset < 0 || offset + length > record_.size) {
    return VerifyChunks(offset, length);  // names the range past the end
  }
  // Opened at the first chunk that needs the disk, once for the call: for
  // the hold (around the page cache where it can) and for pread.
  std::optional<AroundFd> around;
  std::optional<absl::StatusOr<UniqueFd>> fd;
  // Parts of chunks that another read is filling are copied last, once this
  // read has filled its own: a request's first chunk is its predecessor's
  // last, and waiting for it first would queue every read behind the one
  // before it, a chunk from the disk at a time.
  absl::InlinedVector<std::pair<Part, ChunkHold::Pin>, 2> pending;
  const int64_t end = offset + length;
  for (int64_t c = offset / chunk_bytes_; c * chunk_bytes_ < end; ++c) {
    const int64_t chunk_begin = c * chunk_bytes_;
    const int64_t chunk_end =
        std::min(chunk_begin + chunk_bytes_, record_.size);
    const int64_t from = std::max(offset, chunk_begin);
    const int64_t to = std::min(end, chunk_end);
    const Part part{c, from, to, out + (from - offset)};
    if (chunk_bytes_ <= kBlobChunkBytes) {
      ChunkHold::Pin pin;
      ASSIGN_OR_RETURN(const Held held, ReadHeld(around, part, pin));
      if (held == Held::kServed) continue;
      if (held == Held::kPending) {
        pending.emplace_back(part, std::move(pin));
        continue;
      }
    }
    RETURN_IF_ERROR(ReadCached(fd, part));
  }
  for (auto& [part, pin] : pending) {
    RETURN_IF_ERROR(FinishHeld(fd, part, pin));
  }
  return absl::OkStatus();
}

absl::Status BlobReader::ReadCached(std::optional<absl::StatusOr<UniqueFd>>& fd,
                                    const Part& part) const {
  const int64_t c = part.chunk;
  const int64_t chunk_begin = c * chunk_bytes_;
  const int64_t chunk_end = std::min(chunk_begin + chunk_bytes_, record_.size);
  const int64_t from = part.from;
  const int64_t to = part.to;
  char* const dst = part.dst;
  if (FetchFromDisk(c)) {
    if (!fd) fd = OpenFd();
    if (fd->ok()) {
      if (from == chunk_begin && to == chunk_end && IoAligned(dst)) {
        return FetchChunk((*fd)->get(), c, dst);
      }
      char* const checked = ChunkBuffer();
      return FetchChunk((*fd)->get(), c, checked,
                        [&](int64_t piece_begin, int64_t piece_end) {
                          const int64_t lo = std::max(piece_begin, from);
                          const int64_t hi = std::min(piece_end, to);
                          if (lo < hi) {
                            CopyBytes(dst + (lo - from),
                                      checked + (lo - chunk_begin), hi - lo);
                          }
                        });
    }
  }
  RETURN_IF_ERROR(VerifyChunk(c));
  if (!ReadMapped([&] { CopyBytes(dst, map_.data() + from, to - from); })) {
    return CutShort();
  }
  return absl::OkStatus();
}

absl::Status BlobReader::CutShort() const {
  return absl::DataLossError(
      absl::StrCat(Where(), " was cut short while in use (run scalai fsck)"));
}

absl::Status UnchangedBlobs::Check(const BlobReader& blob) {
  if (std::find(checked_.begin(), checked_.end(), &blob) != checked_.end()) {
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(blob.CheckUnchanged());
  checked_.push_back(&blob);
  return absl::OkStatus();
}

}  // namespace scalai
