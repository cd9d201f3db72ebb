// A StepView is one stored step seen under a (possibly different) parallel
// config: every rank's tensors are computed on read from the stored shards
// through a reshard plan, so a view exists the moment it is made, whatever
// the model's size. Reads of a shard stored as it is are plain copies.
//
//   ASSIGN_OR_RETURN(auto view, StepView::Create(store, step, config));
//   RETURN_IF_ERROR(view->ReadTensor(group, shard, offset, length, buffer));
#ifndef SCALAI_TRANSFER_STEP_VIEW_H_
#define SCALAI_TRANSFER_STEP_VIEW_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "ptc/parallel_config.h"
#include "ptc/placement.h"
#include "ptc/reshard_plan.h"
#include "transfer/remote_bytes.h"
#include "transfer/step_bytes.h"
#include "transfer/store.h"

namespace scalai {

class StepView {
 public:
  // `remote`, when given, outlives the view. With it, the bytes of groups
  // this host does not store are read from the shards it retained last
  // (StepRecord::retained), when it retained some, and from its peers.
  static absl::StatusOr<std::unique_ptr<StepView>> Create(
      const Store& store, const StepRecord& step, const ParallelConfig& config,
      const RemoteBytes* remote = nullptr);
  // A view of shards the step retained (StepRecord::retained): with
  // `remote`, the groups not retained are read from peers.
  static absl::StatusOr<std::unique_ptr<StepView>> CreateRetained(
      const Store& store, int64_t step, const RetainedShards& kept,
      const ParallelConfig& config, const RemoteBytes* remote = nullptr);

  int64_t step() const { return step_; }
  // The placement of the view's config.
  const Placement& placement() const { return plan_.to(); }
  // From the placement the step is stored under to placement().
  const ReshardPlan& plan() const { return plan_; }
  // The bytes of the shards as stored, which plan() reads from.
  const StepBytes& stored() const { return bytes_; }

  // Bytes [offset, offset + length) of placement().shards(group)[shard].
  absl::Status ReadTensor(int group, int shard, int64_t offset, int64_t length,
                          char* out) const;
  // The same for one of many reads that make up one operation (a request
  // spanning several tensors): each blob is looked at once for all of them.
  absl::Status ReadTensor(int group, int shard, int64_t offset, int64_t length,
                          char* out, UnchangedBlobs& unchanged) const;
  // The same, but only as far as this host holds the bytes: reads the
  // longest such prefix and returns its length (what a peer serves).
  absl::StatusOr<int64_t> ReadHeldPrefix(int group, int shard, int64_t offset,
                                         int64_t length, char* out) const;

 private:
  StepView(int64_t step, ReshardPlan plan, StepBytes bytes,
           const RemoteBytes* remote)
      : step_(step),
        plan_(std::move(plan)),
        bytes_(std::move(bytes)),
        remote_(remote) {}
  // Reads the segments in order while `held` allows; returns bytes read.
  absl::StatusOr<int64_t> ReadSegments(int group, int shard, int64_t offset,
                                       int64_t length, char* out,
                                       bool held_only,
                                       UnchangedBlobs& unchanged) const;
  // The segment's source bytes, from the peers (`remote_`, set).
  absl::Status ReadRemote(const Segment& seg, char* dst) const;
  int64_t step_;
  ReshardPlan plan_;
  StepBytes bytes_;
  const RemoteBytes* remote_;  // null: held shards only
  // Between this host's materialization and the cluster's release of what
  // it kept: the step as this host held it before, seen under the same
  // config. A group it no longer stores may then lie partly in those
  // shards and partly on a peer still on the old config (its own
  // materialization failed or runs yet), which holds nothing of the new
  // group whole: read under the old config, each piece lies in one place.
  // Peers that let go of their kept shards before this host (Unavailable)
  // are asked again under the config stored now, which they all hold.
  std::unique_ptr<const StepView> retained_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_STEP_VIEW_H_
