// A Materialization re-stores a store's steps under a new parallel config, so
// that after a reconfiguration the mount's views read their bytes straight
// from blobs again instead of gathering them from the old shards.
//
// Only bytes that no stored shard holds in place are written, into one new
// blob per new shard group; a shard identical to a stored one keeps pointing
// at its blob (a pure data-parallel change writes nothing). Writing is the
// long part and may be cancelled. Until Commit, nothing that a reader or a
// crash could see has changed: the new blobs are orphans that the next
// writable open sweeps. Commit is one catalog batch; blobs no record names
// afterwards are then unlinked (a reader that still maps one keeps its
// bytes until it lets go).
//
//   ASSIGN_OR_RETURN(Materialization m,
//                    Materialization::Write(store, config, {.cancel = &stop}));
//   RETURN_IF_ERROR(m.Commit(store));
#ifndef SCALAI_TRANSFER_MATERIALIZER_H_
#define SCALAI_TRANSFER_MATERIALIZER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/parallel_config.h"
#include "transfer/foreground_reads.h"
#include "transfer/parallel.h"
#include "transfer/remote_bytes.h"
#include "transfer/store.h"

namespace scalai {

class Materialization {
 public:
  struct Options {
    // Called with (bytes written, bytes to write); may be empty.
    ProgressFn progress;
    // Set by another thread to stop writing: Write then fails with
    // kCancelled and leaves no file behind.
    const std::atomic<bool>* cancel = nullptr;
    // In a cluster: the groups of the new config this host is to hold
    // (unset: all of them), where the bytes of stored shards it does not
    // hold are read, and whether the shards it replaces are retained
    // (StepRecord::retained) for peers still reading them.
    std::optional<std::vector<int>> hold;
    const RemoteBytes* remote = nullptr;
    bool retain = false;
    // Copy shards that could stay in place when their old blob would
    // otherwise stay for less than half its bytes: a host that keeps a
    // fraction of what it held (a cluster) frees the rest, at the cost of
    // writing a few small replicated shards (layer norms) again.
    bool compact = false;
    // Reads a job waits on, which the writing gives way to (may be null).
    const ForegroundReads* foreground = nullptr;
  };

  // Plans every step not stored under `config` and writes the bytes that
  // must move into new, synced blobs.
  static absl::StatusOr<Materialization> Write(const Store& store,
                                               const ParallelConfig& config,
                                               const Options& options);

  Materialization(Materialization&& other) noexcept;
  Materialization& operator=(Materialization&& other) = delete;
  Materialization(const Materialization&) = delete;
  // Removes the blobs written unless they were committed.
  ~Materialization();

  // Steps re-stored; zero means the store was already under the config.
  int steps() const { return static_cast<int>(steps_.size()); }
  // What the reshard plans say must be written, and what was written.
  int64_t bytes_planned() const { return bytes_planned_; }
  int64_t bytes_written() const { return bytes_written_; }
  // Of those, the bytes read from other hosts (Options::remote).
  int64_t bytes_fetched() const { return bytes_fetched_; }
  // Blob files removed by Commit: no record names them any more.
  const std::vector<std::string>& blobs_freed() const { return blobs_freed_; }

  // What a step is re-stored as (public for the planning helpers).
  struct StepUpdate {
    StepRecord before;
    StepRecord after;
    std::map<int, ShardRecord> before_shards;  // the groups `before` holds
    std::map<int, ShardRecord> shards;         // the groups `after` holds
  };

  // Re-points the steps at their new shards in one catalog batch, then
  // unlinks the blobs no record names. Fails, changing nothing, if a step
  // was re-stored by someone else since Write.
  absl::Status Commit(Store& store);

 private:
  Materialization() = default;

  std::string blob_dir_;
  std::vector<StepUpdate> steps_;
  std::map<std::string, BlobRecord> new_blobs_;
  int64_t bytes_planned_ = 0;
  int64_t bytes_written_ = 0;
  int64_t bytes_fetched_ = 0;
  std::vector<std::string> blobs_freed_;
  bool retain_ = false;
  bool committed_ = false;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_MATERIALIZER_H_
