// The writable part of the mount: steps being saved under ckpt/ (docs/reference.md
// section 3, "Saving a checkpoint through the mount"), free of FUSE like the
// Tree. A worker's `mkdir ckpt/step-N` starts a step under the current
// config, `mkdir step-N/rank-R` and a write of `rank-R/model.safetensors`
// or of files anywhere under `rank-R/extra/` feed its StepWriter. Nodes here have inode numbers of generation 0, which
// no Tree uses, so the server can tell whose an inode is.
//
//   SaveArea area(store);
//   ASSIGN_OR_RETURN(SaveNode step, area.MkdirStep("step-00000200", config));
//   ASSIGN_OR_RETURN(SaveNode rank, area.Mkdir(step.ino, "rank-00000"));
//   ASSIGN_OR_RETURN(auto file, area.Create(rank.ino, "model.safetensors"));
#ifndef SCALAI_FS_SAVE_AREA_H_
#define SCALAI_FS_SAVE_AREA_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transfer/step_writer.h"
#include "transfer/store.h"

namespace scalai {

// What the server needs to know of a node being saved.
struct SaveNode {
  uint64_t ino = 0;
  uint64_t parent = 0;  // the step dir's parent is ckpt, whose inode varies
  std::string name;
  bool dir = false;
  int64_t size = 0;
  int64_t step = -1;
  int rank = -1;  // -1 for a step's own directory
  // Its step has committed: a walk that began before can still finish,
  // and a file written here is only compared with the committed one.
  bool committed = false;
  // In the rank's extra/ (the directory itself too): opaque files saved
  // with the step, at `extra_path` below extra/ ("" for extra/ itself).
  bool extra = false;
  std::string extra_path;
};

class SaveArea {
 public:
  // On a host of a cluster: the ranks of a config saved on this host, or
  // why a step cannot be saved under it here.
  using RanksOfHost =
      std::function<absl::StatusOr<std::vector<int>>(const ParallelConfig&)>;

  explicit SaveArea(Store& store) : store_(store) {}
  // From now on, steps are saved as a cluster's host saves them
  // (StepWriter::Options::ranks): each waits, pending, for Committed or
  // Discard once this host's part is whole. Steps removed before this
  // mount and not yet withdrawn are listed again (RemovedSteps).
  absl::Status SaveAsHost(RanksOfHost ranks);

  static bool Owns(uint64_t ino) { return ino >= 2 && ino < (1ull << 40); }

  // In ckpt/: a new step `step-NNNNNNNN` saved under `config`; refused for
  // a step the store has or one being saved.
  absl::StatusOr<SaveNode> MkdirStep(absl::string_view name,
                                     const ParallelConfig& config);
  // In a step being saved: `rank-RRRRR` of its config; in a rank directory,
  // `extra`, and below it any directory.
  absl::StatusOr<SaveNode> Mkdir(uint64_t parent, absl::string_view name);
  // In a rank directory: its `model.safetensors`, new and empty (also when
  // written again: the new file replaces the old once it closes valid); in
  // its extra/, a file of any name.
  absl::StatusOr<std::pair<SaveNode, std::shared_ptr<ShardFile>>> Create(
      uint64_t parent, absl::string_view name);
  // Reopening an existing file for writing with O_TRUNC starts it again.
  absl::StatusOr<std::shared_ptr<ShardFile>> Rewrite(uint64_t ino);
  // The file a node has now (to read back), or null.
  std::shared_ptr<ShardFile> FileOf(uint64_t ino) const;

  std::optional<SaveNode> Get(uint64_t ino) const;
  std::optional<SaveNode> Lookup(uint64_t parent, absl::string_view name) const;
  std::optional<SaveNode> LookupStep(absl::string_view name) const;
  std::vector<SaveNode> Children(uint64_t dir) const;
  std::vector<SaveNode> Steps() const;

  absl::Status Unlink(uint64_t parent, absl::string_view name);
  absl::Status Rmdir(uint64_t parent, absl::string_view name);
  // On a host of a cluster: the steps whose directory was removed before
  // they committed (rm -r of a save that failed), with the config each was
  // saved under, also across a restart of the mount (the store records a
  // removed pending part). The cluster withdraws each, then releases it
  // here: until then the step number cannot be begun again on this host.
  struct Removed {
    int64_t step = 0;
    ParallelConfig config;
  };
  std::vector<Removed> RemovedSteps() const;
  void ReleaseRemoved(int64_t step);
  // Removes every step (unmount).
  void Clear();

  // The writer closed a file: checks it (the error names the tensor at
  // fault). True when its step is now complete and should commit; Aborted
  // when the step committed without it (a replica closed late).
  absl::StatusOr<bool> Close(uint64_t ino,
                             const std::shared_ptr<ShardFile>& file);
  // Commits a complete step and forgets it; a cluster's host records its
  // part pending instead. The caller holds the lock that guards catalog
  // changes.
  absl::Status Commit(int64_t step);
  // The cluster committed the step: it is shown as committed from now on,
  // and what this host had not saved of it by then is dropped.
  void Committed(int64_t step);
  // The cluster dropped the step: its directories go.
  void Discard(int64_t step);
  // Steps being saved and the dp_rank 0 ranks each still waits for.
  std::vector<std::pair<int64_t, std::vector<int>>> Pending() const;

 private:
  struct Node {
    SaveNode node;
    std::map<std::string, uint64_t> children;
    std::shared_ptr<ShardFile> file;
  };
  struct Step {
    // Shared with Close, which checks a file without holding mu_; null
    // once committed.
    std::shared_ptr<StepWriter> writer;
    uint64_t dir = 0;
    bool committed = false;
  };
  // Requires mu_.
  uint64_t AddNode(SaveNode node);
  void MarkCommittedLocked(std::map<int64_t, Step>::iterator it);
  void RemoveTree(uint64_t ino);

  Store& store_;
  mutable std::mutex mu_;
  RanksOfHost ranks_of_host_;                  // guarded by mu_
  uint64_t next_ino_ = 2;                      // guarded by mu_
  std::map<uint64_t, Node> nodes_;             // guarded by mu_
  std::map<int64_t, Step> steps_;              // guarded by mu_
  std::map<int64_t, ParallelConfig> removed_;  // guarded by mu_
};

}  // namespace scalai

#endif  // SCALAI_FS_SAVE_AREA_H_
