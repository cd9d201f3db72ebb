#include "fs/cluster_saves.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/blob_copy.h"
#include "transfer/blob_reader.h"
#include "transfer/files.h"

namespace scalai {
namespace {

// When the part a vote is for began (its `begun`); none in a vote from a
// version that did not say.
std::optional<int64_t> BegunOf(const std::string& vote) {
  const nlohmann::json j = nlohmann::json::parse(vote, nullptr, false);
  if (!j.is_object() || !j.contains("begun") ||
      !j["begun"].is_number_integer()) {
    return std::nullopt;
  }
  return j["begun"].get<int64_t>();
}

// A step not yet committed as `status` lists it under cluster.saves: which
// hosts voted for it.
nlohmann::json PendingStatus(
    int64_t step, const std::map<std::string, EtcdClient::KeyValue>& votes) {
  nlohmann::json voted = nlohmann::json::array();
  for (const auto& [host, kv] : votes) voted.push_back(host);
  return {{"step", step}, {"voted", std::move(voted)}};
}

// The config a step was saved under, as the first of its votes that names
// one says.
std::optional<ParallelConfig> VotedConfig(
    const std::map<std::string, EtcdClient::KeyValue>& votes) {
  for (const auto& [host, kv] : votes) {
    const nlohmann::json j = nlohmann::json::parse(kv.value, nullptr, false);
    if (!j.is_object() || !j.contains("config") || !j["config"].is_string()) {
      continue;
    }
    absl::StatusOr<ParallelConfig> parsed =
        ParallelConfig::Parse(j["config"].get<std::string>());
    if (parsed.ok()) return *std::move(parsed);
  }
  return std::nullopt;
}

// A vote and a commit carry the step as the catalog records it, less the
// shards: config, groups, bytes and, from rank 0's host, the data position.
nlohmann::json StepJson(const StepRecord& step) {
  nlohmann::json j = {
      {"config", step.config}, {"groups", step.groups}, {"bytes", step.bytes}};
  if (step.consumed_samples) j["consumed_samples"] = *step.consumed_samples;
  return j;
}

absl::StatusOr<StepRecord> StepFromJson(int64_t step, const std::string& value,
                                        const std::string& key) {
  nlohmann::json j = nlohmann::json::parse(value, nullptr, false);
  StepRecord record;
  record.step = step;
  if (j.is_discarded() || !j.is_object() || !j.contains("config") ||
      !j["config"].is_string() || !j.contains("groups") ||
      !j["groups"].is_number_integer() || !j.contains("bytes") ||
      !j["bytes"].is_number_integer() ||
      (j.contains("consumed_samples") &&
       !j["consumed_samples"].is_number_integer())) {
    return absl::DataLossError(
        absl::StrCat("etcd key ", key, " holds no step: ", value));
  }
  record.config = j["config"].get<std::string>();
  record.groups = j["groups"].get<int>();
  record.bytes = j["bytes"].get<int64_t>();
  if (j.contains("consumed_samples"))
    record.consumed_samples = j["consumed_samples"].get<int64_t>();
  return record;
}

// Refusals of replicas kept for `status`.
constexpr size_t kRefusalsKept = 16;

// The host that runs the rank that saves shard group `group`.
std::string SaverHost(const ParallelConfig& config, int group) {
  return config.hosts()[config.HostOfRank(config.SaverOfGroup(group))];
}

// The checksum of a shard's tensor bytes: of each blob from its first
// tensor to its end (a saved shard is one model.safetensors, whose data
// runs from its first tensor to its end), read back and verified. Replicas'
// headers differ (scalai.rank), their tensor bytes do not.
absl::StatusOr<uint64_t> TensorBytesSum(const Store& store,
                                        const ShardRecord& shard) {
  std::vector<int64_t> first(shard.blobs.size(), -1);
  for (const ShardRecord::Location& t : shard.tensors) {
    int64_t& at = first[static_cast<size_t>(t.blob)];
    if (at < 0 || t.offset < at) at = t.offset;
  }
  ChunkHasher hasher;
  std::string buffer(static_cast<size_t>(8 * kBlobChunkBytes), '\0');
  for (size_t b = 0; b < shard.blobs.size(); ++b) {
    if (first[b] < 0) continue;
    std::shared_ptr<const BlobReader> reader =
        BlobReader::Open(store, shard.blobs[b]);
    for (int64_t at = first[b]; at < reader->size();) {
      const int64_t n =
          std::min(static_cast<int64_t>(buffer.size()), reader->size() - at);
      RETURN_IF_ERROR(reader->Read(buffer.data(), n, at));
      hasher.Update(buffer.data(), n);
      at += n;
    }
  }
  return ChunkSumsDigest(hasher.Finish());
}

// A shard as a vote describes it: the checksum of its tensor bytes
// (`data`, for replicas compared across hosts), and, for a host that
// copies it (`for_copy`), its blobs and where each tensor lies in them.
// Nothing in it grows with the shard's bytes: a vote lists every shard of
// a host's part, and etcd refuses values over 1.5 MiB.
nlohmann::json ShardJson(const Store& store, const ShardRecord& shard,
                         const std::string& data, bool for_copy) {
  if (!for_copy) return {{"data", data}};
  nlohmann::json blobs = nlohmann::json::array();
  for (const std::string& name : shard.blobs) {
    absl::StatusOr<BlobRecord> blob = store.Blob(name);
    if (!blob.ok()) return nullptr;
    blobs.push_back(BlobDescription::Of(*blob).ToJson());
  }
  nlohmann::json tensors = nlohmann::json::array();
  for (const ShardRecord::Location& t : shard.tensors)
    tensors.push_back({t.blob, t.offset});
  return {{"blobs", blobs}, {"tensors", tensors}, {"data", data}};
}

}  // namespace

ClusterSaves::ClusterSaves(Job& job, EtcdClient& etcd, std::string host,
                           KeyOf key, PeerOf peer_of, Options options)
    : job_(job),
      etcd_(etcd),
      host_(std::move(host)),
      key_(std::move(key)),
      peer_of_(std::move(peer_of)),
      options_(options) {}

std::string ClusterSaves::NextHost(const ParallelConfig& config,
                                   const std::string& host) {
  const std::vector<std::string>& hosts = config.hosts();
  size_t last = hosts.size();
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (hosts[i] == host) last = i;
  }
  if (last == hosts.size()) return "";
  for (size_t k = 1; k < hosts.size(); ++k) {
    const std::string& next = hosts[(last + k) % hosts.size()];
    if (next != host) return next;
  }
  return "";
}

absl::StatusOr<std::vector<int>> ClusterSaves::RanksOfHost(
    const ParallelConfig& config, const std::string& host) {
  if (config.hosts().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "in a cluster a step is saved under a config that names its hosts "
        "(hosts=...), not ",
        config.ToString()));
  }
  std::vector<int> ranks;
  for (size_t i = 0; i < config.hosts().size(); ++i) {
    if (config.hosts()[i] != host) continue;
    const auto [first, last] = config.RanksOfHost(static_cast<int>(i));
    for (int r = first; r <= last; ++r) ranks.push_back(r);
  }
  if (ranks.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("host ", host, " runs no rank of ", config.ToString()));
  }
  return ranks;
}

std::set<std::string> ClusterSaves::Voters(const ParallelConfig& config) {
  std::set<std::string> voters;
  for (size_t i = 0; i < config.hosts().size(); ++i) {
    const auto [first, last] = config.RanksOfHost(static_cast<int>(i));
    for (int r = first; r <= last; ++r) {
      if (config.SavesShard(r)) {
        voters.insert(config.hosts()[i]);
        break;
      }
    }
  }
  return voters;
}

std::string ClusterSaves::StepPrefix(int64_t step) const {
  return key_(absl::StrFormat("saves/%020d/", step));
}

absl::StatusOr<ClusterSaves::Saves> ClusterSaves::ReadSaves(int64_t from) {
  const std::string prefix = key_("saves/");
  // Steps are numbered with leading zeros: key order is step order.
  ASSIGN_OR_RETURN(
      EtcdClient::Snapshot snapshot,
      etcd_.GetRange(absl::StrCat(prefix, absl::StrFormat("%020d", from)),
                     PrefixEnd(prefix)));
  Saves saves;
  saves.revision = snapshot.revision;
  std::map<int64_t, StepKeys>& steps = saves.steps;
  for (EtcdClient::KeyValue& kv : snapshot.kvs) {
    // saves/STEP/vote/HOST or saves/STEP/committed
    const std::string rest = kv.key.substr(prefix.size());
    const size_t slash = rest.find('/');
    int64_t step = 0;
    if (slash == std::string::npos ||
        !absl::SimpleAtoi(rest.substr(0, slash), &step)) {
      continue;  // not a key this version writes
    }
    const std::string what = rest.substr(slash + 1);
    if (what == "committed") {
      steps[step].committed = std::move(kv);
    } else if (what.rfind("vote/", 0) == 0) {
      steps[step].votes[what.substr(5)] = std::move(kv);
    } else if (what.rfind("recorded/", 0) == 0) {
      steps[step].recorded.insert(what.substr(9));
    } else if (what == "withdrawn") {
      steps[step].withdrawn = kv.mod_revision;
    } else if (what.rfind("dropped/", 0) == 0) {
      steps[step].dropped[what.substr(8)] = std::move(kv.value);
    }
  }
  for (auto& entry : steps) {
    StepKeys& keys = entry.second;
    if (keys.withdrawn == 0) continue;
    std::erase_if(keys.votes, [&](auto& vote) {
      if (BegunOf(vote.second.value).value_or(keys.withdrawn) >=
          keys.withdrawn) {
        return false;
      }
      keys.void_votes.push_back(std::move(vote.second));
      return true;
    });
  }
  return saves;
}

void ClusterSaves::NoteBegun(const std::vector<SaveNode>& saving,
                             const std::vector<PendingStep>& pending,
                             int64_t revision) {
  std::set<int64_t> here;
  for (const SaveNode& s : saving) here.insert(s.step);
  for (const PendingStep& p : pending) here.insert(p.record.step);
  for (int64_t step : here) begun_.try_emplace(step, revision);
  std::erase_if(begun_, [&](const auto& b) {
    return !here.contains(b.first) && !voted_.contains(b.first);
  });
}

absl::Status ClusterSaves::WithdrawAbandoned(std::map<int64_t, StepKeys>& steps,
                                             const std::set<int64_t>& saved) {
  for (auto& [step, keys] : steps) {
    // (A vote of this host's own for copies of other hosts' shards does
    // not save its part: the step would wait for that forever too.)
    if (keys.committed || keys.votes.empty() || saved.contains(step)) {
      continue;
    }
    // The step began on some host before this one started (a vote from a
    // version that does not say when counts as later: it waits, as before).
    bool earlier = false;
    for (const auto& [host, kv] : keys.votes) {
      if (BegunOf(kv.value).value_or(since_) < since_) earlier = true;
    }
    const std::optional<ParallelConfig> config = VotedConfig(keys.votes);
    if (earlier && config && Voters(*config).contains(host_)) {
      RETURN_IF_ERROR(Withdraw(step).status());
      keys.votes.clear();
    }
  }
  return absl::OkStatus();
}

absl::Status ClusterSaves::Reconcile() {
  ASSIGN_OR_RETURN(std::vector<PendingStep> pending,
                   job_.store().PendingSteps());
  ASSIGN_OR_RETURN(Saves read, ReadSaves());
  since_ = read.revision;
  std::map<int64_t, StepKeys>& steps = read.steps;
  std::set<int64_t> saved;  // steps whose part this host's workers saved
  for (const PendingStep& p : pending) {
    if (p.saved) saved.insert(p.record.step);
    StepKeys& keys = steps[p.record.step];
    // Begun before this start; the vote given then says when. Without one,
    // a part of a step withdrawn since may be from before the withdrawal:
    // it counts as void (the step is dropped, as for a host whose mount
    // ended before it saved its part).
    begun_[p.record.step] = keys.withdrawn > 0 ? 0 : since_;
    if (keys.committed) {
      RETURN_IF_ERROR(Record(p.record.step, *keys.committed));
      RETURN_IF_ERROR(Acknowledge(p.record.step, keys));
    } else if (auto vote = keys.votes.find(host_); vote != keys.votes.end()) {
      voted_[p.record.step] = vote->second.value;  // waiting for the others
      if (std::optional<int64_t> begun = BegunOf(vote->second.value)) {
        begun_[p.record.step] = *begun;
      }
    }
    // Otherwise this host saved its part and stopped before it voted:
    // the next round votes.
  }
  {
    nlohmann::json status = nlohmann::json::array();
    for (const PendingStep& p : pending) {
      const StepKeys& keys = steps[p.record.step];
      if (!keys.committed) {
        status.push_back(PendingStatus(p.record.step, keys.votes));
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(status);
  }
  for (const auto& [step, keys] : steps) {
    if (keys.committed || keys.votes.empty() || saved.contains(step)) {
      continue;
    }
    const std::optional<ParallelConfig> config = VotedConfig(keys.votes);
    // A step this host had to save and did not: it can no longer be.
    if (config && Voters(*config).contains(host_)) {
      RETURN_IF_ERROR(Withdraw(step).status());
    }
  }
  return absl::OkStatus();
}

absl::Status ClusterSaves::Acknowledge(int64_t step, StepKeys& keys) {
  if (keys.recorded.contains(host_)) return absl::OkStatus();
  RETURN_IF_ERROR(
      etcd_.PutValue(StepPrefix(step) + "recorded/" + host_, "").status());
  keys.recorded.insert(host_);
  return absl::OkStatus();
}

absl::Status ClusterSaves::Sweep(const std::vector<StepRecord>& recorded,
                                 const std::vector<PendingStep>& pending) {
  constexpr absl::Duration kEvery = absl::Seconds(5);
  if (options_.hosts.empty() || absl::Now() - swept_ < kEvery)
    return absl::OkStatus();
  swept_ = absl::Now();
  std::set<int64_t> here, waiting;
  for (const StepRecord& r : recorded) here.insert(r.step);
  for (const PendingStep& p : pending) waiting.insert(p.record.step);
  const int64_t newest = recorded.empty() ? -1 : recorded.back().step;
  ASSIGN_OR_RETURN(Saves read, ReadSaves());
  int64_t newest_committed = -1;
  for (const auto& [step, keys] : read.steps) {
    if (keys.committed) newest_committed = step;
  }
  for (auto& entry : read.steps) {
    const int64_t step = entry.first;
    StepKeys& keys = entry.second;
    if (!keys.committed) {
      RETURN_IF_ERROR(SweepWithdrawn(step, keys, read.revision));
      continue;
    }
    // Recorded here, or older than the newest step here and not pending:
    // a step the retention dropped, or one from before this host joined,
    // which a beat never records (Advance).
    if (!waiting.contains(step) && (here.contains(step) || step <= newest)) {
      RETURN_IF_ERROR(Acknowledge(step, keys));
    }
    const bool all = std::all_of(options_.hosts.begin(), options_.hosts.end(),
                                 [&](const std::string& h) {
                                   return keys.recorded.contains(h) ||
                                          (step < newest_committed &&
                                           options_.never_mounted &&
                                           options_.never_mounted(h));
                                 });
    if (!all) continue;
    EtcdClient::Txn txn;
    txn.conditions.push_back(
        {keys.committed->key, keys.committed->mod_revision});
    txn.delete_prefixes.push_back(StepPrefix(step));
    RETURN_IF_ERROR(etcd_.Commit(txn).status());
  }
  return absl::OkStatus();
}

absl::Status ClusterSaves::SweepWithdrawn(int64_t step, const StepKeys& keys,
                                          int64_t revision) {
  if (keys.withdrawn == 0) return absl::OkStatus();
  const std::string withdrawal = absl::StrCat(keys.withdrawn);
  // A part here that began before the withdrawal is dropped only once it
  // is pending (Advance): until then the key must stay to void it. A part
  // that begins later is listed with a later revision (NoteBegun), and is
  // a new save of the step whether the key is there or not.
  const auto begun = begun_.find(step);
  const bool void_part =
      begun != begun_.end() && begun->second < keys.withdrawn;
  const bool voted = keys.votes.contains(host_) ||
                     std::any_of(keys.void_votes.begin(), keys.void_votes.end(),
                                 [&](const EtcdClient::KeyValue& kv) {
                                   return kv.key.ends_with("/vote/" + host_);
                                 });
  const auto mine = keys.dropped.find(host_);
  if (!void_part && !voted &&
      (mine == keys.dropped.end() || mine->second != withdrawal)) {
    // (The keys go at a later sweep: this put changes them.)
    return etcd_.PutValue(StepPrefix(step) + "dropped/" + host_, withdrawal)
        .status();
  }
  if (!keys.votes.empty() || !keys.void_votes.empty()) return absl::OkStatus();
  const bool all = std::all_of(
      options_.hosts.begin(), options_.hosts.end(), [&](const std::string& h) {
        const auto done = keys.dropped.find(h);
        return (done != keys.dropped.end() && done->second == withdrawal) ||
               (options_.never_mounted && options_.never_mounted(h));
      });
  if (!all) return absl::OkStatus();
  EtcdClient::Txn txn;
  txn.unchanged.push_back({StepPrefix(step), revision});
  txn.delete_prefixes.push_back(StepPrefix(step));
  return etcd_.Commit(txn).status();
}

absl::StatusOr<int64_t> ClusterSaves::Withdraw(int64_t step) {
  EtcdClient::Txn txn;
  txn.conditions.push_back({StepPrefix(step) + "committed", 0});
  txn.delete_prefixes.push_back(StepPrefix(step) + "vote/");
  // Says when: a host that had not seen it yet may vote for its part
  // after, or mount again with it pending; a part begun before is void.
  // (The key stays until every host is done with the withdrawal, or the
  // step number is saved and committed: Sweep.)
  txn.puts.push_back({StepPrefix(step) + "withdrawn", ""});
  ASSIGN_OR_RETURN(EtcdClient::Committed done, etcd_.Commit(txn));
  return done.applied ? done.revision : 0;
}

absl::Status ClusterSaves::WithdrawRemoved() {
  for (const SaveArea::Removed& r : job_.saves().RemovedSteps()) {
    // A host that runs none of the step's saving ranks cannot hold it up:
    // its directory was all it had of the step.
    if (Voters(r.config).contains(host_)) {
      ASSIGN_OR_RETURN(const int64_t withdrawn, Withdraw(r.step));
      if (withdrawn == 0) {
        job_.ReportError(absl::StrCat(
            "step ", r.step, " was removed here after the cluster committed ",
            "it: it stays (every host had voted for it)"));
      } else {
        // This host's part, if it was pending, goes only now: before the
        // withdrawal, its vote could still have committed the step.
        ASSIGN_OR_RETURN(std::optional<PendingStep> mine,
                         job_.store().FindPending(r.step));
        if (mine) RETURN_IF_ERROR(job_.DiscardSave(r.step));
        Forget(r.step);
      }
    }
    job_.saves().ReleaseRemoved(r.step);
  }
  return absl::OkStatus();
}

absl::Status ClusterSaves::WithdrawLost(std::map<int64_t, StepKeys>& steps) {
  if (!options_.lost) return absl::OkStatus();
  for (auto& [step, keys] : steps) {
    if (keys.committed || keys.votes.empty()) continue;
    const std::optional<ParallelConfig> config = VotedConfig(keys.votes);
    if (!config) continue;
    for (const std::string& voter : Voters(*config)) {
      if (!keys.votes.contains(voter) && options_.lost(voter)) {
        RETURN_IF_ERROR(Withdraw(step).status());
        keys.votes.clear();
        break;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ClusterSaves::DeleteVoidVotes(std::map<int64_t, StepKeys>& steps) {
  for (auto& [step, keys] : steps) {
    if (keys.void_votes.empty()) continue;
    EtcdClient::Txn txn;
    for (const EtcdClient::KeyValue& kv : keys.void_votes) {
      txn.conditions.push_back({kv.key, kv.mod_revision});
      txn.deletes.push_back(kv.key);
    }
    RETURN_IF_ERROR(etcd_.Commit(txn).status());
    keys.void_votes.clear();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ClusterSaves::DataSum(int64_t step,
                                                  const ShardRecord& shard) {
  // By the blobs read: a group may be held by another shard later (a copy
  // in place of a replica that differed).
  std::map<std::string, std::string>& sums = data_sums_[step];
  const std::string key = absl::StrJoin(shard.blobs, ",");
  if (auto it = sums.find(key); it != sums.end()) return it->second;
  ASSIGN_OR_RETURN(uint64_t sum, TensorBytesSum(job_.store(), shard));
  return sums[key] = EncodeChunkSums({sum});
}

absl::StatusOr<std::string> ClusterSaves::VoteFor(const PendingStep& pending) {
  const StepRecord& record = pending.record;
  ASSIGN_OR_RETURN(ParallelConfig config, ParallelConfig::Parse(record.config));
  nlohmann::json vote = StepJson(record);
  if (auto begun = begun_.find(record.step); begun != begun_.end())
    vote["begun"] = begun->second;
  vote["held"] = record.held.value_or(std::vector<int>());
  vote["saved"] = pending.saved;
  vote["replicas"] = options_.replicas;
  // Each shard held; those saved here by the group's saver are
  // "own", for the next host to copy. Under dp > 1, where other hosts' ranks
  // may save replicas of them, with the checksum of its tensor bytes (a
  // copy is checked against its blobs' digests instead).
  nlohmann::json shards = nlohmann::json::object();
  for (const auto& [g, shard] : pending.shards) {
    std::string data;
    if (config.dp() > 1) {
      ASSIGN_OR_RETURN(data, DataSum(record.step, shard));
    }
    nlohmann::json j =
        ShardJson(job_.store(), shard, data, options_.replicas >= 2);
    if (j.is_null()) {
      return absl::DataLossError(absl::StrCat("step ", record.step, " group ",
                                              g, ": a blob has no record"));
    }
    const bool copied = std::find(pending.copied.begin(), pending.copied.end(),
                                  g) != pending.copied.end();
    j["own"] = !copied && SaverHost(config, g) == host_;
    shards[std::to_string(g)] = std::move(j);
  }
  vote["shards"] = std::move(shards);
  // The extra files saved here, for the other hosts to copy and check.
  nlohmann::json extra = nlohmann::json::object();
  for (const auto& [rank, files] : record.extra) {
    nlohmann::json list = nlohmann::json::array();
    for (const ExtraFile& f : files) {
      ASSIGN_OR_RETURN(BlobRecord blob, job_.store().Blob(f.blob));
      nlohmann::json described = BlobDescription::Of(blob).ToJson();
      described["path"] = f.path;
      list.push_back(std::move(described));
    }
    extra[std::to_string(rank)] = {{"host", host_}, {"files", list}};
  }
  vote["extra"] = extra;
  return vote.dump();
}

absl::Status ClusterSaves::Vote(const PendingStep& pending, StepKeys& keys) {
  const int64_t step = pending.record.step;
  ASSIGN_OR_RETURN(std::string value, VoteFor(pending));
  auto voted = voted_.find(step);
  if (voted != voted_.end() && voted->second == value) return absl::OkStatus();
  const std::string key = StepPrefix(step) + "vote/" + host_;
  ASSIGN_OR_RETURN(int64_t revision, etcd_.PutValue(key, value));
  keys.votes[host_] = EtcdClient::KeyValue{key, value, revision, revision, 0};
  voted_[step] = std::move(value);
  return absl::OkStatus();
}

std::vector<ClusterSaves::WantedCopy> ClusterSaves::WantedCopies(
    int64_t step, const StepKeys& keys, const PendingStep* mine) const {
  std::vector<WantedCopy> wanted;
  for (const auto& [from, kv] : keys.votes) {
    if (from == host_) continue;
    const nlohmann::json vote = nlohmann::json::parse(kv.value, nullptr, false);
    if (!vote.is_object() || vote.value("replicas", 1) < 2 ||
        !vote.value("saved", true) || !vote.contains("shards") ||
        !vote["shards"].is_object() || !vote.contains("config") ||
        !vote["config"].is_string()) {
      continue;
    }
    absl::StatusOr<ParallelConfig> config =
        ParallelConfig::Parse(vote["config"].get<std::string>());
    if (!config.ok() || NextHost(*config, from) != host_) continue;
    WantedCopy want{
        step, from, kv.key, config->ToString(), vote.value("groups", 0), {}};
    for (const auto& [group_text, j] : vote["shards"].items()) {
      int g = -1;
      if (absl::SimpleAtoi(group_text, &g) && j.is_object() &&
          j.value("own", false) && !(mine && mine->shards.contains(g))) {
        want.shards[g] = j;
      }
    }
    if (!want.shards.empty()) wanted.push_back(std::move(want));
  }
  return wanted;
}

absl::Status ClusterSaves::Copy(const WantedCopy& want) {
  PeerClient* peer = peer_of_(want.from);
  if (peer == nullptr) {
    return absl::NotFoundError(absl::StrCat("no peer ", want.from));
  }
  std::map<int, ShardRecord> shards;
  std::map<std::string, BlobRecord> blobs;
  absl::Cleanup drop = [&] {
    for (const auto& [name, record] : blobs)
      unlink(job_.store().BlobPath(name).c_str());
  };
  for (const auto& [g, j] : want.shards) {
    ShardRecord shard;
    try {
      const nlohmann::json& list = j.at("blobs");
      for (size_t b = 0; b < list.size(); ++b) {
        RemoteBlob remote;
        ASSIGN_OR_RETURN(remote.described,
                         BlobDescription::FromJson(list.at(b)));
        remote.read = [&, group = g, b](int64_t offset, int64_t length,
                                        char* out) -> absl::StatusOr<int64_t> {
          if (stopping_) return absl::CancelledError("the host is leaving");
          return peer->ReadPendingShard(want.step, group, static_cast<int>(b),
                                        offset, length, out);
        };
        ASSIGN_OR_RETURN(
            auto copy, CopyRemoteBlob(job_.store(), want.step, remote,
                                      absl::StrCat("blob ", b, " of group ", g,
                                                   " of step ", want.step,
                                                   " from host ", want.from)));
        shard.blobs.push_back(copy.first);
        blobs.insert(std::move(copy));
      }
      for (const nlohmann::json& t : j.at("tensors")) {
        shard.tensors.push_back({t.at(0).get<int>(), t.at(1).get<int64_t>()});
      }
    } catch (const std::exception&) {
      return absl::DataLossError(absl::StrCat(
          "etcd key ", want.key, " describes group ", g, " as it cannot be"));
    }
    shards[g] = std::move(shard);
  }
  RETURN_IF_ERROR(SyncDir(job_.store().blob_dir()));
  RETURN_IF_ERROR(job_.store().AddPendingCopies(want.step, want.config,
                                                want.groups, shards, blobs));
  blobs.clear();  // recorded: kept
  return absl::OkStatus();
}

void ClusterSaves::StartCopies(std::vector<WantedCopy> wanted) {
  if (copier_.joinable()) copier_.join();  // done: copying_ was false
  copying_ = true;
  copier_ = std::thread([this, wanted = std::move(wanted)] {
    std::string error;
    for (const WantedCopy& want : wanted) {
      if (absl::Status s = Copy(want); !s.ok()) {
        error = absl::StrCat("the extra replica of step ", want.step,
                             " is not made yet: ", s.message());
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      copy_error_ = std::move(error);
    }
    copying_ = false;
    if (options_.on_copied) options_.on_copied();
  });
}

ClusterSaves::~ClusterSaves() {
  stopping_ = true;
  if (copier_.joinable()) copier_.join();
}

absl::StatusOr<bool> ClusterSaves::DropDifferingReplicas(
    const PendingStep& mine, const StepKeys& keys) {
  const int64_t step = mine.record.step;
  ASSIGN_OR_RETURN(ParallelConfig config,
                   ParallelConfig::Parse(mine.record.config));
  bool dropped = false;
  for (const auto& [g, shard] : mine.shards) {
    const std::string saver = SaverHost(config, g);
    if (saver == host_) continue;
    auto vote = keys.votes.find(saver);
    if (vote == keys.votes.end()) continue;
    const nlohmann::json j =
        nlohmann::json::parse(vote->second.value, nullptr, false);
    const std::string theirs =
        j.is_object() && j.contains("shards") && j["shards"].is_object()
            ? j["shards"]
                  .value(std::to_string(g), nlohmann::json::object())
                  .value("data", "")
            : "";
    ASSIGN_OR_RETURN(std::string ours, DataSum(step, shard));
    if (theirs.empty() || theirs == ours) continue;
    RETURN_IF_ERROR(job_.store().DropPendingGroup(step, g));
    dropped = true;
    const std::string why = absl::StrFormat(
        "step %d: the replica of rank-%05d/model.safetensors saved on host %s "
        "differs from the one host %s saved (a data-parallel copy must be "
        "identical); host %s keeps none of it",
        step, config.SaverOfGroup(g), host_, saver, host_);
    job_.ReportError(why);
    std::lock_guard<std::mutex> lock(mu_);
    refused_.push_back(why);
    if (refused_.size() > kRefusalsKept) refused_.erase(refused_.begin());
  }
  return dropped;
}

void ClusterSaves::Forget(int64_t step) {
  voted_.erase(step);
  data_sums_.erase(step);
  begun_.erase(step);
}

absl::StatusOr<bool> ClusterSaves::TryCommit(int64_t step, StepKeys& keys) {
  std::optional<StepRecord> agreed;
  nlohmann::json extra = nlohmann::json::object();
  nlohmann::json holds = nlohmann::json::object();
  std::map<std::string, nlohmann::json> votes;  // parsed, by host
  for (const auto& [host, kv] : keys.votes) {
    ASSIGN_OR_RETURN(StepRecord vote, StepFromJson(step, kv.value, kv.key));
    const nlohmann::json j = nlohmann::json::parse(kv.value, nullptr, false);
    if (j.contains("extra") && j["extra"].is_object()) {
      for (const auto& [rank, files] : j["extra"].items()) extra[rank] = files;
    }
    if (j.contains("held")) holds[host] = j["held"];
    if (!agreed) {
      agreed = vote;
      agreed->bytes = 0;
      agreed->consumed_samples.reset();
    } else if (vote.config != agreed->config) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step, " was saved under ", agreed->config,
                       " on one host and under ", vote.config, " on host ",
                       host, ": it cannot commit"));
    }
    agreed->bytes += vote.bytes;
    if (vote.consumed_samples) agreed->consumed_samples = vote.consumed_samples;
    votes[host] = j;
  }
  ASSIGN_OR_RETURN(ParallelConfig config,
                   ParallelConfig::Parse(agreed->config));
  // A shard held on several hosts must have the same tensor bytes on each.
  std::map<std::string, std::pair<std::string, std::string>> sums;  // group
  for (const auto& [host, j] : votes) {
    if (!j.contains("shards") || !j["shards"].is_object()) continue;
    for (const auto& [group, shard] : j["shards"].items()) {
      const std::string data = shard.is_object() ? shard.value("data", "") : "";
      auto [seen, first] = sums.try_emplace(group, host, data);
      if (!first && !data.empty() && !seen->second.second.empty() &&
          data != seen->second.second) {
        return absl::FailedPreconditionError(absl::StrCat(
            "step ", step, ": group ", group, " saved on host ", host,
            " differs from the one on host ", seen->second.first,
            " (a data-parallel copy must be identical): it waits for the "
            "replica's host to drop its copy"));
      }
    }
  }
  for (const std::string& voter : Voters(config)) {
    auto vote = votes.find(voter);
    if (vote == votes.end() || !vote->second.value("saved", true))
      return false;  // not yet
  }
  // Each host's own shards held by the next host too, when it asked.
  for (const auto& [host, j] : votes) {
    const std::string next = NextHost(config, host);
    if (j.value("replicas", 1) < 2 || next.empty() || !j.contains("shards") ||
        !j["shards"].is_object()) {
      continue;
    }
    for (const auto& [group, shard] : j["shards"].items()) {
      if (!shard.is_object() || !shard.value("own", false)) continue;
      auto kept = votes.find(next);
      if (kept == votes.end() || !kept->second.contains("shards") ||
          !kept->second["shards"].contains(group)) {
        // Not made yet; or never, the next host being gone: the step then
        // commits with the copies the live hosts hold.
        if (options_.live && !options_.live(next)) continue;
        return false;
      }
    }
  }
  EtcdClient::Txn txn;
  const std::string committed = StepPrefix(step) + "committed";
  txn.conditions.push_back({committed, 0});
  for (const auto& [host, kv] : keys.votes)
    txn.conditions.push_back({kv.key, kv.mod_revision});
  nlohmann::json value = StepJson(*agreed);
  value["extra"] = std::move(extra);
  value["holds"] = std::move(holds);
  txn.puts.push_back({committed, value.dump()});
  txn.delete_prefixes.push_back(StepPrefix(step) + "vote/");
  ASSIGN_OR_RETURN(EtcdClient::Committed done, etcd_.Commit(txn));
  if (!done.applied) return false;  // another host did, or one withdrew
  keys.committed = EtcdClient::KeyValue{committed, value.dump(), done.revision,
                                        done.revision, 0};
  keys.votes.clear();
  return true;
}

absl::Status ClusterSaves::Advance() {
  // First: a step begun again here after its removal is listed below with
  // a revision after the withdrawal, so it is not void.
  RETURN_IF_ERROR(WithdrawRemoved());
  // Listed before etcd is read: the read's revision is then no earlier than
  // the beginning of any step first seen here.
  const std::vector<SaveNode> saving = job_.saves().Steps();
  ASSIGN_OR_RETURN(std::vector<PendingStep> pending,
                   job_.store().PendingSteps());
  // What this round may act on: steps pending here, and steps from the
  // newest one recorded here on (committed since, or being saved). Older
  // ones were recorded, dropped, or committed before this host joined.
  ASSIGN_OR_RETURN(std::vector<StepRecord> recorded, job_.store().Steps());
  const int64_t newest = recorded.empty() ? -1 : recorded.back().step;
  int64_t from = std::max<int64_t>(newest, 0);
  for (const PendingStep& p : pending) from = std::min(from, p.record.step);
  ASSIGN_OR_RETURN(Saves read, ReadSaves(from));
  NoteBegun(saving, pending, read.revision);
  std::map<int64_t, StepKeys>& steps = read.steps;
  // Extra replicas are copied on their own thread, so that the beat (and
  // the lease it renews) never waits for the bytes; the round after they
  // are in votes for them.
  if (!copying_) {
    std::string error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      error = std::exchange(copy_error_, "");
    }
    if (!error.empty()) job_.ReportError(error);
    // Read again now that no copy runs: the last one's are in.
    ASSIGN_OR_RETURN(pending, job_.store().PendingSteps());
    std::map<int64_t, const PendingStep*> held;
    for (const PendingStep& p : pending) held[p.record.step] = &p;
    std::vector<WantedCopy> wanted;
    for (const auto& [step, keys] : steps) {
      if (keys.committed || keys.votes.empty()) continue;
      auto mine = held.find(step);
      for (WantedCopy& want : WantedCopies(
               step, keys, mine == held.end() ? nullptr : mine->second)) {
        wanted.push_back(std::move(want));
      }
    }
    if (!wanted.empty()) StartCopies(std::move(wanted));
  }
  std::set<int64_t> mine;
  for (const PendingStep& p : pending) {
    const int64_t step = p.record.step;
    mine.insert(step);
    StepKeys& keys = steps[step];
    if (keys.committed) continue;  // recorded below
    // Withdrawn: a host that had to save the step stopped before it did.
    // (Copies of other hosts' shards are made only from their votes: with
    // none left, the step is gone too.)
    const bool others_voted =
        keys.votes.size() > (keys.votes.contains(host_) ? 1u : 0u);
    // Or withdrawn after this host's part began: the part is void.
    const auto begun = begun_.find(step);
    const bool void_part = keys.withdrawn > 0 && begun != begun_.end() &&
                           begun->second < keys.withdrawn;
    if ((voted_.contains(step) && !keys.votes.contains(host_)) ||
        (!p.saved && !others_voted && !copying_) || void_part) {
      RETURN_IF_ERROR(job_.DiscardSave(step));
      Forget(step);
      mine.erase(step);
      continue;
    }
    ASSIGN_OR_RETURN(bool dropped, DropDifferingReplicas(p, keys));
    if (dropped) {
      ASSIGN_OR_RETURN(std::optional<PendingStep> now,
                       job_.store().FindPending(step));
      if (now) RETURN_IF_ERROR(Vote(*now, keys));
    } else {
      RETURN_IF_ERROR(Vote(p, keys));
    }
  }
  std::set<int64_t> saved;
  for (const PendingStep& p : pending) {
    if (p.saved) saved.insert(p.record.step);
  }
  RETURN_IF_ERROR(WithdrawAbandoned(steps, saved));
  RETURN_IF_ERROR(WithdrawLost(steps));
  RETURN_IF_ERROR(DeleteVoidVotes(steps));
  for (auto& [step, keys] : steps) {
    if (!keys.committed && !keys.votes.empty()) {
      absl::StatusOr<bool> committed = TryCommit(step, keys);
      if (!committed.ok()) job_.ReportError(committed.status().message());
    }
  }
  // Committed steps this host has pending, or has not recorded and that
  // are newer than every step it had (an older one is one the retention
  // dropped, or one from before this host joined).
  nlohmann::json status = nlohmann::json::array();
  std::vector<HostHolding> holdings;
  for (auto& [step, keys] : steps) {
    if (keys.committed) {
      const nlohmann::json j =
          nlohmann::json::parse(keys.committed->value, nullptr, false);
      if (j.is_object() && j.contains("holds") && j["holds"].is_object() &&
          j.contains("config") && j["config"].is_string()) {
        for (const auto& [host, groups] : j["holds"].items()) {
          if (!groups.is_array()) continue;
          HostHolding h{host, step, j["config"].get<std::string>(),
                        std::vector<int>()};
          for (const nlohmann::json& g : groups) {
            if (g.is_number_integer()) h.groups->push_back(g.get<int>());
          }
          holdings.push_back(std::move(h));
        }
      }
    }
    if (keys.committed && (mine.contains(step) || step > newest)) {
      RETURN_IF_ERROR(Record(step, *keys.committed));
      RETURN_IF_ERROR(Acknowledge(step, keys));
      Forget(step);
    }
    if (!keys.committed && (!keys.votes.empty() || mine.contains(step))) {
      status.push_back(PendingStatus(step, keys.votes));
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(status);
    committed_holdings_ = std::move(holdings);
  }
  return Sweep(recorded, pending);
}

std::vector<HostHolding> ClusterSaves::CommittedHoldings() const {
  std::lock_guard<std::mutex> lock(mu_);
  return committed_holdings_;
}

absl::Status ClusterSaves::Record(int64_t step,
                                  const EtcdClient::KeyValue& committed) {
  ASSIGN_OR_RETURN(StepRecord agreed,
                   StepFromJson(step, committed.value, committed.key));
  const nlohmann::json j =
      nlohmann::json::parse(committed.value, nullptr, false);
  std::map<std::string, BlobRecord> copied;
  // Copies not recorded (a peer failed midway) go; the next round tries
  // again.
  bool recorded = false;
  absl::Cleanup drop = [&] {
    if (recorded) return;
    for (const auto& [blob, record] : copied)
      unlink(job_.store().BlobPath(blob).c_str());
  };
  if (j.contains("extra") && j["extra"].is_object()) {
    for (const auto& [rank_text, saved] : j["extra"].items()) {
      int rank = -1;
      const std::string from = saved.value("host", "");
      if (from == host_) continue;  // saved here: in the pending part
      PeerClient* peer = peer_of_(from);
      if (!absl::SimpleAtoi(rank_text, &rank) || peer == nullptr ||
          !saved.contains("files") || !saved["files"].is_array()) {
        return absl::DataLossError(
            absl::StrCat("etcd key ", committed.key,
                         " names extra files it cannot: ", saved.dump()));
      }
      for (const nlohmann::json& f : saved["files"]) {
        RemoteExtra extra;
        extra.step = step;
        extra.rank = rank;
        try {
          extra.path = f.at("path").get<std::string>();
          ASSIGN_OR_RETURN(extra.described, BlobDescription::FromJson(f));
        } catch (const std::exception&) {
          return absl::DataLossError(
              absl::StrCat("etcd key ", committed.key,
                           " holds a bad extra file: ", f.dump()));
        }
        ASSIGN_OR_RETURN(CopiedExtra copy,
                         CopyExtraFile(job_.store(), *peer, extra));
        agreed.extra[rank].push_back(copy.file);
        copied[copy.file.blob] = copy.record;
      }
    }
  }
  if (!copied.empty()) RETURN_IF_ERROR(SyncDir(job_.store().blob_dir()));
  RETURN_IF_ERROR(job_.CommitAgreedStep(agreed, copied));
  recorded = true;
  return absl::OkStatus();
}

nlohmann::json ClusterSaves::ReplicasRefused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

nlohmann::json ClusterSaves::Status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

}  // namespace scalai
