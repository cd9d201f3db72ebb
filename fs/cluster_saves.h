// ClusterSaves commits a step saved across the hosts of a cluster as one
// (docs/reference.md, "Clusters"), in two phases through etcd:
//
//  1. Workers save their ranks through their own host's mount. Once the
//     ranks with dp_rank 0 of a host are whole, the job records its part
//     pending (PendingStep, durable) and the host votes for the step: the
//     key saves/STEP/vote/HOST says what it holds.
//     With `mount --replicas 2`, the next host in the config's list copies
//     the host's shards as their extra replica (checked against the sums
//     the vote gives) and votes that it holds them too.
//  2. Once every host that runs a dp_rank 0 rank under the step's config
//     has voted (and holds its shards' replicas, when asked for), and
//     every copy of a shard has the same tensor bytes as the others (the
//     votes carry a checksum of each: replicas are compared without being
//     shipped), any host commits the step with one etcd transaction
//     (saves/STEP/committed, on condition that the votes are as read and
//     nothing committed it), and every host records it: with its part if
//     it saved one, else holding no shard of it (its views read them from
//     peers), and with a copy of every extra/ file other hosts saved.
//
// A step some host did not finish is dropped everywhere: a host that starts
// again withdraws the votes of every step it had to save and has not (in a
// transaction that a commit cannot race), and every host whose vote is gone
// drops its part. That holds for the votes there at its start and for
// those that come later: each vote says when its host began the step
// (`begun`, an etcd revision read after its first directory was made), and
// a host that started after that revision knows that its own part of the
// step went with the mount that ended. A step that waits for the vote of a
// host lost for good (not live, left out of the cluster's config) is
// withdrawn too. A withdrawal leaves saves/STEP/withdrawn: every part begun
// before its revision is void, and is dropped by its host, whether it had
// not seen the withdrawal yet or mounts again with the part pending.
//
//   ClusterSaves saves(job, *etcd, "h0", [](auto& what) { return key; });
//   RETURN_IF_ERROR(saves.Reconcile());  // once, at the host's start
//   RETURN_IF_ERROR(saves.Advance());    // then at every beat
#ifndef SCALAI_FS_CLUSTER_SAVES_H_
#define SCALAI_FS_CLUSTER_SAVES_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fs/cluster_coverage.h"
#include "fs/job.h"
#include "fs/save_area.h"
#include "nlohmann/json.hpp"
#include "ptc/parallel_config.h"
#include "transfer/etcd_client.h"
#include "transfer/peer_client.h"

namespace scalai {

class ClusterSaves {
 public:
  // etcd's key for `what` (below the job's prefix).
  using KeyOf = std::function<std::string(const std::string& what)>;
  // The client that reads bytes from host `name`; null for no such peer.
  using PeerOf = std::function<PeerClient*(const std::string& name)>;

  struct Options {
    // How many hosts keep each saved shard: 2 has the next host in the
    // config's list keep a copy of this host's (`mount --replicas`).
    int replicas = 1;
    // Called, on the copying thread, once copies of other hosts' shards
    // are in: the next round votes for them.
    std::function<void()> on_copied;
    // Whether host `name` is a live member of the cluster; unset: all are.
    // A step does not wait for a copy on a host that is gone.
    std::function<bool(const std::string& name)> live;
    // Whether host `name` is lost for good (not live, and left out of the
    // cluster's config); unset: none is. A step that waits for its vote
    // would wait forever: it is withdrawn.
    std::function<bool(const std::string& name)> lost;
    // Every host of the cluster file: a committed step's keys go once
    // each has recorded the step or will never need it. Empty: they stay.
    std::vector<std::string> hosts;
    // Whether host `name` has never mounted the job: it holds no part of
    // any step, and needs only the newest committed step's keys, to record
    // it when it first mounts. Unset: every host may have.
    std::function<bool(const std::string& name)> never_mounted;
  };

  ClusterSaves(Job& job, EtcdClient& etcd, std::string host, KeyOf key,
               PeerOf peer_of, Options options);
  // Stops a copy under way and waits for its thread.
  ~ClusterSaves();

  // The host after `host` in `config`'s list of hosts (the first after
  // the last), which keeps its shards' extra replica; "" for a config on
  // one host.
  static std::string NextHost(const ParallelConfig& config,
                              const std::string& host);

  // The ranks of `config` saved on `host`; refused for a config that names
  // no hosts (every host would hold every rank) or leaves `host` out.
  static absl::StatusOr<std::vector<int>> RanksOfHost(
      const ParallelConfig& config, const std::string& host);
  // The hosts whose votes commit a step saved under `config`: those that
  // run a rank with dp_rank 0.
  static std::set<std::string> Voters(const ParallelConfig& config);

  // At the host's start, before the job takes saves: applies what the
  // cluster decided while it was away, and withdraws the votes of steps it
  // did not finish.
  absl::Status Reconcile();
  // One round: votes for parts saved since, commits steps every voter
  // voted for, records committed steps and drops withdrawn ones.
  absl::Status Advance();

  // The steps being saved as the last round saw them, for `status`: those
  // some host voted for, and those this host holds a part of (from its
  // start on, before it votes).
  nlohmann::json Status() const;
  // Why each replica saved here and found to differ was dropped, newest
  // last (the step's commit clears `status`'s error; these stay).
  nlohmann::json ReplicasRefused() const;
  // What each host held of each committed step when it voted, as the last
  // round saw them: a host reports its holdings a beat later, and a config
  // written at once must not be refused for want of them.
  std::vector<HostHolding> CommittedHoldings() const;

 private:
  // What etcd holds of one step's save.
  struct StepKeys {
    std::map<std::string, EtcdClient::KeyValue> votes;  // by host
    std::optional<EtcdClient::KeyValue> committed;
    // The hosts that recorded the committed step, or never will.
    std::set<std::string> recorded;
    // The revision of the step's last withdrawal (saves/STEP/withdrawn);
    // 0: never withdrawn. A part begun before it is void.
    int64_t withdrawn = 0;
    // Votes for parts begun before the withdrawal (left out of `votes`):
    // their hosts had not seen it yet. They are deleted.
    std::vector<EtcdClient::KeyValue> void_votes;
    // The hosts done with a withdrawal (saves/STEP/dropped/HOST), each
    // with the revision of the withdrawal it is done with.
    std::map<std::string, std::string> dropped;
  };
  // The keys of steps `from` and later, and the revision they were read
  // at: a beat reads only the steps it may still act on, not every step
  // the job ever saved.
  struct Saves {
    std::map<int64_t, StepKeys> steps;
    int64_t revision = 0;
  };
  absl::StatusOr<Saves> ReadSaves(int64_t from = 0);
  // Notes when each step being saved here (`saving`, `pending`: listed
  // before etcd was read at `revision`) began: the revision of the first
  // read after it was seen, which is no earlier.
  void NoteBegun(const std::vector<SaveNode>& saving,
                 const std::vector<PendingStep>& pending, int64_t revision);
  // Withdraws the steps that began elsewhere before this host started,
  // that it had to save and has not: the mount that ended took its part.
  absl::Status WithdrawAbandoned(std::map<int64_t, StepKeys>& steps,
                                 const std::set<int64_t>& saved);
  // Withdraws the steps that wait for the vote of a host lost for good.
  absl::Status WithdrawLost(std::map<int64_t, StepKeys>& steps);
  // Deletes the votes for parts begun before their step's withdrawal.
  absl::Status DeleteVoidVotes(std::map<int64_t, StepKeys>& steps);
  std::string StepPrefix(int64_t step) const;
  // The vote for what this host holds of a pending step.
  absl::StatusOr<std::string> VoteFor(const PendingStep& pending);
  // Votes anew when what this host holds changed since its last vote.
  absl::Status Vote(const PendingStep& pending, StepKeys& keys);
  // The checksum of a held shard's tensor bytes (cached by its blobs).
  absl::StatusOr<std::string> DataSum(int64_t step, const ShardRecord& shard);
  // Shards of another host's vote to copy here, as their extra replica.
  struct WantedCopy {
    int64_t step = 0;
    std::string from;  // the host that saved them
    std::string key;   // its vote's
    std::string config;
    int groups = 0;
    std::map<int, nlohmann::json> shards;  // as the vote describes them
  };
  // What other hosts' votes for `step` ask this host to keep; `mine` is
  // what it holds of the step already.
  std::vector<WantedCopy> WantedCopies(int64_t step, const StepKeys& keys,
                                       const PendingStep* mine) const;
  // Copies them, checked against their sums, into this host's pending part.
  absl::Status Copy(const WantedCopy& want);
  // Runs the copies on copier_.
  void StartCopies(std::vector<WantedCopy> wanted);
  // Drops the replicas saved here whose bytes differ from the shard the
  // host of their dp_rank 0 rank saved; true if it dropped one.
  absl::StatusOr<bool> DropDifferingReplicas(const PendingStep& mine,
                                             const StepKeys& keys);
  void Forget(int64_t step);
  // Commits `step` when every voter voted, under one config; true if it
  // now is committed.
  absl::StatusOr<bool> TryCommit(int64_t step, StepKeys& keys);
  // Withdraws a step not committed: its votes go and saves/STEP/withdrawn
  // is put. Returns the revision of the withdrawal; 0 if the step
  // committed first.
  absl::StatusOr<int64_t> Withdraw(int64_t step);
  // Withdraws the steps removed here before they committed (SaveArea's
  // RemovedSteps) whose saving ranks this host runs, and drops this host's
  // part: a save that failed and was removed with rm -r is dropped
  // everywhere, as a host's unmount before it saved would drop it.
  absl::Status WithdrawRemoved();
  // Says, under saves/STEP/recorded/HOST, that this host will not need
  // the committed step's keys again.
  absl::Status Acknowledge(int64_t step, StepKeys& keys);
  // Of a withdrawn step not committed: says in etcd that this host is
  // done with the withdrawal once no part of the step here began before
  // it and no vote of this host's is left (until then the key must stay:
  // it is what voids such a part), and deletes the step's keys once every
  // host is done and no new save of the step has voted (nothing under its
  // keys changed since they were read at `revision`).
  absl::Status SweepWithdrawn(int64_t step, const StepKeys& keys,
                              int64_t revision);
  // Every few seconds: acknowledges the committed steps this host will
  // never record (older than its newest, not pending here), and deletes
  // the keys of steps every host acknowledged, so that etcd does not keep
  // one key per step the job ever saved; the same for withdrawn steps
  // (SweepWithdrawn). `recorded` and `pending` are this
  // host's as the round read them: one that changed since only delays an
  // acknowledgement to the next sweep.
  absl::Status Sweep(const std::vector<StepRecord>& recorded,
                     const std::vector<PendingStep>& pending);
  // Records a committed step here, with copies of the extra files other
  // hosts saved of it.
  absl::Status Record(int64_t step, const EtcdClient::KeyValue& committed);

  Job& job_;
  EtcdClient& etcd_;
  const std::string host_;
  const KeyOf key_;
  const PeerOf peer_of_;
  const Options options_;
  // Steps this host voted for and still holds pending, with the vote it
  // gave, and the checksums of their shards' tensor bytes by blobs. Only
  // the caller of Reconcile and Advance (one thread) uses them.
  std::map<int64_t, std::string> voted_;
  std::map<int64_t, std::map<std::string, std::string>> data_sums_;
  // The revision this host started at (Reconcile's read).
  int64_t since_ = 0;
  // When each step being saved here began: a revision read after its
  // first directory was made, so no earlier than that.
  std::map<int64_t, int64_t> begun_;
  absl::Time swept_ = absl::InfinitePast();
  mutable std::mutex mu_;
  nlohmann::json status_ = nlohmann::json::array();  // guarded by mu_
  std::vector<std::string> refused_;                 // guarded by mu_
  std::string copy_error_;  // the last copies' failure; guarded by mu_
  // One batch of copies at a time, started by Advance.
  std::thread copier_;
  std::atomic<bool> copying_{false};
  std::atomic<bool> stopping_{false};
  std::vector<HostHolding> committed_holdings_;  // guarded by mu_
};

}  // namespace scalai

#endif  // SCALAI_FS_CLUSTER_SAVES_H_
