// A PeerServer is one host's gRPC service to the other hosts of its cluster
// (transfer/peer.proto): it hands out the bytes of the steps in its store,
// each tensor box read through a StepView, so every byte is verified
// against its blob's checksums before it leaves. A call must carry the
// job's token; one without it is refused UNAUTHENTICATED, counted, and
// served nothing. With TLS configured, only TLS connections are accepted.
//
//   PeerServer::Options o{.job = "gpt", .host = "h0",
//                         .address = "10.0.0.1:7070", .token = token};
//   ASSIGN_OR_RETURN(auto server, PeerServer::Start(store, o));
//   server->counters().refused;  // calls turned away
#ifndef SCALAI_TRANSFER_PEER_SERVER_H_
#define SCALAI_TRANSFER_PEER_SERVER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "transfer/cluster_file.h"
#include "transfer/foreground_reads.h"
#include "transfer/store.h"

namespace scalai {

class PeerServer {
 public:
  struct Options {
    std::string job;
    std::string host;     // this host's name
    std::string address;  // "host:port" to listen on; port 0 picks one
    std::string token;
    std::optional<ClusterTls> tls;
    // Reads a file of this host's mount (ReadFile): up to `length` bytes at
    // `offset` into `out`, fewer at its end. Unset: ReadFile is refused.
    std::function<absl::StatusOr<int64_t>(
        const std::string& path, int64_t offset, int64_t length, char* out)>
        read_file;
    // This host's reads that workers wait on: reads of its tensors asked
    // for a peer's reader (ReadTensorRequest::for_reader) count too, so
    // that this host's materialization gives way to them (may be null).
    ForegroundReads* foreground = nullptr;
  };
  // What the server has done, for `status`.
  struct Counters {
    int64_t refused = 0;  // calls without the job's token
    int64_t failed = 0;   // calls refused for another reason
    // Tensor bytes sent, by the caller's host name.
    std::map<std::string, int64_t> bytes_served;
  };

  // Listens and serves until destroyed. `store` outlives the server.
  static absl::StatusOr<std::unique_ptr<PeerServer>> Start(const Store& store,
                                                           Options options);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  // The port it listens on (the one picked, for port 0).
  int port() const;
  Counters counters() const;

  // Lets go of the views it keeps of what the store no longer holds as it
  // did (a step stored anew, shards retained for peers released, a step
  // removed): until then they map the blobs that held those bytes, whose
  // space stays in use although the blobs were deleted. Cheap; a host calls
  // it after every change of what it holds, or on a timer.
  void DropStaleViews();

  class Service;

 private:
  PeerServer() = default;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_PEER_SERVER_H_
