// PeerBytes reads the bytes of shards this host does not hold from the peers
// that do: each peer sends the longest prefix of a range it holds, and the
// rest is asked of the next one, so a range split between hosts (after a
// reconfiguration, before every host caught up) is still read whole. Reads
// start at different peers for different ranges, so that replicas on
// several hosts share the load. Cached reads fetch whole 4 MiB blocks and
// keep the last kCacheBlocks of them, so that a worker reading a file front
// to back through the mount (128 KiB at a time) costs one call per block.
//
//   PeerBytes remote([&] { return live_peers(); });
//   ASSIGN_OR_RETURN(auto view, StepView::Create(store, step, config, &remote));
#ifndef SCALAI_TRANSFER_PEER_BYTES_H_
#define SCALAI_TRANSFER_PEER_BYTES_H_

#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "transfer/peer_client.h"
#include "transfer/remote_bytes.h"

namespace scalai {

class PeerBytes : public RemoteBytes {
 public:
  static constexpr int64_t kBlockBytes = 4 << 20;
  static constexpr size_t kCacheBlocks = 16;

  // The peers to ask, called at each read; they outlive the read.
  using Peers = std::function<std::vector<PeerClient*>()>;
  explicit PeerBytes(Peers peers) : peers_(std::move(peers)) {}

  absl::Status Read(int64_t step, const std::string& config, ShardRef shard,
                    int64_t shard_bytes, int64_t offset, int64_t length,
                    char* out, Access access) const override;

 private:
  // Reads exactly the range from the peers.
  absl::Status Fetch(int64_t step, const std::string& config, ShardRef shard,
                     int64_t offset, int64_t length, char* out) const;

  // A block of a shard: (step, config, group, shard, block index).
  using BlockKey = std::tuple<int64_t, std::string, int, int, int64_t>;
  Peers peers_;
  mutable std::mutex mu_;  // guards the cache
  mutable std::list<std::pair<BlockKey, std::shared_ptr<const std::string>>>
      blocks_;  // newest first
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_PEER_BYTES_H_
