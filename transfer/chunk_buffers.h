// ChunkBuffers is a small pool of aligned buffers, each holding one chunk
// read by its user, shared by every thread of the process. A chunk is read
// into a free buffer once (the least recently used one is reused) and copied
// out from there by every request that wants part of it while it stays:
// requests for neighbouring ranges of a file usually cut a chunk in two, and
// arrive on different threads. A chunk being read is waited for, never read
// twice at once; a read that fails keeps nothing, and the next request for
// the chunk reads it again.
//
// BlobReader reads a blob's chunks here straight from the disk (O_DIRECT)
// when the page cache does not hold them (blob_reader.h says why).
//
//   ChunkBuffers buffers(/*count=*/32, /*bytes=*/1 << 20);
//   RETURN_IF_ERROR(buffers.Copy({owner, chunk}, load, from, n, out));
#ifndef SCALAI_TRANSFER_CHUNK_BUFFERS_H_
#define SCALAI_TRANSFER_CHUNK_BUFFERS_H_

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace scalai {

class ChunkBuffers {
 public:
  // Which chunk: of which owner (a number unique in the process for as
  // long as its chunks may be asked for), and which of its chunks.
  struct Key {
    uint64_t owner = 0;
    int64_t chunk = -1;
    bool operator==(const Key&) const = default;
  };
  // Fills `buffer` (`bytes` long, aligned for O_DIRECT) with the chunk.
  using Load = absl::FunctionRef<absl::Status(char* buffer)>;

  // `count` buffers of `bytes` each, allocated as first needed; `bytes` a
  // multiple of kAlignment.
  ChunkBuffers(int count, int64_t bytes);
  ChunkBuffers(const ChunkBuffers&) = delete;
  ChunkBuffers& operator=(const ChunkBuffers&) = delete;

  static constexpr int64_t kAlignment = 4096;
  int64_t bytes() const { return bytes_; }

  // Copies bytes [from, from + n) of chunk `key` to `out`, calling `load`
  // first when no buffer holds it; `load`'s error when it fails.
  absl::Status Copy(Key key, Load load, int64_t from, int64_t n, char* out);
  // How many times `load` has been called: what a cold read cost.
  int64_t loads() const;

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  struct Slot {
    Key key;
    bool loading = false;
    int readers = 0;    // copying out now: the slot may not be reused
    uint64_t used = 0;  // when last asked for, for reuse of the oldest
    std::unique_ptr<char, Free> buffer;
  };
  Slot* Find(Key key);
  // The least recently used slot nobody is reading or loading, if any.
  Slot* Reusable();

  const int64_t bytes_;
  mutable std::mutex mu_;
  std::condition_variable changed_;  // a load finished or a reader left
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
  int64_t loads_ = 0;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CHUNK_BUFFERS_H_
