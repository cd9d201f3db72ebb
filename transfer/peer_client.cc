#include "transfer/peer_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/copy_bytes.h"
#include "transfer/peer.grpc.pb.h"
#include "transfer/peer_call.h"

namespace scalai {
namespace {

// Where a streamed chunk's bytes go: parsed straight out of gRPC's buffers
// into the caller's memory (peer::Chunk would first copy them into a string
// of its own, one more pass over every byte fetched).
struct ChunkInto {
  char* out = nullptr;
  int64_t room = 0;  // bytes that may be written at `out`
  int64_t got = 0;   // bytes the chunk carried
  // Why it was refused, if it was.
  enum class Refusal {
    kNone,
    kOverflow,   // it carried more than `room`
    kMalformed,  // it was not a Chunk
    kUnsummed,   // it came without its checksum
    kDamaged,    // its bytes do not match their checksum
  };
  Refusal refusal = Refusal::kNone;
};

// The bytes of a received message, read across gRPC's slices.
class SliceCursor {
 public:
  explicit SliceCursor(std::vector<grpc::Slice> slices)
      : slices_(std::move(slices)) {}
  bool AtEnd() {
    NextSlice();
    return index_ == slices_.size();
  }
  bool Byte(uint8_t* b) {
    NextSlice();
    if (index_ == slices_.size()) return false;
    *b = slices_[index_].begin()[at_++];
    return true;
  }
  // A protobuf varint.
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  bool Skip(uint64_t n) { return Copy(nullptr, n); }
  // A protobuf fixed64: eight bytes, least significant first.
  bool Fixed64(uint64_t* v) {
    uint8_t b[8];
    if (!Copy(reinterpret_cast<char*>(b), 8)) return false;
    *v = 0;
    for (int i = 7; i >= 0; --i) *v = *v << 8 | b[i];
    return true;
  }
  // The next `n` bytes into `out`, or past them when `out` is null.
  bool Copy(char* out, uint64_t n) {
    while (n > 0) {
      NextSlice();
      if (index_ == slices_.size()) return false;
      const size_t take = std::min<uint64_t>(n, slices_[index_].size() - at_);
      if (out != nullptr) {
        CopyBytes(out, slices_[index_].begin() + at_, take);
        out += take;
      }
      at_ += take;
      n -= take;
    }
    return true;
  }

 private:
  void NextSlice() {
    while (index_ < slices_.size() && at_ == slices_[index_].size()) {
      ++index_;
      at_ = 0;
    }
  }
  std::vector<grpc::Slice> slices_;
  size_t index_ = 0;
  size_t at_ = 0;
};

}  // namespace
}  // namespace scalai

// peer.proto's Chunk on the wire: its bytes as field 1, length-delimited
// (absent when empty), and their XXH3 as field 2, fixed64, checked here
// once the message is read; fields it does not know (a newer peer's) are
// skipped, as protobuf would.
template <>
class grpc::SerializationTraits<scalai::ChunkInto, void> {
 public:
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer,
                                  scalai::ChunkInto* chunk) {
    std::vector<grpc::Slice> slices;
    grpc::Status dumped = buffer->Dump(&slices);
    buffer->Clear();
    if (!dumped.ok()) return dumped;
    scalai::SliceCursor in(std::move(slices));
    chunk->got = 0;
    bool seen = false;
    std::optional<uint64_t> sum;
    while (!in.AtEnd()) {
      uint64_t key, n;
      if (!in.Varint(&key)) return Refuse(chunk, kMalformed);
      switch (key & 7) {  // the wire type
        case 0:
          if (!in.Varint(&n)) return Refuse(chunk, kMalformed);
          break;
        case 1:
          if ((key >> 3) != 2) {
            if (!in.Skip(8)) return Refuse(chunk, kMalformed);
            break;
          }
          if (sum.has_value()) return Refuse(chunk, kMalformed);
          if (!in.Fixed64(&n)) return Refuse(chunk, kMalformed);
          sum = n;
          break;
        case 5:
          if (!in.Skip(4)) return Refuse(chunk, kMalformed);
          break;
        case 2:
          if (!in.Varint(&n)) return Refuse(chunk, kMalformed);
          if ((key >> 3) != 1) {
            if (!in.Skip(n)) return Refuse(chunk, kMalformed);
            break;
          }
          // A serializer writes the field once.
          if (seen) return Refuse(chunk, kMalformed);
          seen = true;
          if (n > static_cast<uint64_t>(chunk->room)) {
            return Refuse(chunk, kOverflow);
          }
          if (!in.Copy(chunk->out, n)) return Refuse(chunk, kMalformed);
          chunk->got = static_cast<int64_t>(n);
          break;
        default:
          return Refuse(chunk, kMalformed);
      }
    }
    if (!sum.has_value()) return Refuse(chunk, kUnsummed);
    if (scalai::HashChunk(chunk->out, chunk->got) != *sum) {
      return Refuse(chunk, kDamaged);
    }
    return grpc::Status::OK;
  }

 private:
  using enum scalai::ChunkInto::Refusal;
  // Drain turns the refusal into the caller's error.
  static grpc::Status Refuse(scalai::ChunkInto* chunk,
                             scalai::ChunkInto::Refusal why) {
    chunk->refusal = why;
    return grpc::Status(grpc::StatusCode::DATA_LOSS, "chunk refused");
  }
};

namespace scalai {

namespace {
// The streamed calls, by their index in Channel::methods.
enum StreamedMethod { kReadTensor, kReadFile, kReadExtra, kReadPendingShard };
constexpr const char* kStreamedMethods[] = {"ReadTensor", "ReadFile",
                                            "ReadExtra", "ReadPendingShard"};
}  // namespace

// Hello goes through the generated stub. The streamed calls are made the
// way the stub makes them (ClientReaderFactory, a gRPC header the generated
// code itself uses), but with replies read as ChunkInto.
struct PeerClient::Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<peer::Peer::Stub> stub;
  // "/scalai.peer.Peer/ReadTensor" and so on; the names outlive the
  // methods, which point at them.
  std::string names[std::size(kStreamedMethods)];
  std::optional<grpc::internal::RpcMethod> methods[std::size(kStreamedMethods)];
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
  // A peer that went away (its mount restarted) is dialed again within a
  // second of coming back: gRPC's own backoff grows to two minutes, and
  // every read of its bytes meanwhile would fail although it answers.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  channel_->channel =
      grpc::CreateCustomChannel(peer_.address, credentials, args);
  channel_->stub = peer::Peer::NewStub(channel_->channel);
  for (size_t i = 0; i < std::size(kStreamedMethods); ++i) {
    channel_->names[i] = PeerMethodName(kStreamedMethods[i]);
    channel_->methods[i].emplace(channel_->names[i].c_str(),
                                 grpc::internal::RpcMethod::SERVER_STREAMING,
                                 channel_->channel);
  }
}

PeerClient::~PeerClient() = default;

namespace {

void Prepare(grpc::ClientContext& ctx, const std::string& host,
             const std::string& token, absl::Duration deadline) {
  ctx.AddMetadata(kPeerTokenKey, BearerToken(token));
  ctx.AddMetadata(kPeerHostKey, host);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
}

// Reads a call's stream of chunks into `out`, at most `length` bytes (a
// peer that sends more is not trusted), counting them into `fetched`;
// returns how many came.
absl::StatusOr<int64_t> Drain(grpc::ClientContext& ctx,
                              grpc::ClientReader<ChunkInto>& reader,
                              int64_t length, char* out,
                              std::atomic<int64_t>& fetched,
                              const std::string& where) {
  int64_t got = 0;
  ChunkInto chunk;
  for (;;) {
    chunk.out = out + got;
    chunk.room = length - got;
    if (!reader.Read(&chunk)) break;
    got += chunk.got;
    fetched.fetch_add(chunk.got);
  }
  // Read fails at the stream's end, or on a chunk it could not take; then
  // the call would go on until cancelled.
  using enum ChunkInto::Refusal;
  if (chunk.refusal != kNone) ctx.TryCancel();
  grpc::Status finished = reader.Finish();
  switch (chunk.refusal) {
    case kNone:
      break;
    case kOverflow:
      return absl::DataLossError(
          absl::StrCat(where, ": sent more than the ", length, " bytes asked"));
    case kMalformed:
      return absl::DataLossError(
          absl::StrCat(where, ": sent a message that is not a chunk of bytes"));
    case kUnsummed:
      return absl::DataLossError(absl::StrCat(
          where,
          ": sent bytes without their checksum (a peer of an older "
          "build?); they are not used"));
    case kDamaged:
      return absl::DataLossError(absl::StrCat(
          where, ": ", chunk.got, " bytes from byte ", got,
          " of the reply do not match the checksum they were sent with "
          "(damaged between the hosts); they are not used"));
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
  request.set_for_reader(tensor.for_reader);
  return Stream(absl::StrCat("step ", tensor.step, " under ", tensor.config,
                             ", group ", tensor.group, " shard ", tensor.shard),
                request, kReadTensor, length, out);
}

absl::StatusOr<int64_t> PeerClient::ReadFile(const std::string& path,
                                             int64_t offset, int64_t length,
                                             char* out) {
  peer::ReadFileRequest request;
  request.set_path(path);
  request.set_offset(offset);
  request.set_length(length);
  return Stream(path, request, kReadFile, length, out);
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
                request, kReadExtra, length, out);
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
                request, kReadPendingShard, length, out);
}

template <typename Request>
absl::StatusOr<int64_t> PeerClient::Stream(const std::string& what,
                                           const Request& request, int method,
                                           int64_t length, char* out) {
  const std::string where =
      absl::StrCat("peer ", peer_.name, " (", peer_.address, "), ", what);
  grpc::ClientContext ctx;
  Prepare(ctx, options_.host, options_.token, options_.deadline);
  std::unique_ptr<grpc::ClientReader<ChunkInto>> reader(
      grpc::internal::ClientReaderFactory<ChunkInto>::Create(
          channel_->channel.get(), *channel_->methods[method], &ctx, request));
  absl::StatusOr<int64_t> got =
      Drain(ctx, *reader, length, out, bytes_fetched_, where);
  if (!got.ok()) return Count(got.status());
  Count(absl::OkStatus()).IgnoreError();  // it answered: reachable again
  return got;
}

}  // namespace scalai
