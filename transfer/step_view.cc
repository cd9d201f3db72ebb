#include "transfer/step_view.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

// The plan reads what this host holds (`held`) wherever it can.
absl::StatusOr<ReshardPlan> PlanTo(
    const Store& store, std::shared_ptr<const Placement> from,
    const ParallelConfig& config, const std::optional<std::vector<int>>& held) {
  ASSIGN_OR_RETURN(Placement to,
                   Placement::Create(store.layout(), store.model(), config));
  return ReshardPlan::Create(
      std::move(from), std::make_shared<const Placement>(std::move(to)), held);
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepView>> StepView::Create(
    const Store& store, const StepRecord& step, const ParallelConfig& config,
    const RemoteBytes* remote) {
  ASSIGN_OR_RETURN(std::shared_ptr<const Placement> from,
                   store.StepPlacement(step));
  ASSIGN_OR_RETURN(ReshardPlan plan, PlanTo(store, from, config, step.held));
  ASSIGN_OR_RETURN(StepBytes bytes, StepBytes::Load(store, step, *from));
  std::unique_ptr<StepView> view(
      new StepView(step.step, std::move(plan), std::move(bytes), remote));
  // What this host kept is read only for groups it does not hold.
  if (remote != nullptr && !step.retained.empty() &&
      !view->bytes_.holds_every_group()) {
    ASSIGN_OR_RETURN(
        view->retained_,
        CreateRetained(store, step.step, step.retained.back(), config, remote));
  }
  return view;
}

absl::StatusOr<std::unique_ptr<StepView>> StepView::CreateRetained(
    const Store& store, int64_t step, const RetainedShards& kept,
    const ParallelConfig& config, const RemoteBytes* remote) {
  StepRecord as_stored;
  as_stored.step = step;
  as_stored.config = kept.config;
  ASSIGN_OR_RETURN(std::shared_ptr<const Placement> from,
                   store.StepPlacement(as_stored));
  std::vector<int> held;
  for (const auto& [g, shard] : kept.groups) held.push_back(g);
  ASSIGN_OR_RETURN(ReshardPlan plan, PlanTo(store, from, config, held));
  ASSIGN_OR_RETURN(StepBytes bytes,
                   StepBytes::LoadRetained(store, step, kept, *from));
  return std::unique_ptr<StepView>(
      new StepView(step, std::move(plan), std::move(bytes), remote));
}

absl::Status StepView::ReadTensor(int group, int shard, int64_t offset,
                                  int64_t length, char* out) const {
  UnchangedBlobs unchanged;
  return ReadTensor(group, shard, offset, length, out, unchanged);
}

absl::Status StepView::ReadTensor(int group, int shard, int64_t offset,
                                  int64_t length, char* out,
                                  UnchangedBlobs& unchanged) const {
  ShardRef same = plan_.in_place_source(group, shard);
  if (same.valid() && bytes_.holds(same.group)) {
    const StepBytes::Tensor& t = bytes_.tensor(same);
    return t.Read(offset, length, out, unchanged);
  }
  return ReadSegments(group, shard, offset, length, out, /*held_only=*/false,
                      unchanged)
      .status();
}

absl::StatusOr<int64_t> StepView::ReadHeldPrefix(int group, int shard,
                                                 int64_t offset, int64_t length,
                                                 char* out) const {
  UnchangedBlobs unchanged;
  return ReadSegments(group, shard, offset, length, out, /*held_only=*/true,
                      unchanged);
}

absl::StatusOr<int64_t> StepView::ReadSegments(
    int group, int shard, int64_t offset, int64_t length, char* out,
    bool held_only, UnchangedBlobs& unchanged) const {
  ASSIGN_OR_RETURN(std::vector<Segment> segments,
                   plan_.Resolve(group, shard, offset, length));
  for (const Segment& seg : segments) {
    char* dst = out + (seg.dst_offset - offset);
    if (!seg.src.valid()) {
      std::memset(dst, 0, seg.length);
    } else if (bytes_.holds(seg.src.group)) {
      const StepBytes::Tensor& t = bytes_.tensor(seg.src);
      RETURN_IF_ERROR(t.Read(seg.src_offset, seg.length, dst, unchanged));
    } else if (held_only) {
      return seg.dst_offset - offset;
    } else if (retained_ != nullptr) {
      absl::Status kept = retained_->ReadTensor(group, shard, seg.dst_offset,
                                                seg.length, dst, unchanged);
      // Once every host has finished, the others may have let go of what
      // they kept before this one did: they hold the step as stored now.
      if (absl::IsUnavailable(kept)) kept = ReadRemote(seg, dst);
      RETURN_IF_ERROR(kept);
    } else if (remote_ != nullptr) {
      RETURN_IF_ERROR(ReadRemote(seg, dst));
    } else {
      const TensorShard& s = plan_.from().shards(seg.src.group)[seg.src.shard];
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_, ": ", s.local_name, " of shard group ",
                       seg.src.group, " of ", plan_.from().config().ToString(),
                       " is held by another host"));
    }
  }
  return length;
}

absl::Status StepView::ReadRemote(const Segment& seg, char* dst) const {
  const int64_t size = plan_.from().shards(seg.src.group)[seg.src.shard].bytes;
  return remote_->Read(step_, plan_.from().config().ToString(), seg.src, size,
                       seg.src_offset, seg.length, dst,
                       RemoteBytes::Access::kCached);
}

}  // namespace scalai
