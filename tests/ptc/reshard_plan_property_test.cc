// Property tests of placements and reshard plans over random models, layouts
// and configs. The oracle (plan_oracle.h) re-derives every shard from
// docs/reference.md by itself and cuts it from random full tensors; the plan
// under test must turn the shards of config A into exactly the oracle's
// shards of config B.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <regex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ptc/layout.h"
#include "ptc/model_spec.h"
#include "ptc/placement.h"
#include "ptc/reshard_plan.h"
#include "tests/ptc/plan_oracle.h"
#include "transfer/box_copy.h"

namespace scalai {
namespace {

using namespace oracle;  // NOLINT: the oracle is this test's vocabulary

// Checks the placement against the oracle: same names, shapes and sizes.
void ExpectPlacementMatches(const Placement& p,
                            const std::vector<OracleGroup>& oracle) {
  ASSERT_EQ(p.num_groups(), static_cast<int>(oracle.size()));
  for (int g = 0; g < p.num_groups(); ++g) {
    std::set<std::string> names;
    for (const TensorShard& s : p.shards(g)) {
      names.insert(s.local_name);
      auto it = oracle[g].find(s.local_name);
      ASSERT_NE(it, oracle[g].end())
          << "group " << g << " holds unexpected " << s.local_name;
      EXPECT_EQ(it->second.tensor, s.tensor);
      EXPECT_EQ(static_cast<int64_t>(it->second.bytes.size()), s.bytes)
          << s.local_name;
    }
    EXPECT_EQ(names.size(), oracle[g].size()) << "group " << g;
  }
}

// Materializes every destination shard by executing the plan's copy ops on
// the source shards' bytes.
std::vector<std::vector<Bytes>> ApplyOps(
    const ReshardPlan& plan, const std::vector<std::vector<Bytes>>& src) {
  std::vector<std::vector<Bytes>> out(plan.to().num_groups());
  for (int g = 0; g < plan.to().num_groups(); ++g) {
    for (size_t k = 0; k < plan.to().shards(g).size(); ++k) {
      const TensorShard& dst = plan.to().shards(g)[k];
      const int elem = DTypeSize(plan.to().model().tensor(dst.tensor).dtype);
      Bytes bytes(dst.bytes, std::byte{0x5a});
      for (const CopyOp& op : plan.ops(g, k)) {
        std::byte* view = bytes.data() + dst.ViewOffset(op.dst_piece) * elem;
        if (!op.src.valid()) {
          ZeroBox(view, dst.ViewShape(op.dst_piece), op.dst.origin(),
                  op.dst.shape(), elem);
          continue;
        }
        const TensorShard& s = plan.from().shards(op.src.group)[op.src.shard];
        CopyBox(src[op.src.group][op.src.shard].data() +
                    s.ViewOffset(op.src_piece) * elem,
                s.ViewShape(op.src_piece), op.src_origin, view,
                dst.ViewShape(op.dst_piece), op.dst.origin(), op.dst.shape(),
                elem);
      }
      out[g].push_back(std::move(bytes));
    }
  }
  return out;
}

// Materializes one destination shard through Resolve() in ranges cut at
// random points, as reads of a view would.
Bytes ApplySegments(const ReshardPlan& plan, int g, int k,
                    const std::vector<std::vector<Bytes>>& src,
                    std::mt19937_64& rng) {
  const TensorShard& dst = plan.to().shards(g)[k];
  Bytes bytes(dst.bytes, std::byte{0x5a});
  for (int64_t pos = 0; pos < dst.bytes;) {
    int64_t len = std::min<int64_t>(dst.bytes - pos, 1 + rng() % 97);
    auto segments = plan.Resolve(g, k, pos, len);
    EXPECT_TRUE(segments.ok()) << segments.status();
    int64_t expect = pos;
    for (const Segment& seg : *segments) {
      EXPECT_EQ(seg.dst_offset, expect);
      if (seg.src.valid()) {
        std::memcpy(&bytes[seg.dst_offset],
                    &src[seg.src.group][seg.src.shard][seg.src_offset],
                    seg.length);
      } else {
        std::memset(&bytes[seg.dst_offset], 0, seg.length);
      }
      expect += seg.length;
    }
    EXPECT_EQ(expect, pos + len);
    pos += len;
  }
  return bytes;
}

// Every element of every destination shard is written by exactly one op.
void ExpectOpsTileEachShardOnce(const ReshardPlan& plan) {
  for (int g = 0; g < plan.to().num_groups(); ++g) {
    for (size_t k = 0; k < plan.to().shards(g).size(); ++k) {
      const TensorShard& dst = plan.to().shards(g)[k];
      const int64_t elems = *NumElements(dst.local_shape);
      std::vector<int> count(elems, 0);
      for (const CopyOp& op : plan.ops(g, k)) {
        const Shape& view = dst.ViewShape(op.dst_piece);
        const Shape strides = RowMajorStrides(view);
        ASSERT_TRUE(Box::Full(view).Contains(op.dst)) << op.dst.ToString();
        ASSERT_LE(dst.ViewOffset(op.dst_piece) + *NumElements(view), elems);
        const int64_t n = *op.dst.NumElements();
        for (int64_t e = 0; e < n; ++e) {
          int64_t rest = e, flat = dst.ViewOffset(op.dst_piece);
          for (int d = op.dst.rank() - 1; d >= 0; --d) {
            flat += (op.dst.begin(d) + rest % op.dst.shape()[d]) * strides[d];
            rest /= op.dst.shape()[d];
          }
          ++count[flat];
        }
      }
      for (int64_t e = 0; e < elems; ++e) {
        ASSERT_EQ(count[e], 1)
            << "tensor " << dst.local_name << " element " << e;
      }
    }
  }
}

// Bytes of rank r's new shard that old rank r holds, computed from the oracle.
int64_t OracleKept(const Scenario& s, const std::vector<OracleGroup>& a, int ga,
                   const std::vector<OracleGroup>& b, int gb) {
  int64_t kept = 0;
  for (const auto& [name, shard] : b[gb]) {
    const TensorInfo& t = s.model->tensor(shard.tensor);
    std::vector<bool> held(*NumElements(t.shape), false);
    if (ga >= 0) {
      for (const auto& [n2, old] : a[ga]) {
        if (old.tensor != shard.tensor) continue;
        for (int64_t e : old.elements) {
          if (e >= 0) held[e] = true;
        }
      }
    }
    for (int64_t e : shard.elements)
      kept += (e < 0 || held[e]) ? DTypeSize(t.dtype) : 0;
  }
  return kept;
}

class ReshardPlanProperty : public ::testing::TestWithParam<int> {};

TEST_P(ReshardPlanProperty, PlanTurnsShardsOfAIntoShardsOfBAndBack) {
  std::mt19937_64 rng(GetParam());
  Scenario s = RandomScenario(rng);
  // Draw configs until the layout accepts them; refusals are tested elsewhere.
  auto draw =
      [&]() -> std::pair<ParallelConfig, std::shared_ptr<const Placement>> {
    for (;;) {
      ParallelConfig c = RandomConfig(rng, s.layers);
      auto p = Placement::Create(s.layout, s.model, c);
      if (p.ok()) return {c, std::make_shared<const Placement>(*std::move(p))};
    }
  };
  auto [ca, pa] = draw();
  auto [cb, pb] = draw();
  SCOPED_TRACE(absl::StrCat(s.layout_name, " layers=", s.layers, " ",
                            ca.ToString(), " -> ", cb.ToString(),
                            " divisor=", s.vocab_divisor, " gated=", s.gated));
  std::vector<OracleGroup> oa = OracleGroups(s, ca), ob = OracleGroups(s, cb);
  // Ranks share a group exactly when they share (tp_rank, pp_rank,
  // dp_rank % fsdp), numbered as the oracle numbers its groups.
  for (const ParallelConfig& c : {ca, cb}) {
    for (int r = 0; r < c.world_size(); ++r) {
      const int tp_rank = r % c.tp(), dp_rank = r / c.tp() % c.dp(),
                pp_rank = r / (c.tp() * c.dp());
      const int shards = c.distopt() ? c.dp() : c.fsdp();
      ASSERT_EQ(c.ShardGroup(r),
                (pp_rank * c.tp() + tp_rank) * shards + dp_rank % shards)
          << c.ToString() << " rank " << r;
      EXPECT_EQ(c.SavesShard(r), dp_rank < shards);
      if (c.SavesShard(r)) {
        EXPECT_EQ(c.SaverOfGroup(c.ShardGroup(r)), r);
      }
    }
  }
  ExpectPlacementMatches(*pa, oa);
  ExpectPlacementMatches(*pb, ob);
  if (HasFatalFailure()) return;

  auto ab = ReshardPlan::Create(pa, pb);
  ASSERT_TRUE(ab.ok()) << ab.status();
  ExpectOpsTileEachShardOnce(*ab);
  if (HasFatalFailure()) return;
  const auto bytes_a = OracleBytes(*pa, oa);
  const auto bytes_b = OracleBytes(*pb, ob);
  const auto got_b = ApplyOps(*ab, bytes_a);
  for (int g = 0; g < pb->num_groups(); ++g) {
    for (size_t k = 0; k < pb->shards(g).size(); ++k) {
      ASSERT_EQ(got_b[g][k], bytes_b[g][k])
          << "ops: group " << g << " " << pb->shards(g)[k].local_name;
      ASSERT_EQ(ApplySegments(*ab, g, static_cast<int>(k), bytes_a, rng),
                bytes_b[g][k])
          << "segments: group " << g << " " << pb->shards(g)[k].local_name;
    }
  }

  // Back again: A -> B -> A is the identity.
  auto ba = ReshardPlan::Create(pb, pa);
  ASSERT_TRUE(ba.ok()) << ba.status();
  EXPECT_EQ(ApplyOps(*ba, got_b), bytes_a);

  // Accounting: totals add up, and "kept" is what the same-numbered old rank
  // holds.
  PlanSummary sum = ab->Summarize();
  ASSERT_EQ(static_cast<int>(sum.ranks.size()), cb.world_size());
  int64_t total = 0;
  for (const RankTraffic& r : sum.ranks) {
    const int gb = cb.ShardGroup(r.rank);
    const int ga = r.rank < ca.world_size() ? ca.ShardGroup(r.rank) : -1;
    EXPECT_EQ(r.bytes_total, pb->group_bytes(gb));
    EXPECT_EQ(r.bytes_kept + r.bytes_fetched, r.bytes_total);
    EXPECT_EQ(r.bytes_kept, OracleKept(s, oa, ga, ob, gb)) << "rank " << r.rank;
    total += r.bytes_total;
  }
  EXPECT_EQ(sum.bytes_total, total);
  int64_t unique = 0;
  for (int g = 0; g < pb->num_groups(); ++g) unique += pb->group_bytes(g);
  EXPECT_LE(sum.bytes_to_write, unique);
  // A shard reused in place must really be byte-identical.
  for (int g = 0; g < pb->num_groups(); ++g) {
    for (size_t k = 0; k < pb->shards(g).size(); ++k) {
      ShardRef src = ab->in_place_source(g, static_cast<int>(k));
      if (src.valid()) {
        EXPECT_EQ(bytes_a[src.group][src.shard], bytes_b[g][k]);
      }
    }
  }
}

// Every config whose tp cuts an attention head or a query group is refused
// for saying so; the ones the plan test draws therefore keep them whole.
TEST_P(ReshardPlanProperty, RefusesExactlyTheTpsThatCutHeadsOrGroups) {
  std::mt19937_64 rng(GetParam() + 1000);
  Scenario s = RandomScenario(rng);
  for (int i = 0; i < 20; ++i) {
    ParallelConfig c = RandomConfig(rng, s.layers);
    SCOPED_TRACE(absl::StrCat(s.layout_name, " heads=", s.heads,
                              " groups=", s.groups, " ", c.ToString()));
    auto p = Placement::Create(s.layout, s.model, c);
    const bool whole = s.heads % c.tp() == 0 && s.groups % c.tp() == 0;
    if (!whole) {
      ASSERT_FALSE(p.ok());
      EXPECT_THAT(std::string(p.status().message()),
                  ::testing::HasSubstr(
                      absl::StrCat(" cannot be split across tp=", c.tp())));
    } else if (!p.ok()) {
      EXPECT_THAT(std::string(p.status().message()),
                  ::testing::Not(::testing::HasSubstr("cannot be split")));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RandomModels, ReshardPlanProperty,
                         ::testing::Range(1, 301));

TEST(ReshardPlan, PureDataParallelChangeMovesNothing) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 100; ++trial) {
    Scenario s = RandomScenario(rng);
    ParallelConfig a = RandomConfig(rng, s.layers);
    auto pa = Placement::Create(s.layout, s.model, a);
    if (!pa.ok()) continue;
    auto b =
        *ParallelConfig::Create(a.tp(), a.pp(), a.dp() % 16 + 1, a.stages());
    // Under fsdp, the runs that hold one copy each stay as they were;
    // under distopt the optimizer state is cut anew, so it moves.
    if (b.dp() % a.fsdp() != 0 || a.distopt()) continue;
    b = *b.WithFsdp(a.fsdp());
    auto pb = Placement::Create(s.layout, s.model, b);
    ASSERT_TRUE(pb.ok()) << pb.status();
    SCOPED_TRACE(a.ToString() + " -> " + b.ToString());
    auto plan = ReshardPlan::Create(std::make_shared<const Placement>(*pa),
                                    std::make_shared<const Placement>(*pb));
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->Summarize().bytes_to_write, 0);
  }
}

TEST(ReshardPlan, DataParallelGrowthFetchesOnlyForNewRanks) {
  auto layout = *Layout::Load("megatron-core-gpt");
  auto spec = *ModelSpec::Parse("layers=4,hidden=64,heads=4,vocab=500");
  ASSERT_TRUE(spec.ApplyParams(layout).ok());
  auto model = std::make_shared<const Model>(*spec.Build(layout, DType::kBF16));
  auto from = std::make_shared<const Placement>(*Placement::Create(
      layout, model, *ParallelConfig::Parse("tp=2,pp=2,dp=1")));
  auto to = std::make_shared<const Placement>(*Placement::Create(
      layout, model, *ParallelConfig::Parse("tp=2,pp=2,dp=2")));
  PlanSummary s = ReshardPlan::Create(from, to)->Summarize();
  EXPECT_EQ(s.bytes_to_write, 0);
  // Ranks 0..3 of the old job exist; under dp=2, ranks 0,1 keep (pp 0, same
  // tp); ranks 2,3 are dp replicas of pp 0 but old ranks 2,3 were pp 1.
  EXPECT_EQ(s.ranks[0].bytes_fetched, 0);
  EXPECT_EQ(s.ranks[1].bytes_fetched, 0);
  EXPECT_EQ(s.ranks[2].bytes_kept, 0);
  EXPECT_EQ(s.ranks[4].bytes_kept, 0);  // a new rank holds nothing yet
  EXPECT_EQ(s.ranks[4].bytes_fetched, s.ranks[4].bytes_total);
}

}  // namespace
}  // namespace scalai
