// A BlobReader is one blob of a store open for reading, whose bytes are
// verified against the blob's chunk sums (blob_checksum.h) the first time
// each chunk is read, and remembered as verified while the file stays as it
// was (same size and modification time). It holds the blob mapped but no
// file descriptor: a mount serves thousands of blobs, across generations,
// and descriptors are opened only for the length of a copy (OpenFd). The
// mapping keeps the bytes even once the blob's name is gone (a step
// retired while a reader still has it open). A blob that is missing, short,
// changed or unrecorded still opens: every read that needs it fails with a
// DataLoss error naming the blob, its step and the chunk, so one damaged blob
// costs only the reads that touch it and wrong bytes are never handed out.
//
//   std::shared_ptr<const BlobReader> blob = BlobReader::Open(store, name);
//   RETURN_IF_ERROR(blob->Verify(offset, n));  // then blob->data() + offset
//   RETURN_IF_ERROR(blob->Read(out, n, offset));
#ifndef SCALAI_TRANSFER_BLOB_READER_H_
#define SCALAI_TRANSFER_BLOB_READER_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "transfer/chunk_hold.h"
#include "transfer/files.h"
#include "transfer/store.h"

namespace scalai {

class BlobReader {
 public:
  static std::shared_ptr<const BlobReader> Open(const Store& store,
                                                const std::string& name);
  // The same, with the record already looked up (Store::Blob).
  static std::shared_ptr<const BlobReader> Open(
      std::string path, std::string name, absl::StatusOr<BlobRecord> record);
  BlobReader(const BlobReader&) = delete;
  BlobReader& operator=(const BlobReader&) = delete;

  const std::string& name() const { return name_; }
  // Its file did not exist at the open (a writer may have retired it since
  // the reader's catalog named it: StepSnapshot).
  bool missing() const { return missing_; }
  int64_t step() const { return record_.step; }
  // The recorded size.
  int64_t size() const { return record_.size; }
  // The blob mapped; a range may be touched only after Verify accepted it,
  // and only inside ReadMapped (mapping_guard.h).
  const std::byte* data() const { return map_.data(); }
  // The blob's file opened for reading (with `flags` added to O_RDONLY),
  // for a copy that stays inside the kernel; fails if its name is gone or
  // now names another file.
  absl::StatusOr<UniqueFd> OpenFd(int flags = 0) const;

  // Checks that bytes [offset, offset + length) are the bytes recorded:
  // the file is unchanged (CheckUnchanged), and each chunk they touch is
  // hashed the first time. Thread-safe.
  absl::Status Verify(int64_t offset, int64_t length) const;
  // The two halves of Verify, for an operation that reads many small pieces
  // of a blob (rows of a tensor split along dim 1): one stat, that the file
  // still has its recorded size (a new modification time forgets which
  // chunks were checked), then the chunks of each piece.
  absl::Status CheckUnchanged() const;
  absl::Status VerifyChunks(int64_t offset, int64_t length) const;
  // Verify, then copy the bytes out (ReadChunks).
  absl::Status Read(char* out, int64_t length, int64_t offset) const;
  // The second half of Read, once CheckUnchanged has passed in this
  // operation. A chunk the page cache lacks is read from the disk around
  // the cache (O_DIRECT) into a slot of the process's ChunkHold, checked
  // there, and copied out from there, by this read and by the one that
  // wants the chunk's other part: the disk's bytes land in memory once,
  // with no page cache pages to fill and none to copy from. Where the
  // filesystem refuses O_DIRECT, or every slot is in use, such a chunk is
  // read with pread into a buffer and checked there instead (into `out`
  // itself when the range covers the chunk whole). Chunks already verified,
  // and chunks the page cache holds, are copied from the mapping.
  absl::Status ReadChunks(char* out, int64_t length, int64_t offset) const;
  // The error for a read of the mapping that faulted (ReadMapped): the file
  // was cut short while in use.
  absl::Status CutShort() const;
  // Hands bytes [offset, offset + length) to `sink` in order, in pieces of
  // at most kBlobChunkBytes, read with pread into `buffer` (kBlobChunkBytes
  // long) and never through the mapping: a long sequential copy pays no page
  // faults, and a chunk not yet verified is read whole, once, and verified
  // from the same buffer it is copied from.
  using Sink = std::function<absl::Status(const char* data, int64_t bytes)>;
  absl::Status ReadInto(int64_t offset, int64_t length, char* buffer,
                        const Sink& sink) const;

 private:
  BlobReader() = default;
  // How many chunks one read of a cold chunk reads at most (ReadHeld).
  static constexpr size_t kChunksAhead = 4;
  absl::Status VerifyChunk(int64_t chunk) const;
  // Whether chunk `chunk` is best read with pread, checked in a buffer: it
  // is not verified, the page cache lacks it, and it is no longer than
  // kBlobChunkBytes (FetchChunk).
  bool FetchFromDisk(int64_t chunk) const;
  bool IsVerified(int64_t chunk) const;
  void MarkVerified(int64_t chunk) const;
  absl::Status ChunkMismatch(int64_t chunk) const;
  // Exactly `bytes` at `offset`: with pread from `fd` when it is open (a
  // short file is damage), else from the mapping.
  absl::Status Fetch(int fd, char* out, int64_t bytes, int64_t offset) const;
  // Chunk `chunk` (of kBlobChunkBytes) read whole into `buffer` with Fetch,
  // checked against its sum and marked verified. It is read and hashed a
  // piece at a time, and `fresh` is called with the blob's bytes [begin,
  // end) of each piece just hashed, while they are still in the CPU's cache
  // (they may yet turn out damaged: the caller hands nothing out until this
  // returns OK).
  absl::Status FetchChunk(
      int fd, int64_t chunk, char* buffer,
      absl::FunctionRef<void(int64_t begin, int64_t end)> fresh =
          [](int64_t, int64_t) {}) const;
  // The core of FetchChunk: `fetch(at, n)` brings bytes [at, at + n) of the
  // chunk into place in `buffer`, a piece at a time, each hashed and handed
  // to `fresh` as it comes.
  absl::Status CheckChunk(
      int64_t chunk, char* buffer,
      absl::FunctionRef<absl::Status(int64_t at, int64_t n)> fetch,
      absl::FunctionRef<void(int64_t begin, int64_t end)> fresh) const;
  // The blob opened with O_DIRECT for the hold's reads, at their first
  // need in one ReadChunks call; `direct` turns false where ReadAround had
  // to turn O_DIRECT off for the rest of a read.
  struct AroundFd {
    absl::StatusOr<UniqueFd> fd;
    bool direct = true;
  };
  // Chunks `first`, `first` + 1, ... read whole into `buffers` (one each,
  // kBlobChunkBytes, page-aligned) with one read from `around`; not
  // checked (CheckChunk).
  absl::Status ReadAround(AroundFd& around, int64_t first,
                          absl::Span<char* const> buffers) const;
  // Bytes [from, to) of chunk `chunk`, bound for `dst`: one chunk's share
  // of a ReadChunks call.
  struct Part {
    int64_t chunk;
    int64_t from;
    int64_t to;
    char* dst;
  };
  // Where ReadHeld left a part.
  enum class Held {
    kServed,   // copied out of a slot this read filled
    kPending,  // in a slot, to be copied once filled (FinishHeld)
    kNotHeld,  // for the caller's other paths (ReadCached)
  };
  // A part out of the ChunkHold: `pending` is pinned to the slot that holds
  // its chunk; or, when the chunk is neither verified nor in the page cache,
  // to a slot this read fills now (ReadAround, with `around` opened at first
  // need), copying the part out as it is checked. The chunks after it that
  // no one holds yet are read in the same read, into slots of their own,
  // for the requests to come (kChunksAhead).
  absl::StatusOr<Held> ReadHeld(std::optional<AroundFd>& around,
                                const Part& part,
                                ChunkHold::Pin& pending) const;
  // A kPending part, once its slot is filled; through ReadCached if the
  // fill was abandoned.
  absl::Status FinishHeld(std::optional<absl::StatusOr<UniqueFd>>& fd,
                          const Part& part, ChunkHold::Pin& pending) const;
  // A part read the way a chunk is without the hold: from the mapping, or
  // with pread into a buffer where the chunk must come from the disk.
  absl::Status ReadCached(std::optional<absl::StatusOr<UniqueFd>>& fd,
                          const Part& part) const;
  std::string Where() const;

  std::string name_;
  std::string path_;
  BlobRecord record_;
  // kBlobChunkBytes; the whole blob for a record with one whole-blob sum.
  int64_t chunk_bytes_ = 0;
  std::vector<uint64_t> sums_;
  absl::Status damage_;  // why the blob cannot be read at all
  bool missing_ = false;
  dev_t dev_ = 0;  // the file mapped, to tell it from a replacement
  ino_t ino_ = 0;
  MappedFile map_;
  // One bit a chunk: verified since the file was last seen modified.
  std::unique_ptr<std::atomic<uint64_t>[]> verified_;
  mutable std::atomic<int64_t> mtime_ns_{0};
  // The blob's id in the ChunkHold; a new one when the file changes.
  mutable std::atomic<uint64_t> hold_id_{0};
  // Whether any chunk of it went to the hold (else reads skip looking).
  mutable std::atomic<bool> held_once_{false};
  // Whether the filesystem refused O_DIRECT for it.
  mutable std::atomic<bool> no_direct_{false};
};

// The blobs that one operation (a read request, a blob being written) has
// found unchanged, so that it looks at each once however many pieces it
// reads from it.
//
//   UnchangedBlobs unchanged;
//   RETURN_IF_ERROR(unchanged.Check(blob));
//   RETURN_IF_ERROR(blob.VerifyChunks(offset, n));
class UnchangedBlobs {
 public:
  absl::Status Check(const BlobReader& blob);

 private:
  std::vector<const BlobReader*> checked_;  // few: a linear search is fastest
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_BLOB_READER_H_
