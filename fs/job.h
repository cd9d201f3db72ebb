// A mounted job's moving parts, free of FUSE: the tree new opens see, the
// older trees the kernel may still name, the reconfiguration that switches
// between them, the materialization that follows, the steps published
// through the mount, and the text of `status`. The FUSE adapter's control
// file drives it, and so can anything else that holds it (a test, a peer
// that relays a cluster-wide config): the adapter only hears of each switch
// through `on_switch`, to drop the kernel's caches.
//
//   Job job(*store, std::move(tree), {.keep_steps = 3});
//   RETURN_IF_ERROR(job.Reconfigure(*ParallelConfig::Parse("tp=4,pp=1,dp=2")));
//   job.WaitMaterialized(absl::Seconds(60));
#ifndef SCALAI_FS_JOB_H_
#define SCALAI_FS_JOB_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fs/save_area.h"
#include "fs/tree.h"
#include "nlohmann/json.hpp"
#include "ptc/parallel_config.h"
#include "transfer/foreground_reads.h"
#include "transfer/remote_bytes.h"
#include "transfer/store.h"

namespace scalai {

class Job {
 public:
  // Called after each switch to a new generation, without the lock held,
  // with the names in the new root: the adapter drops the kernel's entries
  // for them and retires the older trees' inodes.
  using OnSwitch = std::function<void(std::vector<std::string> root_names)>;
  // Asked, without the lock held, to make a config that this store can serve
  // current wherever else it must be (the other hosts of a cluster); an
  // error refuses the reconfiguration and changes nothing here. Returns
  // where the config stands in the cluster's order of agreed configs (a
  // number that grows with each, etcd's revision): configs agreed elsewhere
  // arrive on other threads meanwhile, and the newest must win however
  // their switches interleave.
  using Agreement =
      std::function<absl::StatusOr<int64_t>(const ParallelConfig&)>;
  // More of `status`, under the key it names; called with the job's lock
  // held, so it must not call the job.
  using StatusSection = std::function<nlohmann::json()>;
  // How a step is saved when its ranks span hosts: the ranks of a config
  // saved on this host (or why none can be), and, called without the lock
  // held, that this host's part of a step is saved and pending
  // (PendingStep) for the cluster to commit (CommitAgreedStep) or drop
  // (DiscardSave).
  struct SaveAgreement {
    SaveArea::RanksOfHost ranks;
    std::function<void(int64_t step)> saved;
  };

  struct Options {
    // After each step published, keep the newest K steps (0: all); a step
    // with a file open in any live tree is kept until a later commit.
    int keep_steps = 0;
    OnSwitch on_switch;
  };

  Job(Store& store, std::unique_ptr<Tree> tree, Options options);
  // Cancels and joins the materialization; steps not yet committed are
  // discarded.
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  Store& store() { return store_; }
  SaveArea& saves() { return *saves_; }

  // The tree new opens see.
  std::shared_ptr<const Tree> current();
  // The live tree that owns `ino` (the current one for the root), or null.
  std::shared_ptr<const Tree> TreeOf(uint64_t ino);
  // The node `ino` names, with the tree that keeps it alive; `node` is null
  // when no live tree has it.
  struct Found {
    std::shared_ptr<const Tree> tree;
    const Node* node = nullptr;
  };
  Found Find(uint64_t ino);
  // The live trees older than the current one.
  std::vector<std::shared_ptr<const Tree>> OlderTrees();
  // The kernel forgot `nlookup` lookups of `ino`: a tree nobody names any
  // more is let go.
  void Forget(uint64_t ino, uint64_t nlookup);
  // Lets go of the older trees the kernel names nothing of. A switch keeps
  // the tree it replaces (a lookup may be on its way to it), and a tree
  // whose last lookup was forgotten while it was current gets no FORGET
  // after it: once the lookups on their way have arrived, this is what
  // retires it (and closes its blobs' mappings).
  void RetireUnusedOlderTrees();

  // How a cluster shares out a step's bytes: the groups of a config this
  // host holds (unset: all) and where the views and materialization read
  // the others. Shards replaced by a materialization are then retained for
  // peers until ReleaseRetained.
  struct Holding {
    std::function<std::optional<std::vector<int>>(const ParallelConfig&)>
        groups;
    const RemoteBytes* remote = nullptr;  // outlives its use by the job
  };
  // Stops a running materialization, rebuilds the current views with
  // `holding` and restarts it. Cleared (a member leaving), the views read
  // only what this store holds.
  absl::Status SetHolding(Holding holding);
  // Forgets the shards retained for peers, once every host has finished
  // moving off them; returns how many blob files went.
  absl::StatusOr<int> ReleaseRetained();

  // Hooks set by whoever serves or coordinates the job; each replaces the
  // one before.
  void SetOnSwitch(OnSwitch on_switch);
  void SetAgreement(Agreement agreement);
  absl::Status SetSaveAgreement(SaveAgreement agreement);
  void SetStatusSection(std::string key, StatusSection section);

  // Makes `config` current: validates it, has it agreed (SetAgreement),
  // records it in the store, switches every view at once and starts
  // materializing it. The same config again retries a failed
  // materialization and otherwise changes nothing. On an error nothing
  // changed, and `status` says why.
  absl::Status Reconfigure(const ParallelConfig& config);
  // The same for a config already agreed elsewhere (another host wrote it),
  // at `agreed_at` in the cluster's order (Agreement): no agreement is
  // asked for. A config agreed before one already applied here changes
  // nothing: it was superseded. Its success clears only an error that such
  // a config set: a refused write's reason stays.
  absl::Status ApplyAgreed(const ParallelConfig& config, int64_t agreed_at);
  // Commits a step whose every dp_rank 0 rank has a valid shard, applies the
  // retention, and switches to a tree that shows it (`latest` moves). With
  // a SaveAgreement, this host's part is recorded pending instead.
  absl::Status PublishStep(int64_t step);
  // The cluster committed a step, described by `agreed`: recorded with what
  // this host saved of it (Store::CommitAgreedStep), then as PublishStep.
  absl::Status CommitAgreedStep(
      const StepRecord& agreed,
      const std::map<std::string, BlobRecord>& copied = {});
  // The cluster dropped a step: what this host saved or is saving of it
  // goes.
  absl::Status DiscardSave(int64_t step);
  // Builds the current views again as a new generation, after something
  // they show changed outside the job (a dataset withheld).
  absl::Status Refresh();
  // Materializes the current config, superseding a running materialization:
  // a store whose steps are not stored under it yet catches up.
  void StartMaterialization();
  // Cancels and joins the materialization; the views stay correct.
  void StopMaterialization();
  // Waits until no materialization runs; false on timeout.
  bool WaitMaterialized(absl::Duration timeout);

  // Where the job stands: what `status` shows but the saves and the
  // sections others add.
  struct Progress {
    uint64_t generation = 0;
    std::string config;
    std::string state;  // "ready", "materializing" or "failed"
    double progress = 1.0;
    int64_t bytes_to_move = 0;
    int64_t bytes_moved = 0;
    std::string error;  // empty: none
  };
  Progress progress();

  // Reads of checkpoint files, which the materialization gives way to:
  // whoever answers one (the FUSE adapter, the peer server for a peer's
  // reader) marks it here with a ForegroundReads::Reading.
  ForegroundReads& foreground_reads() { return foreground_reads_; }

  // The error `status` shows until the next success clears it.
  void ReportError(absl::string_view message);
  // The JSON of MOUNT/status, newline-terminated.
  std::string StatusText();

 private:
  // Reconfigure (`agreed_at` unset: agreed here, when there is an
  // agreement) and ApplyAgreed in one.
  absl::Status Change(const ParallelConfig& config,
                      std::optional<int64_t> agreed_at);
  void StartMaterializationLocked();  // requires mu_
  void Materialize(const ParallelConfig& target,
                   const std::atomic<bool>& cancel);
  std::vector<std::shared_ptr<const Tree>> SwitchLocked(
      std::shared_ptr<const Tree> tree);  // requires mu_
  void RetireIfUnusedLocked(const std::shared_ptr<const Tree>& tree);
  // The live trees of generations before `generation`.
  std::vector<std::shared_ptr<const Tree>> TreesBeforeLocked(
      uint64_t generation) const;
  void ApplyRetentionLocked();
  // A tree of the next generation built from the records as they are now,
  // made current.
  absl::Status SwitchToRebuiltLocked(
      std::vector<std::shared_ptr<const Tree>>& retired);
  // After `step` was recorded: retention, a tree that shows it, and its
  // materialization if saved under another config.
  absl::Status ShowCommittedLocked(
      int64_t step, std::vector<std::shared_ptr<const Tree>>& retired);
  std::vector<std::string> RootNamesLocked() const;
  absl::Status CheckGenerationLocked() const;
  Progress ProgressLocked() const;

  Store& store_;
  const int keep_steps_;
  ForegroundReads foreground_reads_;  // thread-safe on its own
  std::unique_ptr<SaveArea> saves_;   // thread-safe on its own

  // Lock order: mu_ only. Every catalog change happens under mu_, so a tree
  // is always built from one consistent set of records.
  std::mutex mu_;
  std::condition_variable idle_;         // signalled when materializing_ ends
  std::shared_ptr<const Tree> current_;  // guarded by mu_
  // Trees the kernel may still name inodes of, by generation; guarded by mu_.
  std::map<uint64_t, std::shared_ptr<const Tree>> trees_;
  std::string error_;  // guarded by mu_
  // Why the last config agreed elsewhere could not be served here, if it
  // could not; guarded by mu_.
  std::string agreed_refusal_;
  // The hooks; guarded by mu_, and called on copies without it.
  OnSwitch on_switch_;
  Agreement agreement_;
  // Where the newest config agreed and applied here stands in the
  // cluster's order (Agreement); guarded by mu_.
  int64_t last_agreed_at_ = 0;
  std::function<void(int64_t)> step_saved_;  // SaveAgreement::saved
  std::string status_key_;
  StatusSection status_section_;
  Holding holding_;

  // The newest materialization worker and its cancel flag; guarded by mu_.
  // Each worker joins the one it superseded, so joining the newest joins all.
  std::thread worker_;
  std::shared_ptr<std::atomic<bool>> cancel_;
  bool materializing_ = false;  // guarded by mu_
  // The last materialization failed (a damaged source, a full disk): the
  // views read from the stored shards until the same config is written
  // again, which retries it. Guarded by mu_.
  bool materialization_failed_ = false;
  // Why it failed, shown while `status` says so, whatever else cleared the
  // error (a step published, a config written); guarded by mu_.
  std::string materialization_error_;
  // Bytes written and to write by the running (or last) materialization.
  std::atomic<int64_t> moved_{0};
  std::atomic<int64_t> to_move_{0};
};

}  // namespace scalai

#endif  // SCALAI_FS_JOB_H_
