#include "transfer/step_snapshot.h"

#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::StatusOr<StepSnapshot> StepSnapshot::Take(const Store& store,
                                                std::optional<int64_t> step) {
  StepSnapshot snap;
  snap.store_ = &store;
  ASSIGN_OR_RETURN(snap.step_, store.ResolveStep(step));
  ASSIGN_OR_RETURN(snap.placement_, store.StepPlacement(snap.step_));
  ASSIGN_OR_RETURN(snap.bytes_,
                   StepBytes::Load(store, snap.step_, *snap.placement_));
  for (const std::string& name : snap.step_.ExtraBlobs()) {
    snap.extras_.emplace(name, BlobReader::Open(store, name));
  }
  return snap;
}

absl::StatusOr<StepSnapshot> StepSnapshot::Open(const std::string& dir,
                                                std::optional<int64_t> step) {
  return Open([&] { return Store::Open(dir, Store::Access::kReadOnly); }, step);
}

absl::StatusOr<StepSnapshot> StepSnapshot::Open(const StoreOpener& open_store,
                                                std::optional<int64_t> step) {
  std::set<std::string> seen_gone;
  for (int tries = 1;; ++tries) {
    ASSIGN_OR_RETURN(std::unique_ptr<Store> store, open_store());
    ASSIGN_OR_RETURN(StepSnapshot snap, Take(*store, step));
    snap.owned_ = std::move(store);
    bool retired = false;
    for (const std::string& name : snap.missing()) {
      retired |= seen_gone.insert(name).second;
    }
    if (!retired) return snap;
    if (tries == kTries) {
      return absl::UnavailableError(absl::StrCat(
          "store ", snap.store_->dir(),
          ": its writer retired the blobs of step ", snap.step_.step,
          " during each of ", kTries, " tries to read it"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10 * tries));
  }
}

absl::StatusOr<std::shared_ptr<const BlobReader>> StepSnapshot::extra_blob(
    const std::string& name) const {
  auto it = extras_.find(name);
  if (it == extras_.end()) {
    return absl::InternalError(
        absl::StrCat("blob ", name, " is no extra file of step ", step_.step));
  }
  return it->second;
}

std::set<std::string> StepSnapshot::missing() const {
  std::set<std::string> missing = bytes_.MissingBlobs();
  for (const auto& [name, blob] : extras_) {
    if (blob->missing()) missing.insert(name);
  }
  return missing;
}

}  // namespace scalai
