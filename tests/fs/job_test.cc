// The mounted job's orchestration, driven without FUSE: a reconfiguration
// switches the views at once, materialization then stores the new shards,
// and a refused config changes nothing. Bytes are checked against shards
// that synth cuts directly for the config.
#include "fs/job.h"

#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/store_fixture.h"
#include "transfer/blob_checksum.h"
#include "transfer/fsck.h"

namespace scalai {
namespace {

class JobTest : public StoreFixture {
 protected:
  std::unique_ptr<Job> MakeJob(const char* config) {
    auto tree = Tree::Build(*store_, *ParallelConfig::Parse(config), 1);
    EXPECT_TRUE(tree.ok()) << tree.status();
    Job::Options options;
    options.on_switch = [this](std::vector<std::string> names) {
      switches_.push_back(std::move(names));
    };
    return std::make_unique<Job>(*store_, std::move(*tree), options);
  }

  // Rank `rank`'s model file of `step` in `tree` holds the tensor bytes
  // of the shard cut directly under `config` (the headers' metadata differ).
  void ExpectShardEqualsDirectCut(const Tree& tree, const char* step,
                                  const ParallelConfig& config, int rank) {
    const std::string rank_name = absl::StrFormat("rank-%05d", rank);
    const Node* file =
        Walk(tree, {"ckpt", step, rank_name.c_str(), "model.safetensors"});
    ASSERT_NE(file, nullptr) << step << " " << rank_name;
    std::string got = ReadNode(tree, *file, 1 << 20);
    std::string want = DirectShardFile(config, rank);
    auto got_header =
        SafetensorsHeader::Parse(got, static_cast<int64_t>(got.size()));
    auto want_header =
        SafetensorsHeader::Parse(want, static_cast<int64_t>(want.size()));
    ASSERT_TRUE(got_header.ok()) << got_header.status();
    EXPECT_EQ(got.substr(got_header->data_start()),
              want.substr(want_header->data_start()))
        << step << " " << rank_name;
  }

  // Every rank's model file in `tree` equals the shard cut directly.
  void ExpectViewsEqualDirectCuts(const Tree& tree) {
    for (int rank = 0; rank < tree.config().world_size(); ++rank) {
      ExpectShardEqualsDirectCut(tree, "step-00000042", tree.config(), rank);
    }
  }

  // A worker of rank 0 saves its shard, cut directly, into step `step`
  // (directory `step_dir`), the step's only rank saved here.
  void SaveRank0(Job& job, uint64_t step_dir, const ParallelConfig& config,
                 int64_t step) {
    SaveArea& area = job.saves();
    auto rank = area.Mkdir(step_dir, "rank-00000");
    ASSERT_TRUE(rank.ok()) << rank.status();
    auto file = area.Create(rank->ino, "model.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    const std::string bytes = DirectShardFile(config, 0);
    ASSERT_TRUE(
        file->second->Write(bytes.data(), static_cast<int64_t>(bytes.size()), 0)
            .ok());
    absl::StatusOr<bool> complete = area.Close(file->first.ino, file->second);
    ASSERT_TRUE(complete.ok()) << complete.status();
    EXPECT_TRUE(*complete);
    ASSERT_TRUE(job.PublishStep(step).ok());
  }

  // The job becomes host `a` of a cluster of two under `hosted` (every
  // config agreed at once), saving rank 0 of each step; what it saves is
  // recorded pending and the cluster's agreement is left to the test.
  void JoinAsHostA(Job& job, const ParallelConfig& hosted) {
    job.SetAgreement(
        [](const ParallelConfig&) -> absl::StatusOr<int64_t> { return 1; });
    ASSERT_TRUE(job.Reconfigure(hosted).ok());
    ASSERT_TRUE(job.WaitMaterialized(absl::Seconds(60)));
    ASSERT_TRUE(job.SetSaveAgreement({[](const ParallelConfig&) {
                                        return std::vector<int>{0};
                                      },
                                      [](int64_t) {}})
                    .ok());
  }

  nlohmann::json Status(Job& job) {
    return nlohmann::json::parse(job.StatusText());
  }

  std::vector<std::vector<std::string>> switches_;
};

TEST_F(JobTest, ReconfigureSwitchesAtOnceAndMaterializesTheNewShards) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  for (const char* text :
       {"tp=4,pp=1,dp=1", "tp=1,pp=3,dp=2", "tp=2,pp=2,dp=1,stages=1:2"}) {
    SCOPED_TRACE(text);
    const ParallelConfig config = *ParallelConfig::Parse(text);
    const uint64_t before = job->current()->generation();
    ASSERT_TRUE(job->Reconfigure(config).ok());
    std::shared_ptr<const Tree> switched = job->current();
    EXPECT_EQ(switched->generation(), before + 1);
    EXPECT_EQ(switched->config(), config);
    // The views are right before a byte was materialized...
    ExpectViewsEqualDirectCuts(*switched);
    ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
    nlohmann::json status = Status(*job);
    EXPECT_EQ(status["state"], "ready") << status.dump();
    EXPECT_EQ(status["config"], config.ToString());
    EXPECT_TRUE(status["error"].is_null()) << status.dump();
    // ...and after: the same generation, now read from the new blobs, which
    // the store records under the new config.
    EXPECT_EQ(job->current()->generation(), before + 1);
    ExpectViewsEqualDirectCuts(*job->current());
    auto step = store_->FindStep(42);
    ASSERT_TRUE(step.ok() && step->has_value());
    EXPECT_EQ((*step)->config, config.ToString());
  }
  // The adapter heard of each switch, with the new root's names.
  ASSERT_EQ(switches_.size(), 3u);
  EXPECT_EQ(switches_.back(),
            (std::vector<std::string>{"ckpt", "config", "data", "job.json",
                                      "status"}));
}

TEST_F(JobTest, RefusedConfigChangesNothingAndSaysWhy) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
  // tp=3 does not divide the model's 4 heads.
  absl::Status refused =
      job->Reconfigure(*ParallelConfig::Parse("tp=3,pp=1,dp=1"));
  EXPECT_FALSE(refused.ok());
  EXPECT_EQ(job->current()->generation(), 1u);
  EXPECT_EQ(job->current()->config().ToString(), "tp=2,pp=1,dp=1");
  EXPECT_TRUE(switches_.empty());
  nlohmann::json status = Status(*job);
  EXPECT_EQ(status["error"], std::string(refused.message()));
  auto step = store_->FindStep(42);
  EXPECT_EQ((*step)->config, "tp=2,pp=1,dp=1");
  // The same config again changes nothing, and clears the refusal.
  ASSERT_TRUE(job->Reconfigure(*ParallelConfig::Parse("tp=2,pp=1,dp=1")).ok());
  EXPECT_EQ(job->current()->generation(), 1u);
  EXPECT_TRUE(switches_.empty());
  EXPECT_TRUE(Status(*job)["error"].is_null());
}

// A failed materialization's reason stays in `status` while its state is
// "failed", whatever clears the error meanwhile: here a step published
// under the current config, which leaves the failure standing.
TEST_F(JobTest, AFailedMaterializationKeepsItsReasonWhileFailed) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
  // Damage the middle of every blob: a tensor's bytes no longer match
  // their chunk sums, so copying them for tp=1 fails.
  for (const auto& blob : fs::directory_iterator(dir_ / "store/blobs")) {
    std::fstream f(blob.path(),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(blob.path()) / 2));
    f.write("damage", 6);
  }
  const ParallelConfig one = *ParallelConfig::Parse("tp=1,pp=1,dp=1");
  ASSERT_TRUE(job->Reconfigure(one).ok());
  ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
  nlohmann::json status = Status(*job);
  ASSERT_EQ(status["state"], "failed") << status.dump();
  ASSERT_TRUE(status["error"].is_string()) << status.dump();
  const std::string reason = status["error"];
  EXPECT_NE(reason.find("materialization of tp=1,pp=1,dp=1 failed"),
            std::string::npos)
      << reason;

  auto dir = job->saves().MkdirStep("step-00000043", one);
  ASSERT_TRUE(dir.ok()) << dir.status();
  SaveRank0(*job, dir->ino, one, 43);
  ASSERT_NE(Walk(*job->current(), {"ckpt", "step-00000043"}), nullptr);
  status = Status(*job);
  EXPECT_EQ(status["state"], "failed") << status.dump();
  EXPECT_EQ(status["error"], reason) << status.dump();
}

TEST_F(JobTest, HostsAreRefusedWithoutAClusterAndAskedOfOneWithIt) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  const ParallelConfig hosted =
      *ParallelConfig::Parse("tp=2,pp=1,dp=2,hosts=h0+h1");
  absl::Status alone = job->Reconfigure(hosted);
  EXPECT_EQ(alone.code(), absl::StatusCode::kInvalidArgument) << alone;
  EXPECT_NE(alone.message().find("without --cluster"), std::string::npos);
  EXPECT_EQ(job->current()->generation(), 1u);
  // With an agreement, it is asked; its refusal changes nothing either.
  std::vector<std::string> asked;
  job->SetAgreement([&](const ParallelConfig& c) -> absl::StatusOr<int64_t> {
    asked.push_back(c.ToString());
    if (c.hosts().size() != 2) return absl::FailedPreconditionError("no");
    return 1;
  });
  ASSERT_TRUE(job->Reconfigure(hosted).ok());
  EXPECT_EQ(job->current()->config(), hosted);
  EXPECT_FALSE(
      job->Reconfigure(*ParallelConfig::Parse("tp=2,pp=1,dp=3,hosts=a+b+c"))
          .ok());
  EXPECT_EQ(job->current()->config(), hosted);
  EXPECT_EQ(asked, (std::vector<std::string>{"tp=2,pp=1,dp=2,hosts=h0+h1",
                                             "tp=2,pp=1,dp=3,hosts=a+b+c"}));
  // A config agreed elsewhere is not asked about again, and leaves the
  // refusal of this host's write in `status` (the writer still learns why).
  ASSERT_TRUE(
      job->ApplyAgreed(*ParallelConfig::Parse("tp=1,pp=1,dp=1"), 2).ok());
  EXPECT_EQ(asked.size(), 2u);
  EXPECT_EQ(Status(*job)["error"], "no");
  ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
  // One this store cannot serve (tp=3 does not divide 4 heads) says why,
  // until a config agreed after it is served.
  EXPECT_FALSE(
      job->ApplyAgreed(*ParallelConfig::Parse("tp=3,pp=1,dp=1"), 3).ok());
  EXPECT_NE(Status(*job)["error"], "no");
  EXPECT_FALSE(Status(*job)["error"].is_null());
  ASSERT_TRUE(
      job->ApplyAgreed(*ParallelConfig::Parse("tp=2,pp=1,dp=1"), 4).ok());
  EXPECT_TRUE(Status(*job)["error"].is_null());
  ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
}

// Two hosts write configs at once: this host's is agreed first, and the
// other's, agreed after it, reaches this host (on the watch's thread)
// before this host's agreement has returned. The later config stands; a
// config agreed before it, arriving late, changes nothing.
TEST_F(JobTest, AConfigAgreedLaterStandsHoweverTheSwitchesInterleave) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  const ParallelConfig mine = *ParallelConfig::Parse("tp=1,pp=1,dp=2");
  const ParallelConfig theirs = *ParallelConfig::Parse("tp=2,pp=1,dp=2");
  job->SetAgreement([&](const ParallelConfig&) -> absl::StatusOr<int64_t> {
    EXPECT_TRUE(job->ApplyAgreed(theirs, 11).ok());
    return 10;  // this host's commit, before theirs
  });
  ASSERT_TRUE(job->Reconfigure(mine).ok());
  EXPECT_EQ(job->current()->config().ToString(), theirs.ToString());
  ASSERT_TRUE(job->ApplyAgreed(mine, 10).ok());
  EXPECT_EQ(job->current()->config().ToString(), theirs.ToString());
  const ParallelConfig next = *ParallelConfig::Parse("tp=1,pp=1,dp=1");
  ASSERT_TRUE(job->ApplyAgreed(next, 12).ok());
  EXPECT_EQ(job->current()->config().ToString(), next.ToString());
  ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
  EXPECT_EQ(job->progress().config, next.ToString());
}

// On a host of a cluster a step's part saved here waits, pending and
// unseen, until the cluster commits the step (then it shows, holding this
// host's part) or drops it (then its blobs go); ranks of other hosts are
// refused.
TEST_F(JobTest, AHostsPartOfAStepWaitsForTheCluster) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  job->SetAgreement(
      [](const ParallelConfig&) -> absl::StatusOr<int64_t> { return 1; });
  const ParallelConfig hosted =
      *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b");
  ASSERT_TRUE(job->Reconfigure(hosted).ok());
  ASSERT_TRUE(job->WaitMaterialized(absl::Seconds(60)));
  std::vector<int64_t> saved;
  ASSERT_TRUE(job->SetSaveAgreement(
                     {[](const ParallelConfig&) { return std::vector<int>{0}; },
                      [&](int64_t step) { saved.push_back(step); }})
                  .ok());
  auto save_rank0 = [&](int64_t step) {
    SaveArea& area = job->saves();
    auto dir = area.MkdirStep(absl::StrFormat("step-%08d", step), hosted);
    ASSERT_TRUE(dir.ok()) << dir.status();
    absl::StatusOr<SaveNode> other = area.Mkdir(dir->ino, "rank-00001");
    EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_NE(other.status().message().find("runs on another host"),
              std::string::npos)
        << other.status();
    SaveRank0(*job, dir->ino, hosted, step);
  };
  auto shows = [&](int64_t step) {
    return Walk(*job->current(),
                {"ckpt", absl::StrFormat("step-%08d", step).c_str()}) !=
           nullptr;
  };

  save_rank0(50);
  EXPECT_EQ(saved, std::vector<int64_t>{50});
  EXPECT_FALSE(store_->FindStep(50)->has_value());
  EXPECT_FALSE(shows(50));
  auto pending = store_->PendingSteps();
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_EQ(pending->size(), 1u);
  EXPECT_EQ((*pending)[0].record.held, std::vector<int>{0});
  EXPECT_TRUE(CheckStore(*store_, {})->empty());

  StepRecord agreed;
  agreed.step = 50;
  agreed.config = hosted.ToString();
  agreed.groups = 2;
  agreed.bytes = 1234;
  ASSERT_TRUE(job->CommitAgreedStep(agreed).ok());
  EXPECT_TRUE(store_->PendingSteps()->empty());
  const StepRecord committed = **store_->FindStep(50);
  EXPECT_EQ(committed.held, std::vector<int>{0});
  EXPECT_EQ(committed.bytes, 1234);
  ASSERT_TRUE(shows(50));
  ExpectShardEqualsDirectCut(*job->current(), "step-00000050", hosted, 0);
  EXPECT_TRUE(CheckStore(*store_, {})->empty());

  // A step the cluster drops leaves nothing behind.
  const auto blob_files = [&] {
    return std::distance(fs::directory_iterator(dir_ / "store" / "blobs"),
                         fs::directory_iterator());
  };
  const auto blobs_with_50 = blob_files();
  save_rank0(51);
  EXPECT_EQ(blob_files(), blobs_with_50 + 1);
  ASSERT_TRUE(job->DiscardSave(51).ok());
  EXPECT_TRUE(store_->PendingSteps()->empty());
  EXPECT_EQ(blob_files(), blobs_with_50);
  EXPECT_FALSE(shows(51));
  EXPECT_TRUE(CheckStore(*store_, {})->empty());
  // Its number may be saved again.
  save_rank0(51);
  EXPECT_EQ(store_->PendingSteps()->size(), 1u);
}

// A step removed before it committed (rm -r of a save that failed): a
// cluster's host lists it for the cluster to withdraw and refuses to begin
// it again until then; a single host forgets it at once.
TEST_F(JobTest, AStepRemovedOnAHostWaitsForTheClusterToWithdrawIt) {
  const ParallelConfig single = *ParallelConfig::Parse("tp=2,pp=1,dp=1");
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  const auto begin_and_remove = [&](const ParallelConfig& config) {
    SaveArea& area = job->saves();
    auto dir = area.MkdirStep("step-00000060", config);
    ASSERT_TRUE(dir.ok()) << dir.status();
    ASSERT_TRUE(area.Mkdir(dir->ino, "rank-00000").ok());
    ASSERT_TRUE(area.Rmdir(dir->ino, "rank-00000").ok());
    ASSERT_TRUE(area.Rmdir(0, "step-00000060").ok());
  };
  begin_and_remove(single);
  EXPECT_TRUE(job->saves().RemovedSteps().empty());

  const ParallelConfig hosted =
      *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b");
  JoinAsHostA(*job, hosted);
  begin_and_remove(hosted);
  SaveArea& area = job->saves();
  std::vector<SaveArea::Removed> removed = area.RemovedSteps();
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0].step, 60);
  EXPECT_EQ(removed[0].config.ToString(), hosted.ToString());
  absl::StatusOr<SaveNode> again = area.MkdirStep("step-00000060", hosted);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(again.status().message().find("being withdrawn"), std::string::npos)
      << again.status();
  area.ReleaseRemoved(60);
  EXPECT_TRUE(area.RemovedSteps().empty());
  EXPECT_TRUE(area.MkdirStep("step-00000060", hosted).ok());
}

// A step whose part this host saved and voted for, removed before the
// cluster decided, stays removed when the mount starts again before the
// withdrawal: its part is listed again and cannot vote.
TEST_F(JobTest, AStepRemovedWithItsPartPendingStaysRemovedAcrossARestart) {
  const ParallelConfig hosted =
      *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b");
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  JoinAsHostA(*job, hosted);
  SaveArea& area = job->saves();
  auto dir = area.MkdirStep("step-00000061", hosted);
  ASSERT_TRUE(dir.ok()) << dir.status();
  SaveRank0(*job, dir->ino, hosted, 61);
  ASSERT_TRUE((*store_->FindPending(61)).has_value());
  EXPECT_FALSE((*store_->FindPending(61))->removed);
  // rm -r ckpt/step-00000061
  std::optional<SaveNode> rank = area.Lookup(dir->ino, "rank-00000");
  ASSERT_TRUE(rank.has_value());
  ASSERT_TRUE(area.Unlink(rank->ino, "model.safetensors").ok());
  ASSERT_TRUE(area.Rmdir(dir->ino, "rank-00000").ok());
  ASSERT_TRUE(area.Rmdir(0, "step-00000061").ok());
  // The part stays until the cluster has withdrawn the step.
  std::optional<PendingStep> part = *store_->FindPending(61);
  ASSERT_TRUE(part.has_value());
  EXPECT_TRUE(part->removed);

  job.reset();
  store_.reset();
  store_ = *Store::Open((dir_ / "store").string());
  std::vector<PendingStep> pending = *store_->PendingSteps();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_TRUE(pending[0].removed);
  job = MakeJob(hosted.ToString().c_str());
  JoinAsHostA(*job, hosted);
  std::vector<SaveArea::Removed> removed = job->saves().RemovedSteps();
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0].step, 61);
  EXPECT_EQ(removed[0].config.ToString(), hosted.ToString());
  EXPECT_EQ(job->saves().MkdirStep("step-00000061", hosted).status().code(),
            absl::StatusCode::kUnavailable);

  // Withdrawn: the part goes, and nothing of the removal is left.
  ASSERT_TRUE(job->DiscardSave(61).ok());
  job->saves().ReleaseRemoved(61);
  EXPECT_FALSE((*store_->FindPending(61)).has_value());
  EXPECT_TRUE((*store_->PendingSteps()).empty());
  job.reset();
  store_.reset();
  store_ = *Store::Open((dir_ / "store").string());
  job = MakeJob(hosted.ToString().c_str());
  JoinAsHostA(*job, hosted);
  EXPECT_TRUE(job->saves().RemovedSteps().empty());
  EXPECT_TRUE(CheckStore(*store_, {})->empty());
}

// With `--replicas 2`, a host also keeps copies of another host's shards
// of a pending step: they are held with its own part once the step commits,
// and a copy found to differ is dropped with its blob.
TEST_F(JobTest, CopiesOfAnotherHostsShardsAreHeldWithThePart) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  const ParallelConfig hosted =
      *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b");
  JoinAsHostA(*job, hosted);
  // Host a saves rank 0; rank 1's shard, as host b saved it, is copied in.
  auto save = [&](int64_t step) {
    SaveArea& area = job->saves();
    auto dir = area.MkdirStep(absl::StrFormat("step-%08d", step), hosted);
    ASSERT_TRUE(dir.ok()) << dir.status();
    SaveRank0(*job, dir->ino, hosted, step);
    const std::string bytes = DirectShardFile(hosted, 0);
    auto own = store_->FindPending(step);
    ASSERT_TRUE(own.ok() && own->has_value());
    // Rank 1's file has rank 0's layout (tp halves of the same tensors).
    const std::string copy = DirectShardFile(hosted, 1);
    auto own_header =
        SafetensorsHeader::Parse(bytes, static_cast<int64_t>(bytes.size()));
    auto copy_header =
        SafetensorsHeader::Parse(copy, static_cast<int64_t>(copy.size()));
    ASSERT_TRUE(own_header.ok() && copy_header.ok());
    const std::string blob = Store::NewBlobName();
    {
      std::ofstream out(store_->BlobPath(blob), std::ios::binary);
      out.write(copy.data(), static_cast<std::streamsize>(copy.size()));
    }
    ChunkHasher hasher;
    hasher.Update(copy.data(), static_cast<int64_t>(copy.size()));
    ShardRecord shard;
    shard.blobs = {blob};
    for (const ShardRecord::Location& t : (*own)->shards.at(0).tensors) {
      shard.tensors.push_back(
          {0, t.offset - own_header->data_start() + copy_header->data_start()});
    }
    ASSERT_TRUE(store_
                    ->AddPendingCopies(
                        step, hosted.ToString(), 2, {{1, shard}},
                        {{blob, BlobRecord{static_cast<int64_t>(copy.size()),
                                           hasher.Finish(), step}}})
                    .ok());
  };
  // A copy of a group this host's workers saved too (copied before they
  // did): the saved shard stands for it, the copy's blob goes with the step.
  auto copy_own = [&](int64_t step) -> std::string {
    auto own = store_->FindPending(step);
    EXPECT_TRUE(own.ok() && own->has_value());
    const ShardRecord saved = (*own)->shards.at(0);
    const std::string blob = Store::NewBlobName();
    fs::copy_file(store_->BlobPath(saved.blobs[0]), store_->BlobPath(blob));
    auto record = store_->Blob(saved.blobs[0]);
    EXPECT_TRUE(record.ok());
    ShardRecord shard = saved;
    shard.blobs = {blob};
    EXPECT_TRUE(store_
                    ->AddPendingCopies(step, hosted.ToString(), 2, {{0, shard}},
                                       {{blob, *record}})
                    .ok());
    return blob;
  };

  save(60);
  const std::string duplicate = copy_own(60);
  auto pending = store_->FindPending(60);
  ASSERT_TRUE(pending.ok() && pending->has_value());
  EXPECT_TRUE((*pending)->saved);
  EXPECT_EQ((*pending)->record.held, (std::vector<int>{0, 1}));
  EXPECT_EQ((*pending)->copied, std::vector<int>{1});
  EXPECT_EQ((*pending)->duplicates, std::vector<std::string>{duplicate});
  EXPECT_TRUE(CheckStore(*store_, {})->empty());
  StepRecord agreed;
  agreed.step = 60;
  agreed.config = hosted.ToString();
  agreed.groups = 2;
  ASSERT_TRUE(job->CommitAgreedStep(agreed).ok());
  EXPECT_TRUE(store_->PendingSteps()->empty());
  EXPECT_EQ((**store_->FindStep(60)).held, (std::vector<int>{0, 1}));
  ExpectShardEqualsDirectCut(*job->current(), "step-00000060", hosted, 0);
  ExpectShardEqualsDirectCut(*job->current(), "step-00000060", hosted, 1);
  EXPECT_FALSE(fs::exists(store_->BlobPath(duplicate)));
  EXPECT_TRUE(CheckStore(*store_, {})->empty());

  // A copy dropped takes its blob; the host's own part stays.
  save(61);
  auto copied = store_->FindPending(61);
  ASSERT_TRUE(copied.ok() && copied->has_value());
  const std::string copy_blob = (*copied)->shards.at(1).blobs[0];
  ASSERT_TRUE(store_->DropPendingGroup(61, 1).ok());
  EXPECT_FALSE(fs::exists(store_->BlobPath(copy_blob)));
  auto left = store_->FindPending(61);
  ASSERT_TRUE(left.ok() && left->has_value());
  EXPECT_EQ((*left)->record.held, std::vector<int>{0});
  EXPECT_TRUE(CheckStore(*store_, {})->empty());
  ASSERT_TRUE(job->DiscardSave(61).ok());
  EXPECT_TRUE(store_->PendingSteps()->empty());
  EXPECT_TRUE(CheckStore(*store_, {})->empty());
}

TEST_F(JobTest, OlderTreesLiveWhileTheKernelNamesThem) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  std::shared_ptr<const Tree> first = job->current();
  const Node* ckpt = Walk(*first, {"ckpt"});
  first->CountLookup(ckpt->ino);
  ASSERT_TRUE(job->Reconfigure(*ParallelConfig::Parse("tp=4,pp=1,dp=1")).ok());
  ASSERT_EQ(job->OlderTrees().size(), 1u);
  EXPECT_EQ(job->TreeOf(ckpt->ino), first);
  EXPECT_EQ(job->Find(ckpt->ino).node, ckpt);
  // The last lookup forgotten, the old generation goes.
  job->Forget(ckpt->ino, 1);
  EXPECT_TRUE(job->OlderTrees().empty());
  EXPECT_EQ(job->TreeOf(ckpt->ino), nullptr);
  EXPECT_EQ(job->TreeOf(kRootIno), job->current());
}

// A tree replaced while the kernel named nothing of it gets no FORGET to
// retire it: the reaper's pass does, and leaves the trees still named.
TEST_F(JobTest, OlderTreesTheKernelNamesNothingOfAreRetired) {
  std::unique_ptr<Job> job = MakeJob("tp=2,pp=1,dp=1");
  const uint64_t unnamed_ckpt = Walk(*job->current(), {"ckpt"})->ino;
  ASSERT_TRUE(job->Reconfigure(*ParallelConfig::Parse("tp=4,pp=1,dp=1")).ok());
  ASSERT_EQ(job->OlderTrees().size(), 1u);  // kept by the switch
  job->RetireUnusedOlderTrees();
  EXPECT_TRUE(job->OlderTrees().empty());
  EXPECT_EQ(job->TreeOf(unnamed_ckpt), nullptr);
  // A tree the kernel still names stays.
  std::shared_ptr<const Tree> named = job->current();
  const Node* ckpt = Walk(*named, {"ckpt"});
  named->CountLookup(ckpt->ino);
  ASSERT_TRUE(job->Reconfigure(*ParallelConfig::Parse("tp=2,pp=1,dp=1")).ok());
  job->RetireUnusedOlderTrees();
  ASSERT_EQ(job->OlderTrees().size(), 1u);
  EXPECT_EQ(job->TreeOf(ckpt->ino), named);
}

}  // namespace
}  // namespace scalai
