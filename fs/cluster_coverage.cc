#include "fs/cluster_coverage.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ptc/reshard_plan.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::StatusOr<std::vector<HostHolding>> HoldingsOf(const Store& store,
                                                    const std::string& host) {
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store.Steps());
  std::vector<HostHolding> out;
  for (const StepRecord& s : steps) {
    out.push_back({host, s.step, s.config, s.held});
    for (const RetainedShards& kept : s.retained) {
      std::vector<int> groups;
      for (const auto& [g, shard] : kept.groups) groups.push_back(g);
      out.push_back({host, s.step, kept.config, std::move(groups)});
    }
  }
  return out;
}

nlohmann::json HoldingsToJson(const std::vector<HostHolding>& holdings) {
  nlohmann::json j = nlohmann::json::array();
  for (const HostHolding& h : holdings) {
    j.push_back({{"step", h.step},
                 {"config", h.config},
                 {"groups", h.groups ? nlohmann::json(*h.groups)
                                     : nlohmann::json(nullptr)}});
  }
  return j;
}

std::vector<HostHolding> HoldingsFromJson(const std::string& host,
                                          const nlohmann::json& j) {
  std::vector<HostHolding> out;
  if (!j.is_array()) return out;
  for (const nlohmann::json& e : j) {
    try {
      HostHolding h{host, e.at("step").get<int64_t>(),
                    e.at("config").get<std::string>(), std::nullopt};
      if (!e.at("groups").is_null())
        h.groups = e.at("groups").get<std::vector<int>>();
      out.push_back(std::move(h));
    } catch (const std::exception&) {
      continue;
    }
  }
  return out;
}

namespace {

// Merges [begin, end) ranges and returns the first byte of [0, size) none
// covers, or size.
int64_t FirstGap(std::vector<std::pair<int64_t, int64_t>> ranges,
                 int64_t size) {
  std::sort(ranges.begin(), ranges.end());
  int64_t covered = 0;
  for (const auto& [b, e] : ranges) {
    if (b > covered) break;
    covered = std::max(covered, e);
  }
  return std::min(covered, size);
}

}  // namespace

absl::Status CheckCoverage(const Store& store, const ParallelConfig& config,
                           const std::vector<HostHolding>& holdings) {
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store.Steps());
  ASSIGN_OR_RETURN(Placement target,
                   Placement::Create(store.layout(), store.model(), config));
  auto to = std::make_shared<const Placement>(std::move(target));
  for (const StepRecord& step : steps) {
    // Most often the hosts together hold every group of one config (the
    // cluster's, or any config without hosts): the step is whole, and no
    // plan is needed.
    std::map<std::string, std::set<int>> groups_of;
    bool whole = false;
    for (const HostHolding& h : holdings) {
      if (h.step != step.step || whole) continue;
      if (!h.groups) {
        whole = true;
        continue;
      }
      absl::StatusOr<ParallelConfig> c = ParallelConfig::Parse(h.config);
      if (!c.ok()) continue;
      std::set<int>& held = groups_of[h.config];
      for (int g : *h.groups) {
        if (g >= 0 && g < c->num_shard_groups()) held.insert(g);
      }
      whole = static_cast<int>(held.size()) == c->num_shard_groups();
    }
    if (whole) continue;
    // Per destination shard, the byte ranges some live host holds.
    std::map<std::pair<int, int>, std::vector<std::pair<int64_t, int64_t>>>
        held;
    for (const HostHolding& h : holdings) {
      if (h.step != step.step) continue;
      StepRecord as_held;
      as_held.step = h.step;
      as_held.config = h.config;
      absl::StatusOr<std::shared_ptr<const Placement>> from =
          store.StepPlacement(as_held);
      if (!from.ok()) continue;  // a config this store cannot read
      ASSIGN_OR_RETURN(ReshardPlan plan,
                       ReshardPlan::Create(*from, to, h.groups));
      auto holds = [&](int group) {
        return !h.groups ||
               std::binary_search(h.groups->begin(), h.groups->end(), group);
      };
      for (int g = 0; g < to->num_groups(); ++g) {
        for (size_t k = 0; k < to->shards(g).size(); ++k) {
          ASSIGN_OR_RETURN(
              std::vector<Segment> segments,
              plan.Resolve(g, static_cast<int>(k), 0, to->shards(g)[k].bytes));
          auto& ranges = held[{g, static_cast<int>(k)}];
          for (const Segment& seg : segments) {
            if (!seg.src.valid() || holds(seg.src.group)) {
              ranges.push_back({seg.dst_offset, seg.dst_offset + seg.length});
            }
          }
        }
      }
    }
    for (int g = 0; g < to->num_groups(); ++g) {
      for (size_t k = 0; k < to->shards(g).size(); ++k) {
        const TensorShard& shard = to->shards(g)[k];
        const int64_t gap =
            FirstGap(held[{g, static_cast<int>(k)}], shard.bytes);
        if (gap == shard.bytes) continue;
        int rank = 0;
        while (config.ShardGroup(rank) != g) ++rank;
        return absl::FailedPreconditionError(absl::StrCat(
            "no live host holds ", shard.local_name, " of rank ", rank,
            " (step ", step.step, ", from byte ", gap,
            "): a host that held it is gone and no data-parallel replica is "
            "left"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace scalai
