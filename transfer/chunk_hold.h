// A ChunkHold keeps blob chunks that were read from the disk around the
// page cache (O_DIRECT) and verified, until every byte of each has been
// copied out. A mount's read requests do not line up with the 1 MiB chunks
// (a stored shard's bytes sit a header's length past their place in the
// blob, and requests are a little under 1 MiB), so each chunk is wanted by
// two requests, often at the same time on two threads: the first to come
// reads and checks it, the second copies its part from the same buffer
// once it is filled instead of reading it again. A fixed number of 1 MiB
// slots, shared by the process; when all are pinned, Acquire says so and
// the caller reads through the page cache as before. It does so too while
// a SharedPageCache lives: another reader of the same blobs (a
// materialization, copying the step into a new layout while workers read
// it) then finds each chunk in the page cache, and the disk is read once
// for both, not once each.
//
//   ChunkHold::Pin pin = ChunkHold::Shared().Acquire(key, bytes);
//   if (pin.must_fill()) pin.Filled(ReadAndCheck(pin.data()));
//   else if (pin) pin.Wait();
//   if (pin && pin.status().ok()) { copy from pin.data(); pin.Served(n); }
#ifndef SCALAI_TRANSFER_CHUNK_HOLD_H_
#define SCALAI_TRANSFER_CHUNK_HOLD_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"

namespace scalai {

class ChunkHold {
 public:
  // What a slot is for: one chunk of one blob as it is now (BlobReader
  // gives a blob a new id when its file changes).
  struct Key {
    uint64_t blob = 0;  // 0: none
    int64_t chunk = -1;
    bool operator==(const Key&) const = default;
  };
  class Pin;
  // While one lives, readers leave chunks they would read around the page
  // cache to it instead (those held already are still served).
  class SharedPageCache {
   public:
    SharedPageCache() { ++Shared().page_cache_shared_; }
    ~SharedPageCache() { --Shared().page_cache_shared_; }
    SharedPageCache(const SharedPageCache&) = delete;
    SharedPageCache& operator=(const SharedPageCache&) = delete;
  };

  // `slots` buffers of `slot_bytes` (a multiple of 4 KiB), in one region
  // of memory whose pages are taken as first used.
  ChunkHold(int slots, int64_t slot_bytes);
  ChunkHold(const ChunkHold&) = delete;
  ChunkHold& operator=(const ChunkHold&) = delete;
  ~ChunkHold();
  // The process's hold: 64 slots of a chunk each (64 MiB at most), enough
  // for eight readers with 4 MiB of read-ahead each in flight.
  static ChunkHold& Shared();
  // A fresh blob id, never 0 and never given twice.
  static uint64_t NewBlobId();

  // Whether a SharedPageCache lives.
  bool page_cache_shared() const { return page_cache_shared_.load() > 0; }
  // The slot holding `key`, perhaps still being filled (Pin::Wait). An
  // empty pin when none holds it.
  Pin Find(Key key);
  // The same, but when no slot holds `key`, a free slot (or the one least
  // recently used that no one has pinned) is given to it for the caller to
  // fill (must_fill), `bytes` long. An empty pin when every slot is pinned.
  Pin Acquire(Key key, int64_t bytes);

 private:
  struct Slot {
    Key key;
    char* bytes = nullptr;
    int64_t unserved = 0;  // bytes of the chunk not yet copied out
    int pins = 0;
    bool filling = false;
    absl::Status status;  // of the fill
    uint64_t used = 0;    // when last pinned, for choosing one to reuse
  };
  // With mu_ held: the slot holding `key`, pinned; or null.
  Slot* PinHolder(Key key);
  void Wait(Slot& slot);
  void Filled(Slot& slot, absl::Status status);
  void Served(Slot& slot, int64_t bytes);
  void Unpin(Slot& slot, bool filled);

  const int64_t slot_bytes_;
  // The slots' memory, in huge pages where the kernel gives them: a slot
  // lying in one physically contiguous piece is one segment of a disk
  // request, where 4 KiB pages cap an O_DIRECT request at the device's
  // segment count (254 on this project's virtio disks: 1 MiB).
  char* region_ = nullptr;
  size_t region_bytes_ = 0;
  std::mutex mu_;
  std::condition_variable filled_;
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
  std::atomic<int> page_cache_shared_{0};
};

// One thread's claim on a slot: while it is held the slot's bytes stay.
class ChunkHold::Pin {
 public:
  Pin() = default;
  Pin(Pin&& other) noexcept;
  Pin& operator=(Pin&& other) noexcept;
  ~Pin();
  explicit operator bool() const { return slot_ != nullptr; }
  // Whether this caller was given the slot to fill: it reads the chunk into
  // data(), then calls Filled, success or not (others wait for it).
  bool must_fill() const { return must_fill_; }
  char* data() const { return slot_->bytes; }
  // Until the slot is filled (a no-op for the one who fills it).
  void Wait() {
    if (!must_fill_) hold_->Wait(*slot_);
  }
  // How the fill went, once waited for; the bytes may be used only when
  // it went well.
  const absl::Status& status() const { return slot_->status; }
  void Filled(absl::Status status);
  // `bytes` of the chunk were copied out: once all have been, the slot is
  // free for another chunk.
  void Served(int64_t bytes);

 private:
  friend class ChunkHold;
  Pin(ChunkHold* hold, Slot* slot, bool must_fill)
      : hold_(hold), slot_(slot), must_fill_(must_fill) {}
  ChunkHold* hold_ = nullptr;
  Slot* slot_ = nullptr;
  bool must_fill_ = false;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CHUNK_HOLD_H_
