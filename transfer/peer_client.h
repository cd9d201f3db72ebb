// A PeerClient calls one other host of the cluster (transfer/peer.proto)
// with the job's token and this host's name, each call under a deadline, so
// a peer that stops answering costs a bounded wait and is then marked
// unreachable until a call succeeds again. It counts what it fetched and
// what failed, for `status`.
//
//   PeerClient peer(cluster.hosts[1], {.host = "h0", .token = cluster.token});
//   ASSIGN_OR_RETURN(int64_t got,
//                    peer.ReadTensor({step, "tp=2,pp=1,dp=1", 0, 3}, 0, n, buf));
#ifndef SCALAI_TRANSFER_PEER_CLIENT_H_
#define SCALAI_TRANSFER_PEER_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transfer/cluster_file.h"

namespace scalai {

class PeerClient {
 public:
  struct Options {
    std::string host;  // this host's name, told to the peer
    std::string token;
    std::optional<ClusterTls> tls;
    absl::Duration deadline = absl::Seconds(30);  // per call
  };
  // One tensor box of a step seen under a config (peer.proto, ReadTensor).
  struct TensorRef {
    int64_t step = 0;
    std::string config;
    int group = 0;
    int shard = 0;
    // A worker waits on these bytes (peer.proto, ReadTensorRequest).
    bool for_reader = false;
  };
  struct Hello {
    std::string job;
    std::string host;
  };

  PeerClient(ClusterHost peer, Options options);
  ~PeerClient();

  const ClusterHost& peer() const { return peer_; }
  absl::StatusOr<Hello> SayHello();
  // Bytes [offset, offset + length) of `tensor` into `out`, as far as the
  // peer holds them: returns how many it sent, the longest prefix it holds
  // (in a cluster a host holds only some shards); an error names the peer.
  absl::StatusOr<int64_t> ReadTensor(const TensorRef& tensor, int64_t offset,
                                     int64_t length, char* out);

  // Bytes [offset, offset + length) of a file of the peer's mount into
  // `out`; returns how many there were (fewer at the file's end).
  absl::StatusOr<int64_t> ReadFile(const std::string& path, int64_t offset,
                                   int64_t length, char* out);

  // Bytes [offset, offset + length) of rank `rank`'s extra/`path` of a
  // step, as the peer saved it (peer.proto, ReadExtra).
  absl::StatusOr<int64_t> ReadExtra(int64_t step, int rank,
                                    const std::string& path, int64_t offset,
                                    int64_t length, char* out);

  // Bytes [offset, offset + length) of blob `blob` of group `group`'s
  // shard of a step the peer holds pending (peer.proto, ReadPendingShard).
  absl::StatusOr<int64_t> ReadPendingShard(int64_t step, int group, int blob,
                                           int64_t offset, int64_t length,
                                           char* out);

  int64_t bytes_fetched() const { return bytes_fetched_.load(); }
  int64_t errors() const { return errors_.load(); }
  // False after a call that found the peer down or silent, until one
  // succeeds.
  bool reachable() const { return reachable_.load(); }

 private:
  struct Channel;
  absl::Status Count(absl::Status s);
  // One streamed call (`method` indexes Channel's) into `out`; errors name
  // the peer and `what`.
  template <typename Request>
  absl::StatusOr<int64_t> Stream(const std::string& what,
                                 const Request& request, int method,
                                 int64_t length, char* out);

  const ClusterHost peer_;
  const Options options_;
  std::unique_ptr<Channel> channel_;
  std::atomic<int64_t> bytes_fetched_{0};
  std::atomic<int64_t> errors_{0};
  std::atomic<bool> reachable_{true};
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_PEER_CLIENT_H_
