// `scalai plan`: how many bytes each rank keeps and fetches when a job moves
// from one parallel config to another, and what materialization must write.
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/parallel_config.h"
#include "ptc/placement.h"
#include "ptc/reshard_plan.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/human_bytes.h"
#include "tools/model_options.h"
#include "transfer/store.h"

namespace scalai {
namespace {

struct PlanOptions {
  std::string store;
  ModelOptions model;
  std::string from;
  std::string to;
  bool json = false;
};

absl::StatusOr<std::shared_ptr<const Placement>> Place(
    const LoadedModel& m, const std::string& text) {
  ASSIGN_OR_RETURN(ParallelConfig config, ParallelConfig::Parse(text));
  ASSIGN_OR_RETURN(Placement p, Placement::Create(m.layout, m.model, config));
  return std::make_shared<const Placement>(std::move(p));
}

void PrintJson(const ReshardPlan& plan, const PlanSummary& s) {
  nlohmann::json j = {
      {"from", plan.from().config().ToString()},
      {"to", plan.to().config().ToString()},
      {"bytes_total", s.bytes_total},
      {"bytes_kept", s.bytes_kept},
      {"bytes_fetched", s.bytes_fetched},
      {"bytes_to_write", s.bytes_to_write},
      {"ranks", nlohmann::json::array()},
  };
  for (const RankTraffic& r : s.ranks) {
    j["ranks"].push_back({{"rank", r.rank},
                          {"bytes_total", r.bytes_total},
                          {"bytes_kept", r.bytes_kept},
                          {"bytes_fetched", r.bytes_fetched}});
  }
  std::printf("%s\n", j.dump(2).c_str());
}

void PrintTable(const LoadedModel& m, const ReshardPlan& plan,
                const PlanSummary& s) {
  const ParallelConfig& from = plan.from().config();
  const ParallelConfig& to = plan.to().config();
  std::printf("plan %s: %s -> %s (world %d -> %d)\n", m.layout.name().c_str(),
              from.ToString().c_str(), to.ToString().c_str(), from.world_size(),
              to.world_size());
  std::printf("model: %d tensors, %lld layers, %s\n", m.model->size(),
              static_cast<long long>(plan.to().num_layers()),
              HumanBytes(m.model->total_bytes()).c_str());
  std::printf("%7s %14s %14s %14s\n", "rank", "shard", "kept", "fetched");
  for (const RankTraffic& r : s.ranks) {
    std::printf(
        "%7d %14s %14s %14s\n", r.rank, HumanBytes(r.bytes_total).c_str(),
        HumanBytes(r.bytes_kept).c_str(), HumanBytes(r.bytes_fetched).c_str());
  }
  std::printf(
      "%7s %14s %14s %14s\n", "total", HumanBytes(s.bytes_total).c_str(),
      HumanBytes(s.bytes_kept).c_str(), HumanBytes(s.bytes_fetched).c_str());
  std::printf(
      "to write: %s (new shards, replicas once, that no old shard holds as "
      "is)\n",
      HumanBytes(s.bytes_to_write).c_str());
}

// The model and current config of a store (`scalai plan STORE --to C2`).
absl::StatusOr<LoadedModel> FromStore(const std::string& dir,
                                      std::string& from) {
  ASSIGN_OR_RETURN(auto store, Store::Open(dir, Store::Access::kReadOnly));
  if (store->model() == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "store ", dir, " has no model yet: import a checkpoint first"));
  }
  if (from.empty() && store->current_config())
    from = store->current_config()->ToString();
  return LoadedModel{store->layout(), store->model()};
}

absl::Status RunPlan(PlanOptions o) {
  LoadedModel m;
  if (!o.store.empty()) {
    if (!o.model.model.empty()) {
      return absl::InvalidArgumentError("give a STORE or --model, not both");
    }
    ASSIGN_OR_RETURN(m, FromStore(o.store, o.from));
  } else {
    if (o.model.model.empty() || o.from.empty()) {
      return absl::InvalidArgumentError(
          "give a STORE, or --layout, --model and --from");
    }
    ASSIGN_OR_RETURN(m, o.model.Load());
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const Placement> from, Place(m, o.from));
  ASSIGN_OR_RETURN(std::shared_ptr<const Placement> to, Place(m, o.to));
  ASSIGN_OR_RETURN(ReshardPlan plan, ReshardPlan::Create(from, to));
  PlanSummary summary = plan.Summarize();
  if (o.json) {
    PrintJson(plan, summary);
  } else {
    PrintTable(m, plan, summary);
  }
  return absl::OkStatus();
}

}  // namespace

Command AddPlanCommand(CLI::App& root) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* app = root.add_subcommand("plan",
                                      "Print the bytes each rank keeps and "
                                      "fetches to move between two configs");
  app->add_option("STORE", o->store,
                  "a store: its model, and its current config as --from");
  o->model.Register(app, /*required=*/false);
  app->add_option("--from", o->from, "current config, e.g. tp=2,pp=2,dp=2");
  app->add_option("--to", o->to, "new config")->required();
  app->add_flag("--json", o->json, "machine-readable output");
  return {app, [o] { return RunPlan(*o); }};
}

}  // namespace scalai
