// The datasets of a cluster's hosts must be the same data (a shared file
// system, or copies): at each mount, CompareDatasets puts each dataset this
// host registered under /scalai/JOB/datasets/NAME unless a host did first
// (one etcd transaction), and compares it with what is there: format,
// samples, global batch, seed, epochs and the XXH3 of the source files'
// bytes. A dataset whose copy here differs is withheld from this host's
// views (Store::WithholdDataset) and returned with the reason, naming both,
// unless no other host is live: then this copy becomes the cluster's (a
// dataset registered again with other content, every host unmounted).
//
//   ASSIGN_OR_RETURN(auto refused, CompareDatasets(store, etcd, key, "h1"));
#ifndef SCALAI_FS_CLUSTER_DATASETS_H_
#define SCALAI_FS_CLUSTER_DATASETS_H_

#include <functional>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "transfer/etcd_client.h"
#include "transfer/store.h"

namespace scalai {

// The datasets refused here, by name, with why.
absl::StatusOr<std::map<std::string, std::string>> CompareDatasets(
    Store& store, EtcdClient& etcd,
    const std::function<std::string(const std::string&)>& key,
    const std::string& host);

}  // namespace scalai

#endif  // SCALAI_FS_CLUSTER_DATASETS_H_
