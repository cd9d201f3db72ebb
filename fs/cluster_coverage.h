// Whether the live hosts of a cluster hold every byte a config needs: a
// config that leaves out a failed host is accepted when data-parallel
// replicas on the others cover its shards, and refused otherwise, naming the
// first tensor and rank that no live host holds.
//
//   std::vector<HostHolding> live = {{"h0", step, "tp=2,pp=1,dp=2,hosts=h0+h1",
//                                     std::vector<int>{0, 1}}};
//   RETURN_IF_ERROR(CheckCoverage(store, config, live));
#ifndef SCALAI_FS_CLUSTER_COVERAGE_H_
#define SCALAI_FS_CLUSTER_COVERAGE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "ptc/parallel_config.h"
#include "transfer/store.h"

namespace scalai {

// Shards one host holds of one step: the groups of `config` (all when
// unset), as stored or retained.
struct HostHolding {
  std::string host;
  int64_t step = 0;
  std::string config;
  std::optional<std::vector<int>> groups;
};

// What `store` holds, as the HostHoldings of host `host`.
absl::StatusOr<std::vector<HostHolding>> HoldingsOf(const Store& store,
                                                    const std::string& host);
// The same as JSON (for etcd) and back; entries that do not parse are
// skipped (a host that published none holds nothing the check counts).
nlohmann::json HoldingsToJson(const std::vector<HostHolding>& holdings);
std::vector<HostHolding> HoldingsFromJson(const std::string& host,
                                          const nlohmann::json& j);

// Every step of `store` seen under `config` must be covered by `holdings`
// together; else kFailedPrecondition naming the step, tensor and rank.
absl::Status CheckCoverage(const Store& store, const ParallelConfig& config,
                           const std::vector<HostHolding>& holdings);

}  // namespace scalai

#endif  // SCALAI_FS_CLUSTER_COVERAGE_H_
