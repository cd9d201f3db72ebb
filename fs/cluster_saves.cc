#include "fs/cluster_saves.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/extra_copy.h"
#include "transfer/files.h"

namespace scalai {
namespace {

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

}  // namespace

ClusterSaves::ClusterSaves(Job& job, EtcdClient& etcd, std::string host,
                           KeyOf key, PeerOf peer_of)
    : job_(job),
      etcd_(etcd),
      host_(std::move(host)),
      key_(std::move(key)),
      peer_of_(std::move(peer_of)) {}

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
      if (config.Coords(r).dp_rank == 0) {
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

absl::StatusOr<std::map<int64_t, ClusterSaves::StepKeys>>
ClusterSaves::ReadSaves() {
  const std::string prefix = key_("saves/");
  ASSIGN_OR_RETURN(EtcdClient::Snapshot snapshot, etcd_.GetPrefix(prefix));
  std::map<int64_t, StepKeys> steps;
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
    }
  }
  return steps;
}

absl::Status ClusterSaves::Reconcile() {
  ASSIGN_OR_RETURN(std::vector<PendingStep> pending,
                   job_.store().PendingSteps());
  ASSIGN_OR_RETURN(auto steps, ReadSaves());
  std::set<int64_t> mine;
  for (const PendingStep& p : pending) {
    mine.insert(p.record.step);
    StepKeys& keys = steps[p.record.step];
    if (keys.committed) {
      RETURN_IF_ERROR(Record(p.record.step, *keys.committed));
    } else if (keys.votes.contains(host_)) {
      voted_.insert(p.record.step);  // still waiting for the others
    }
    // Otherwise this host saved its part and stopped before it voted:
    // the next round votes.
  }
  for (const auto& [step, keys] : steps) {
    if (keys.committed || keys.votes.empty() || mine.contains(step) ||
        keys.votes.contains(host_)) {
      continue;
    }
    absl::StatusOr<StepRecord> voted = StepFromJson(
        step, keys.votes.begin()->second.value, keys.votes.begin()->first);
    if (!voted.ok()) continue;
    absl::StatusOr<ParallelConfig> config =
        ParallelConfig::Parse(voted->config);
    // A step this host had to save and did not: it can no longer be.
    if (config.ok() && Voters(*config).contains(host_)) {
      RETURN_IF_ERROR(Withdraw(step));
    }
  }
  return absl::OkStatus();
}

absl::Status ClusterSaves::Withdraw(int64_t step) {
  EtcdClient::Txn txn;
  txn.conditions.push_back({StepPrefix(step) + "committed", 0});
  txn.delete_prefixes.push_back(StepPrefix(step) + "vote/");
  return etcd_.Commit(txn).status();
}

absl::Status ClusterSaves::Vote(const PendingStep& pending, StepKeys& keys) {
  nlohmann::json vote = StepJson(pending.record);
  vote["held"] = pending.record.held.value_or(std::vector<int>());
  // The extra files saved here, for the other hosts to copy and check.
  nlohmann::json extra = nlohmann::json::object();
  for (const auto& [rank, files] : pending.record.extra) {
    nlohmann::json list = nlohmann::json::array();
    for (const ExtraFile& f : files) {
      ASSIGN_OR_RETURN(BlobRecord blob, job_.store().Blob(f.blob));
      list.push_back({{"path", f.path},
                      {"size", f.size},
                      {"sums", EncodeChunkSums(blob.chunks)}});
    }
    extra[std::to_string(rank)] = {{"host", host_}, {"files", list}};
  }
  vote["extra"] = extra;
  const std::string key = StepPrefix(pending.record.step) + "vote/" + host_;
  const std::string value = vote.dump();
  ASSIGN_OR_RETURN(int64_t revision, etcd_.PutValue(key, value));
  keys.votes[host_] = EtcdClient::KeyValue{key, value, revision, revision, 0};
  voted_.insert(pending.record.step);
  return absl::OkStatus();
}

absl::StatusOr<bool> ClusterSaves::TryCommit(int64_t step, StepKeys& keys) {
  std::optional<StepRecord> agreed;
  nlohmann::json extra = nlohmann::json::object();
  nlohmann::json holds = nlohmann::json::object();
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
  }
  ASSIGN_OR_RETURN(ParallelConfig config,
                   ParallelConfig::Parse(agreed->config));
  for (const std::string& voter : Voters(config)) {
    if (!keys.votes.contains(voter)) return false;  // not yet
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
  ASSIGN_OR_RETURN(std::vector<PendingStep> pending,
                   job_.store().PendingSteps());
  ASSIGN_OR_RETURN(auto steps, ReadSaves());
  std::set<int64_t> mine;
  for (const PendingStep& p : pending) {
    const int64_t step = p.record.step;
    mine.insert(step);
    StepKeys& keys = steps[step];
    if (keys.committed) continue;  // recorded below
    if (!voted_.contains(step)) {
      RETURN_IF_ERROR(Vote(p, keys));
    } else if (!keys.votes.contains(host_)) {
      // Withdrawn: a host that had to save the step stopped before it did.
      RETURN_IF_ERROR(job_.DiscardSave(step));
      voted_.erase(step);
      mine.erase(step);
    }
  }
  for (auto& [step, keys] : steps) {
    if (!keys.committed && !keys.votes.empty()) {
      absl::StatusOr<bool> committed = TryCommit(step, keys);
      if (!committed.ok()) job_.ReportError(committed.status().message());
    }
  }
  // Committed steps this host has pending, or has not recorded and that
  // are newer than every step it has (an older one is one the retention
  // dropped, or one from before this host joined).
  ASSIGN_OR_RETURN(std::vector<StepRecord> recorded, job_.store().Steps());
  const int64_t newest = recorded.empty() ? -1 : recorded.back().step;
  nlohmann::json status = nlohmann::json::array();
  std::vector<HostHolding> holdings;
  for (const auto& [step, keys] : steps) {
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
      voted_.erase(step);
    }
    if (!keys.committed && !keys.votes.empty()) {
      nlohmann::json voted = nlohmann::json::array();
      for (const auto& [host, kv] : keys.votes) voted.push_back(host);
      status.push_back({{"step", step}, {"voted", voted}});
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  status_ = std::move(status);
  committed_holdings_ = std::move(holdings);
  return absl::OkStatus();
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
          extra.size = f.at("size").get<int64_t>();
          ASSIGN_OR_RETURN(extra.sums,
                           DecodeChunkSums(f.at("sums").get<std::string>()));
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

nlohmann::json ClusterSaves::Status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

}  // namespace scalai
