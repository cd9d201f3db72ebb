// A ReshardPlan says how to build every shard of placement `to` from the
// shards of placement `from` of the same model: copy operations between boxes,
// the byte segments behind any destination byte range, and how many bytes each
// rank keeps, fetches, and the job must write at least.
//
//   ASSIGN_OR_RETURN(ReshardPlan plan, ReshardPlan::Create(from, to));
//   for (const CopyOp& op : plan.ops(group, shard)) ...  // dst box <- src box
//   ASSIGN_OR_RETURN(auto segments, plan.Resolve(group, shard, offset, n));
#ifndef SCALAI_PTC_RESHARD_PLAN_H_
#define SCALAI_PTC_RESHARD_PLAN_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/box.h"
#include "ptc/placement.h"

namespace scalai {

// A shard of a placement: shards(group)[shard].
struct ShardRef {
  int group = -1;
  int shard = -1;
  bool valid() const { return group >= 0; }
  friend bool operator==(const ShardRef&, const ShardRef&) = default;
};

// Fill `dst` of the destination shard from the same-shaped region at
// `src_origin` of source shard `src`, or with zeros when !src.valid().
// Both boxes are in the view of a piece (TensorShard::ViewShape): the
// local tensor itself, or under distopt a view of a flat shard.
struct CopyOp {
  Box dst;
  ShardRef src;
  Shape src_origin;
  int dst_piece = 0;
  int src_piece = 0;
};

// `length` bytes at `dst_offset` of a destination shard come from
// `src_offset` of source shard `src`, or are zeros when !src.valid().
struct Segment {
  int64_t dst_offset = 0;
  int64_t length = 0;
  ShardRef src;
  int64_t src_offset = 0;
  friend bool operator==(const Segment&, const Segment&) = default;
};

struct RankTraffic {
  int rank = 0;
  int64_t bytes_total = 0;  // the rank's new shard
  int64_t bytes_kept =
      0;  // held by the same-numbered old rank (or zero padding)
  int64_t bytes_fetched = 0;  // the rest: read from other ranks' shards
};

struct PlanSummary {
  int64_t bytes_total = 0;
  int64_t bytes_kept = 0;
  int64_t bytes_fetched = 0;
  // Bytes of new shards, replicas and identical shards counted once, that
  // no old shard holds identically: what materialization must write at
  // least.
  int64_t bytes_to_write = 0;
  std::vector<RankTraffic> ranks;
};

class ReshardPlan {
 public:
  // Both placements must be of the same model (names, dtypes, shapes).
  // `held`, when set, lists the groups of `from` this host holds (in a
  // cluster); a byte some of them has is read from there rather than from
  // a replica elsewhere.
  static absl::StatusOr<ReshardPlan> Create(
      std::shared_ptr<const Placement> from,
      std::shared_ptr<const Placement> to,
      const std::optional<std::vector<int>>& held = std::nullopt);

  const Placement& from() const { return *from_; }
  const Placement& to() const { return *to_; }

  // The ops that fill to().shards(group)[shard], ordered by destination
  // position; their dst boxes tile the shard exactly once.
  const std::vector<CopyOp>& ops(int group, int shard) const {
    return groups_[group].ops[shard];
  }

  // A source shard identical to the destination shard (same pieces in the same
  // local places), so its bytes can be used in place; invalid when none.
  ShardRef in_place_source(int group, int shard) const {
    return groups_[group].in_place[shard];
  }

  // The first destination shard (in group order) identical to this one,
  // itself when no earlier one is: shards of a tensor replicated across
  // tensor-parallel ranks (a layer norm) share it, so a host that stores
  // several stores the bytes once.
  ShardRef first_identical(int group, int shard) const {
    return groups_[group].first_identical[shard];
  }

  // The segments that fill bytes [offset, offset + length) of the destination
  // shard, in order and without gaps.
  absl::StatusOr<std::vector<Segment>> Resolve(int group, int shard,
                                               int64_t offset,
                                               int64_t length) const;

  PlanSummary Summarize() const;

 private:
  struct GroupPlan {
    std::vector<std::vector<CopyOp>> ops;   // per destination shard
    std::vector<ShardRef> in_place;         // per destination shard
    std::vector<ShardRef> first_identical;  // per destination shard
  };
  std::shared_ptr<const Placement> from_;
  std::shared_ptr<const Placement> to_;
  std::vector<GroupPlan> groups_;
};

}  // namespace scalai

#endif  // SCALAI_PTC_RESHARD_PLAN_H_
