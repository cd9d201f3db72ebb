#include "transfer/step_view.h"

#include <cstring>

#include "ptc/status_macros.h"
#include "transfer/mapping_guard.h"

namespace scalai {

absl::StatusOr<std::unique_ptr<StepView>> StepView::Create(
    const Store& store, const StepRecord& step, const ParallelConfig& config) {
  ASSIGN_OR_RETURN(std::shared_ptr<const Placement> from,
                   store.StepPlacement(step));
  ASSIGN_OR_RETURN(Placement to,
                   Placement::Create(store.layout(), store.model(), config));
  ASSIGN_OR_RETURN(ReshardPlan plan,
                   ReshardPlan::Create(
                       from, std::make_shared<const Placement>(std::move(to))));
  ASSIGN_OR_RETURN(StepBytes bytes, StepBytes::Load(store, step, *from));
  return std::unique_ptr<StepView>(
      new StepView(step.step, std::move(plan), std::move(bytes)));
}

absl::Status StepView::ReadTensor(int group, int shard, int64_t offset,
                                  int64_t length, char* out) const {
  ShardRef same = plan_.in_place_source(group, shard);
  if (same.valid()) {
    const StepBytes::Tensor& t = bytes_.tensor(same);
    RETURN_IF_ERROR(t.Verify(offset, length));
    if (!ReadMapped([&] { std::memcpy(out, t.data + offset, length); })) {
      return t.blob->CutShort();
    }
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::vector<Segment> segments,
                   plan_.Resolve(group, shard, offset, length));
  UnchangedBlobs unchanged;
  for (const Segment& seg : segments) {
    char* dst = out + (seg.dst_offset - offset);
    if (seg.src.valid()) {
      const StepBytes::Tensor& t = bytes_.tensor(seg.src);
      RETURN_IF_ERROR(t.Verify(seg.src_offset, seg.length, unchanged));
      if (!ReadMapped(
              [&] { std::memcpy(dst, t.data + seg.src_offset, seg.length); })) {
        return t.blob->CutShort();
      }
    } else {
      std::memset(dst, 0, seg.length);
    }
  }
  return absl::OkStatus();
}

}  // namespace scalai
