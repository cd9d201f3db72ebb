// What both ends of a peer call agree on: the metadata keys that carry the
// job's token and the caller's name, the token check, and the one
// translator between gRPC's status and absl::Status (their codes are the
// same numbers by design).
//
//   context.AddMetadata(kPeerTokenKey, BearerToken(token));
//   if (!TokenMatches(presented, BearerToken(token))) ... UNAUTHENTICATED
#ifndef SCALAI_TRANSFER_PEER_CALL_H_
#define SCALAI_TRANSFER_PEER_CALL_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "transfer/peer.grpc.pb.h"

namespace scalai {

inline constexpr char kPeerTokenKey[] = "authorization";
inline constexpr char kPeerHostKey[] = "scalai-host";

// gRPC's defaults suit many small messages; peers stream megabytes. Both
// ends let a stream run 16 MiB ahead of its reader (64 KiB by default,
// grown only by probing), send frames of up to 1 MiB (16 KiB), and read
// their sockets in pieces of up to 4 MiB. Measured with
// tools/bench_cluster_transfer.py: a rank read from a peer through the
// mount went from 147-150 to 181-207 MB/s.
struct PeerChannelSetting {
  const char* name;
  int value;
};
inline constexpr PeerChannelSetting kPeerChannelSettings[] = {
    {GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20},
    {GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20},
    {GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 4 << 20},
    {GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20},
    {GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10},
    {GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20},
};

// A method of peer.proto's service as gRPC names it on the wire
// ("/scalai.peer.Peer/ReadTensor"): the streamed calls are registered and
// made by hand (ChunkFrom, ChunkInto), not through the generated code.
inline std::string PeerMethodName(absl::string_view method) {
  return absl::StrCat("/", peer::Peer::service_full_name(), "/", method);
}

inline std::string BearerToken(absl::string_view token) {
  return absl::StrCat("Bearer ", token);
}

// Compares in time that depends on the lengths only, so that a caller
// cannot find the token a byte at a time.
inline bool TokenMatches(absl::string_view presented,
                         absl::string_view expected) {
  if (presented.size() != expected.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(presented[i] ^ expected[i]);
  }
  return diff == 0;
}

inline absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

}  // namespace scalai

#endif  // SCALAI_TRANSFER_PEER_CALL_H_
