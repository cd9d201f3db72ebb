// `scalai dataset add`: registers a JSONL or Megatron dataset in a store.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/progress_bar.h"
#include "transfer/dataset_import.h"
#include "transfer/store.h"

namespace scalai {
namespace {

struct DatasetAddCliOptions {
  std::string store;
  DatasetImportOptions import;
};

absl::Status RunDatasetAdd(DatasetAddCliOptions& o) {
  ASSIGN_OR_RETURN(auto store, Store::Open(o.store));
  ProgressBar bar("index");
  o.import.progress = bar.Callback();
  auto added = AddDataset(*store, o.import);
  bar.Finish();
  if (!added.ok()) return added.status();
  const DatasetRecord* record = &added->record;
  std::printf(
      "%s dataset %s (%s): %lld samples in %zu file%s, global batch %lld, "
      "%lld batches per epoch, %lld dropped per epoch, %lld epoch%s\n",
      added->replaced ? "replaced" : "added", o.import.name.c_str(),
      record->format.c_str(), static_cast<long long>(record->samples),
      o.import.files.size(), o.import.files.size() == 1 ? "" : "s",
      static_cast<long long>(record->global_batch),
      static_cast<long long>(record->samples / record->global_batch),
      static_cast<long long>(record->samples % record->global_batch),
      static_cast<long long>(record->epochs), record->epochs == 1 ? "" : "s");
  return absl::OkStatus();
}

}  // namespace

Command AddDatasetCommand(CLI::App& root) {
  auto o = std::make_shared<DatasetAddCliOptions>();
  CLI::App* app = root.add_subcommand("dataset", "Manage a store's datasets");
  app->require_subcommand(1);
  CLI::App* add = app->add_subcommand(
      "add", "Register a dataset: JSONL files or Megatron .idx/.bin pairs");
  add->add_option("STORE", o->store, "store directory")->required();
  add->add_option("NAME", o->import.name, "the dataset's name under data/")
      ->required();
  add->add_option("--format", o->import.format, "jsonl or megatron")
      ->required()
      ->check(CLI::IsMember({"jsonl", "megatron"}));
  add->add_option("--global-batch", o->import.global_batch,
                  "samples per global batch (all dp ranks together)")
      ->required()
      ->check(CLI::PositiveNumber);
  add->add_option("--seed", o->import.seed, "seed of the order (default 1234)");
  add->add_option("--epochs", o->import.epochs, "epochs (default 1)")
      ->check(CLI::PositiveNumber);
  add->add_flag("--replace", o->import.replace,
                "register NAME again in place of its record (after its files "
                "changed, or to index them again)");
  add->add_option("FILES", o->import.files,
                  "JSONL files, or Megatron .idx/.bin files or their prefix")
      ->required();
  return {app, [o] { return RunDatasetAdd(*o); }};
}

}  // namespace scalai
