// A StepSnapshot beside the store's writer: a snapshot reads on after the
// writer retires the step's blobs (a reconfiguration commits), a catalog
// read before such a commit is taken again, and a blob lost from the disk
// is reported, not waited for. An export of a step this store holds only
// part of (a cluster's host) is refused.
#include "transfer/step_snapshot.h"

#include <optional>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "tests/store_fixture.h"
#include "transfer/exporter.h"

namespace scalai {
namespace {

class StepSnapshotTest : public StoreFixture {
 protected:
  // Every rank's exported model.safetensors under tp=2,pp=2,dp=1 (a config
  // the step is stored under at no time here), concatenated.
  absl::StatusOr<std::string> Export(const StepSnapshot& step,
                                     const std::string& name) {
    const ParallelConfig config = *ParallelConfig::Parse("tp=2,pp=2,dp=1");
    ExportOptions o;
    o.out = (dir_ / name).string();
    o.config = config;
    auto exported = ExportCheckpoint(step, o);
    if (!exported.ok()) return exported.status();
    std::string all;
    for (int rank = 0; rank < config.world_size(); ++rank) {
      all += ReadAll(o.out +
                     absl::StrFormat("/rank-%05d/model.safetensors", rank));
    }
    return all;
  }

  std::string Reference() {
    auto step = StepSnapshot::Take(*store_, std::nullopt);
    EXPECT_TRUE(step.ok()) << step.status();
    auto bytes = Export(*step, "reference");
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *bytes : "";
  }
};

TEST_F(StepSnapshotTest, ReadsOnAfterItsBlobsAreRetired) {
  const std::string want = Reference();
  auto step = StepSnapshot::Open(store_dir(), std::nullopt);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->step().config, saved_config().ToString());
  Reconfigure("tp=1,pp=1,dp=1");
  auto got = Export(*step, "after");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, want);
}

TEST_F(StepSnapshotTest, TakesTheStepAgainWhenItsBlobsWentMeanwhile) {
  const std::string want = Reference();
  // A catalog read before the commit names the blobs it retired.
  auto before = Store::Open(store_dir(), Store::Access::kReadOnly);
  ASSERT_TRUE(before.ok()) << before.status();
  const std::set<std::string> freed = Reconfigure("tp=1,pp=1,dp=1");
  auto stale = StepSnapshot::Take(**before, std::nullopt);
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_EQ(stale->missing(), freed);

  // Open's first catalog is that one; its second is read after the commit.
  int opens = 0;
  auto step = StepSnapshot::Open(
      [&]() -> absl::StatusOr<std::unique_ptr<Store>> {
        if (++opens == 1) return std::move(*before);
        return Store::Open(store_dir(), Store::Access::kReadOnly);
      },
      std::nullopt);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(opens, 2);
  EXPECT_TRUE(step->missing().empty());
  EXPECT_EQ(step->step().config, "tp=1,pp=1,dp=1");
  auto got = Export(*step, "after");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, want);
}

// A writer that retires the step's blobs between every catalog read and
// the blobs' opens (a job reconfigured without pause) wears Open out.
TEST_F(StepSnapshotTest, GivesUpOnAWriterThatNeverStops) {
  int opens = 0;
  auto step = StepSnapshot::Open(
      [&]() -> absl::StatusOr<std::unique_ptr<Store>> {
        auto stale = Store::Open(store_dir(), Store::Access::kReadOnly);
        Reconfigure(++opens % 2 == 1 ? "tp=1,pp=1,dp=1" : "tp=2,pp=1,dp=1");
        return stale;
      },
      std::nullopt);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kUnavailable)
      << step.status();
  EXPECT_NE(step.status().message().find("during each of 20 tries"),
            std::string::npos)
      << step.status();
  EXPECT_EQ(opens, StepSnapshot::kTries);
}

TEST_F(StepSnapshotTest, ALostBlobIsReportedNotWaitedFor) {
  const std::string lost = store_->Shard(42, 1)->blobs[0];
  fs::remove(store_->BlobPath(lost));
  auto step = StepSnapshot::Open(store_dir(), std::nullopt);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->missing(), std::set<std::string>{lost});
  auto got = Export(*step, "out");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_NE(got.status().message().find(lost), std::string::npos)
      << got.status();
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

// A cluster's host holds only its groups of the step; the others' shards
// are on other hosts, out of an export's reach.
TEST_F(StepSnapshotTest, AnExportOfAStepHeldInPartIsRefused) {
  Materialization::Options o;
  o.hold = std::vector<int>{0};
  auto m = Materialization::Write(
      *store_, *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b"), o);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->Commit(*store_).ok());
  auto step = StepSnapshot::Open(store_dir(), std::nullopt);
  ASSERT_TRUE(step.ok()) << step.status();
  auto got = Export(*step, "out");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition)
      << got.status();
  EXPECT_NE(got.status().message().find(
                "step 42: this store holds 1 of its 2 shard groups"),
            std::string::npos)
      << got.status();
  EXPECT_NE(got.status().message().find("out of the cluster's mount"),
            std::string::npos)
      << got.status();
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

TEST_F(StepSnapshotTest, AStepThatIsGoneIsNamed) {
  auto step = StepSnapshot::Open(store_dir(), 41);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kNotFound) << step.status();
}

}  // namespace
}  // namespace scalai
