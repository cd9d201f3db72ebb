#include "ptc/parallel_config.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace scalai {
namespace {

using ::testing::HasSubstr;

TEST(ParallelConfig, ParsesAndFormats) {
  auto c = ParallelConfig::Parse("tp=2,pp=4,dp=8");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tp(), 2);
  EXPECT_EQ(c->pp(), 4);
  EXPECT_EQ(c->dp(), 8);
  EXPECT_EQ(c->world_size(), 64);
  EXPECT_EQ(c->ToString(), "tp=2,pp=4,dp=8");
}

TEST(ParallelConfig, AcceptsAnyKeyOrderStagesAndEchoNewline) {
  auto c = ParallelConfig::Parse("dp=2,stages=3:2:2,pp=3,tp=1\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->stages(), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(c->ToString(), "tp=1,pp=3,dp=2,stages=3:2:2");
  EXPECT_EQ(*ParallelConfig::Parse(c->ToString()), *c);
}

struct BadConfig {
  const char* text;
  const char* message;
};

class ParallelConfigRefuses : public ::testing::TestWithParam<BadConfig> {};

TEST_P(ParallelConfigRefuses, WithAMessageNamingTheFault) {
  auto c = ParallelConfig::Parse(GetParam().text);
  ASSERT_FALSE(c.ok()) << GetParam().text;
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ParallelConfigRefuses,
    ::testing::Values(
        BadConfig{"", "empty"}, BadConfig{"banana", "not key=value"},
        BadConfig{"tp=2,pp=2", "missing dp="},
        BadConfig{"tp=0,pp=1,dp=1", "tp=0 must be at least 1"},
        BadConfig{"tp=-2,pp=1,dp=1", "tp=-2 must be at least 1"},
        BadConfig{"tp=two,pp=1,dp=1", "tp=two is not a number"},
        BadConfig{"tp=2x,pp=1,dp=1", "tp=2x is not a number"},
        BadConfig{"tp=2,pp=1,dp=1,ep=2", "unknown key \"ep\""},
        BadConfig{"tp=2,tp=2,pp=1,dp=1", "tp given twice"},
        BadConfig{"tp=1,pp=2,dp=1,stages=3", "stages lists 1 stages but pp=2"},
        BadConfig{"tp=1,pp=2,dp=1,stages=3:0", "stages=0 must be at least 1"},
        BadConfig{"tp=1,pp=2,dp=1,stages=3:x", "stages=x is not a number"},
        BadConfig{"tp=4096,pp=4096,dp=4096", "exceeds"},
        BadConfig{"tp=99999999999,pp=1,dp=1", "too large"}));

TEST(ParallelConfig, MegatronRankOrder) {
  auto c = *ParallelConfig::Parse("tp=2,pp=3,dp=4");
  // rank = (pp_rank * dp + dp_rank) * tp + tp_rank
  EXPECT_EQ(c.Coords(0), (RankCoords{0, 0, 0}));
  EXPECT_EQ(c.Coords(1), (RankCoords{1, 0, 0}));
  EXPECT_EQ(c.Coords(2), (RankCoords{0, 1, 0}));
  EXPECT_EQ(c.Coords(8), (RankCoords{0, 0, 1}));
  EXPECT_EQ(c.Coords(23), (RankCoords{1, 3, 2}));
  for (int r = 0; r < c.world_size(); ++r) {
    EXPECT_EQ(c.Rank(c.Coords(r)), r);
    RankCoords rc = c.Coords(r);
    EXPECT_EQ(c.ShardGroup(r), rc.pp_rank * c.tp() + rc.tp_rank);
  }
}

TEST(ParallelConfig, DefaultStagesAreEvenWithEarlierStagesTakingTheRemainder) {
  auto c = *ParallelConfig::Parse("tp=1,pp=4,dp=1");
  EXPECT_EQ(*c.LayersPerStage(10), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(*c.LayersPerStage(4), (std::vector<int64_t>{1, 1, 1, 1}));
}

TEST(ParallelConfig, StagesMustFitTheModel) {
  auto c = *ParallelConfig::Parse("tp=1,pp=4,dp=1");
  auto too_few = c.LayersPerStage(3);
  ASSERT_FALSE(too_few.ok());
  EXPECT_THAT(std::string(too_few.status().message()),
              HasSubstr("pp=4 needs at least 4 layers but the model has 3"));
  auto explicit_stages = *ParallelConfig::Parse("tp=1,pp=2,dp=1,stages=5:4");
  EXPECT_EQ(*explicit_stages.LayersPerStage(9), (std::vector<int64_t>{5, 4}));
  auto wrong_sum = explicit_stages.LayersPerStage(10);
  ASSERT_FALSE(wrong_sum.ok());
  EXPECT_THAT(std::string(wrong_sum.status().message()),
              HasSubstr("stages=5:4 sum to 9 layers but the model has 10"));
}

}  // namespace
}  // namespace scalai
