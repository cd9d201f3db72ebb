#include "transfer/chunk_hold.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <utility>

#include "transfer/blob_checksum.h"

namespace scalai {

ChunkHold::ChunkHold(int slots, int64_t slot_bytes)
    : slot_bytes_(slot_bytes), slots_(slots) {
  constexpr size_t kHugePage = 2 << 20;
  region_bytes_ = slots * slot_bytes + kHugePage;
  void* region = mmap(nullptr, region_bytes_, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED) throw std::bad_alloc();
  region_ = static_cast<char*>(region);
  char* const aligned = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(region_) + kHugePage - 1) / kHugePage *
      kHugePage);
  // Best effort: without huge pages the slots work the same, in smaller
  // disk requests.
  madvise(aligned, slots * slot_bytes, MADV_HUGEPAGE);
  for (int i = 0; i < slots; ++i) slots_[i].bytes = aligned + i * slot_bytes;
}

ChunkHold::~ChunkHold() { munmap(region_, region_bytes_); }

ChunkHold& ChunkHold::Shared() {
  static ChunkHold* const hold = new ChunkHold(64, kBlobChunkBytes);
  return *hold;
}

uint64_t ChunkHold::NewBlobId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

ChunkHold::Slot* ChunkHold::PinHolder(Key key) {
  for (Slot& slot : slots_) {
    if (slot.key != key) continue;
    ++slot.pins;
    slot.used = ++clock_;
    return &slot;
  }
  return nullptr;
}

ChunkHold::Pin ChunkHold::Find(Key key) {
  if (key.blob == 0) return Pin();
  std::lock_guard lock(mu_);
  Slot* slot = PinHolder(key);
  return slot == nullptr ? Pin() : Pin(this, slot, false);
}

void ChunkHold::Wait(Slot& slot) {
  std::unique_lock lock(mu_);
  filled_.wait(lock, [&slot] { return !slot.filling; });
}

ChunkHold::Pin ChunkHold::Acquire(Key key, int64_t bytes) {
  if (key.blob == 0 || bytes > slot_bytes_) return Pin();
  std::lock_guard lock(mu_);
  if (Slot* held = PinHolder(key)) return Pin(this, held, false);
  Slot* chosen = nullptr;
  for (Slot& slot : slots_) {
    if (slot.pins > 0) continue;
    if (slot.key.blob == 0) {
      chosen = &slot;
      break;
    }
    // A chunk still held for a part never asked for: the oldest goes.
    if (chosen == nullptr || slot.used < chosen->used) chosen = &slot;
  }
  if (chosen == nullptr) return Pin();
  chosen->key = key;
  chosen->unserved = bytes;
  chosen->pins = 1;
  chosen->filling = true;
  chosen->status = absl::OkStatus();
  chosen->used = ++clock_;
  return Pin(this, chosen, true);
}

void ChunkHold::Filled(Slot& slot, absl::Status status) {
  {
    std::lock_guard lock(mu_);
    slot.filling = false;
    // A failed fill is told to those waiting now; whoever comes later
    // tries again (and finds the damage for itself).
    if (!status.ok()) slot.key = Key();
    slot.status = std::move(status);
  }
  filled_.notify_all();
}

void ChunkHold::Served(Slot& slot, int64_t bytes) {
  std::lock_guard lock(mu_);
  slot.unserved -= bytes;
  if (slot.unserved <= 0) slot.key = Key();
}

void ChunkHold::Unpin(Slot& slot, bool filled) {
  if (!filled) {
    Filled(slot, absl::AbortedError("a chunk's read was abandoned"));
  }
  std::lock_guard lock(mu_);
  --slot.pins;
}

ChunkHold::Pin::Pin(Pin&& other) noexcept
    : hold_(std::exchange(other.hold_, nullptr)),
      slot_(std::exchange(other.slot_, nullptr)),
      must_fill_(std::exchange(other.must_fill_, false)) {}

ChunkHold::Pin& ChunkHold::Pin::operator=(Pin&& other) noexcept {
  if (this != &other) {
    if (slot_ != nullptr) hold_->Unpin(*slot_, !must_fill_);
    hold_ = std::exchange(other.hold_, nullptr);
    slot_ = std::exchange(other.slot_, nullptr);
    must_fill_ = std::exchange(other.must_fill_, false);
  }
  return *this;
}

ChunkHold::Pin::~Pin() {
  if (slot_ != nullptr) hold_->Unpin(*slot_, !must_fill_);
}

void ChunkHold::Pin::Filled(absl::Status status) {
  must_fill_ = false;
  hold_->Filled(*slot_, std::move(status));
}

void ChunkHold::Pin::Served(int64_t bytes) { hold_->Served(*slot_, bytes); }

}  // namespace scalai
