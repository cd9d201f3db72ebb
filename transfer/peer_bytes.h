// PeerBytes reads the bytes of shards this host does not hold from the peers
// that do: each peer sends the longest prefix of a range it holds, and the
// rest is asked of the next one, so a range split between hosts (after a
// reconfiguration, before every host caught up) is still read whole. Reads
// start at different peers for different ranges, so that replicas on
// several hosts share the load.
//
//   PeerBytes remote([&] { return live_peers(); });
//   ASSIGN_OR_RETURN(auto view, StepView::Create(store, step, config, &remote));
#ifndef SCALAI_TRANSFER_PEER_BYTES_H_
#define SCALAI_TRANSFER_PEER_BYTES_H_

#include <functional>
#include <vector>

#include "transfer/peer_client.h"
#include "transfer/remote_bytes.h"

namespace scalai {

class PeerBytes : public RemoteBytes {
 public:
  // The peers to ask, called at each read; they outlive the read.
  using Peers = std::function<std::vector<PeerClient*>()>;
  explicit PeerBytes(Peers peers) : peers_(std::move(peers)) {}

  absl::Status Read(int64_t step, const std::string& config, ShardRef shard,
                    int64_t offset, int64_t length, char* out) const override;

 private:
  Peers peers_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_PEER_BYTES_H_
