// A StepWriter takes in one step as workers save it through the mount (docs/reference.md
// section 3, "Saving a checkpoint through the mount"). Each rank's
// model.safetensors goes straight into a new blob of the store, with no
// second copy; when its writer closes it, the header is checked against the
// layout for that rank and the checksum taken. Once every rank that saves
// its group (dp_rank 0, or dp_rank < S under fsdp=S:
// ParallelConfig::SavesShard) has closed a valid shard, Commit makes the
// blobs durable and
// records the step in one catalog batch. Nothing is recorded before: a step
// never committed leaves only blobs that no record names, which the next
// open of the store removes (and the writer's destructor, when it runs).
//
//   ASSIGN_OR_RETURN(auto writer, StepWriter::Create(store, 200, config));
//   ASSIGN_OR_RETURN(std::shared_ptr<ShardFile> file, writer->Open(rank));
//   RETURN_IF_ERROR(file->Write(data, n, offset));
//   RETURN_IF_ERROR(writer->Close(rank, file));
//   if (writer->complete()) RETURN_IF_ERROR(writer->Commit());
#ifndef SCALAI_TRANSFER_STEP_WRITER_H_
#define SCALAI_TRANSFER_STEP_WRITER_H_

#include <condition_variable>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/parallel_config.h"
#include "ptc/placement.h"
#include "transfer/blob_checksum.h"
#include "transfer/files.h"
#include "transfer/store.h"
#include "transfer/write_behind.h"

namespace scalai {

// One file being saved, backed by its own new blob. Writes may come from
// several threads. Chunk sums are taken as the bytes arrive while they
// arrive in order (one writer, as usual); a chunk that a write touched out
// of order (a header written last at offset 0, pieces in any order) is read
// back and hashed at close, and only that chunk.
// Bytes that arrive in order are streamed to disk as they come (WriteBehind),
// so a save is mostly on disk when its writer calls fsync.
class ShardFile {
 public:
  // A file with no name in `dir` (O_TMPFILE), gone when dropped: for bytes
  // that are only compared, never kept. Writes past `max_bytes` fail.
  static absl::StatusOr<std::shared_ptr<ShardFile>> Scratch(
      const std::string& dir, int64_t max_bytes);
  // The largest valid model.safetensors holding `tensor_bytes` of tensors:
  // the 8-byte length, the largest header accepted, the data.
  static int64_t SizeLimit(int64_t tensor_bytes);
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  // Fails with OutOfRange, writing nothing, for bytes past the file's limit
  // (a shard far larger than its rank's could ever be valid).
  absl::Status Write(const char* data, int64_t size, int64_t offset);
  // Empties the file (open with O_TRUNC, or truncate to 0).
  absl::Status Truncate();
  // fdatasync: what the writer's fsync asks for.
  absl::Status Sync();
  // Reads back what was written; returns the bytes read.
  absl::StatusOr<int64_t> Read(char* out, int64_t size, int64_t offset) const;
  // Read, for SameBytes; valid while the file lives.
  RangeReader Reader() const;
  int64_t size() const;
  const std::string& blob() const { return blob_; }
  // The chunk sums of the file as it is now (blob_checksum.h).
  absl::StatusOr<std::vector<uint64_t>> ChunkSums();
  // From now on Write and Truncate fail with FailedPrecondition: the bytes
  // are being committed, and a committed blob never changes, whichever
  // handle still names it. Waits for writes already under way to end.
  void Seal();
  // The commit failed: the file may be written again.
  void Unseal();

 private:
  friend class StepWriter;
  ShardFile() = default;

  // What the last successful check found, for the commit and for
  // comparing replicas without parsing the header again.
  struct Checked {
    std::vector<int64_t> offsets;  // of the shard group's tensors
    int64_t data_start = 0;
    int64_t data_bytes = 0;
    std::optional<int64_t> consumed_samples;  // rank 0's metadata
  };
  Checked checked_;  // written by Close before the file is published

  std::string blob_;
  std::string path_;
  std::string label_;  // how errors name it: rank-00000/model.safetensors
  int64_t max_bytes_ = std::numeric_limits<int64_t>::max();
  UniqueFd fd_;
  mutable std::mutex mu_;
  int64_t size_ = 0;  // guarded by mu_
  // The in-order prefix [0, stream_.bytes()) as written; guarded by mu_.
  ChunkHasher stream_;
  // Chunks a write touched out of order: stream_'s sums of them are stale.
  std::set<int64_t> rewritten_;  // guarded by mu_
  // Sums of chunks outside the stream, read back since last written.
  std::map<int64_t, uint64_t> read_back_;  // guarded by mu_
  // Streams the in-order prefix to disk as it grows; guarded by mu_.
  WriteBehind behind_;
  // A failed writeback seen while streaming, which fsync can no longer
  // report; guarded by mu_.
  absl::Status write_error_;
  // Seal(): no write may start; guarded by mu_.
  bool sealed_ = false;
  // Writes and truncations under way, which Seal waits out; guarded by mu_.
  int changing_ = 0;
  std::condition_variable unchanging_;
  // Counts a change under way, or refuses it once sealed.
  absl::Status BeginChange();
  void EndChange();
};

class StepWriter {
 public:
  struct Options {
    // On a host of a cluster: the ranks saved here (the others are saved
    // on their own hosts). Only they may be written, the step is complete
    // here once its groups' savers closed valid shards, and Commit
    // records it pending (PendingStep) until the cluster commits it. A
    // group whose saver runs on another host is kept here too
    // when a replica of it was saved here, for the cluster to compare with
    // the other host's (by checksum) and to hold a second copy.
    std::optional<std::vector<int>> ranks;
  };
  // Refuses a step that is already committed, and a store that does not
  // know its model yet (the first step comes by import).
  static absl::StatusOr<std::unique_ptr<StepWriter>> Create(
      Store& store, int64_t step, const ParallelConfig& config,
      Options options);
  static absl::StatusOr<std::unique_ptr<StepWriter>> Create(
      Store& store, int64_t step, const ParallelConfig& config) {
    return Create(store, step, config, Options());
  }
  ~StepWriter();

  int64_t step() const { return step_; }
  const ParallelConfig& config() const { return placement_->config(); }

  // A new, empty model.safetensors for `rank`. A rank may write its file
  // again: the new one replaces the old when it closes valid.
  absl::StatusOr<std::shared_ptr<ShardFile>> Open(int rank);
  // The largest valid model.safetensors of `rank` (ShardFile::SizeLimit).
  int64_t ShardLimit(int rank) const;
  // Checks the rank's file as its writer closes it: a safetensors header
  // with exactly the rank's tensors (names, dtypes, local shapes) and data
  // to the end, equal to the bytes of its replicas. The error names the
  // file and the tensor at fault; the file is then kept out of the step.
  absl::Status Close(int rank, const std::shared_ptr<ShardFile>& file);
  // `rank` is a rank of the step's config, saved on this host.
  absl::Status CheckRank(int rank) const;
  // The rank's file was removed: the step waits for a new one.
  void Forget(int rank);

  // The largest extra/ file: every byte of it is hashed at close and copied
  // by export, so a write far past it (a sparse terabyte) is refused.
  static constexpr int64_t kMaxExtraBytes = int64_t{4} << 30;
  // A new, empty rank-R/extra/`path` (an opaque file: RNG state, args), of
  // at most kMaxExtraBytes.
  absl::StatusOr<std::shared_ptr<ShardFile>> OpenExtra(int rank,
                                                       const std::string& path);
  // Its writer closed it: it is part of the step when the step commits, in
  // place of an earlier file of the same path. Nothing is checked.
  absl::Status CloseExtra(int rank, const std::string& path,
                          const std::shared_ptr<ShardFile>& file);
  // The extra file was removed.
  void ForgetExtra(int rank, const std::string& path);
  // The refusal of an extra file opened or closed once its step committed.
  static absl::Status LateExtra(int64_t step, int rank,
                                const std::string& path);
  // A rank that holds a replica (not its group's saver) began to save
  // (made its directory): the step
  // waits for its shard too, so that the extra/ files it writes before its
  // shard are part of the step. Leave undoes it (its directory went).
  void Join(int rank);
  void Leave(int rank);
  // Every saver, and every rank that joined, has closed a valid shard.
  bool complete() const;
  // The ranks still to close a valid shard, for `status`.
  std::vector<int> missing() const;
  // Syncs the blobs and records the step, atomically; the blobs then belong
  // to the store. Extra replicas' blobs are removed. With Options::ranks
  // the step is recorded pending instead; the same call again does nothing.
  absl::Status Commit();
  // Commit records the step pending (Options::ranks).
  bool pending() const { return ranks_.has_value(); }

 private:
  StepWriter(Store& store, int64_t step,
             std::shared_ptr<const Placement> placement,
             std::optional<std::set<int>> ranks);
  // Whether the step waits for `rank`'s shard here: it saves its group or
  // joined, and is saved on this host.
  bool Awaited(int rank) const;  // requires mu_
  absl::StatusOr<ShardFile::Checked> Check(int rank, ShardFile& file);
  // A tied model's last stage holds the input embedding again (pp > 1):
  // each tp slice must equal the first stage's. Requires mu_.
  absl::Status CompareTiedCopies() const;
  // A new file backed by a new blob of the step.
  absl::StatusOr<std::shared_ptr<ShardFile>> NewFile(int rank,
                                                     absl::string_view label,
                                                     int64_t max_bytes);

  Store& store_;
  const int64_t step_;
  const std::shared_ptr<const Placement> placement_;
  const std::optional<std::set<int>> ranks_;  // Options::ranks
  mutable std::mutex mu_;
  // Guarded by mu_: each rank's valid file, the replicas' ranks that
  // joined, the closed extra files by (rank, path), each blob made, and
  // whether the step is committed.
  std::vector<std::shared_ptr<ShardFile>> valid_;
  std::set<int> joined_;
  std::map<std::pair<int, std::string>, std::shared_ptr<ShardFile>> extra_;
  std::set<std::string> blobs_;
  bool committed_ = false;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_STEP_WRITER_H_
