#include "transfer/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "ptc/status_macros.h"
#include "transfer/etcd.grpc.pb.h"
#include "transfer/peer_call.h"

namespace scalai {

namespace pb = etcdserverpb;

struct EtcdClient::Stubs {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::KV::Stub> kv;
  std::unique_ptr<pb::Watch::Stub> watch;
  std::unique_ptr<pb::Lease::Stub> lease;
};

std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(end.back() + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

namespace {

bool IsIpv4Literal(absl::string_view host) {
  int dots = 0;
  for (char c : host) {
    if (c == '.') {
      ++dots;
    } else if (c < '0' || c > '9') {
      return false;
    }
  }
  return dots == 3;
}

// The gRPC target for a list of endpoints: every member when they are
// IPv4 addresses, so that the channel moves to another member when one goes
// down (a leader killed); otherwise the first.
std::string Target(const std::vector<std::string>& endpoints) {
  std::vector<std::string> addresses;
  bool literal = true;
  for (const std::string& e : endpoints) {
    absl::string_view rest = e;
    if (!absl::ConsumePrefix(&rest, "http://")) {
      absl::ConsumePrefix(&rest, "https://");
    }
    addresses.emplace_back(rest);
    literal &= IsIpv4Literal(rest.substr(0, rest.rfind(':')));
  }
  if (literal && addresses.size() > 1) {
    return absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
  }
  return addresses.front();
}

EtcdClient::KeyValue FromPb(const pb::KeyValue& kv) {
  return {kv.key(), kv.value(), kv.create_revision(), kv.mod_revision(),
          kv.lease()};
}

// A watch's stream, read on its own thread until cancelled.
class StreamWatch final : public EtcdClient::Watch {
 public:
  StreamWatch(pb::Watch::Stub& stub, pb::WatchCreateRequest create,
              std::function<void(const EtcdClient::Event&)> on_event,
              std::string where)
      : where_(std::move(where)) {
    stream_ = stub.Watch(&ctx_);
    pb::WatchRequest request;
    *request.mutable_create_request() = std::move(create);
    if (!stream_->Write(request)) {
      End(absl::UnavailableError(
          absl::StrCat(where_, ": cannot start the watch")));
      return;
    }
    reader_ = std::thread([this, on_event = std::move(on_event)] {
      pb::WatchResponse response;
      while (stream_->Read(&response)) {
        if (response.canceled()) {
          End(absl::AbortedError(absl::StrCat(
              where_, ": watch cancelled by etcd: ", response.cancel_reason(),
              response.compact_revision() > 0
                  ? absl::StrCat(" (compacted at ", response.compact_revision(),
                                 ")")
                  : "")));
          break;
        }
        for (const pb::Event& e : response.events()) {
          on_event({e.type() == pb::Event::DELETE, FromPb(e.kv())});
        }
      }
      grpc::Status finished = stream_->Finish();
      if (!stopping_.load()) End(FromGrpc(finished, where_));
    });
  }

  ~StreamWatch() override {
    stopping_ = true;
    ctx_.TryCancel();
    if (reader_.joinable()) reader_.join();
  }

  absl::Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  void End(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) {
      status_ = s.ok() ? absl::UnavailableError(
                             absl::StrCat(where_, ": the watch ended"))
                       : std::move(s);
    }
  }

  const std::string where_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::WatchRequest, pb::WatchResponse>>
      stream_;
  std::thread reader_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  absl::Status status_;  // guarded by mu_
};

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(
    const std::vector<std::string>& endpoints,
    const std::optional<ClusterTls>& tls, absl::Duration deadline) {
  if (endpoints.empty()) {
    return absl::InvalidArgumentError("no etcd endpoint given");
  }
  std::unique_ptr<EtcdClient> client(new EtcdClient());
  client->endpoints_ = absl::StrJoin(endpoints, ",");
  client->deadline_ = deadline;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (tls) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = tls->ca;
    options.pem_private_key = tls->key;
    options.pem_cert_chain = tls->cert;
    credentials = grpc::SslCredentials(options);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  auto stubs = std::make_unique<Stubs>();
  // A read of a prefix answers in one message, which gRPC caps at 4 MiB
  // unless told otherwise; a job's keys pass that as it runs. etcd bounds
  // it already: its database is at most its quota (2 GiB by default).
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  stubs->channel =
      grpc::CreateCustomChannel(Target(endpoints), credentials, args);
  stubs->kv = pb::KV::NewStub(stubs->channel);
  stubs->watch = pb::Watch::NewStub(stubs->channel);
  stubs->lease = pb::Lease::NewStub(stubs->channel);
  client->stubs_ = std::move(stubs);
  return client;
}

EtcdClient::~EtcdClient() = default;

namespace {

void Prepare(grpc::ClientContext& ctx, absl::Duration deadline) {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  // A member being elected or restarted answers UNAVAILABLE for a moment:
  // the call waits for the channel within its deadline instead.
  ctx.set_wait_for_ready(true);
}

}  // namespace

absl::Status EtcdClient::Failed(const grpc::Status& s,
                                absl::string_view what) const {
  // Calls wait for a connection (Prepare): an endpoint that is down or
  // cut off shows only as the deadline passing.
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(
        absl::StrCat("etcd (", endpoints_, "), ", what, ": no answer within ",
                     absl::FormatDuration(deadline_),
                     " (is etcd running, and reachable from this host?)"));
  }
  return FromGrpc(s, absl::StrCat("etcd (", endpoints_, "), ", what));
}

absl::StatusOr<std::optional<EtcdClient::KeyValue>> EtcdClient::Get(
    const std::string& key) {
  ASSIGN_OR_RETURN(KeyAt read, GetAt(key));
  return std::move(read.kv);
}

absl::StatusOr<EtcdClient::KeyAt> EtcdClient::GetAt(const std::string& key) {
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  pb::RangeRequest request;
  request.set_key(key);
  pb::RangeResponse response;
  grpc::Status s = stubs_->kv->Range(&ctx, request, &response);
  if (!s.ok()) return Failed(s, absl::StrCat("reading ", key));
  KeyAt read;
  read.revision = response.header().revision();
  if (!response.kvs().empty()) read.kv = FromPb(response.kvs(0));
  return read;
}

absl::StatusOr<EtcdClient::Snapshot> EtcdClient::GetPrefix(
    const std::string& prefix) {
  return GetRange(prefix, PrefixEnd(prefix));
}

absl::StatusOr<EtcdClient::Snapshot> EtcdClient::GetRange(
    const std::string& from, const std::string& end) {
  return Range(from, end, /*keys_only=*/false);
}

absl::StatusOr<EtcdClient::Snapshot> EtcdClient::ListPrefix(
    const std::string& prefix) {
  return Range(prefix, PrefixEnd(prefix), /*keys_only=*/true);
}

absl::StatusOr<EtcdClient::Snapshot> EtcdClient::Range(const std::string& from,
                                                       const std::string& end,
                                                       bool keys_only) {
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  pb::RangeRequest request;
  request.set_key(from);
  request.set_range_end(end);
  request.set_keys_only(keys_only);
  pb::RangeResponse response;
  grpc::Status s = stubs_->kv->Range(&ctx, request, &response);
  if (!s.ok()) {
    return Failed(s, absl::StrCat("reading keys from ", from, " to ", end));
  }
  Snapshot snapshot;
  snapshot.revision = response.header().revision();
  for (const pb::KeyValue& kv : response.kvs()) {
    snapshot.kvs.push_back(FromPb(kv));
  }
  return snapshot;
}

absl::StatusOr<int64_t> EtcdClient::PutValue(const std::string& key,
                                             const std::string& value,
                                             int64_t lease) {
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  pb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease);
  pb::PutResponse response;
  grpc::Status s = stubs_->kv->Put(&ctx, request, &response);
  if (!s.ok()) return Failed(s, absl::StrCat("writing ", key));
  return response.header().revision();
}

absl::Status EtcdClient::Compact(int64_t revision) {
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  pb::CompactionRequest request;
  request.set_revision(revision);
  pb::CompactionResponse response;
  grpc::Status s = stubs_->kv->Compact(&ctx, request, &response);
  // Another host compacted as far or further first.
  if (s.error_code() == grpc::StatusCode::OUT_OF_RANGE &&
      absl::StrContains(s.error_message(), "has been compacted")) {
    return absl::OkStatus();
  }
  if (!s.ok()) {
    return Failed(s, absl::StrCat("compacting to revision ", revision));
  }
  return absl::OkStatus();
}

absl::StatusOr<EtcdClient::Snapshot> EtcdClient::GetMany(
    const std::vector<std::string>& keys) {
  Snapshot snapshot;
  for (size_t first = 0; first < keys.size(); first += kMaxTxnOps) {
    const size_t last = std::min(keys.size(), first + kMaxTxnOps);
    // No condition: the transaction's reads always run, at one revision.
    pb::TxnRequest request;
    for (size_t i = first; i < last; ++i) {
      request.add_success()->mutable_request_range()->set_key(keys[i]);
    }
    grpc::ClientContext ctx;
    Prepare(ctx, deadline_);
    pb::TxnResponse response;
    grpc::Status s = stubs_->kv->Txn(&ctx, request, &response);
    if (!s.ok()) {
      return Failed(s, absl::StrCat("reading ", last - first, " keys from ",
                                    keys[first]));
    }
    snapshot.revision = response.header().revision();
    for (const pb::ResponseOp& op : response.responses()) {
      for (const pb::KeyValue& kv : op.response_range().kvs()) {
        snapshot.kvs.push_back(FromPb(kv));
      }
    }
  }
  return snapshot;
}

absl::StatusOr<EtcdClient::Committed> EtcdClient::Commit(const Txn& txn) {
  pb::TxnRequest request;
  for (const Condition& c : txn.conditions) {
    pb::Compare* compare = request.add_compare();
    compare->set_key(c.key);
    compare->set_result(pb::Compare::EQUAL);
    compare->set_target(pb::Compare::MOD);
    compare->set_mod_revision(c.mod_revision);
  }
  for (const Unchanged& u : txn.unchanged) {
    pb::Compare* compare = request.add_compare();
    compare->set_key(u.prefix);
    compare->set_range_end(PrefixEnd(u.prefix));
    compare->set_result(pb::Compare::LESS);
    compare->set_target(pb::Compare::MOD);
    compare->set_mod_revision(u.revision + 1);
  }
  for (const Put& p : txn.puts) {
    pb::PutRequest* put = request.add_success()->mutable_request_put();
    put->set_key(p.key);
    put->set_value(p.value);
    put->set_lease(p.lease);
  }
  for (const std::string& key : txn.deletes) {
    request.add_success()->mutable_request_delete_range()->set_key(key);
  }
  for (const std::string& prefix : txn.delete_prefixes) {
    pb::DeleteRangeRequest* del =
        request.add_success()->mutable_request_delete_range();
    del->set_key(prefix);
    del->set_range_end(PrefixEnd(prefix));
  }
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  pb::TxnResponse response;
  grpc::Status s = stubs_->kv->Txn(&ctx, request, &response);
  if (!s.ok()) return Failed(s, "committing a transaction");
  return Committed{response.succeeded(), response.header().revision()};
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(absl::Duration ttl) {
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  pb::LeaseGrantRequest request;
  request.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(ttl)));
  pb::LeaseGrantResponse response;
  grpc::Status s = stubs_->lease->LeaseGrant(&ctx, request, &response);
  if (!s.ok()) return Failed(s, "granting a lease");
  if (!response.error().empty()) {
    return absl::UnavailableError(absl::StrCat(
        "etcd (", endpoints_, "), granting a lease: ", response.error()));
  }
  return response.id();
}

absl::Status EtcdClient::KeepAlive(int64_t lease) {
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  auto stream = stubs_->lease->LeaseKeepAlive(&ctx);
  pb::LeaseKeepAliveRequest request;
  request.set_id(lease);
  pb::LeaseKeepAliveResponse response;
  const bool answered = stream->Write(request) && stream->Read(&response);
  stream->WritesDone();
  ctx.TryCancel();  // one round is all this call wants
  grpc::Status s = stream->Finish();
  if (!answered) return Failed(s, absl::StrCat("renewing lease ", lease));
  // A lease that has expired is answered with a TTL of 0 or less.
  if (response.ttl() <= 0) {
    return absl::NotFoundError(
        absl::StrCat("etcd (", endpoints_, "): lease ", lease, " has expired"));
  }
  return absl::OkStatus();
}

absl::Status EtcdClient::RevokeLease(int64_t lease) {
  grpc::ClientContext ctx;
  Prepare(ctx, deadline_);
  pb::LeaseRevokeRequest request;
  request.set_id(lease);
  pb::LeaseRevokeResponse response;
  grpc::Status s = stubs_->lease->LeaseRevoke(&ctx, request, &response);
  if (!s.ok()) return Failed(s, absl::StrCat("revoking lease ", lease));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> EtcdClient::WatchPrefix(
    const std::string& prefix, int64_t after,
    std::function<void(const Event&)> on_event) {
  pb::WatchCreateRequest create;
  create.set_key(prefix);
  create.set_range_end(PrefixEnd(prefix));
  create.set_start_revision(after + 1);
  auto watch = std::make_unique<StreamWatch>(
      *stubs_->watch, std::move(create), std::move(on_event),
      absl::StrCat("etcd (", endpoints_, "), watching ", prefix, "*"));
  if (absl::Status s = watch->status(); !s.ok()) return s;
  return watch;
}

}  // namespace scalai
