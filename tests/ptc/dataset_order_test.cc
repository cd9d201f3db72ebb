// The dataset order of docs/reference.md ("Dataset position"): every epoch a
// bijection of the samples, chosen by the seed; batches split among
// data-parallel ranks as docs/reference.md says; and a job whose dp changes between
// batches consumes exactly the global batches of an unchanged job.
#include "ptc/dataset_order.h"

#include <vector>

#include "gtest/gtest.h"

namespace scalai {
namespace {

TEST(DatasetOrderTest, EveryEpochIsAPermutation) {
  for (int64_t n : {1, 2, 3, 5, 7, 64, 65, 1000, 4097, 100003}) {
    DatasetOrder order = *DatasetOrder::Create(n, 1, 42, 3);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::vector<int> seen(n, 0);
      for (int64_t i = 0; i < n; ++i) {
        int64_t s = order.SampleAt(epoch * n + i);
        ASSERT_GE(s, 0);
        ASSERT_LT(s, n);
        ++seen[s];
      }
      for (int64_t s = 0; s < n; ++s) ASSERT_EQ(seen[s], 1) << n << " " << s;
    }
  }
}

TEST(DatasetOrderTest, TheSeedAndTheEpochChooseTheOrder) {
  const int64_t n = 1000;
  DatasetOrder a = *DatasetOrder::Create(n, 10, 1, 2);
  DatasetOrder same = *DatasetOrder::Create(n, 10, 1, 2);
  DatasetOrder other = *DatasetOrder::Create(n, 10, 2, 2);
  int differ_seed = 0, differ_epoch = 0, fixed_points = 0;
  for (int64_t p = 0; p < n; ++p) {
    EXPECT_EQ(a.SampleAt(p), same.SampleAt(p));
    differ_seed += a.SampleAt(p) != other.SampleAt(p);
    differ_epoch += a.SampleAt(p) != a.SampleAt(n + p);
    fixed_points += a.SampleAt(p) == p;
  }
  EXPECT_GT(differ_seed, 900);
  EXPECT_GT(differ_epoch, 900);
  EXPECT_LT(fixed_points, 20);  // shuffled, not the identity
}

TEST(DatasetOrderTest, HugeDatasetsNeedNoMemory) {
  const int64_t n = int64_t{1} << 40;
  DatasetOrder order = *DatasetOrder::Create(n + 3, 4096, 7, 1000);
  for (int64_t p : {int64_t{0}, n / 3, n - 1, order.total_positions() - 1}) {
    int64_t s = order.SampleAt(p);
    EXPECT_GE(s, 0);
    EXPECT_LT(s, n + 3);
  }
}

TEST(DatasetOrderTest, PartialBatchesAreDropped) {
  DatasetOrder order = *DatasetOrder::Create(103, 10, 5, 2);
  EXPECT_EQ(order.batches_per_epoch(), 10);
  EXPECT_EQ(order.dropped_per_epoch(), 3);
  EXPECT_EQ(order.total_positions(), 200);
  // Each epoch's 100 positions are 100 distinct samples.
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<int> seen(103, 0);
    for (int p = 0; p < 100; ++p) ++seen[order.SampleAt(epoch * 100 + p)];
    int once = 0;
    for (int c : seen) {
      EXPECT_LE(c, 1);
      once += c;
    }
    EXPECT_EQ(once, 100);
  }
}

TEST(DatasetOrderTest, RefusesWhatCannotBeServed) {
  EXPECT_FALSE(DatasetOrder::Create(0, 1, 0).ok());
  EXPECT_FALSE(DatasetOrder::Create(10, 0, 0).ok());
  EXPECT_FALSE(DatasetOrder::Create(10, 11, 0).ok());
  EXPECT_FALSE(DatasetOrder::Create(10, 5, 0, 0).ok());
  DatasetOrder order = *DatasetOrder::Create(100, 6, 0);
  EXPECT_TRUE(order.CheckDp(6).ok());
  absl::Status s = order.CheckDp(7);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("global batch 6 is smaller than dp=7"),
            absl::string_view::npos)
      << s;
  EXPECT_FALSE(order.CheckDp(0).ok());
}

TEST(DatasetOrderTest, SlicesTileEveryBatchAsSpecSays) {
  for (int64_t b = 1; b <= 13; ++b) {
    DatasetOrder order = *DatasetOrder::Create(100, b, 0);
    for (int dp = 1; dp <= b; ++dp) {
      int64_t next = 0;
      for (int d = 0; d < dp; ++d) {
        BatchSlice s = order.Slice(dp, d);
        EXPECT_EQ(s.offset, next);
        EXPECT_EQ(s.count, b / dp + (d < b % dp ? 1 : 0)) << b << " " << dp;
        next += s.count;
      }
      EXPECT_EQ(next, b);
    }
  }
}

// Training with dp changing between steps (4 -> 3 -> 8 -> 1, global batch
// not divisible by most of them) across two epochs: the batches the ranks
// consume together are exactly the unchanged job's.
TEST(DatasetOrderTest, ChangingDpNeitherRepeatsNorSkips) {
  const int64_t b = 10;
  DatasetOrder order = *DatasetOrder::Create(103, b, 9, 2);
  struct Phase {
    int dp;
    int steps;
  };
  const std::vector<Phase> phases = {{4, 3}, {3, 5}, {8, 6}, {1, 6}};
  std::vector<int64_t> consumed;
  int64_t position = 0;
  for (const Phase& phase : phases) {
    ASSERT_TRUE(order.CheckDp(phase.dp).ok());
    for (int step = 0; step < phase.steps; ++step) {
      // Each rank reads its next slice from the views computed at `position`.
      std::vector<int64_t> batch;
      for (int d = 0; d < phase.dp; ++d) {
        const int64_t count = order.Slice(phase.dp, d).count;
        for (int64_t j = 0; j < count; ++j) {
          batch.push_back(
              order.RankSample(position, phase.dp, d, step * count + j));
        }
      }
      ASSERT_EQ(static_cast<int64_t>(batch.size()), b);
      consumed.insert(consumed.end(), batch.begin(), batch.end());
    }
    position += phase.steps * b;  // the committed step's position
  }
  ASSERT_EQ(position, order.total_positions());
  for (int64_t p = 0; p < position; ++p) {
    ASSERT_EQ(consumed[p], order.SampleAt(p)) << p;
  }
  for (const Phase& phase : phases) {
    int64_t total = 0;
    for (int d = 0; d < phase.dp; ++d)
      total += order.RankSamples(0, phase.dp, d);
    EXPECT_EQ(total, order.total_positions());
  }
}

}  // namespace
}  // namespace scalai
