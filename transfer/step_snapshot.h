// A StepSnapshot is one committed step held for reading: its record as the
// catalog stood at one moment, and every blob it names (its shards' and its
// extra files') opened. An opened blob stays readable for as long as the
// snapshot lives (BlobReader keeps it mapped), even after a writer beside
// it has retired it: a mount that reconfigures, or a step removed. So
// `scalai export` reads a whole step while the job that holds the store
// runs on.
//
//   ASSIGN_OR_RETURN(StepSnapshot snap, StepSnapshot::Open("/data/job", {}));
//   const StepBytes::Tensor& t = snap.bytes().tensor({group, shard});
#ifndef SCALAI_TRANSFER_STEP_SNAPSHOT_H_
#define SCALAI_TRANSFER_STEP_SNAPSHOT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "ptc/placement.h"
#include "transfer/blob_reader.h"
#include "transfer/step_bytes.h"
#include "transfer/store.h"

namespace scalai {

class StepSnapshot {
 public:
  // How many times Open takes the step before it gives up.
  static constexpr int kTries = 20;

  // Opens store `dir` for reading (Store::Access::kReadOnly) and takes step
  // `step`, the newest when unset. A blob the catalog names but whose file
  // is gone was, most likely, retired between the catalog's open and the
  // blob's: the store is opened again and the step taken anew, up to
  // kTries times in all, and then Open fails (Unavailable). A blob that a
  // catalog opened after its file was seen gone still names was lost, not
  // retired (a writer removes a blob's file only once the commit that drops
  // its record is durable): the snapshot is returned as it is, and each
  // read that needs that blob fails naming it, as in any damaged store.
  static absl::StatusOr<StepSnapshot> Open(const std::string& dir,
                                           std::optional<int64_t> step);
  // The same with each try's store opened by `open_store`.
  static absl::StatusOr<StepSnapshot> Open(const StoreOpener& open_store,
                                           std::optional<int64_t> step);
  // Takes step `step` (the newest when unset) of a store this process has
  // open, without trying again: blobs found gone are in missing().
  static absl::StatusOr<StepSnapshot> Take(const Store& store,
                                           std::optional<int64_t> step);

  const Store& store() const { return *store_; }
  const StepRecord& step() const { return step_; }
  // The placement the step's shards are stored under.
  const std::shared_ptr<const Placement>& placement() const {
    return placement_;
  }
  const StepBytes& bytes() const { return bytes_; }
  // The blob of one of the step's extra files (StepRecord::extra); any
  // other blob is an internal error.
  absl::StatusOr<std::shared_ptr<const BlobReader>> extra_blob(
      const std::string& name) const;
  // The blobs the step names whose files were gone when it was taken.
  std::set<std::string> missing() const;

 private:
  StepSnapshot() = default;

  std::unique_ptr<Store> owned_;  // set by Open
  const Store* store_ = nullptr;
  StepRecord step_;
  std::shared_ptr<const Placement> placement_;
  StepBytes bytes_;
  std::map<std::string, std::shared_ptr<const BlobReader>> extras_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_STEP_SNAPSHOT_H_
