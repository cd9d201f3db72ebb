// `scalai fsck`: verifies every blob checksum and catalog record.
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/model_options.h"
#include "tools/progress_bar.h"
#include "transfer/fsck.h"
#include "transfer/store.h"

namespace scalai {
namespace {

absl::Status RunFsck(const std::string& dir, bool repair) {
  ASSIGN_OR_RETURN(auto store,
                   Store::Open(dir, repair ? Store::Access::kRepair
                                           : Store::Access::kReadWrite));
  ProgressBar bar("fsck");
  auto problems = CheckStore(*store, bar.Callback());
  bar.Finish();
  if (!problems.ok()) return problems.status();
  if (store->orphans_removed() > 0) {
    std::printf(
        "removed %d orphaned file%s (blobs or dataset indexes) left by an "
        "interrupted write\n",
        store->orphans_removed(), store->orphans_removed() == 1 ? "" : "s");
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

Command AddFsckCommand(CLI::App& root) {
  auto dir = std::make_shared<std::string>();
  auto repair = std::make_shared<bool>(false);
  CLI::App* app = root.add_subcommand(
      "fsck", "Verify every blob checksum and catalog record");
  app->add_option("STORE", *dir, "store directory")->required();
  app->add_flag("--repair", *repair,
                "remove blob files no record names even when the catalog "
                "names none (left by an interrupted first import)");
  return {app, [dir, repair] { return RunFsck(*dir, *repair); }};
}

}  // namespace scalai
