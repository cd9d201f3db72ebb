#include "fs/cluster_datasets.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

// What the hosts compare of a dataset; `by` names the host that put it.
nlohmann::json Fingerprint(const DatasetRecord& d, const std::string& host) {
  nlohmann::json j = {{"format", d.format},
                      {"samples", d.samples},
                      {"global_batch", d.global_batch},
                      {"seed", d.seed},
                      {"epochs", d.epochs},
                      {"content", nullptr},
                      {"by", host}};
  if (d.content_xxh3) j["content"] = absl::StrFormat("%016x", *d.content_xxh3);
  return j;
}

// How `mine` differs from the cluster's `theirs`, or "" when it does not.
// A content sum either side lacks (a record from before it was kept) is
// not compared.
std::string Difference(const nlohmann::json& mine,
                       const nlohmann::json& theirs) {
  for (const char* field :
       {"format", "samples", "global_batch", "seed", "epochs", "content"}) {
    if (!theirs.contains(field)) continue;
    if (std::string(field) == "content" &&
        (mine[field].is_null() || theirs[field].is_null())) {
      continue;
    }
    if (mine[field] != theirs[field]) {
      return absl::StrCat(field, " ", mine[field].dump(), " here, ",
                          theirs[field].dump(), " on host ",
                          theirs.value("by", std::string("?")));
    }
  }
  return "";
}

// Why this host may not serve dataset `name` (fingerprint `mine`), or
// nothing when it may. Every outcome is decided by a transaction
// conditional on the key as read, so two hosts mounting at once cannot
// both win: the one that agrees with the cluster's copy rewrites it
// unchanged, and the one that replaces it does so only while no other
// host is live (a re-registration: every host was unmounted first).
absl::StatusOr<std::optional<std::string>> CompareDataset(
    EtcdClient& etcd, const std::string& k, const std::string& members,
    const std::string& name, const nlohmann::json& mine,
    const std::string& host) {
  constexpr int kTries = 8;  // each lost race means another host decided
  for (int attempt = 0; attempt < kTries; ++attempt) {
    EtcdClient::Txn first;
    first.conditions.push_back({k, 0});
    first.puts.push_back({k, mine.dump()});
    ASSIGN_OR_RETURN(EtcdClient::Committed put, etcd.Commit(first));
    if (put.applied) return std::nullopt;  // this host registered it
    ASSIGN_OR_RETURN(std::optional<EtcdClient::KeyValue> kv, etcd.Get(k));
    if (!kv) continue;  // deleted meanwhile
    const nlohmann::json theirs =
        nlohmann::json::parse(kv->value, nullptr, false);
    const std::string differs =
        theirs.is_object() ? Difference(mine, theirs)
                           : absl::StrCat("etcd key ", k, " holds ", kv->value);
    EtcdClient::Txn decide;
    decide.conditions.push_back({k, kv->mod_revision});
    if (differs.empty()) {
      decide.puts.push_back({k, kv->value});
    } else {
      ASSIGN_OR_RETURN(EtcdClient::Snapshot live, etcd.ListPrefix(members));
      std::vector<std::string> others;
      for (const EtcdClient::KeyValue& m : live.kvs) {
        const std::string other = m.key.substr(members.size());
        if (other != host) others.push_back(other);
      }
      if (!others.empty()) {
        return absl::StrCat("dataset ", name, " differs from the cluster's (",
                            differs, "): this host does not serve it (to ",
                            "replace the cluster's copy, unmount every host, ",
                            "then mount this one first; live now: ",
                            absl::StrJoin(others, ", "), ")");
      }
      decide.puts.push_back({k, mine.dump()});
    }
    ASSIGN_OR_RETURN(EtcdClient::Committed done, etcd.Commit(decide));
    if (done.applied) return std::nullopt;
  }
  return absl::UnavailableError(absl::StrCat("dataset ", name, ": etcd key ", k,
                                             " kept changing over ", kTries,
                                             " reads"));
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> CompareDatasets(
    Store& store, EtcdClient& etcd,
    const std::function<std::string(const std::string&)>& key,
    const std::string& host) {
  ASSIGN_OR_RETURN(auto datasets, store.Datasets());
  std::map<std::string, std::string> refused;
  for (const auto& [name, record] : datasets) {
    ASSIGN_OR_RETURN(
        std::optional<std::string> reason,
        CompareDataset(etcd, key("datasets/" + name), key("members/"), name,
                       Fingerprint(record, host), host));
    if (!reason) continue;
    store.WithholdDataset(name, *reason);
    refused[name] = *std::move(reason);
  }
  return refused;
}

}  // namespace scalai
