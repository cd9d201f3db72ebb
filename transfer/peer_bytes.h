// PeerBytes reads the bytes of shards this host does not hold from the peers
// that do: each peer sends the longest prefix of a range it holds, and the
// rest is asked of the next one, so a range split between hosts (after a
// reconfiguration, before every host caught up) is still read whole. Reads
// start at different peers for different ranges, so that replicas on
// several hosts share the load. Cached reads fetch whole 4 MiB blocks and
// keep the last kCacheBlocks of them, so that a worker reading a file front
// to back through the mount (1 MiB at a time) costs one call per block; the
// next kReadAheadBlocks blocks are fetched in the background meanwhile, so
// that such a reader rarely waits for the network. Exact reads (a
// materialization's) take what cached blocks hold instead of fetching it
// again.
//
//   PeerBytes remote([&] { return live_peers(); });
//   ASSIGN_OR_RETURN(auto view, StepView::Create(store, step, config, &remote));
#ifndef SCALAI_TRANSFER_PEER_BYTES_H_
#define SCALAI_TRANSFER_PEER_BYTES_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transfer/peer_client.h"
#include "transfer/remote_bytes.h"

namespace scalai {

class PeerBytes : public RemoteBytes {
 public:
  struct Options {
    // What a cached read fetches at a time, and how many such blocks are
    // kept.
    int64_t block_bytes = 4 << 20;
    size_t cache_blocks = 16;  // more than read_ahead_blocks
    // Blocks after the one read that are fetched in the background, by
    // this many threads (each a call in flight).
    int64_t read_ahead_blocks = 4;
    int read_ahead_threads = 3;
  };

  // The peers to ask, called at each read; they outlive the read.
  using Peers = std::function<std::vector<PeerClient*>()>;
  explicit PeerBytes(Peers peers) : PeerBytes(std::move(peers), Options()) {}
  PeerBytes(Peers peers, Options options);
  // Waits for the blocks being read ahead (each bounded by the peers'
  // deadlines).
  ~PeerBytes() override;

  absl::Status Read(int64_t step, const std::string& config, ShardRef shard,
                    int64_t shard_bytes, int64_t offset, int64_t length,
                    char* out, Access access) const override;
  void Forget(int64_t step) const override;
  // Bytes exact reads took from blocks cached for views instead of
  // fetching them again.
  int64_t bytes_reused() const { return bytes_reused_.load(); }

 private:
  // The range's bytes: those of blocks already cached copied from them,
  // the rest fetched exactly.
  absl::Status ReadExact(int64_t step, const std::string& config,
                         ShardRef shard, int64_t offset, int64_t length,
                         char* out) const;
  // Reads exactly the range from the peers: for a worker's read through the
  // mount (kCached), which the serving host's materialization gives way to,
  // or for a materialization (kExact).
  absl::Status Fetch(int64_t step, const std::string& config, ShardRef shard,
                     int64_t offset, int64_t length, char* out,
                     Access access) const;

  // A block of a shard: (step, config, group, shard, block index).
  struct BlockKey {
    int64_t step;
    std::string config;
    ShardRef shard;
    int64_t index;
    bool operator==(const BlockKey&) const = default;
  };
  // A cached block: fetched by whoever claims it first, a reader or the
  // read-ahead thread; the others wait for it. Fields guarded by mu_.
  struct Block {
    BlockKey key;
    int64_t begin = 0;  // key.index * block_bytes
    // Left uninitialized until fetched: zero-filling each 4 MiB block
    // took 6.5% of a reading host's time in a profile.
    std::unique_ptr<char[]> bytes;
    int64_t size = 0;
    bool queued = false;  // to be read ahead
    bool claimed = false;
    bool done = false;
    bool evicted = false;  // left the cache: read ahead no more
    absl::Status status;   // once done
  };
  // The cached block `index` of a shard, added (unclaimed) if missing.
  // Requires mu_.
  std::shared_ptr<Block> Find(int64_t step, const std::string& config,
                              ShardRef shard, int64_t shard_bytes,
                              int64_t index) const;
  // Fetches the block if nobody claimed it yet, else waits until it is
  // fetched; a failed block leaves the cache, to be asked again.
  absl::Status Await(const std::shared_ptr<Block>& block) const;
  void ReadAhead();  // the read-ahead thread

  Peers peers_;
  const Options options_;
  mutable std::mutex mu_;  // guards the cache and the read-ahead queue
  mutable std::condition_variable changed_;  // a block done, or work queued
  mutable std::list<std::shared_ptr<Block>> blocks_;  // newest first
  mutable std::deque<std::shared_ptr<Block>> ahead_;  // blocks to read ahead
  mutable std::atomic<int64_t> bytes_reused_{0};
  bool stopping_ = false;
  std::vector<std::thread> readers_;  // read ahead
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_PEER_BYTES_H_
