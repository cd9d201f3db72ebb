#include "transfer/chunk_buffers.h"

#include <cstring>
#include <new>

namespace scalai {

ChunkBuffers::ChunkBuffers(int count, int64_t bytes)
    : bytes_(bytes), slots_(count) {}

ChunkBuffers::Slot* ChunkBuffers::Find(Key key) {
  for (Slot& s : slots_) {
    if (s.key == key) return &s;
  }
  return nullptr;
}

ChunkBuffers::Slot* ChunkBuffers::Reusable() {
  Slot* oldest = nullptr;
  for (Slot& s : slots_) {
    if (s.loading || s.readers > 0) continue;
    if (oldest == nullptr || s.used < oldest->used) oldest = &s;
  }
  return oldest;
}

absl::Status ChunkBuffers::Copy(Key key, Load load, int64_t from, int64_t n,
                                char* out) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    Slot* slot = Find(key);
    if (slot != nullptr && slot->loading) {
      changed_.wait(lock);
      continue;
    }
    if (slot != nullptr) {
      slot->used = ++clock_;
      ++slot->readers;
      lock.unlock();
      std::memcpy(out, slot->buffer.get() + from, n);
      lock.lock();
      if (--slot->readers == 0) changed_.notify_all();
      return absl::OkStatus();
    }
    slot = Reusable();
    if (slot == nullptr) {  // every buffer in use: wait for one
      changed_.wait(lock);
      continue;
    }
    if (slot->buffer == nullptr) {
      slot->buffer.reset(
          static_cast<char*>(std::aligned_alloc(kAlignment, bytes_)));
      if (slot->buffer == nullptr) throw std::bad_alloc();
    }
    slot->key = key;
    slot->loading = true;
    slot->used = ++clock_;
    ++loads_;
    lock.unlock();
    // Only this thread touches a slot while it loads.
    absl::Status loaded = load(slot->buffer.get());
    if (loaded.ok()) std::memcpy(out, slot->buffer.get() + from, n);
    lock.lock();
    slot->loading = false;
    if (!loaded.ok()) slot->key = Key{};
    changed_.notify_all();
    return loaded;
  }
}

int64_t ChunkBuffers::loads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return loads_;
}

}  // namespace scalai
