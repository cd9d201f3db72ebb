// The live reshard over the host reference transport (threads for GPUs,
// queues for NCCL): for random models and plans (both layouts, GQA,
// SwiGLU, vocab padding, uneven stages, tp/pp/dp changes, fsdp and
// distopt), every rank of A ∪ B runs its part at once from the oracle's A
// bytes, and every B byte must equal the oracle's direct cut, each written
// once; every send is received, at the size the receiver expected.
#include "transfer/live_reshard.h"

#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/ptc/plan_oracle.h"

namespace scalai {
namespace {

using namespace oracle;  // NOLINT: the oracle is this test's vocabulary

class LiveReshardProperty : public ::testing::TestWithParam<int> {};

TEST_P(LiveReshardProperty, EveryRankGetsItsDirectCutEachByteOnce) {
  std::mt19937_64 rng(GetParam());
  Scenario s = RandomScenario(rng);
  std::shared_ptr<const Placement> pa = RandomPlacement(rng, s, 24);
  std::shared_ptr<const Placement> pb = RandomPlacement(rng, s, 24);
  const ParallelConfig& ca = pa->config();
  const ParallelConfig& cb = pb->config();
  // Small rounds cut boxes and messages; large ones send each whole.
  LiveSchedule::Options options;
  options.round_bytes = std::vector<int64_t>{64, 1000, 1 << 20}[rng() % 3];
  // A quarter of the plans send each rank's own bytes to itself, as the
  // one-GPU check does through NCCL.
  options.local_through_transport = rng() % 4 == 0;
  SCOPED_TRACE(
      absl::StrCat(s.layout_name, " ", ca.ToString(), " -> ", cb.ToString(),
                   " round_bytes ", options.round_bytes,
                   options.local_through_transport ? " self messages" : ""));
  auto plan = ReshardPlan::Create(pa, pb);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto schedule = LiveSchedule::Create(*plan, options);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  const auto bytes_a = OracleBytes(*pa, OracleGroups(s, ca));
  const auto bytes_b = OracleBytes(*pb, OracleGroups(s, cb));

  const int world = schedule->world();
  HostTransport transport(world, absl::Seconds(30));
  std::vector<std::vector<std::vector<std::byte>>> got(world);
  std::vector<absl::StatusOr<LiveTraffic>> traffic(world, LiveTraffic());
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      static const std::vector<std::vector<std::byte>> kNone;
      const auto& a = r < ca.world_size() ? bytes_a[ca.ShardGroup(r)] : kNone;
      traffic[r] = RunLiveReshard(*schedule, r, a, got[r], transport);
    });
  }
  for (std::thread& t : ranks) t.join();
  int64_t sent = 0, received = 0;
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(traffic[r].ok()) << "rank " << r << ": " << traffic[r].status();
    sent += traffic[r]->sent_bytes;
    received += traffic[r]->received_bytes;
    if (r >= cb.world_size()) {
      EXPECT_TRUE(got[r].empty()) << "rank " << r << " is not in B";
      continue;
    }
    const int g = cb.ShardGroup(r);
    ASSERT_EQ(got[r].size(), bytes_b[g].size()) << "rank " << r;
    for (size_t k = 0; k < got[r].size(); ++k) {
      ASSERT_EQ(got[r][k], bytes_b[g][k])
          << "rank " << r << " " << pb->shards(g)[k].local_name;
    }
    // Each destination byte written once: what the rank wrote adds up to
    // its shard.
    EXPECT_EQ(traffic[r]->local_bytes + traffic[r]->received_bytes,
              pb->group_bytes(g))
        << "rank " << r;
  }
  EXPECT_EQ(sent, received);
  EXPECT_EQ(transport.unclaimed(), 0);
}

INSTANTIATE_TEST_SUITE_P(RandomPlans, LiveReshardProperty,
                         ::testing::Range(1, 301));

// A receive of another size than was sent, and one that no send meets,
// fail naming the ranks, instead of corrupting or hanging.
TEST(HostTransport, RefusesAMessageOfAnotherSizeAndEndsAWaitForNone) {
  HostTransport transport(2, absl::Milliseconds(200));
  std::vector<std::byte> three(3), four(4);
  ASSERT_TRUE(transport.Exchange(0, {{1, three.data(), 3}}, {}).ok());
  absl::Status wrong = transport.Exchange(1, {}, {{0, four.data(), 4}});
  EXPECT_THAT(
      std::string(wrong.message()),
      ::testing::HasSubstr("rank 0 sent 3 bytes to rank 1, which expected 4"));
  absl::Status none = transport.Exchange(1, {}, {{0, four.data(), 4}});
  EXPECT_EQ(none.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(none.message()),
              ::testing::HasSubstr("for a message from rank 0"));
  EXPECT_EQ(transport.unclaimed(), 0);
}

}  // namespace
}  // namespace scalai
