// `scalai inspect`: a store's layout, model, steps, datasets and size.
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/human_bytes.h"
#include "tools/model_options.h"
#include "transfer/store.h"

namespace scalai {
namespace {

struct InspectOptions {
  std::string store;
  bool json = false;
};

absl::Status RunInspect(const InspectOptions& o) {
  ASSIGN_OR_RETURN(auto store, Store::Open(o.store, Store::Access::kReadOnly));
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store->Steps());
  ASSIGN_OR_RETURN(auto blobs, store->Blobs());
  ASSIGN_OR_RETURN(auto datasets, store->Datasets());
  int64_t store_bytes = 0;
  for (const auto& [name, b] : blobs) store_bytes += b.size;
  const Model* model = store->model().get();
  int64_t layers = 0;
  if (model != nullptr) {
    for (const TensorInfo& t : model->tensors()) {
      auto rule = store->layout().Classify(t.name);
      if (rule.ok() && rule->layer) layers = std::max(layers, *rule->layer + 1);
    }
  }
  const std::string config = store->current_config()
                                 ? store->current_config()->ToString()
                                 : std::string("none");
  if (o.json) {
    nlohmann::json j = {
        {"layout", store->layout().name()},
        {"params", store->layout().params()},
        {"model",
         {{"tensors", model ? model->size() : 0},
          {"layers", layers},
          {"bytes", model ? model->total_bytes() : 0}}},
        {"config", config},
        {"steps", nlohmann::json::array()},
        {"datasets", nlohmann::json::array()},
        {"store_bytes", store_bytes},
        {"blobs", blobs.size()},
    };
    for (const StepRecord& s : steps) {
      j["steps"].push_back(
          {{"step", s.step}, {"config", s.config}, {"bytes", s.bytes}});
    }
    for (const auto& [name, d] : datasets) {
      j["datasets"].push_back({{"name", name},
                               {"format", d.format},
                               {"samples", d.samples},
                               {"global_batch", d.global_batch},
                               {"seed", d.seed},
                               {"epochs", d.epochs},
                               {"files", d.parts.size()}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("store     %s\n", store->dir().c_str());
  std::printf("layout    %s %s\n", store->layout().name().c_str(),
              store->layout().params().dump().c_str());
  if (model != nullptr) {
    std::printf("model     %d tensors, %lld layers, %s\n", model->size(),
                static_cast<long long>(layers),
                HumanBytes(model->total_bytes()).c_str());
  } else {
    std::printf("model     none yet (the first import sets it)\n");
  }
  std::printf("config    %s\n", config.c_str());
  std::printf("steps     %zu\n", steps.size());
  for (const StepRecord& s : steps) {
    std::printf("  step-%08lld  %-28s %12s\n", static_cast<long long>(s.step),
                s.config.c_str(), HumanBytes(s.bytes).c_str());
  }
  std::printf("datasets  %zu\n", datasets.size());
  for (const auto& [name, d] : datasets) {
    std::printf(
        "  %-16s %-8s %12lld samples  global batch %lld  %lld epoch%s\n",
        name.c_str(), d.format.c_str(), static_cast<long long>(d.samples),
        static_cast<long long>(d.global_batch),
        static_cast<long long>(d.epochs), d.epochs == 1 ? "" : "s");
  }
  std::printf("size      %s in %zu blobs\n", HumanBytes(store_bytes).c_str(),
              blobs.size());
  return absl::OkStatus();
}

}  // namespace

Command AddInspectCommand(CLI::App& root) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* app = root.add_subcommand(
      "inspect", "Show a store's layout, model, steps and size");
  app->add_option("STORE", o->store, "store directory")->required();
  app->add_flag("--json", o->json, "machine-readable output");
  return {app, [o] { return RunInspect(*o); }};
}

}  // namespace scalai
