#include "transfer/peer_server.h"

#include <grpcpp/grpcpp.h>

#include <deque>
#include <limits>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/blob_reader.h"
#include "transfer/peer.grpc.pb.h"
#include "transfer/peer_call.h"
#include "transfer/step_view.h"

namespace scalai {
namespace {

// Bytes sent per message: large enough that a stream runs at the link's
// rate, well under gRPC's 4 MiB default message limit.
constexpr int64_t kChunkBytes = 1 << 20;
// Step views kept for repeated reads of the same step and config.
constexpr size_t kMaxViews = 8;

// The value of metadata `key`, or `absent` when the call has none.
std::string Metadata(const grpc::ServerContext& ctx, const char* key,
                     absl::string_view absent = "") {
  auto it = ctx.client_metadata().find(key);
  if (it == ctx.client_metadata().end() || it->second.empty()) {
    return std::string(absent);
  }
  return std::string(it->second.data(), it->second.size());
}

// A chunk to send, whose bytes gRPC takes over rather than copies: a
// peer::Chunk would be serialized by copying its string into a buffer of
// gRPC's, one more pass over every byte served. Each chunk gets a buffer of
// its own, freed once gRPC has sent it.
struct ChunkFrom {
  explicit ChunkFrom(int64_t room)
      : bytes(std::make_unique_for_overwrite<char[]>(room)) {}
  char* data() { return bytes.get(); }
  // Serialize moves the buffer into gRPC's message, hence mutable.
  mutable std::unique_ptr<char[]> bytes;
  int64_t size = 0;  // bytes of it to send
};

}  // namespace
}  // namespace scalai

// peer.proto's Chunk on the wire, in a small slice: field 2 (fixed64, the
// bytes' XXH3), then field 1's key and length; the bytes follow in a slice
// that owns the chunk's buffer.
template <>
class grpc::SerializationTraits<scalai::ChunkFrom, void> {
 public:
  static grpc::Status Serialize(const scalai::ChunkFrom& chunk,
                                grpc::ByteBuffer* buffer, bool* own_buffer) {
    *own_buffer = true;
    uint8_t head[20] = {0x11};  // field 2, wire type 1: 8 bytes, low first
    size_t used = 1;
    const uint64_t sum = scalai::HashChunk(chunk.bytes.get(), chunk.size);
    for (int i = 0; i < 8; ++i)
      head[used++] = static_cast<uint8_t>(sum >> 8 * i);
    if (chunk.size == 0) {  // no field 1: an empty Chunk has no bytes
      const grpc::Slice only(head, used);
      grpc::ByteBuffer message(&only, 1);
      buffer->Swap(&message);
      return grpc::Status::OK;
    }
    head[used++] = 0x0a;  // field 1, wire type 2; then the varint
    for (uint64_t n = static_cast<uint64_t>(chunk.size);; n >>= 7) {
      head[used++] = static_cast<uint8_t>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0));
      if (n < 0x80) break;
    }
    const grpc::Slice slices[] = {
        grpc::Slice(head, used),
        grpc::Slice(chunk.bytes.release(), static_cast<size_t>(chunk.size),
                    [](void* p) { delete[] static_cast<char*>(p); })};
    grpc::ByteBuffer message(slices, std::size(slices));
    buffer->Swap(&message);
    return grpc::Status::OK;
  }
};

namespace scalai {

struct PeerServer::State {
  const Store* store = nullptr;
  Options options;
  std::unique_ptr<Service> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;

  std::mutex mu;  // guards what follows
  Counters counters;
  // Views by (step, config asked for, config the step is stored under): a
  // materialization that stores the step anew makes the old view stale.
  using ViewKey = std::tuple<int64_t, std::string, std::string>;
  std::map<ViewKey, std::shared_ptr<const StepView>> views;
  std::deque<ViewKey> view_order;  // oldest first

  // The step seen under `config_text` through what this host holds of it:
  // its stored shards first, then any it retained for its peers.
  absl::StatusOr<std::vector<std::shared_ptr<const StepView>>> ViewsOf(
      int64_t step, const std::string& config_text) {
    ASSIGN_OR_RETURN(ParallelConfig config, ParallelConfig::Parse(config_text));
    ASSIGN_OR_RETURN(std::optional<StepRecord> record, store->FindStep(step));
    if (!record) return NoStep(step);
    if (std::optional<std::vector<std::shared_ptr<const StepView>>> cached =
            CachedViews(*record, config)) {
      return *cached;
    }
    // This host's own materialization may commit while the views are made:
    // the step's record and its shards' records are read at one moment, or
    // a view could pair a shard record with the placement it replaced.
    std::shared_lock<std::shared_mutex> consistent =
        store->catalog().HoldCommits();
    ASSIGN_OR_RETURN(record, store->FindStep(step));
    if (!record) return NoStep(step);
    std::vector<std::shared_ptr<const StepView>> made;
    for (int i = -1; i < static_cast<int>(record->retained.size()); ++i) {
      ASSIGN_OR_RETURN(const ViewKey key, KeyOf(*record, i, config));
      {
        std::lock_guard<std::mutex> lock(mu);
        if (auto it = views.find(key); it != views.end()) {
          made.push_back(it->second);
          continue;
        }
      }
      absl::StatusOr<std::unique_ptr<StepView>> view =
          i < 0 ? StepView::Create(*store, *record, config)
                : StepView::CreateRetained(*store, step, record->retained[i],
                                           config);
      RETURN_IF_ERROR(view.status());
      std::shared_ptr<const StepView> shared = std::move(*view);
      made.push_back(shared);
      std::lock_guard<std::mutex> lock(mu);
      if (views.emplace(key, shared).second) {
        view_order.push_back(key);
        if (view_order.size() > kMaxViews) {
          views.erase(view_order.front());
          view_order.pop_front();
        }
      }
    }
    return made;
  }

  // Views are keyed by exactly what they read from: the config the shards
  // are stored under and every held shard's blobs. A materialization that
  // stores the step anew, a release of what it retained, or the same step
  // number saved again (its blobs are new) gives another key; a view cached
  // for what the host held before is never served for what it holds now.
  // (`i` < 0: the stored shards; else the i-th retained holding.)
  absl::StatusOr<ViewKey> KeyOf(const StepRecord& record, int i,
                                const ParallelConfig& config) const {
    ASSIGN_OR_RETURN(std::string from, HeldAs(record, i));
    return ViewKey{record.step, config.ToString(), std::move(from)};
  }

  // What a view of `record`'s holding `i` reads from (KeyOf).
  absl::StatusOr<std::string> HeldAs(const StepRecord& record, int i) const {
    std::string from;
    auto add = [&](int g, const ShardRecord& shard) {
      absl::StrAppend(&from, " ", g, ":", absl::StrJoin(shard.blobs, ","));
    };
    if (i < 0) {
      from = absl::StrCat("stored ", record.config);
      for (int g = 0; g < record.groups; ++g) {
        if (!record.holds(g)) continue;
        ASSIGN_OR_RETURN(ShardRecord shard, store->Shard(record.step, g));
        add(g, shard);
      }
    } else {
      from = absl::StrCat("retained ", record.retained[i].config);
      for (const auto& [g, shard] : record.retained[i].groups) add(g, shard);
    }
    return from;
  }

  // Forgets the cached views of what the store no longer holds as it was
  // (DropStaleViews).
  void DropStale() {
    std::vector<ViewKey> cached;
    {
      std::lock_guard<std::mutex> lock(mu);
      cached.assign(view_order.begin(), view_order.end());
    }
    std::set<ViewKey> stale;
    for (const ViewKey& key : cached) {
      const auto& [step, config, from] = key;
      absl::StatusOr<std::optional<StepRecord>> record = store->FindStep(step);
      bool held = false;
      if (record.ok() && record->has_value()) {
        for (int i = -1;
             !held && i < static_cast<int>((*record)->retained.size()); ++i) {
          absl::StatusOr<std::string> now = HeldAs(**record, i);
          held = now.ok() && *now == from;
        }
      }
      if (!held) stale.insert(key);
    }
    if (stale.empty()) return;
    std::lock_guard<std::mutex> lock(mu);
    for (const ViewKey& key : stale) views.erase(key);
    std::erase_if(view_order,
                  [&](const ViewKey& key) { return stale.contains(key); });
  }

  // Every view of the step as `record` holds it, if all are cached.
  std::optional<std::vector<std::shared_ptr<const StepView>>> CachedViews(
      const StepRecord& record, const ParallelConfig& config) {
    std::vector<std::shared_ptr<const StepView>> found;
    for (int i = -1; i < static_cast<int>(record.retained.size()); ++i) {
      // A shard record gone meanwhile: the caller reads again, locked.
      absl::StatusOr<ViewKey> key = KeyOf(record, i, config);
      if (!key.ok()) return std::nullopt;
      std::lock_guard<std::mutex> lock(mu);
      auto it = views.find(*key);
      if (it == views.end()) return std::nullopt;
      found.push_back(it->second);
    }
    return found;
  }

  absl::Status NoStep(int64_t step) const {
    return absl::NotFoundError(
        absl::StrCat("host ", options.host, " has no step ", step));
  }

  // The blob of rank `rank`'s extra/`path` of `step`, as this host saved
  // it: in the step's record, or in its pending part.
  absl::StatusOr<std::string> ExtraBlob(int64_t step, int rank,
                                        const std::string& path) const {
    std::vector<StepRecord> records;
    ASSIGN_OR_RETURN(std::optional<StepRecord> record, store->FindStep(step));
    if (record) records.push_back(*std::move(record));
    ASSIGN_OR_RETURN(std::optional<PendingStep> pending,
                     store->FindPending(step));
    if (pending) records.push_back(std::move(pending->record));
    for (const StepRecord& r : records) {
      auto files = r.extra.find(rank);
      if (files == r.extra.end()) continue;
      for (const ExtraFile& f : files->second) {
        if (f.path == path) return f.blob;
      }
    }
    return absl::NotFoundError(
        absl::StrCat("host ", options.host, " holds no extra/", path,
                     " of rank ", rank, " of step ", step));
  }

  absl::StatusOr<std::string> PendingShardBlob(int64_t step, int group,
                                               int blob) const {
    ASSIGN_OR_RETURN(std::optional<PendingStep> pending,
                     store->FindPending(step));
    if (pending) {
      auto shard = pending->shards.find(group);
      if (shard != pending->shards.end() && blob >= 0 &&
          blob < static_cast<int>(shard->second.blobs.size())) {
        return shard->second.blobs[blob];
      }
    }
    return absl::NotFoundError(absl::StrCat(
        "host ", options.host, " holds no blob ", blob, " of group ", group,
        " of step ", step, " waiting for the cluster"));
  }

  // The caller's name if it presented the job's token; else the refusal,
  // counted.
  grpc::Status Admit(const grpc::ServerContext& ctx, std::string* caller) {
    if (!TokenMatches(Metadata(ctx, kPeerTokenKey),
                      BearerToken(options.token))) {
      std::lock_guard<std::mutex> lock(mu);
      ++counters.refused;
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat("host ", options.host,
                                       ": this call lacks the job's token"));
    }
    *caller = Metadata(ctx, kPeerHostKey, "(unnamed)");
    return grpc::Status::OK;
  }

  grpc::Status Fail(const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    ++counters.failed;
    return ToGrpc(s);
  }
};

// peer.proto's service, registered by hand rather than through the
// generated base class so that the streamed calls write ChunkFrom: the
// handlers are gRPC's own, the ones the generated code registers.
class PeerServer::Service final : public grpc::Service {
 public:
  explicit Service(State& state) : s_(state) {
    AddStreamed("ReadTensor", &Service::ReadTensor);
    AddStreamed("ReadFile", &Service::ReadFile);
    AddStreamed("ReadExtra", &Service::ReadExtra);
    AddStreamed("ReadPendingShard", &Service::ReadPendingShard);
    AddMethod(new grpc::internal::RpcServiceMethod(
        Name("Hello"), grpc::internal::RpcMethod::NORMAL_RPC,
        new grpc::internal::RpcMethodHandler<Service, peer::HelloRequest,
                                             peer::HelloResponse>(
            [](Service* service, grpc::ServerContext* ctx,
               const peer::HelloRequest* request,
               peer::HelloResponse* response) {
              return service->Hello(ctx, request, response);
            },
            this)));
  }

  grpc::Status Hello(grpc::ServerContext* ctx, const peer::HelloRequest*,
                     peer::HelloResponse* response) {
    std::string caller;
    if (grpc::Status admitted = s_.Admit(*ctx, &caller); !admitted.ok()) {
      return admitted;
    }
    response->set_job(s_.options.job);
    response->set_host(s_.options.host);
    return grpc::Status::OK;
  }

  grpc::Status ReadTensor(grpc::ServerContext* ctx,
                          const peer::ReadTensorRequest* request,
                          grpc::ServerWriter<ChunkFrom>* writer) {
    std::string caller;
    if (grpc::Status admitted = s_.Admit(*ctx, &caller); !admitted.ok()) {
      return admitted;
    }
    absl::StatusOr<std::vector<std::shared_ptr<const StepView>>> views =
        s_.ViewsOf(request->step(), request->config());
    if (!views.ok()) return s_.Fail(views.status());
    const Placement& placement = views->front()->placement();
    const int group = request->group();
    const int shard = request->shard();
    if (group < 0 || group >= placement.num_groups() || shard < 0 ||
        shard >= static_cast<int>(placement.shards(group).size())) {
      return s_.Fail(absl::OutOfRangeError(absl::StrCat(
          "no shard ", shard, " in group ", group, " of ", request->config())));
    }
    const int64_t size = placement.shards(group)[shard].bytes;
    const int64_t offset = request->offset();
    const int64_t length = request->length();
    if (offset < 0 || length < 0 || offset > size || length > size - offset) {
      return s_.Fail(absl::OutOfRangeError(absl::StrCat(
          "bytes [", offset, ", +", length, ") of a ", size, "-byte tensor")));
    }
    ForegroundReads::Reading reading(
        request->for_reader() ? s_.options.foreground : nullptr);
    // The longest prefix of the range this host holds, in chunks: each
    // chunk is read from whichever of its views holds the next bytes,
    // straight into the buffer gRPC sends.
    for (int64_t at = 0; at < length;) {
      if (ctx->IsCancelled()) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "caller went away");
      }
      const int64_t n = std::min(kChunkBytes, length - at);
      ChunkFrom chunk(n);
      int64_t held = 0;
      for (bool more = true; more && held < n;) {
        more = false;
        for (const std::shared_ptr<const StepView>& view : *views) {
          absl::StatusOr<int64_t> read = view->ReadHeldPrefix(
              group, shard, offset + at + held, n - held, chunk.data() + held);
          if (!read.ok()) return s_.Fail(read.status());
          held += *read;
          more |= *read > 0;
          if (held == n) break;
        }
      }
      if (held > 0) {
        chunk.size = held;
        if (!writer->Write(chunk)) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "caller went away");
        }
        std::lock_guard<std::mutex> lock(s_.mu);
        s_.counters.bytes_served[caller] += held;
      }
      if (held < n) break;  // holds no more: the caller asks another host
      at += n;
    }
    return grpc::Status::OK;
  }

  grpc::Status ReadExtra(grpc::ServerContext* ctx,
                         const peer::ReadExtraRequest* request,
                         grpc::ServerWriter<ChunkFrom>* writer) {
    std::string caller;
    if (grpc::Status admitted = s_.Admit(*ctx, &caller); !admitted.ok()) {
      return admitted;
    }
    absl::StatusOr<std::string> blob =
        s_.ExtraBlob(request->step(), request->rank(), request->path());
    if (!blob.ok()) return s_.Fail(blob.status());
    return StreamBlob(ctx, caller, *blob, request->offset(), request->length(),
                      writer);
  }

  grpc::Status ReadPendingShard(grpc::ServerContext* ctx,
                                const peer::ReadPendingShardRequest* request,
                                grpc::ServerWriter<ChunkFrom>* writer) {
    std::string caller;
    if (grpc::Status admitted = s_.Admit(*ctx, &caller); !admitted.ok()) {
      return admitted;
    }
    absl::StatusOr<std::string> blob =
        s_.PendingShardBlob(request->step(), request->group(), request->blob());
    if (!blob.ok()) return s_.Fail(blob.status());
    return StreamBlob(ctx, caller, *blob, request->offset(), request->length(),
                      writer);
  }

  // Bytes [offset, offset + length) of a stored blob, verified, or fewer
  // at its end.
  grpc::Status StreamBlob(grpc::ServerContext* ctx, const std::string& caller,
                          const std::string& blob, int64_t offset,
                          int64_t asked,
                          grpc::ServerWriter<ChunkFrom>* writer) {
    std::shared_ptr<const BlobReader> reader =
        BlobReader::Open(*s_.store, blob);
    const int64_t size = reader->size();
    if (offset < 0 || asked < 0 || offset > size) {
      return s_.Fail(absl::OutOfRangeError(absl::StrCat(
          "bytes [", offset, ", +", asked, ") of a ", size, "-byte blob")));
    }
    const int64_t length = std::min(asked, size - offset);
    for (int64_t at = 0; at < length; at += kChunkBytes) {
      if (ctx->IsCancelled()) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "caller went away");
      }
      const int64_t n = std::min(kChunkBytes, length - at);
      ChunkFrom chunk(n);
      if (absl::Status read = reader->Read(chunk.data(), n, offset + at);
          !read.ok()) {
        return s_.Fail(read);
      }
      chunk.size = n;
      if (!writer->Write(chunk)) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "caller went away");
      }
      std::lock_guard<std::mutex> lock(s_.mu);
      s_.counters.bytes_served[caller] += n;
    }
    return grpc::Status::OK;
  }

  grpc::Status ReadFile(grpc::ServerContext* ctx,
                        const peer::ReadFileRequest* request,
                        grpc::ServerWriter<ChunkFrom>* writer) {
    std::string caller;
    if (grpc::Status admitted = s_.Admit(*ctx, &caller); !admitted.ok()) {
      return admitted;
    }
    if (!s_.options.read_file) {
      return s_.Fail(absl::UnimplementedError(
          absl::StrCat("host ", s_.options.host, " serves no mount")));
    }
    if (request->offset() < 0 || request->length() < 0 ||
        request->length() >
            std::numeric_limits<int64_t>::max() - request->offset()) {
      return s_.Fail(absl::OutOfRangeError(
          absl::StrCat("bytes [", request->offset(), ", +", request->length(),
                       ") of a file")));
    }
    for (int64_t at = 0; at < request->length(); at += kChunkBytes) {
      if (ctx->IsCancelled()) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "caller went away");
      }
      const int64_t n = std::min(kChunkBytes, request->length() - at);
      ChunkFrom chunk(n);
      absl::StatusOr<int64_t> got = s_.options.read_file(
          request->path(), request->offset() + at, n, chunk.data());
      if (!got.ok()) return s_.Fail(got.status());
      if (*got > 0) {
        chunk.size = *got;
        if (!writer->Write(chunk)) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "caller went away");
        }
        std::lock_guard<std::mutex> lock(s_.mu);
        s_.counters.bytes_served[caller] += *got;
      }
      if (*got < n) break;  // the end of the file
    }
    return grpc::Status::OK;
  }

 private:
  template <class Request>
  void AddStreamed(const char* method, grpc::Status (Service::*handler)(
                                           grpc::ServerContext*, const Request*,
                                           grpc::ServerWriter<ChunkFrom>*)) {
    AddMethod(new grpc::internal::RpcServiceMethod(
        Name(method), grpc::internal::RpcMethod::SERVER_STREAMING,
        new grpc::internal::ServerStreamingHandler<Service, Request, ChunkFrom>(
            [handler](Service* service, grpc::ServerContext* ctx,
                      const Request* request,
                      grpc::ServerWriter<ChunkFrom>* writer) {
              return (service->*handler)(ctx, request, writer);
            },
            this)));
  }

  // "/scalai.peer.Peer/ReadTensor" and so on, kept for as long as the
  // methods that point at them.
  const char* Name(const char* method) {
    return names_.emplace_back(PeerMethodName(method)).c_str();
  }

  State& s_;
  std::deque<std::string> names_;  // grows without moving what it holds
};

absl::StatusOr<std::unique_ptr<PeerServer>> PeerServer::Start(
    const Store& store, Options options) {
  std::unique_ptr<PeerServer> server(new PeerServer());
  server->state_ = std::make_unique<State>();
  State& s = *server->state_;
  s.store = &store;
  s.options = std::move(options);
  s.service = std::make_unique<Service>(s);
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (s.options.tls) {
    grpc::SslServerCredentialsOptions tls(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    tls.pem_root_certs = s.options.tls->ca;
    tls.pem_key_cert_pairs.push_back({s.options.tls->key, s.options.tls->cert});
    credentials = grpc::SslServerCredentials(tls);
  } else {
    credentials = grpc::InsecureServerCredentials();
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(s.options.address, credentials, &s.port);
  builder.RegisterService(s.service.get());
  for (const PeerChannelSetting& setting : kPeerChannelSettings) {
    builder.AddChannelArgument(setting.name, setting.value);
  }
  s.server = builder.BuildAndStart();
  if (s.server == nullptr || s.port == 0) {
    return absl::UnavailableError(
        absl::StrCat("host ", s.options.host, ": cannot listen on ",
                     s.options.address, " (in use, or not this host's?)"));
  }
  return server;
}

PeerServer::~PeerServer() {
  // Calls still streaming get a second to end, then are cancelled.
  if (state_ && state_->server) {
    state_->server->Shutdown(std::chrono::system_clock::now() +
                             std::chrono::seconds(1));
  }
}

int PeerServer::port() const { return state_->port; }

void PeerServer::DropStaleViews() { state_->DropStale(); }

PeerServer::Counters PeerServer::counters() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->counters;
}

}  // namespace scalai
