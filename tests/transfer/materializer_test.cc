// The plan executor on a real store: it writes exactly the plan's minimum,
// nothing for a pure data-parallel change, leaves no file when cancelled or
// dropped before its commit, refuses to commit over a step changed meanwhile,
// and after its commit the store exports the same bytes and frees the blobs
// no record names.
#include "transfer/materializer.h"

#include <filesystem>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "ptc/reshard_plan.h"
#include "tests/store_fixture.h"
#include "transfer/exporter.h"
#include "transfer/fsck.h"

namespace scalai {
namespace {

ParallelConfig Config(const char* text) { return *ParallelConfig::Parse(text); }

class MaterializerTest : public StoreFixture {
 protected:
  void SetUp() override {
    MakeStore(
        "layers=4,hidden=64,heads=4,groups=4,vocab=50,gated_linear_unit=1",
        saved_, 5);
  }

  int BlobFiles() const {
    int n = 0;
    for ([[maybe_unused]] auto& e :
         fs::directory_iterator(dir_ / "store/blobs"))
      ++n;
    return n;
  }

  int64_t Planned(const ParallelConfig& to) const {
    auto from = std::make_shared<const Placement>(
        *Placement::Create(layout_, model_, saved_));
    auto dst = std::make_shared<const Placement>(
        *Placement::Create(layout_, model_, to));
    return ReshardPlan::Create(from, dst)->Summarize().bytes_to_write;
  }

  // Every rank's exported model.safetensors under `config`, concatenated.
  std::string Export(const ParallelConfig& config, const char* name) {
    ExportOptions o;
    o.out = (dir_ / name).string();
    o.config = config;
    auto step = StepSnapshot::Take(*store_, std::nullopt);
    EXPECT_TRUE(step.ok()) << step.status();
    EXPECT_TRUE(ExportCheckpoint(*step, o).ok());
    std::string all;
    for (int g = 0; g < config.num_shard_groups(); ++g) {
      const int rank = config.Rank({g % config.tp(), 0, g / config.tp()});
      all += ReadAll(dir_ / name / absl::StrFormat("rank-%05d", rank) /
                     "model.safetensors");
    }
    return all;
  }

  const ParallelConfig saved_ = Config("tp=2,pp=2,dp=1");
};

TEST_F(MaterializerTest, WritesThePlansMinimumAndCommitsOnce) {
  const ParallelConfig to = Config("tp=1,pp=4,dp=2");
  const std::string before = Export(to, "before");
  const std::string saved_before = Export(saved_, "saved-before");
  const int files_before = BlobFiles();
  auto m = Materialization::Write(*store_, to, {});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->steps(), 1);
  EXPECT_GT(m->bytes_planned(), 0);
  EXPECT_EQ(m->bytes_planned(), Planned(to));
  EXPECT_EQ(m->bytes_written(), m->bytes_planned());
  // Written but not committed: the records still say tp=2,pp=2.
  EXPECT_EQ(store_->Steps()->front().config, saved_.ToString());
  ASSERT_TRUE(m->Commit(*store_).ok());
  EXPECT_EQ(store_->Steps()->front().config, to.ToString());
  EXPECT_EQ(store_->Steps()->front().groups, 4);
  EXPECT_FALSE(m->blobs_freed().empty());
  EXPECT_EQ(static_cast<size_t>(BlobFiles()), store_->Blobs()->size());
  EXPECT_LE(BlobFiles(), files_before + 4);
  auto problems = CheckStore(*store_, nullptr);
  ASSERT_TRUE(problems.ok());
  EXPECT_TRUE(problems->empty()) << (*problems)[0];
  EXPECT_EQ(Export(to, "after"), before);
  EXPECT_EQ(Export(saved_, "saved-after"), saved_before);
}

TEST_F(MaterializerTest, PureDataParallelChangeWritesNothing) {
  auto m = Materialization::Write(*store_, Config("tp=2,pp=2,dp=8"), {});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->steps(), 1);
  EXPECT_EQ(m->bytes_planned(), 0);
  EXPECT_EQ(m->bytes_written(), 0);
  const int files = BlobFiles();
  ASSERT_TRUE(m->Commit(*store_).ok());
  EXPECT_EQ(BlobFiles(), files);
  EXPECT_TRUE(m->blobs_freed().empty());
  // Already stored under the config: nothing left to do.
  auto again = Materialization::Write(*store_, Config("tp=2,pp=2,dp=8"), {});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->steps(), 0);
}

TEST_F(MaterializerTest, CancelledOrDroppedLeavesNoFile) {
  const int files = BlobFiles();
  std::atomic<bool> cancel{true};
  Materialization::Options o;
  o.cancel = &cancel;
  auto m = Materialization::Write(*store_, Config("tp=4,pp=1,dp=1"), o);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(BlobFiles(), files);
  {
    auto dropped =
        Materialization::Write(*store_, Config("tp=4,pp=1,dp=1"), {});
    ASSERT_TRUE(dropped.ok());
    EXPECT_GT(BlobFiles(), files);
  }
  EXPECT_EQ(BlobFiles(), files);
  EXPECT_EQ(store_->Steps()->front().config, saved_.ToString());
}

// Under a read that is never answered, each piece waits the longest a
// yield may, and the materialization still finishes with the same bytes.
TEST_F(MaterializerTest, GivesWayToReadsAndStillFinishes) {
  const ParallelConfig to = Config("tp=4,pp=1,dp=1");
  const std::string expected = Export(to, "expected");
  std::atomic<int64_t> now{0};
  ForegroundReads reads(ForegroundReads::Clock{
      [&] { return now.load(); }, [&](int64_t nanos) { now += nanos; }});
  ForegroundReads::Reading endless(&reads);
  Materialization::Options o;
  o.foreground = &reads;
  auto m = Materialization::Write(*store_, to, o);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_GT(m->bytes_written(), 0);
  // Every piece written (at most 256 KiB, headers included) waited.
  const int64_t pieces = (m->bytes_written() + (256 << 10) - 1) / (256 << 10);
  EXPECT_GE(reads.waited_nanos(), pieces * ForegroundReads::kMaxWaitNanos);
  ASSERT_TRUE(m->Commit(*store_).ok());
  EXPECT_EQ(Export(to, "after"), expected);
}

TEST_F(MaterializerTest, RefusesToCommitOverAStepChangedMeanwhile) {
  auto first = Materialization::Write(*store_, Config("tp=4,pp=1,dp=1"), {});
  auto second = Materialization::Write(*store_, Config("tp=1,pp=2,dp=1"), {});
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(second->Commit(*store_).ok());
  absl::Status s = first->Commit(*store_);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(store_->Steps()->front().config, "tp=1,pp=2,dp=1");
}

}  // namespace
}  // namespace scalai
