// A host that joins a running cluster with an empty store fills it from the
// cluster: the job's layout from etcd, and the newest step's shards (the
// ranks with dp_rank 0 under the cluster's config) read from a live peer's
// mount and imported as files are, so every check of an import applies to
// them. The bytes cross the network once, counted by the peer that served
// them. Files saved under extra/ are not taken.
//
//   if (StoreIsEmpty(dir)) RETURN_IF_ERROR(FillStoreFromCluster(cluster, "h3", dir));
//   ASSIGN_OR_RETURN(auto store, Store::Open(dir));
#ifndef SCALAI_FS_CLUSTER_JOIN_H_
#define SCALAI_FS_CLUSTER_JOIN_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transfer/cluster_file.h"

namespace scalai {

// Whether `dir` is an existing directory with nothing in it.
absl::StatusOr<bool> StoreIsEmpty(const std::string& dir);

absl::Status FillStoreFromCluster(const ClusterFile& cluster,
                                  const std::string& host,
                                  const std::string& store_dir);

}  // namespace scalai

#endif  // SCALAI_FS_CLUSTER_JOIN_H_
