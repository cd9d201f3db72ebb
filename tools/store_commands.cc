// The store's commands: `scalai init`, `import`, `export`, `inspect`, `fsck`.
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/model_options.h"
#include "tools/progress_bar.h"
#include "transfer/exporter.h"
#include "transfer/fsck.h"
#include "transfer/importer.h"
#include "transfer/store.h"

namespace scalai {
namespace {

std::optional<int64_t> OptionalStep(const CLI::Option* option, int64_t value) {
  if (option->count() == 0) return std::nullopt;
  return value;
}

struct InitOptions {
  std::string store;
  std::string layout;
  std::vector<std::string> params;
};

absl::Status RunInit(const InitOptions& o) {
  ASSIGN_OR_RETURN(Layout layout, Layout::Load(o.layout));
  for (const std::string& kv : o.params) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--param \"", kv, "\": expected k=v"));
    }
    RETURN_IF_ERROR(layout.SetParam(kv.substr(0, eq), kv.substr(eq + 1)));
  }
  ASSIGN_OR_RETURN(auto store, Store::Create(o.store, layout));
  std::printf("initialized store %s (layout %s)\n", o.store.c_str(),
              layout.name().c_str());
  return absl::OkStatus();
}

struct ImportCliOptions {
  std::string store, src, config;
  int64_t step = 0;
  CLI::Option* step_option = nullptr;
};

absl::Status RunImport(const ImportCliOptions& o) {
  ASSIGN_OR_RETURN(auto store, Store::Open(o.store));
  ImportOptions options;
  options.src = o.src;
  ASSIGN_OR_RETURN(options.config, ParallelConfig::Parse(o.config));
  options.step = OptionalStep(o.step_option, o.step);
  ProgressBar bar("import");
  options.progress = bar.Callback();
  auto result = ImportCheckpoint(*store, options);
  bar.Finish();
  if (!result.ok()) return result.status();
  std::printf("imported step %lld (%s): %d files, %s\n",
              static_cast<long long>(result->step.step),
              result->step.config.c_str(), result->files,
              HumanBytes(result->bytes_copied).c_str());
  return absl::OkStatus();
}

struct ExportCliOptions {
  std::string store, out, config;
  int64_t step = 0;
  CLI::Option* step_option = nullptr;
  bool merged = false;
  int64_t max_file_bytes = int64_t{5} << 30;
};

absl::Status RunExport(const ExportCliOptions& o) {
  ASSIGN_OR_RETURN(auto store, Store::Open(o.store));
  ExportOptions options;
  options.out = o.out;
  options.step = OptionalStep(o.step_option, o.step);
  options.merged = o.merged;
  options.max_file_bytes = o.max_file_bytes;
  if (!o.merged) {
    if (o.config.empty())
      return absl::InvalidArgumentError("give --config C (or --merged)");
    ASSIGN_OR_RETURN(ParallelConfig config, ParallelConfig::Parse(o.config));
    options.config = config;
  }
  ProgressBar bar("export");
  options.progress = bar.Callback();
  auto result = ExportCheckpoint(*store, options);
  bar.Finish();
  if (!result.ok()) return result.status();
  std::printf("exported step %lld: %d files, %s\n",
              static_cast<long long>(result->step), result->files,
              HumanBytes(result->bytes_written).c_str());
  return absl::OkStatus();
}

struct InspectOptions {
  std::string store;
  bool json = false;
};

absl::Status RunInspect(const InspectOptions& o) {
  ASSIGN_OR_RETURN(auto store, Store::Open(o.store));
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store->Steps());
  ASSIGN_OR_RETURN(auto blobs, store->Blobs());
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
  std::printf("datasets  0\n");
  std::printf("size      %s in %zu blobs\n", HumanBytes(store_bytes).c_str(),
              blobs.size());
  return absl::OkStatus();
}

absl::Status RunFsck(const std::string& dir) {
  ASSIGN_OR_RETURN(auto store, Store::Open(dir));
  ProgressBar bar("fsck");
  auto problems = CheckStore(*store, bar.Callback());
  bar.Finish();
  if (!problems.ok()) return problems.status();
  if (store->orphans_removed() > 0) {
    std::printf("removed %d orphaned blobs left by an interrupted write\n",
                store->orphans_removed());
  }
  if (problems->empty()) {
    ASSIGN_OR_RETURN(auto blobs, store->Blobs());
    std::printf("%s: ok (%zu blobs verified)\n", dir.c_str(), blobs.size());
    return absl::OkStatus();
  }
  for (size_t i = 1; i < problems->size(); ++i) {
    std::fprintf(stderr, "scalai fsck: %s\n", (*problems)[i].c_str());
  }
  return absl::DataLossError(problems->front());
}

}  // namespace

Command AddInitCommand(CLI::App& root) {
  auto o = std::make_shared<InitOptions>();
  CLI::App* app = root.add_subcommand(
      "init", "Create an empty store for a model with a layout");
  app->add_option("STORE", o->store, "store directory (created, mode 0700)")
      ->required();
  app->add_option("--layout", o->layout, "layout preset or JSON file")
      ->required();
  app->add_option("--param", o->params, "layout parameter k=v (repeatable)");
  return {app, [o] { return RunInit(*o); }};
}

Command AddImportCommand(CLI::App& root) {
  auto o = std::make_shared<ImportCliOptions>();
  CLI::App* app = root.add_subcommand("import",
                                      "Import per-rank shards, a .safetensors "
                                      "model or a Hugging Face directory");
  app->add_option("STORE", o->store, "store directory")->required();
  app->add_option("SRC", o->src, "checkpoint to import")->required();
  app->add_option("--config", o->config,
                  "the config the checkpoint was saved under")
      ->required();
  o->step_option = app->add_option(
      "--step", o->step, "step number (default: from metadata, or 0)");
  return {app, [o] { return RunImport(*o); }};
}

Command AddExportCommand(CLI::App& root) {
  auto o = std::make_shared<ExportCliOptions>();
  CLI::App* app = root.add_subcommand(
      "export", "Write a step as per-rank shards for a config, or merged");
  app->add_option("STORE", o->store, "store directory")->required();
  app->add_option("OUT", o->out, "output directory (new or empty)")->required();
  auto* config =
      app->add_option("--config", o->config, "config of the shards to write");
  auto* merged =
      app->add_flag("--merged", o->merged,
                    "write the full model as a Hugging Face sharded directory");
  config->excludes(merged);
  o->step_option =
      app->add_option("--step", o->step, "step (default: the newest)");
  app->add_option("--max-file-bytes", o->max_file_bytes,
                  "with --merged: bytes per file")
      ->capture_default_str();
  return {app, [o] { return RunExport(*o); }};
}

Command AddInspectCommand(CLI::App& root) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* app = root.add_subcommand(
      "inspect", "Show a store's layout, model, steps and size");
  app->add_option("STORE", o->store, "store directory")->required();
  app->add_flag("--json", o->json, "machine-readable output");
  return {app, [o] { return RunInspect(*o); }};
}

Command AddFsckCommand(CLI::App& root) {
  auto dir = std::make_shared<std::string>();
  CLI::App* app = root.add_subcommand(
      "fsck", "Verify every blob checksum and catalog record");
  app->add_option("STORE", *dir, "store directory")->required();
  return {app, [dir] { return RunFsck(*dir); }};
}

}  // namespace scalai
