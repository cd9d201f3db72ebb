// `scalai fsck`: verifies every blob checksum and catalog record.
#include <sys/statvfs.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/model_options.h"
#include "tools/progress_bar.h"
#include "transfer/fsck.h"
#include "transfer/store.h"

namespace scalai {
namespace {

// Every problem but the first on stderr; the first is the command's error.
absl::Status Report(const std::vector<std::string>& problems) {
  for (size_t i = 1; i < problems.size(); ++i) {
    std::fprintf(stderr, "scalai fsck: %s\n", problems[i].c_str());
  }
  return absl::DataLossError(problems.front());
}

// The check of a store this process cannot write, `where` saying why: a
// mount (or another writer) holds it, or it lies on a read-only filesystem.
// Nothing is swept or rewritten, and blobs a holder retires meanwhile are no
// fault.
absl::Status RunFsckAsReader(const std::string& dir, const char* where) {
  ProgressBar bar("fsck");
  auto check = CheckStoreBesideWriter(
      [&] { return Store::Open(dir, Store::Access::kReadOnly); },
      bar.Callback());
  bar.Finish();
  if (!check.ok()) return check.status();
  if (!check->problems.empty()) return Report(check->problems);
  const std::string retired =
      check->retired == 0 ? ""
                          : absl::StrCat(", which retired ", check->retired,
                                         " of them meanwhile");
  std::printf("%s: ok (%zu blobs verified %s%s)\n", dir.c_str(), check->blobs,
              where, retired.c_str());
  return absl::OkStatus();
}

bool OnReadOnlyFilesystem(const std::string& dir) {
  struct statvfs st;
  return statvfs(dir.c_str(), &st) == 0 && (st.f_flag & ST_RDONLY) != 0;
}

absl::Status RunFsck(const std::string& dir, bool repair) {
  if (!repair && OnReadOnlyFilesystem(dir)) {
    return RunFsckAsReader(dir, "on a read-only filesystem");
  }
  auto store = Store::Open(
      dir, repair ? Store::Access::kRepair : Store::Access::kReadWrite);
  if (!repair && !store.ok() && Store::HeldByAnother(store.status())) {
    return RunFsckAsReader(dir,
                           "beside the scalai process that holds the store");
  }
  if (!store.ok()) return store.status();
  ProgressBar bar("fsck");
  auto problems = CheckStore(**store, bar.Callback());
  bar.Finish();
  if (!problems.ok()) return problems.status();
  if ((*store)->orphans_removed() > 0) {
    std::printf(
        "removed %d orphaned file%s (blobs or dataset indexes) left by an "
        "interrupted write\n",
        (*store)->orphans_removed(),
        (*store)->orphans_removed() == 1 ? "" : "s");
  }
  if (!problems->empty()) return Report(*problems);
  ASSIGN_OR_RETURN(auto blobs, (*store)->Blobs());
  std::printf("%s: ok (%zu blobs verified)\n", dir.c_str(), blobs.size());
  return absl::OkStatus();
}

}  // namespace

Command AddFsckCommand(CLI::App& root) {
  auto dir = std::make_shared<std::string>();
  auto repair = std::make_shared<bool>(false);
  CLI::App* app = root.add_subcommand(
      "fsck",
      "Verify every blob checksum and catalog record (beside a mount too)");
  app->add_option("STORE", *dir, "store directory")->required();
  app->add_flag("--repair", *repair,
                "remove blob files no record names even when the catalog "
                "names none (left by an interrupted first import)");
  return {app, [dir, repair] { return RunFsck(*dir, *repair); }};
}

}  // namespace scalai
