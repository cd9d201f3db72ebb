#include "ptc/parallel_config.h"

#include <random>

#include "absl/strings/str_cat.h"
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

TEST(ParallelConfig, HostsRunContiguousBlocksOfRanks) {
  auto c = ParallelConfig::Parse("tp=2,pp=2,dp=2,hosts=h0+gpu-1+h_2+h3");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hosts(), (std::vector<std::string>{"h0", "gpu-1", "h_2", "h3"}));
  EXPECT_EQ(c->ToString(), "tp=2,pp=2,dp=2,hosts=h0+gpu-1+h_2+h3");
  EXPECT_EQ(*ParallelConfig::Parse(c->ToString()), *c);
  // 8 ranks on 4 hosts: two each, in rank order.
  std::vector<int> host_of;
  for (int rank = 0; rank < 8; ++rank) host_of.push_back(c->HostOfRank(rank));
  EXPECT_EQ(host_of, (std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3}));
  for (int host = 0; host < 4; ++host) {
    EXPECT_EQ(c->RanksOfHost(host), std::pair(2 * host, 2 * host + 1));
  }
  // The hosts are part of the config: another order is another config.
  EXPECT_NE(*ParallelConfig::Parse("tp=2,pp=2,dp=2,hosts=h3+gpu-1+h_2+h0"), *c);
  auto plain = ParallelConfig::Parse("tp=2,pp=2,dp=2");
  EXPECT_TRUE(plain->hosts().empty());
  EXPECT_EQ(plain->HostOfRank(7), 0);
  EXPECT_EQ(plain->RanksOfHost(0), std::pair(0, 7));
  EXPECT_EQ(*c->WithHosts({}), *plain);
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
        BadConfig{"tp=99999999999,pp=1,dp=1", "too large"},
        BadConfig{"tp=2,pp=1,dp=1,hosts=a+a", "host a is listed twice"},
        BadConfig{"tp=2,pp=1,dp=2,hosts=a+b+c",
                  "world size 4 cannot be split over 3 hosts"},
        BadConfig{"tp=2,pp=1,dp=1,hosts=a++b", "host name \"\""},
        BadConfig{"tp=2,pp=1,dp=1,hosts=", "host name \"\""},
        BadConfig{"tp=2,pp=1,dp=1,hosts=a,hosts=b", "hosts given twice"},
        BadConfig{"tp=2,pp=1,dp=1,hosts=a b", "host name \"a b\""},
        BadConfig{"tp=1,pp=1,dp=6,fsdp=4", "fsdp=4 must divide dp=6"},
        BadConfig{"tp=1,pp=1,dp=4,fsdp=0", "fsdp=0 must be at least 1"},
        BadConfig{"tp=1,pp=1,dp=4,fsdp=2,fsdp=2", "fsdp given twice"},
        BadConfig{"tp=1,pp=1,dp=4,distopt=2", "distopt=2 must be 0 or 1"},
        BadConfig{"tp=1,pp=1,dp=4,distopt=1,distopt=1", "distopt given twice"},
        BadConfig{"tp=1,pp=1,dp=4,fsdp=2,distopt=1",
                  "fsdp and distopt=1 exclude each other"}));

TEST(ParallelConfig, DistoptGivesEveryDpRankItsOwnGroup) {
  auto c = ParallelConfig::Parse("dp=3,distopt=1,tp=2,pp=2");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->distopt());
  EXPECT_EQ(c->ToString(), "tp=2,pp=2,dp=3,distopt=1");
  EXPECT_EQ(*ParallelConfig::Parse(c->ToString()), *c);
  EXPECT_EQ(c->num_shard_groups(), 12);
  for (int rank = 0; rank < c->world_size(); ++rank) {
    EXPECT_TRUE(c->SavesShard(rank));
    EXPECT_EQ(c->SaverOfGroup(c->ShardGroup(rank)), rank);
  }
  // Rank 5: tp_rank 1, dp_rank 2, pp_rank 0: group (0 * 2 + 1) * 3 + 2.
  EXPECT_EQ(c->ShardGroup(5), 5);
  EXPECT_EQ(c->DescribeRank(5), "rank 5 (tp_rank 1, pp_rank 0, dp_rank 2)");
  EXPECT_EQ(ParallelConfig::Parse("tp=1,pp=1,dp=2,distopt=0")->ToString(),
            "tp=1,pp=1,dp=2");
}

TEST(ParallelConfig, FsdpGroupsRanksByChunkAndTheFirstRunSaves) {
  auto c = ParallelConfig::Parse("tp=2,pp=2,dp=4,fsdp=2");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->fsdp(), 2);
  EXPECT_EQ(c->ToString(), "tp=2,pp=2,dp=4,fsdp=2");
  EXPECT_EQ(*ParallelConfig::Parse(c->ToString()), *c);
  EXPECT_EQ(c->num_shard_groups(), 8);
  // Rank 5: tp_rank 1, dp_rank 2 (chunk 0), pp_rank 0; rank 7: dp_rank 3
  // (chunk 1). dp ranks 0 and 2 hold the same chunk.
  EXPECT_EQ(c->ShardGroup(5), 2);
  EXPECT_EQ(c->ShardGroup(7), 3);
  EXPECT_EQ(c->ShardGroup(1), c->ShardGroup(5));
  EXPECT_EQ(c->SaverOfGroup(2), 1);
  EXPECT_EQ(c->SaverOfGroup(3), 3);
  EXPECT_TRUE(c->SavesShard(3));
  EXPECT_FALSE(c->SavesShard(5));
  EXPECT_EQ(c->ChunkOfGroup(3), 1);
  // fsdp=1 is the default: replicas, written as such.
  EXPECT_EQ(ParallelConfig::Parse("tp=2,pp=2,dp=4,fsdp=1")->ToString(),
            "tp=2,pp=2,dp=4");
}

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

namespace scalai {
namespace {

ParallelConfig Config(int tp, int pp, int dp) {
  return *ParallelConfig::Create(tp, pp, dp);
}

TEST(ExtraSourceRank, SameConfigSeesItsOwnFiles) {
  const ParallelConfig c = Config(2, 2, 2);
  std::set<int> all;
  for (int r = 0; r < c.world_size(); ++r) all.insert(r);
  for (int r = 0; r < c.world_size(); ++r) {
    EXPECT_EQ(ExtraSourceRank(c, all, c, r), r);
  }
}

TEST(ExtraSourceRank, FallsBackToDataRankZeroThenRankZero) {
  const ParallelConfig saved = Config(2, 2, 2), now = Config(4, 1, 3);
  // Only the dp_rank 0 ranks saved: 0, 1 (pp 0) and 4, 5 (pp 1).
  const std::set<int> dp0 = {0, 1, 4, 5};
  for (int r = 0; r < now.world_size(); ++r) {
    const RankCoords c = now.Coords(r);
    const int want = c.tp_rank < 2 ? c.tp_rank : 0;  // pp_rank is 0 in now
    EXPECT_EQ(ExtraSourceRank(saved, dp0, now, r), want) << r;
  }
  // Same coordinates win over dp_rank 0 when that rank saved too.
  EXPECT_EQ(ExtraSourceRank(saved, {0, 1, 2, 3, 4, 5}, Config(2, 1, 2), 2), 2);
  EXPECT_EQ(ExtraSourceRank(saved, {0, 1, 4, 5}, Config(2, 1, 2), 2), 0);
}

TEST(ExtraSourceRank, NoneWhenNoCandidateSaved) {
  EXPECT_EQ(ExtraSourceRank(Config(2, 1, 1), {1}, Config(1, 1, 1), 0),
            std::nullopt);
  EXPECT_EQ(ExtraSourceRank(Config(2, 1, 1), {}, Config(2, 1, 1), 1),
            std::nullopt);
}

// Whatever the configs, the answer is a rank that saved files.
TEST(ExtraSourceRank, AlwaysNamesARankThatSaved) {
  for (int trial = 0; trial < 500; ++trial) {
    const ParallelConfig saved =
        Config(1 + trial % 3, 1 + trial / 3 % 3, 1 + trial / 9 % 3);
    const ParallelConfig now =
        Config(1 + trial / 27 % 3, 1 + trial / 81 % 3, 1 + trial % 2);
    std::set<int> some;
    for (int r = 0; r < saved.world_size(); ++r) {
      if ((r * 7 + trial) % 3 != 0) some.insert(r);
    }
    for (int r = 0; r < now.world_size(); ++r) {
      std::optional<int> got = ExtraSourceRank(saved, some, now, r);
      if (got) {
        EXPECT_TRUE(some.contains(*got));
      } else {
        EXPECT_FALSE(some.contains(0));
      }
    }
  }
}

// Issue 16: a refusal quotes the input, but only a short, printable excerpt
// of it, however long or binary the input was.
TEST(ParallelConfig, ErrorsQuoteAShortEscapedExcerpt) {
  const std::string huge = "tp=\xff\x01," + std::string(1 << 20, 'x');
  auto c = ParallelConfig::Parse(huge);
  ASSERT_FALSE(c.ok());
  const std::string message(c.status().message());
  EXPECT_LT(message.size(), 400u) << message.substr(0, 400);
  EXPECT_THAT(message, HasSubstr(absl::StrCat("(", huge.size(), " bytes)")));
  EXPECT_THAT(message, HasSubstr("tp=\\xff\\x01 is not a number"));
  for (char ch : message) {
    EXPECT_TRUE(ch >= 0x20 && ch < 0x7f) << static_cast<int>(ch);
  }
  c = ParallelConfig::Parse(std::string("tp=2,pp=1,dp=1,\x80=3"));
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("unknown key \"\\x80\""));
}

}  // namespace
}  // namespace scalai
