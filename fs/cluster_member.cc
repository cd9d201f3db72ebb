#include "fs/cluster_member.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "fs/cluster_coverage.h"
#include "fs/cluster_datasets.h"
#include "ptc/status_macros.h"
#include "transfer/etcd_large_value.h"

namespace scalai {
namespace {

// The value of the config key: the config, the cluster's generation (one
// more at each change) and the host that wrote it.
struct Agreed {
  ParallelConfig config;
  int64_t generation = 0;
  std::string by;
};

std::string AgreedValue(const ParallelConfig& config, int64_t generation,
                        const std::string& by) {
  return nlohmann::json{
      {"config", config.ToString()}, {"generation", generation}, {"by", by}}
      .dump();
}

absl::StatusOr<Agreed> ParseAgreed(const std::string& value) {
  nlohmann::json j = nlohmann::json::parse(value, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("config") ||
      !j["config"].is_string() || !j.contains("generation") ||
      !j["generation"].is_number_integer()) {
    return absl::DataLossError(
        absl::StrCat("the cluster's config key holds no config: ", value));
  }
  ASSIGN_OR_RETURN(ParallelConfig config,
                   ParallelConfig::Parse(j["config"].get<std::string>()));
  return Agreed{config, j["generation"].get<int64_t>(),
                j.value("by", std::string())};
}

}  // namespace

std::string ClusterMember::Key(const std::string& job,
                               const std::string& what) {
  return absl::StrCat("/scalai/", job, "/", what);
}

ClusterMember::ClusterMember(Job& job, ClusterFile cluster, std::string host,
                             Options options)
    : job_(job),
      cluster_(std::move(cluster)),
      host_(std::move(host)),
      options_(options) {}

absl::StatusOr<std::unique_ptr<ClusterMember>> ClusterMember::Join(
    Job& job, const ClusterFile& cluster, const std::string& host,
    Options options) {
  ASSIGN_OR_RETURN(const ClusterHost* me, cluster.FindHost(host));
  std::unique_ptr<ClusterMember> member(
      new ClusterMember(job, cluster, host, options));
  member->address_ = me->address;
  RETURN_IF_ERROR(member->Start());
  return member;
}

absl::Status ClusterMember::Start() {
  ASSIGN_OR_RETURN(etcd_, EtcdClient::Connect(cluster_.etcd, cluster_.tls,
                                              absl::Seconds(5)));
  // The cluster's config: created from this host's when there is none yet,
  // in a transaction that a host joining at the same moment cannot race.
  EtcdClient::Txn create;
  create.conditions.push_back({Key("config"), 0});
  create.puts.push_back(
      {Key("config"), AgreedValue(job_.current()->config(), 1, host_)});
  // What a host with an empty store needs before any peer can help it.
  create.puts.push_back({Key("layout"), job_.store().layout().ToJson().dump()});
  RETURN_IF_ERROR(etcd_->Commit(create).status());
  // The model, tensors in the store's order: the peers name a tensor by its
  // index in it, so a host that joins with an empty store takes this order.
  // A model of tens of thousands of tensors passes what etcd takes in one
  // request: it goes in parts.
  if (job_.store().model() != nullptr) {
    RETURN_IF_ERROR(PutLargeIfAbsent(*etcd_, Key("model"),
                                     Store::EncodeModel(*job_.store().model()))
                        .status());
  }
  // Read with the revision it was read at: the watch starts there (the
  // history before the config's last change may be compacted).
  ASSIGN_OR_RETURN(EtcdClient::KeyAt read, etcd_->GetAt(Key("config")));
  if (!read.kv.has_value()) {
    return absl::UnavailableError(
        absl::StrCat("etcd lost the cluster's config key ", Key("config")));
  }
  const EtcdClient::KeyValue* kv = &*read.kv;
  ASSIGN_OR_RETURN(Agreed agreed, ParseAgreed(kv->value));
  // The peers, before any view of the cluster's config is built: those
  // views read what this host does not hold through them.
  PeerClient::Options calls;
  calls.host = host_;
  calls.token = cluster_.token;
  calls.tls = cluster_.tls;
  for (const ClusterHost& h : cluster_.hosts) {
    if (h.name == host_) continue;
    calls.deadline = kPeerCheck;
    peers_by_name_[h.name].client = std::make_unique<PeerClient>(h, calls);
    calls.deadline = kPeerBytesDeadline;
    peers_by_name_[h.name].data = std::make_unique<PeerClient>(h, calls);
  }
  remote_ = std::make_unique<PeerBytes>([this] { return PeersForBytes(); });
  // Before the views are built again: a dataset whose copy here differs
  // from the cluster's is left out of them.
  ASSIGN_OR_RETURN(
      datasets_refused_,
      CompareDatasets(
          job_.store(), *etcd_,
          [this](const std::string& what) { return Key(what); }, host_));
  if (!datasets_refused_.empty()) RETURN_IF_ERROR(job_.Refresh());
  RETURN_IF_ERROR(job_.SetHolding(
      {[this](const ParallelConfig& c) { return HeldGroups(c); },
       remote_.get()}));
  if (absl::Status s = job_.ApplyAgreed(agreed.config, kv->mod_revision);
      !s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("host ", host_, " cannot serve the cluster's config ",
                     agreed.config.ToString(), ": ", s.message()));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    seen_revision_ = kv->mod_revision;
    generation_ = agreed.generation;
    agreed_ = agreed.config;
  }
  PeerServer::Options peer;
  peer.job = cluster_.job;
  peer.host = host_;
  peer.address = address_;
  peer.token = cluster_.token;
  peer.tls = cluster_.tls;
  peer.read_file = [this](const std::string& path, int64_t offset,
                          int64_t length, char* out) {
    return ReadFile(path, offset, length, out);
  };
  peer.foreground = &job_.foreground_reads();
  ASSIGN_OR_RETURN(peers_, PeerServer::Start(job_.store(), peer));
  RETURN_IF_ERROR(Register());
  RETURN_IF_ERROR(Watch(read.revision));
  // Saves across hosts: what the cluster decided while this host was away
  // first, then this host's saves go through the cluster.
  std::vector<std::string> every_host;
  for (const ClusterHost& h : cluster_.hosts) every_host.push_back(h.name);
  saves_ = std::make_unique<ClusterSaves>(
      job_, *etcd_, host_,
      [this](const std::string& what) { return Key(what); },
      [this](const std::string& name) -> PeerClient* {
        auto it = peers_by_name_.find(name);
        return it == peers_by_name_.end() ? nullptr : it->second.data.get();
      },
      ClusterSaves::Options{
          .replicas = options_.replicas,
          .on_copied = [this] { BeatNow(); },
          .live = [this](const std::string& name) { return IsLive(name); },
          .lost = [this](const std::string& name) { return IsLost(name); },
          .hosts = std::move(every_host),
          .never_mounted =
              [this](const std::string& name) { return NeverMounted(name); }});
  RETURN_IF_ERROR(saves_->Reconcile());
  RETURN_IF_ERROR(job_.SetSaveAgreement({[this](const ParallelConfig& config) {
                                           return ClusterSaves::RanksOfHost(
                                               config, host_);
                                         },
                                         [this](int64_t) { BeatNow(); }}));
  job_.SetAgreement(
      [this](const ParallelConfig& config) { return Propose(config); });
  job_.SetStatusSection("cluster", [this] { return StatusSection(); });
  RecordProgress();
  CompactHistory(ReadCluster());
  for (const auto& [name, reason] : datasets_refused_) job_.ReportError(reason);
  beat_ = std::thread([this] { Beat(); });
  check_ = std::thread([this] { CheckPeers(); });
  return absl::OkStatus();
}

ClusterMember::~ClusterMember() {
  (void)job_.SetSaveAgreement({});  // reads nothing: cannot fail
  job_.SetAgreement(nullptr);
  job_.SetStatusSection("", nullptr);
  // The peers go with this member: the job stops reading through them.
  if (remote_ != nullptr) (void)job_.SetHolding({});
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (beat_.joinable()) beat_.join();
  if (check_.joinable()) check_.join();
  std::unique_ptr<EtcdClient::Watch> watch, saves_watch;
  int64_t lease = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watch = std::move(watch_);
    saves_watch = std::move(saves_watch_);
    lease = lease_;
  }
  watch.reset();
  saves_watch.reset();
  saves_.reset();  // its copies read from peers_by_name_'s clients
  // Not live from now on, rather than when the lease runs out.
  if (lease != 0 && etcd_ != nullptr) (void)etcd_->RevokeLease(lease);
  peers_.reset();
}

absl::Status ClusterMember::Register() {
  ASSIGN_OR_RETURN(int64_t lease, etcd_->GrantLease(kLeaseTtl));
  RETURN_IF_ERROR(etcd_
                      ->PutValue(Key("members/" + host_),
                                 nlohmann::json{{"address", address_}}.dump(),
                                 lease)
                      .status());
  std::lock_guard<std::mutex> lock(mu_);
  lease_ = lease;
  return absl::OkStatus();
}

absl::Status ClusterMember::Watch(int64_t after) {
  ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient::Watch> watch,
                   etcd_->WatchPrefix(Key("config"), after,
                                      [this](const EtcdClient::Event& e) {
                                        if (!e.deleted) Apply(e.kv);
                                      }));
  // A vote or a commit of a step elsewhere is acted on at once, not at the
  // next beat: each round of a save across hosts (vote, copy, commit,
  // record) would otherwise wait up to a beat.
  ASSIGN_OR_RETURN(
      std::unique_ptr<EtcdClient::Watch> saves,
      etcd_->WatchPrefix(Key("saves/"), after,
                         [this](const EtcdClient::Event&) { BeatNow(); }));
  std::unique_ptr<EtcdClient::Watch> old, old_saves;  // joined unlocked
  std::lock_guard<std::mutex> lock(mu_);
  old = std::exchange(watch_, std::move(watch));
  old_saves = std::exchange(saves_watch_, std::move(saves));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ClusterMember::ReadFile(const std::string& path,
                                                int64_t offset, int64_t length,
                                                char* out) {
  std::shared_ptr<const Tree> tree = job_.current();
  const Node* node = tree->Get(kRootIno);
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    if (part == "." || part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("path ", path, ": no . or .. in a peer's path"));
    }
    ASSIGN_OR_RETURN(const Node* next,
                     tree->Lookup(node->ino, std::string(part)));
    if (next == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("no ", path, " in the mount of host ", host_));
    }
    node = next;
  }
  if (node->kind != NodeKind::kFile || node->live) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a file a peer may read"));
  }
  return tree->Read(*node, offset, length, out);
}

void ClusterMember::Apply(const EtcdClient::KeyValue& kv) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kv.mod_revision <= seen_revision_) return;  // seen (or our own)
  }
  absl::StatusOr<Agreed> agreed = ParseAgreed(kv.value);
  if (!agreed.ok()) {
    job_.ReportError(agreed.status().message());
    return;
  }
  // A config this host cannot serve is reported in its status by the job;
  // the cluster's generation moves on all the same.
  (void)job_.ApplyAgreed(agreed->config, kv.mod_revision);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kv.mod_revision > seen_revision_) {
      seen_revision_ = kv.mod_revision;
      generation_ = agreed->generation;
      agreed_ = agreed->config;
    }
  }
  BeatNow();  // record the progress now
}

void ClusterMember::BeatNow() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    beat_now_ = true;
  }
  wake_.notify_all();
}

absl::StatusOr<int64_t> ClusterMember::Propose(const ParallelConfig& config) {
  std::lock_guard<std::mutex> one_at_a_time(propose_mu_);
  int64_t revision = 0;
  int64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    revision = seen_revision_;
    generation = generation_;
    // Every host named must be the cluster file's, and live: a host that is
    // not would leave its ranks without one.
    for (const std::string& name : config.hosts()) {
      RETURN_IF_ERROR(cluster_.FindHost(name).status());
      bool live = name == host_;
      for (const nlohmann::json& h : hosts_) {
        if (h.value("name", "") == name) live |= h.value("live", false);
      }
      if (!live) {
        return absl::FailedPreconditionError(absl::StrCat(
            "host ", name, " is not live: its ranks would have no host"));
      }
    }
  }
  // The live hosts must hold every byte the config needs between them: a
  // host lost with the only copy of some shard leaves a config without it
  // refused, naming what is missing.
  ASSIGN_OR_RETURN(std::vector<HostHolding> holdings,
                   HoldingsOf(job_.store(), host_));
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const nlohmann::json& h : hosts_) {
      const std::string name = h.value("name", "");
      if (name == host_ || !h.value("live", false) || !h.contains("holds"))
        continue;
      for (HostHolding& held : HoldingsFromJson(name, h["holds"]))
        holdings.push_back(std::move(held));
    }
    // A step committed since a live host last reported what it holds: what
    // it held when it voted.
    std::set<std::pair<std::string, int64_t>> reported;
    for (const HostHolding& held : holdings)
      reported.insert({held.host, held.step});
    for (HostHolding& held : saves_->CommittedHoldings()) {
      bool live = held.host == host_;
      for (const nlohmann::json& h : hosts_) {
        if (h.value("name", "") == held.host) live |= h.value("live", false);
      }
      if (live && !reported.contains({held.host, held.step}))
        holdings.push_back(std::move(held));
    }
  }
  RETURN_IF_ERROR(CheckCoverage(job_.store(), config, holdings));
  EtcdClient::Txn txn;
  txn.conditions.push_back({Key("config"), revision});
  txn.puts.push_back(
      {Key("config"), AgreedValue(config, generation + 1, host_)});
  absl::StatusOr<EtcdClient::Committed> committed = etcd_->Commit(txn);
  if (!committed.ok()) {
    return absl::UnavailableError(
        absl::StrCat("the cluster could not agree on ", config.ToString(), ": ",
                     committed.status().message()));
  }
  if (!committed->applied) {
    std::string now = "unknown";
    if (auto kv = etcd_->Get(Key("config")); kv.ok() && *kv) {
      if (auto a = ParseAgreed((*kv)->value); a.ok()) {
        now = absl::StrCat(a->config.ToString(), " (generation ", a->generation,
                           ", by ", a->by, ")");
      }
    }
    return absl::FailedPreconditionError(
        absl::StrCat("another host changed the cluster's config meanwhile; "
                     "it is now ",
                     now, ": write yours again if it is still wanted"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // The watch may have seen this commit already, and a later one too: what
  // it saw last stands.
  if (committed->revision >= seen_revision_) {
    seen_revision_ = committed->revision;
    generation_ = generation + 1;
    agreed_ = config;
  }
  return committed->revision;
}

void ClusterMember::Beat() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, absl::ToChronoMilliseconds(kBeat), [this] {
        return stopping_.load() || std::exchange(beat_now_, false);
      });
      if (stopping_) return;
    }
    int64_t lease = 0;
    bool watching = false;
    int64_t revision = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      lease = lease_;
      watching = watch_ != nullptr && watch_->status().ok() &&
                 saves_watch_ != nullptr && saves_watch_->status().ok();
      revision = seen_revision_;
    }
    absl::Status s = etcd_->KeepAlive(lease);
    if (s.code() == absl::StatusCode::kNotFound) {
      s = Register();  // cut off longer than the lease: live again
    }
    if (s.ok() && !watching) {
      // The watch ended (etcd restarted, a leader lost): catch up on what
      // was missed, then watch again from the revision read at, which
      // compaction has not forgotten (a watch from the config's last
      // change would be refused once the history before was compacted).
      absl::StatusOr<EtcdClient::KeyAt> read = etcd_->GetAt(Key("config"));
      s = read.status();
      if (s.ok() && read->kv.has_value()) Apply(*read->kv);
      if (s.ok()) s = Watch(std::max(revision, read->revision));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      etcd_error_ = s.ok() ? "" : std::string(s.message());
    }
    if (s.ok()) {
      RecordProgress();
      CompactHistory(ReadCluster());
      ReleaseWhenAllFinished();
      RetryWhenPeerBack();
      if (absl::Status saved = saves_->Advance(); !saved.ok()) {
        job_.ReportError(
            absl::StrCat("saving across hosts: ", saved.message()));
      }
    }
    // Blobs released or removed since the last beat get their space back
    // once no view a peer asked for maps them.
    peers_->DropStaleViews();
  }
}

bool ClusterMember::IsLive(const std::string& name) {
  if (name == host_) return true;
  std::lock_guard<std::mutex> lock(mu_);
  for (const nlohmann::json& h : hosts_) {
    if (h.value("name", "") == name) return h.value("live", false);
  }
  return false;
}

bool ClusterMember::IsLost(const std::string& name) {
  if (name == host_) return false;
  std::lock_guard<std::mutex> lock(mu_);
  // Not live as etcd was last read (a host not read yet is not lost).
  const auto seen = std::find_if(
      hosts_.begin(), hosts_.end(),
      [&](const nlohmann::json& h) { return h.value("name", "") == name; });
  if (seen == hosts_.end() || seen->value("live", true)) return false;
  if (!agreed_ || agreed_->hosts().empty()) return false;
  const std::vector<std::string>& named = agreed_->hosts();
  return std::find(named.begin(), named.end(), name) == named.end();
}

bool ClusterMember::NeverMounted(const std::string& name) {
  if (name == host_) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return mounted_.has_value() && !mounted_->contains(name);
}

std::optional<std::vector<int>> ClusterMember::HeldGroups(
    const ParallelConfig& config) const {
  if (config.hosts().empty()) return std::nullopt;
  std::set<int> groups;
  for (size_t i = 0; i < config.hosts().size(); ++i) {
    const std::string& host = config.hosts()[i];
    if (host != host_ && (options_.replicas < 2 ||
                          ClusterSaves::NextHost(config, host) != host_)) {
      continue;
    }
    const auto [first, last] = config.RanksOfHost(static_cast<int>(i));
    for (int rank = first; rank <= last; ++rank) {
      groups.insert(config.ShardGroup(rank));
    }
  }
  return std::vector<int>(groups.begin(), groups.end());
}

std::vector<PeerClient*> ClusterMember::PeersForBytes() {
  std::vector<PeerClient*> answered, others;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, peer] : peers_by_name_)
    (peer.answered ? answered : others).push_back(peer.data.get());
  answered.insert(answered.end(), others.begin(), others.end());
  return answered;
}

void ClusterMember::RetryWhenPeerBack() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!std::exchange(peer_back_, false)) return;
  }
  // A materialization that failed while a peer was unreachable (a cut
  // cable, a host restarting) is tried again once the peer answers.
  if (job_.progress().state == "failed") job_.StartMaterialization();
}

void ClusterMember::ReleaseWhenAllFinished() {
  // Anything kept for peers shows as a second holding of a step.
  std::set<int64_t> steps;
  bool kept = false;
  for (const HostHolding& h : holdings_) kept |= !steps.insert(h.step).second;
  if (!kept) return;
  const Job::Progress mine = job_.progress();
  if (mine.state != "ready") return;
  absl::StatusOr<ParallelConfig> config = ParallelConfig::Parse(mine.config);
  if (!config.ok()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const nlohmann::json& h : hosts_) {
      const std::string name = h.value("name", "");
      const bool named =
          std::find(config->hosts().begin(), config->hosts().end(), name) !=
          config->hosts().end();
      const bool live = h.value("live", false);
      // A host the config runs ranks on must have finished, live; any
      // other live host too (it may still read from the retained shards).
      if (!named && !live) continue;
      if (name == host_) continue;
      if (!live || h.value("config", "") != mine.config ||
          h.value("state", "") != "ready") {
        return;
      }
    }
  }
  absl::StatusOr<int> released = job_.ReleaseRetained();
  if (!released.ok()) {
    job_.ReportError(absl::StrCat("releasing the shards kept for peers: ",
                                  released.status().message()));
    return;
  }
  bytes_held_key_.clear();  // what this host holds changed: count again
}

void ClusterMember::CheckPeers() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, absl::ToChronoMilliseconds(kPeerCheck),
                     [this] { return stopping_.load(); });
      if (stopping_) return;
    }
    for (auto& [name, peer] : peers_by_name_) {
      if (stopping_) return;
      absl::StatusOr<PeerClient::Hello> hello = peer.client->SayHello();
      std::string error;
      if (!hello.ok()) {
        error = std::string(hello.status().message());
      } else if (hello->job != cluster_.job || hello->host != name) {
        // Someone else listens at that address: not trusted as the peer.
        error = absl::StrCat("dialed ", name, " of job ", cluster_.job, " but ",
                             hello->host, " of job ", hello->job, " answered");
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (!peer.answered && error.empty()) peer_back_ = true;
      peer.answered = error.empty();
      peer.error = std::move(error);
    }
  }
}

void ClusterMember::RecordProgress() {
  const Job::Progress p = job_.progress();
  int64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation = generation_;
  }
  nlohmann::json progress = {{"generation", generation},
                             {"config", p.config},
                             {"state", p.state},
                             {"progress", p.progress},
                             {"bytes_moved", p.bytes_moved},
                             {"error", nullptr}};
  if (!p.error.empty()) progress["error"] = p.error;
  // The bytes this host's store holds change only with its config or
  // state (a materialization committed, a step saved): counted then, not
  // at every beat.
  const std::string key =
      absl::StrCat(p.generation, " ", p.config, " ", p.state);
  if (key != bytes_held_key_) {
    absl::StatusOr<std::map<std::string, BlobRecord>> blobs =
        job_.store().Blobs();
    absl::StatusOr<std::vector<HostHolding>> holdings =
        HoldingsOf(job_.store(), host_);
    if (!blobs.ok() || !holdings.ok()) return;
    bytes_held_ = 0;
    for (const auto& [name, blob] : *blobs) bytes_held_ += blob.size;
    holdings_ = *std::move(holdings);
    bytes_held_key_ = key;
  }
  progress["bytes_held"] = bytes_held_;
  // What this host holds of each step, for a host that checks a config
  // leaving some host out (CheckCoverage).
  progress["holds"] = HoldingsToJson(holdings_);
  std::string value =
      progress.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (value == progress_written_) return;
  }
  if (etcd_->PutValue(Key("progress/" + host_), value).ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    progress_written_ = std::move(value);
  }
}

int64_t ClusterMember::ReadCluster() {
  // Only the members and their progress: the job's other keys (its model,
  // every step committed) grow with the job, and a beat reading them all
  // would pass gRPC's 4 MiB a message on a long job and fail at every beat.
  // Of those, only the names and revisions, then the progress values that
  // changed: a value lists what its host holds of every step, and every
  // host reading every value at every beat would make etcd send
  // hosts x hosts values twice a second.
  const auto failed = [&](const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    etcd_error_ = std::string(s.message());
    return 0;
  };
  const std::string members = Key("members/");
  const std::string done = Key("progress/");
  absl::StatusOr<EtcdClient::Snapshot> live = etcd_->ListPrefix(members);
  if (!live.ok()) return failed(live.status());
  absl::StatusOr<EtcdClient::Snapshot> listed = etcd_->ListPrefix(done);
  if (!listed.ok()) return failed(listed.status());
  std::set<std::string> live_names, listed_names;
  for (const EtcdClient::KeyValue& kv : live->kvs) {
    live_names.insert(kv.key.substr(members.size()));
  }
  std::vector<std::string> changed;
  for (const EtcdClient::KeyValue& kv : listed->kvs) {
    const std::string name = kv.key.substr(done.size());
    listed_names.insert(name);
    auto seen = progress_seen_.find(name);
    if (seen == progress_seen_.end() ||
        seen->second.mod_revision != kv.mod_revision) {
      changed.push_back(kv.key);
    }
  }
  // One round trip for all that changed (every host's, when all
  // materialize at once), up to 128 hosts; none when nothing did. A key
  // deleted meanwhile is simply not there.
  absl::StatusOr<EtcdClient::Snapshot> read = etcd_->GetMany(changed);
  if (!read.ok()) return failed(read.status());
  for (EtcdClient::KeyValue& kv : read->kvs) {
    nlohmann::json value = nlohmann::json::parse(kv.value, nullptr, false);
    if (value.is_discarded()) value = nlohmann::json::object();
    progress_seen_[kv.key.substr(done.size())] = {kv.mod_revision,
                                                  std::move(value)};
  }
  std::erase_if(progress_seen_, [&](const auto& seen) {
    return !listed_names.contains(seen.first);
  });
  const int64_t revision = listed->revision;
  nlohmann::json hosts = nlohmann::json::array();
  for (const ClusterHost& h : cluster_.hosts) {
    nlohmann::json entry = {{"name", h.name},
                            {"address", h.address},
                            {"live", live_names.contains(h.name)}};
    if (auto it = progress_seen_.find(h.name); it != progress_seen_.end()) {
      if (it->second.value.is_object()) {
        for (const auto& [key, value] : it->second.value.items()) {
          entry[key] = value;
        }
      }
    }
    hosts.push_back(std::move(entry));
  }
  std::lock_guard<std::mutex> lock(mu_);
  hosts_ = std::move(hosts);
  mounted_ = std::move(listed_names);
  return revision;
}

void ClusterMember::CompactHistory(int64_t now_revision) {
  if (now_revision <= 0) return;
  const absl::Time now = absl::Now();
  if (now - history_marked_ < cluster_.etcd_history) return;
  // Every host does this; compacting where another host already has is
  // no error. A watch that ends starts again from a revision read then
  // (Beat), never from one this forgot.
  if (history_mark_ > 0) {
    if (absl::Status s = etcd_->Compact(history_mark_); !s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      etcd_error_ = std::string(s.message());
    }
  }
  history_mark_ = now_revision;
  history_marked_ = now;
}

nlohmann::json ClusterMember::StatusSection() {
  PeerServer::Counters counters = peers_->counters();
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json served = nlohmann::json::object();
  for (const auto& [host, bytes] : counters.bytes_served) served[host] = bytes;
  // The ranks each host runs under the cluster's config: all of them on
  // every host without hosts=, a block each with it.
  nlohmann::json hosts = hosts_;
  if (agreed_) {
    const std::vector<std::string>& named = agreed_->hosts();
    for (nlohmann::json& h : hosts) {
      const auto it =
          std::find(named.begin(), named.end(), h.value("name", ""));
      if (!named.empty() && it == named.end()) {
        h["ranks"] = nullptr;  // the config leaves it out: it runs none
        continue;
      }
      const auto [first, last] =
          agreed_->RanksOfHost(static_cast<int>(it - named.begin()));
      h["ranks"] = {first, last};
    }
  }
  nlohmann::json j = {{"job", cluster_.job},
                      {"host", host_},
                      {"generation", generation_},
                      {"etcd_error", nullptr},
                      {"hosts", hosts},
                      {"peer_calls_refused", counters.refused},
                      {"peer_calls_failed", counters.failed},
                      {"bytes_served", served},
                      {"bytes_reused", remote_->bytes_reused()},
                      {"saves", saves_->Status()},
                      {"replicas_refused", saves_->ReplicasRefused()},
                      {"datasets_refused", datasets_refused_}};
  if (!etcd_error_.empty()) j["etcd_error"] = etcd_error_;
  // Each other host as this one last reached it.
  nlohmann::json peers = nlohmann::json::object();
  for (const auto& [name, peer] : peers_by_name_) {
    peers[name] = {
        {"reachable", peer.answered},
        {"error", nullptr},
        {"calls_failed", peer.client->errors() + peer.data->errors()},
        {"bytes_fetched",
         peer.client->bytes_fetched() + peer.data->bytes_fetched()}};
    if (!peer.error.empty()) peers[name]["error"] = peer.error;
  }
  j["peers"] = std::move(peers);
  return j;
}

}  // namespace scalai
