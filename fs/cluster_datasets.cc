#include "fs/cluster_datasets.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> CompareDatasets(
    Store& store, EtcdClient& etcd,
    const std::function<std::string(const std::string&)>& key,
    const std::string& host) {
  ASSIGN_OR_RETURN(auto datasets, store.Datasets());
  std::map<std::string, std::string> refused;
  for (const auto& [name, record] : datasets) {
    const std::string k = key("datasets/" + name);
    const nlohmann::json mine = Fingerprint(record, host);
    EtcdClient::Txn first;
    first.conditions.push_back({k, 0});
    first.puts.push_back({k, mine.dump()});
    ASSIGN_OR_RETURN(EtcdClient::Committed put, etcd.Commit(first));
    if (put.applied) continue;  // this host registered it for the cluster
    ASSIGN_OR_RETURN(std::optional<EtcdClient::KeyValue> kv, etcd.Get(k));
    if (!kv) continue;
    const nlohmann::json theirs =
        nlohmann::json::parse(kv->value, nullptr, false);
    std::string differs =
        theirs.is_object() ? Difference(mine, theirs)
                           : absl::StrCat("etcd key ", k, " holds ", kv->value);
    if (differs.empty()) continue;
    std::string reason =
        absl::StrCat("dataset ", name, " differs from the cluster's (", differs,
                     "): this host does not serve it");
    store.WithholdDataset(name, reason);
    refused[name] = std::move(reason);
  }
  return refused;
}

}  // namespace scalai
