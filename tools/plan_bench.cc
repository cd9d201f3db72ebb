// Times reshard planning at scale: placement of both configs, the plan, and
// its per-rank summary. Run by hand (not in CI):
//   build/tools/plan_bench [--from C1] [--to C2] [--model k=v,...] [--reps N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "ptc/model_spec.h"
#include "ptc/placement.h"
#include "ptc/reshard_plan.h"
#include "ptc/status_macros.h"
#include "tools/human_bytes.h"
#include "tools/model_options.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Reshard planning benchmark", "plan_bench");
  scalai::ModelOptions model;
  model.layout = "megatron-core-gpt";
  model.model =
      "layers=128,hidden=8192,heads=64,groups=8,ffn=28672,vocab=128256,bias=1,"
      "gated_linear_unit=1";
  std::string from = "tp=8,pp=16,dp=16", to = "tp=4,pp=8,dp=64";
  int reps = 5;
  app.add_option("--layout", model.layout)->capture_default_str();
  app.add_option("--model", model.model)->capture_default_str();
  app.add_option("--from", from)->capture_default_str();
  app.add_option("--to", to)->capture_default_str();
  app.add_option("--reps", reps)->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto loaded = model.Load();
  if (!loaded.ok()) {
    std::fprintf(stderr, "plan_bench: %s\n",
                 std::string(loaded.status().message()).c_str());
    return 1;
  }
  auto cfrom = scalai::ParallelConfig::Parse(from);
  auto cto = scalai::ParallelConfig::Parse(to);
  if (!cfrom.ok() || !cto.ok()) {
    std::fprintf(stderr, "plan_bench: bad config\n");
    return 1;
  }
  std::printf("model: %d tensors, %s; %s (%d ranks) -> %s (%d ranks)\n",
              loaded->model->size(),
              scalai::HumanBytes(loaded->model->total_bytes()).c_str(),
              from.c_str(), cfrom->world_size(), to.c_str(), cto->world_size());
  std::vector<double> totals;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    auto pa = scalai::Placement::Create(loaded->layout, loaded->model, *cfrom);
    auto pb = scalai::Placement::Create(loaded->layout, loaded->model, *cto);
    if (!pa.ok() || !pb.ok()) {
      std::fprintf(
          stderr, "plan_bench: %s\n",
          std::string((pa.ok() ? pb.status() : pa.status()).message()).c_str());
      return 1;
    }
    auto t1 = Clock::now();
    auto plan = scalai::ReshardPlan::Create(
        std::make_shared<const scalai::Placement>(*std::move(pa)),
        std::make_shared<const scalai::Placement>(*std::move(pb)));
    if (!plan.ok()) {
      std::fprintf(stderr, "plan_bench: %s\n",
                   std::string(plan.status().message()).c_str());
      return 1;
    }
    auto t2 = Clock::now();
    scalai::PlanSummary summary = plan->Summarize();
    auto t3 = Clock::now();
    std::printf(
        "rep %d: placements %.3f s, plan %.3f s, summary %.3f s, total %.3f s "
        "(%zu ranks summarized, %s to write)\n",
        rep, Seconds(t0, t1), Seconds(t1, t2), Seconds(t2, t3), Seconds(t0, t3),
        summary.ranks.size(),
        scalai::HumanBytes(summary.bytes_to_write).c_str());
    totals.push_back(Seconds(t0, t3));
  }
  std::sort(totals.begin(), totals.end());
  std::printf("median total: %.3f s over %d reps\n", totals[totals.size() / 2],
              reps);
  return 0;
}
