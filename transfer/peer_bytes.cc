#include "transfer/peer_bytes.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ptc/status_macros.h"
#include "transfer/copy_bytes.h"

namespace scalai {

PeerBytes::PeerBytes(Peers peers, Options options)
    : peers_(std::move(peers)), options_(options) {
  for (int i = 0; i < options_.read_ahead_threads; ++i) {
    readers_.emplace_back([this] { ReadAhead(); });
  }
}

PeerBytes::~PeerBytes() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    ahead_.clear();
  }
  changed_.notify_all();
  for (std::thread& t : readers_) t.join();
}

std::shared_ptr<PeerBytes::Block> PeerBytes::Find(int64_t step,
                                                  const std::string& config,
                                                  ShardRef shard,
                                                  int64_t shard_bytes,
                                                  int64_t index) const {
  BlockKey key{step, config, shard, index};
  for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
    if ((*it)->key != key) continue;
    blocks_.splice(blocks_.begin(), blocks_, it);  // the newest now
    return blocks_.front();
  }
  auto block = std::make_shared<Block>();
  block->key = std::move(key);
  block->begin = index * options_.block_bytes;
  block->size =
      std::min(block->begin + options_.block_bytes, shard_bytes) - block->begin;
  block->bytes =
      std::make_unique_for_overwrite<char[]>(static_cast<size_t>(block->size));
  blocks_.push_front(block);
  if (blocks_.size() > options_.cache_blocks) {
    blocks_.back()->evicted = true;
    blocks_.pop_back();
  }
  return block;
}

absl::Status PeerBytes::Await(const std::shared_ptr<Block>& block) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (!block->claimed) {
    block->claimed = true;
    lock.unlock();
    absl::Status fetched =
        Fetch(block->key.step, block->key.config, block->key.shard,
              block->begin, block->size, block->bytes.get(), Access::kCached);
    lock.lock();
    block->status = std::move(fetched);
    block->done = true;
    changed_.notify_all();
  }
  changed_.wait(lock, [&] { return block->done; });
  if (block->status.ok()) return absl::OkStatus();
  blocks_.remove(block);  // asked again by the next read
  return block->status;
}

void PeerBytes::ReadAhead() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !ahead_.empty(); });
    if (stopping_) return;
    std::shared_ptr<Block> block = std::move(ahead_.front());
    ahead_.pop_front();
    if (block->claimed || block->evicted) continue;
    lock.unlock();
    Await(block).IgnoreError();  // a reader that needs it sees the error
    lock.lock();
  }
}

void PeerBytes::Forget(int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  // A block being fetched finishes for its readers but is found no more.
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    if ((*it)->key.step != step) {
      ++it;
      continue;
    }
    (*it)->evicted = true;
    it = blocks_.erase(it);
  }
}

absl::Status PeerBytes::ReadExact(int64_t step, const std::string& config,
                                  ShardRef shard, int64_t offset,
                                  int64_t length, char* out) const {
  // What a view's reads brought here already is copied, not fetched again:
  // a byte crosses the network once per host while its block stays cached.
  int64_t missing_from = -1;  // start of the run not found in the cache
  auto fetch_missing = [&](int64_t until) -> absl::Status {
    if (missing_from < 0) return absl::OkStatus();
    absl::Status s =
        Fetch(step, config, shard, missing_from, until - missing_from,
              out + (missing_from - offset), Access::kExact);
    missing_from = -1;
    return s;
  };
  for (int64_t at = offset; at < offset + length;) {
    const int64_t index = at / options_.block_bytes;
    const int64_t end =
        std::min((index + 1) * options_.block_bytes, offset + length);
    bool cached = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const BlockKey key{step, config, shard, index};
      for (const std::shared_ptr<Block>& block : blocks_) {
        if (block->key != key) continue;
        if (block->done && block->status.ok()) {
          CopyBytes(out + (at - offset),
                    block->bytes.get() + (at - block->begin), end - at);
          cached = true;
          bytes_reused_.fetch_add(end - at);
        }
        break;
      }
    }
    if (cached) {
      RETURN_IF_ERROR(fetch_missing(at));
    } else if (missing_from < 0) {
      missing_from = at;
    }
    at = end;
  }
  return fetch_missing(offset + length);
}

absl::Status PeerBytes::Read(int64_t step, const std::string& config,
                             ShardRef shard, int64_t shard_bytes,
                             int64_t offset, int64_t length, char* out,
                             Access access) const {
  if (access == Access::kExact)
    return ReadExact(step, config, shard, offset, length, out);
  const int64_t blocks =
      (shard_bytes + options_.block_bytes - 1) / options_.block_bytes;
  for (int64_t at = offset; at < offset + length;) {
    const int64_t index = at / options_.block_bytes;
    std::shared_ptr<Block> block;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The blocks after this one are queued for the background threads,
      // then this one is found last: the newest, it stays cached while it
      // is read.
      for (int64_t next = index + 1;
           next <= index + options_.read_ahead_blocks && next < blocks;
           ++next) {
        std::shared_ptr<Block> later =
            Find(step, config, shard, shard_bytes, next);
        if (later->claimed || later->queued) continue;
        later->queued = true;
        ahead_.push_back(std::move(later));
      }
      block = Find(step, config, shard, shard_bytes, index);
    }
    changed_.notify_all();
    RETURN_IF_ERROR(Await(block));
    const int64_t n =
        std::min(block->begin + block->size, offset + length) - at;
    CopyBytes(out + (at - offset), block->bytes.get() + (at - block->begin), n);
    at += n;
  }
  return absl::OkStatus();
}

absl::Status PeerBytes::Fetch(int64_t step, const std::string& config,
                              ShardRef shard, int64_t offset, int64_t length,
                              char* out, Access access) const {
  std::vector<PeerClient*> peers = peers_();
  const PeerClient::TensorRef ref{step, config, shard.group, shard.shard,
                                  access == Access::kCached};
  // Spread ranges over the peers: the replicas of a shard share the reads.
  const size_t start =
      peers.empty() ? 0
                    : static_cast<size_t>(shard.group * 131 + shard.shard +
                                          offset / options_.block_bytes) %
                          peers.size();
  std::vector<std::string> errors;
  int64_t done = 0;
  // Each pass asks every peer once for what is still missing; a pass in
  // which none had any byte of it ends the read.
  for (bool progress = true; progress && done < length;) {
    progress = false;
    for (size_t i = 0; i < peers.size() && done < length; ++i) {
      PeerClient& peer = *peers[(start + i) % peers.size()];
      absl::StatusOr<int64_t> got =
          peer.ReadTensor(ref, offset + done, length - done, out + done);
      if (!got.ok()) {
        errors.push_back(std::string(got.status().message()));
        continue;
      }
      done += *got;
      progress |= *got > 0;
    }
  }
  if (done == length) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "step ", step, ": bytes [", offset + done, ", ", offset + length,
      ") of shard ", shard.shard, " of group ", shard.group, " under ", config,
      " are held by no reachable host",
      errors.empty() ? ""
                     : absl::StrCat(" (", absl::StrJoin(errors, "; "), ")")));
}

}  // namespace scalai
