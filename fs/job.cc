#include "fs/job.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "transfer/materializer.h"

namespace scalai {

Job::Job(Store& store, std::unique_ptr<Tree> tree, Options options)
    : store_(store),
      keep_steps_(options.keep_steps),
      saves_(std::make_unique<SaveArea>(store)),
      current_(std::move(tree)),
      on_switch_(std::move(options.on_switch)) {
  trees_[current_->generation()] = current_;
}

Job::~Job() {
  StopMaterialization();
  // Steps not committed are discarded: their blobs go now.
  saves_->Clear();
}

std::shared_ptr<const Tree> Job::current() {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

std::shared_ptr<const Tree> Job::TreeOf(uint64_t ino) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ino == kRootIno) return current_;
  auto it = trees_.find(Tree::GenerationOf(ino));
  return it == trees_.end() ? nullptr : it->second;
}

Job::Found Job::Find(uint64_t ino) {
  Found f{TreeOf(ino)};
  if (f.tree != nullptr) f.node = f.tree->Get(ino);
  return f;
}

std::vector<std::shared_ptr<const Tree>> Job::OlderTrees() {
  std::lock_guard<std::mutex> lock(mu_);
  return TreesBeforeLocked(current_->generation());
}

std::vector<std::shared_ptr<const Tree>> Job::TreesBeforeLocked(
    uint64_t generation) const {
  std::vector<std::shared_ptr<const Tree>> older;
  for (const auto& [g, tree] : trees_) {
    if (g < generation) older.push_back(tree);
  }
  return older;
}

void Job::Forget(uint64_t ino, uint64_t nlookup) {
  std::shared_ptr<const Tree> tree = TreeOf(ino);
  if (tree == nullptr) return;
  tree->Forget(ino, nlookup);
  std::lock_guard<std::mutex> lock(mu_);
  RetireIfUnusedLocked(tree);
}

void Job::RetireUnusedOlderTrees() {
  std::vector<std::shared_ptr<const Tree>> older;
  {
    std::lock_guard<std::mutex> lock(mu_);
    older = TreesBeforeLocked(current_->generation());
    for (const auto& tree : older) RetireIfUnusedLocked(tree);
  }
  // `older` goes here, unlocked: the last references close the mappings.
}

// Lets go of an old tree once the kernel names none of its inodes: no
// lookup is left, so no file of it is open either. The caller holds `tree`
// until it has unlocked: the last reference closes the tree's blob
// mappings, and for blobs already unlinked that is when the filesystem
// frees their space, which is slow.
void Job::RetireIfUnusedLocked(const std::shared_ptr<const Tree>& tree) {
  if (tree != nullptr && tree != current_ && tree->total_lookups() == 0) {
    trees_.erase(tree->generation());
  }
}

std::vector<std::string> Job::RootNamesLocked() const {
  std::vector<std::string> names;
  for (uint64_t c : current_->Get(kRootIno)->children) {
    names.push_back(current_->Get(c)->name);
  }
  return names;
}

absl::Status Job::CheckGenerationLocked() const {
  if (current_->generation() >= Tree::kMaxGeneration) {
    return absl::ResourceExhaustedError(
        "this mount has run out of generations: unmount and mount again");
  }
  return absl::OkStatus();
}

// Makes `tree` the one new opens see. The tree it replaces stays: a lookup
// in the root may be on its way to it right now. Returns the older trees,
// for the caller to drop once it has unlocked.
std::vector<std::shared_ptr<const Tree>> Job::SwitchLocked(
    std::shared_ptr<const Tree> tree) {
  const uint64_t replaced = current_->generation();
  trees_[tree->generation()] = tree;
  current_ = std::move(tree);
  std::vector<std::shared_ptr<const Tree>> older = TreesBeforeLocked(replaced);
  for (const auto& t : older) RetireIfUnusedLocked(t);
  return older;
}

void Job::SetOnSwitch(OnSwitch on_switch) {
  std::lock_guard<std::mutex> lock(mu_);
  on_switch_ = std::move(on_switch);
}

void Job::SetAgreement(Agreement agreement) {
  std::lock_guard<std::mutex> lock(mu_);
  agreement_ = std::move(agreement);
}

absl::Status Job::SetSaveAgreement(SaveAgreement agreement) {
  RETURN_IF_ERROR(saves_->SaveAsHost(std::move(agreement.ranks)));
  std::lock_guard<std::mutex> lock(mu_);
  step_saved_ = std::move(agreement.saved);
  return absl::OkStatus();
}

void Job::SetStatusSection(std::string key, StatusSection section) {
  std::lock_guard<std::mutex> lock(mu_);
  status_key_ = std::move(key);
  status_section_ = std::move(section);
}

absl::Status Job::Reconfigure(const ParallelConfig& config) {
  return Change(config, std::nullopt);
}

absl::Status Job::ApplyAgreed(const ParallelConfig& config, int64_t agreed_at) {
  return Change(config, agreed_at);
}

absl::Status Job::Change(const ParallelConfig& config,
                         std::optional<int64_t> agreed_at) {
  const bool agree = !agreed_at.has_value();
  // Whether a config agreed at `at` was superseded by one applied here;
  // if not, it is the newest from now on. Requires mu_.
  const auto superseded = [this](int64_t at) {
    if (at < last_agreed_at_) return true;
    last_agreed_at_ = at;
    return false;
  };
  std::vector<std::shared_ptr<const Tree>> retired;  // dropped unlocked
  std::vector<std::string> names;
  OnSwitch on_switch;
  bool switched = false;
  absl::Status result = [&]() -> absl::Status {
    Agreement agreement;
    std::shared_ptr<const Tree> base;  // the tree `next` was built beside
    std::unique_ptr<Tree> next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (agreed_at.has_value() && superseded(*agreed_at)) {
        return absl::OkStatus();
      }
      if (config == current_->config()) {
        // The same config again retries a failed materialization (space
        // freed, a blob restored); otherwise it changes nothing.
        if (materialization_failed_) StartMaterializationLocked();
        return absl::OkStatus();
      }
      if (!config.hosts().empty() && agree && !agreement_) {
        return absl::InvalidArgumentError(
            "hosts= names the hosts of a job that spans hosts; this mount was "
            "started without --cluster, so its one host runs every rank");
      }
      RETURN_IF_ERROR(CheckGenerationLocked());
      // Built before anyone else is asked: a config this store cannot serve
      // is refused here, and agreed nowhere.
      ASSIGN_OR_RETURN(next,
                       Tree::Build(store_, config, current_->generation() + 1,
                                   holding_.remote));
      base = current_;
      if (agree) agreement = agreement_;
    }
    // The agreement may take a network round trip: the lock is not held,
    // so the mount keeps answering meanwhile.
    if (agreement) {
      ASSIGN_OR_RETURN(agreed_at, agreement(config));
    }
    std::lock_guard<std::mutex> lock(mu_);
    // Meanwhile a config agreed after this one may have been applied (the
    // cluster's watch runs on its own thread): the newest stands.
    if (agreed_at.has_value() && superseded(*agreed_at)) {
      return absl::OkStatus();
    }
    if (config == current_->config()) return absl::OkStatus();  // applied
    if (current_ != base) {
      // Meanwhile the catalog changed (a step published, a materialization
      // committed): the tree is built again from the records as they are.
      RETURN_IF_ERROR(CheckGenerationLocked());
      ASSIGN_OR_RETURN(next,
                       Tree::Build(store_, config, current_->generation() + 1,
                                   holding_.remote));
    }
    RETURN_IF_ERROR(store_.SetCurrentConfig(config));
    retired = SwitchLocked(std::shared_ptr<const Tree>(std::move(next)));
    StartMaterializationLocked();
    switched = true;
    return absl::OkStatus();
  }();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!result.ok()) {
      error_ = std::string(result.message());
      if (!agree) agreed_refusal_ = error_;
    } else if (agree || error_ == agreed_refusal_) {
      // A config agreed elsewhere clears only what such a config set: a
      // write here refused (another host's won the race) keeps saying why
      // while the winner's config is applied.
      error_.clear();
    }
    if (switched) names = RootNamesLocked();
    on_switch = on_switch_;
  }
  if (switched && on_switch) on_switch(std::move(names));
  return result;
}

// Drops the oldest steps beyond keep_steps, sparing any step a handle of any
// generation has open.
void Job::ApplyRetentionLocked() {
  if (keep_steps_ <= 0) return;
  absl::StatusOr<std::vector<StepRecord>> steps = store_.Steps();
  if (!steps.ok()) return;
  // Steps are in step order: all but the newest keep_steps go.
  const int64_t older = static_cast<int64_t>(steps->size()) - keep_steps_;
  for (int64_t i = 0; i < older; ++i) {
    const int64_t step = (*steps)[i].step;
    bool open = false;
    for (const auto& [generation, tree] : trees_) open |= tree->StepOpen(step);
    if (open) continue;  // a later commit tries again
    if (absl::Status d = store_.DeleteStep(step); !d.ok()) {
      error_ = absl::StrCat("retention: ", d.message());
      return;
    }
  }
}

absl::Status Job::PublishStep(int64_t step) {
  std::vector<std::shared_ptr<const Tree>> retired;  // dropped unlocked
  std::vector<std::string> names;
  OnSwitch on_switch;
  std::function<void(int64_t)> saved;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(saves_->Commit(step));
    if (step_saved_) {
      saved = step_saved_;  // pending: the cluster commits it
    } else {
      RETURN_IF_ERROR(ShowCommittedLocked(step, retired));
      names = RootNamesLocked();
      on_switch = on_switch_;
    }
  }
  if (saved) saved(step);
  if (on_switch) on_switch(std::move(names));
  return absl::OkStatus();
}

absl::Status Job::CommitAgreedStep(
    const StepRecord& agreed, const std::map<std::string, BlobRecord>& copied) {
  std::vector<std::shared_ptr<const Tree>> retired;  // dropped unlocked
  std::vector<std::string> names;
  OnSwitch on_switch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(store_.CommitAgreedStep(agreed, copied));
    saves_->Committed(agreed.step);
    RETURN_IF_ERROR(ShowCommittedLocked(agreed.step, retired));
    names = RootNamesLocked();
    on_switch = on_switch_;
  }
  if (on_switch) on_switch(std::move(names));
  return absl::OkStatus();
}

absl::Status Job::Refresh() {
  std::vector<std::shared_ptr<const Tree>> retired;  // dropped unlocked
  std::vector<std::string> names;
  OnSwitch on_switch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(SwitchToRebuiltLocked(retired));
    names = RootNamesLocked();
    on_switch = on_switch_;
  }
  if (on_switch) on_switch(std::move(names));
  return absl::OkStatus();
}

absl::Status Job::DiscardSave(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  saves_->Discard(step);
  return store_.DiscardPending(step);
}

absl::Status Job::SwitchToRebuiltLocked(
    std::vector<std::shared_ptr<const Tree>>& retired) {
  RETURN_IF_ERROR(CheckGenerationLocked());
  ASSIGN_OR_RETURN(std::unique_ptr<Tree> next,
                   Tree::Build(store_, current_->config(),
                               current_->generation() + 1, holding_.remote));
  retired = SwitchLocked(std::shared_ptr<const Tree>(std::move(next)));
  return absl::OkStatus();
}

absl::Status Job::ShowCommittedLocked(
    int64_t step, std::vector<std::shared_ptr<const Tree>>& retired) {
  // A step number used before (the old step deleted) must not be read
  // from what peers sent of the old one.
  if (holding_.remote != nullptr) holding_.remote->Forget(step);
  ApplyRetentionLocked();
  RETURN_IF_ERROR(SwitchToRebuiltLocked(retired));
  // A step saved under an earlier config is materialized like the rest.
  absl::StatusOr<std::optional<StepRecord>> record = store_.FindStep(step);
  if (record.ok() && *record &&
      (*record)->config != current_->config().ToString()) {
    StartMaterializationLocked();
  }
  error_.clear();  // the step is whole: earlier refusals are moot
  return absl::OkStatus();
}

// Writes the current config's shards into new blobs, commits them and
// switches to a tree that reads from them. Runs on a worker thread; a newer
// start cancels it.
void Job::Materialize(const ParallelConfig& target,
                      const std::atomic<bool>& cancel) {
  Materialization::Options options;
  options.cancel = &cancel;
  options.foreground = &foreground_reads_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (holding_.groups) options.hold = holding_.groups(target);
    options.remote = holding_.remote;
    options.retain = holding_.remote != nullptr;
    options.compact = holding_.remote != nullptr;
  }
  options.progress = [this, &cancel](int64_t done, int64_t total) {
    if (cancel.load()) return;  // the newer worker owns the counters
    to_move_ = total;
    moved_ = done;
  };
  absl::StatusOr<Materialization> m =
      Materialization::Write(store_, target, options);
  // Dropped after unlocking (see RetireIfUnusedLocked).
  std::shared_ptr<const Tree> replaced;
  std::lock_guard<std::mutex> lock(mu_);
  if (cancel.load()) return;  // superseded: the newer worker reports
  materializing_ = false;
  idle_.notify_all();
  absl::Status result = m.status();
  if (result.ok() && m->steps() > 0) {
    result = m->Commit(store_);
    absl::StatusOr<std::unique_ptr<Tree>> same = absl::InternalError("");
    if (result.ok()) {
      // The same views, now read from the new blobs: the generation and its
      // inodes stay, so the kernel's caches stay valid.
      same = Tree::Rebuild(store_, *current_);
      result = same.status();
    }
    if (result.ok()) {
      replaced = std::exchange(current_,
                               std::shared_ptr<const Tree>(std::move(*same)));
      trees_[current_->generation()] = current_;
    }
  }
  if (result.ok()) {
    to_move_ = m->bytes_planned();
    moved_ = m->bytes_written();
  } else {
    // The views keep reading from the old shards: correct, only slower.
    // `moved_` and `to_move_` stay where the copy stopped.
    materialization_failed_ = true;
    materialization_error_ =
        absl::StrCat("materialization of ", target.ToString(),
                     " failed: ", result.message());
    error_ = materialization_error_;
  }
}

absl::Status Job::SetHolding(Holding holding) {
  bool was_running = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_running = materializing_;
  }
  StopMaterialization();
  std::shared_ptr<const Tree> replaced;  // dropped unlocked
  std::lock_guard<std::mutex> lock(mu_);
  holding_ = std::move(holding);
  // The same views, reading what is not here from elsewhere: the
  // generation and its inodes stay.
  ASSIGN_OR_RETURN(std::unique_ptr<Tree> same,
                   Tree::Rebuild(store_, *current_, holding_.remote));
  replaced =
      std::exchange(current_, std::shared_ptr<const Tree>(std::move(same)));
  trees_[current_->generation()] = current_;
  if (was_running && holding_.remote != nullptr) StartMaterializationLocked();
  return absl::OkStatus();
}

absl::StatusOr<int> Job::ReleaseRetained() {
  int released = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ASSIGN_OR_RETURN(released, store_.ReleaseRetained());
  }
  // The views read the retained shards too (StepView): views without them,
  // and the kernel told to forget the old ones, whose mappings hold the
  // released blobs' space.
  if (released > 0) RETURN_IF_ERROR(Refresh());
  return released;
}

void Job::StartMaterialization() {
  std::lock_guard<std::mutex> lock(mu_);
  StartMaterializationLocked();
}

void Job::StartMaterializationLocked() {
  if (cancel_) cancel_->store(true);
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  cancel_ = cancel;
  materializing_ = true;
  materialization_failed_ = false;
  moved_ = 0;
  to_move_ = 0;
  worker_ = std::thread([this, cancel, target = current_->config(),
                         previous = std::move(worker_)]() mutable {
    if (previous.joinable()) previous.join();
    try {
      Materialize(target, *cancel);
    } catch (const std::exception& e) {
      // A bug must not take the mount down: it is reported instead.
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancel->load()) {
        materializing_ = false;
        materialization_failed_ = true;
        materialization_error_ =
            absl::StrCat("materialization failed: ", e.what());
        error_ = materialization_error_;
        idle_.notify_all();
      }
    }
  });
}

void Job::StopMaterialization() {
  std::thread worker;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancel_) cancel_->store(true);
    worker = std::move(worker_);
    materializing_ = false;
    idle_.notify_all();
  }
  if (worker.joinable()) worker.join();
}

bool Job::WaitMaterialized(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_.wait_for(lock, absl::ToChronoSeconds(timeout),
                        [this] { return !materializing_; });
}

void Job::ReportError(absl::string_view message) {
  std::lock_guard<std::mutex> lock(mu_);
  error_ = std::string(message);
}

Job::Progress Job::ProgressLocked() const {
  Progress p;
  p.generation = current_->generation();
  p.config = current_->config().ToString();
  p.bytes_moved = moved_.load();
  p.bytes_to_move = to_move_.load();
  if (materializing_ || materialization_failed_) {
    p.progress = p.bytes_to_move > 0
                     ? static_cast<double>(p.bytes_moved) / p.bytes_to_move
                     : 0.0;
  }
  p.state = materializing_            ? "materializing"
            : materialization_failed_ ? "failed"
                                      : "ready";
  // A state of "failed" always comes with its reason: what cleared the
  // error since (the write of a config that raced the failure, a step
  // published) did not undo the failure.
  p.error = error_.empty() && materialization_failed_ ? materialization_error_
                                                      : error_;
  return p;
}

Job::Progress Job::progress() {
  std::lock_guard<std::mutex> lock(mu_);
  return ProgressLocked();
}

std::string Job::StatusText() {
  std::lock_guard<std::mutex> lock(mu_);
  const Progress p = ProgressLocked();
  nlohmann::json j = {{"generation", p.generation},
                      {"config", p.config},
                      {"state", p.state},
                      {"progress", p.progress},
                      {"error", nullptr},
                      {"bytes_to_move", p.bytes_to_move},
                      {"bytes_moved", p.bytes_moved}};
  if (!p.error.empty()) j["error"] = p.error;
  if (status_section_) j[status_key_] = status_section_();
  // Steps being saved, and the saving ranks each still waits for.
  j["saving"] = nlohmann::json::array();
  for (const auto& [step, missing] : saves_->Pending())
    j["saving"].push_back({{"step", step}, {"waiting_for", missing}});
  // An error may quote bytes that are not UTF-8 (a name a client chose):
  // they are replaced rather than thrown over.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
         "\n";
}

}  // namespace scalai
