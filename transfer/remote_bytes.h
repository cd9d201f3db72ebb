// RemoteBytes is where a view finds the bytes of stored shards that its host
// does not hold: in a cluster each host keeps only its own ranks' shards,
// and the others are read from the hosts that hold them (fs/ implements it
// over the peers of transfer/peer_client.h).
#ifndef SCALAI_TRANSFER_REMOTE_BYTES_H_
#define SCALAI_TRANSFER_REMOTE_BYTES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "ptc/reshard_plan.h"

namespace scalai {

class RemoteBytes {
 public:
  virtual ~RemoteBytes() = default;
  // How a range is read: kExact fetches exactly its bytes (a
  // materialization, whose every byte is counted); kCached may fetch the
  // blocks around it and keep them for the reads that follow (a worker
  // reading a file front to back through the mount).
  enum class Access { kExact, kCached };
  // Bytes [offset, offset + length) of shards(shard.group)[shard.shard]
  // (`shard_bytes` long) of step `step` seen under `config` into `out`: all
  // of them, or an error that names what no reachable host holds.
  // Thread-safe.
  virtual absl::Status Read(int64_t step, const std::string& config,
                            ShardRef shard, int64_t shard_bytes, int64_t offset,
                            int64_t length, char* out, Access access) const = 0;
  // Step `step` was committed (again): what was kept of an earlier step
  // of that number is dropped, so that no read returns its bytes.
  virtual void Forget(int64_t step) const = 0;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_REMOTE_BYTES_H_
