#include "transfer/peer_client.h"

#include <grpcpp/grpcpp.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/peer.grpc.pb.h"
#include "transfer/peer_call.h"

namespace scalai {

struct PeerClient::Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<peer::Peer::Stub> stub;
};

PeerClient::PeerClient(ClusterHost peer, Options options)
    : peer_(std::move(peer)), options_(std::move(options)) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options_.tls) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = options_.tls->ca;
    tls.pem_private_key = options_.tls->key;
    tls.pem_cert_chain = options_.tls->cert;
    credentials = grpc::SslCredentials(tls);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  channel_ = std::make_unique<Channel>();
  grpc::ChannelArguments args;
  for (const PeerChannelSetting& setting : kPeerChannelSettings) {
    args.SetInt(setting.name, setting.value);
  }
  channel_->channel =
      grpc::CreateCustomChannel(peer_.address, credentials, args);
  channel_->stub = peer::Peer::NewStub(channel_->channel);
}

PeerClient::~PeerClient() = default;

namespace {

void Prepare(grpc::ClientContext& ctx, const std::string& host,
             const std::string& token, absl::Duration deadline) {
  ctx.AddMetadata(kPeerTokenKey, BearerToken(token));
  ctx.AddMetadata(kPeerHostKey, host);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
}

// Copies a call's stream of chunks into `out`, at most `length` bytes (a
// peer that sends more is not trusted), counting them into `fetched`;
// returns how many came.
absl::StatusOr<int64_t> Drain(grpc::ClientContext& ctx,
                              grpc::ClientReader<peer::Chunk>& reader,
                              int64_t length, char* out,
                              std::atomic<int64_t>& fetched,
                              const std::string& where) {
  peer::Chunk chunk;
  int64_t got = 0;
  bool overflow = false;
  while (reader.Read(&chunk)) {
    const int64_t n = static_cast<int64_t>(chunk.data().size());
    if (n > length - got) {
      overflow = true;
      ctx.TryCancel();
      break;
    }
    std::memcpy(out + got, chunk.data().data(), static_cast<size_t>(n));
    got += n;
    fetched.fetch_add(n);
  }
  grpc::Status finished = reader.Finish();
  if (overflow) {
    return absl::DataLossError(
        absl::StrCat(where, ": sent more than the ", length, " bytes asked"));
  }
  RETURN_IF_ERROR(FromGrpc(finished, where));
  return got;
}

}  // namespace

absl::Status PeerClient::Count(absl::Status s) {
  if (s.ok()) {
    reachable_ = true;
    return s;
  }
  errors_.fetch_add(1);
  if (s.code() == absl::StatusCode::kUnavailable ||
      s.code() == absl::StatusCode::kDeadlineExceeded) {
    reachable_ = false;
  }
  return s;
}

absl::StatusOr<PeerClient::Hello> PeerClient::SayHello() {
  grpc::ClientContext ctx;
  Prepare(ctx, options_.host, options_.token, options_.deadline);
  peer::HelloRequest request;
  peer::HelloResponse response;
  grpc::Status s = channel_->stub->Hello(&ctx, request, &response);
  if (absl::Status st = Count(FromGrpc(
          s, absl::StrCat("peer ", peer_.name, " (", peer_.address, ")")));
      !st.ok()) {
    return st;
  }
  return Hello{response.job(), response.host()};
}

absl::StatusOr<int64_t> PeerClient::ReadTensor(const TensorRef& tensor,
                                               int64_t offset, int64_t length,
                                               char* out) {
  peer::ReadTensorRequest request;
  request.set_step(tensor.step);
  request.set_config(tensor.config);
  request.set_group(tensor.group);
  request.set_shard(tensor.shard);
  request.set_offset(offset);
  request.set_length(length);
  return Stream(absl::StrCat("step ", tensor.step, " under ", tensor.config,
                             ", group ", tensor.group, " shard ", tensor.shard),
                length, out, [&](grpc::ClientContext& ctx) {
                  return channel_->stub->ReadTensor(&ctx, request);
                });
}

absl::StatusOr<int64_t> PeerClient::ReadFile(const std::string& path,
                                             int64_t offset, int64_t length,
                                             char* out) {
  peer::ReadFileRequest request;
  request.set_path(path);
  request.set_offset(offset);
  request.set_length(length);
  return Stream(path, length, out, [&](grpc::ClientContext& ctx) {
    return channel_->stub->ReadFile(&ctx, request);
  });
}

absl::StatusOr<int64_t> PeerClient::ReadExtra(int64_t step, int rank,
                                              const std::string& path,
                                              int64_t offset, int64_t length,
                                              char* out) {
  peer::ReadExtraRequest request;
  request.set_step(step);
  request.set_rank(rank);
  request.set_path(path);
  request.set_offset(offset);
  request.set_length(length);
  return Stream(absl::StrCat("step ", step, " rank ", rank, " extra/", path),
                length, out, [&](grpc::ClientContext& ctx) {
                  return channel_->stub->ReadExtra(&ctx, request);
                });
}

absl::StatusOr<int64_t> PeerClient::ReadPendingShard(int64_t step, int group,
                                                     int blob, int64_t offset,
                                                     int64_t length,
                                                     char* out) {
  peer::ReadPendingShardRequest request;
  request.set_step(step);
  request.set_group(group);
  request.set_blob(blob);
  request.set_offset(offset);
  request.set_length(length);
  return Stream(absl::StrCat("step ", step, " group ", group, " blob ", blob),
                length, out, [&](grpc::ClientContext& ctx) {
                  return channel_->stub->ReadPendingShard(&ctx, request);
                });
}

template <typename Start>
absl::StatusOr<int64_t> PeerClient::Stream(const std::string& what,
                                           int64_t length, char* out,
                                           Start start) {
  const std::string where =
      absl::StrCat("peer ", peer_.name, " (", peer_.address, "), ", what);
  grpc::ClientContext ctx;
  Prepare(ctx, options_.host, options_.token, options_.deadline);
  std::unique_ptr<grpc::ClientReader<peer::Chunk>> reader = start(ctx);
  absl::StatusOr<int64_t> got =
      Drain(ctx, *reader, length, out, bytes_fetched_, where);
  if (!got.ok()) return Count(got.status());
  Count(absl::OkStatus()).IgnoreError();  // it answered: reachable again
  return got;
}

}  // namespace scalai
