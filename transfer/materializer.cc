#include "transfer/materializer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "ptc/reshard_plan.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/chunk_hold.h"
#include "transfer/copy_bytes.h"
#include "transfer/fetch_ahead.h"
#include "transfer/mapping_guard.h"
#include "transfer/step_view.h"
#include "transfer/write_behind.h"

namespace scalai {
namespace {

// Bytes hashed and written at a time: small enough to stay in the CPU's
// cache between the hash and the write's copy (one pass over memory, not
// two), large enough that system calls cost nothing next to the copy.
constexpr int64_t kChunkBytes = 256 << 10;
// How often the writers look at the cancel flag and report progress.
constexpr int64_t kProgressBytes = 8 << 20;

// One new blob: the shards of one group of one step that no stored shard
// holds in place, as a safetensors file of their local names, so that every
// blob describes itself (fsck checks each location against its header).
struct BlobJob {
  size_t step;  // index into the steps being materialized
  int group;
  std::string name;
  std::vector<int> shards;
  std::string header;
  int64_t bytes = 0;  // header and data
};

absl::Status CheckCancel(const std::atomic<bool>* cancel) {
  if (cancel != nullptr && cancel->load()) {
    return absl::CancelledError("materialization superseded");
  }
  return absl::OkStatus();
}

// Appends to a new blob, hashing its chunks in blob order. Short pieces
// (rows of a split along dim 1, zero padding) are gathered in a window and
// written together; long ones are read from their source blob a chunk at a
// time (AppendFromBlob) and written from that buffer.
class BlobWriter {
 public:
  BlobWriter(UniqueFd out, std::string path, const ForegroundReads* foreground,
             const std::atomic<bool>* cancel)
      : out_(std::move(out)),
        path_(std::move(path)),
        foreground_(foreground),
        cancel_(cancel),
        window_(new char[kChunkBytes]),
        source_(NewIoBuffer(kBlobChunkBytes)) {}

  absl::Status Append(const char* data, int64_t n) {
    if (n >= kChunkBytes) {
      RETURN_IF_ERROR(Flush());
      for (int64_t at = 0; at < n; at += kChunkBytes) {
        RETURN_IF_ERROR(HashAndWrite(data + at, std::min(kChunkBytes, n - at)));
      }
      return absl::OkStatus();
    }
    if (used_ + n > kChunkBytes) RETURN_IF_ERROR(Flush());
    CopyBytes(window_.get() + used_, data, n);
    used_ += n;
    return absl::OkStatus();
  }

  // Long pieces are read from their blob with pread, a source chunk at a
  // time, which is also when an unverified chunk is checked: no page faults
  // on the source mapping, and the hash and the write find each piece in
  // the CPU's cache.
  absl::Status AppendFromBlob(const BlobReader& blob, int64_t offset,
                              int64_t n) {
    RETURN_IF_ERROR(Flush());
    return blob.ReadInto(
        offset, n, source_.get(), [this](const char* data, int64_t bytes) {
          for (int64_t at = 0; at < bytes; at += kChunkBytes) {
            RETURN_IF_ERROR(
                HashAndWrite(data + at, std::min(kChunkBytes, bytes - at)));
          }
          return absl::OkStatus();
        });
  }

  absl::Status AppendZeros(int64_t n) {
    while (n > 0) {
      if (used_ == kChunkBytes) RETURN_IF_ERROR(Flush());
      const int64_t k = std::min(n, kChunkBytes - used_);
      std::memset(window_.get() + used_, 0, k);
      used_ += k;
      n -= k;
    }
    return absl::OkStatus();
  }

  absl::Status Flush() {
    if (used_ == 0) return absl::OkStatus();
    RETURN_IF_ERROR(HashAndWrite(window_.get(), used_));
    used_ = 0;
    return absl::OkStatus();
  }

  std::vector<uint64_t> chunk_sums() const { return hasher_.Finish(); }

 private:
  absl::Status HashAndWrite(const char* data, int64_t n) {
    // Before the piece's hash and copy, the bulk of what writing costs. A
    // cancelled writer no longer waits: whoever cancelled waits for it.
    if (foreground_ != nullptr && !(cancel_ != nullptr && cancel_->load())) {
      foreground_->Yield();
    }
    hasher_.Update(data, n);
    RETURN_IF_ERROR(WriteAll(out_.get(), data, n, path_));
    written_ += n;
    return WriteBehind::Apply(out_.get(), behind_.Advance(written_), path_);
  }

  UniqueFd out_;
  std::string path_;
  const ForegroundReads* foreground_;
  const std::atomic<bool>* cancel_;
  std::unique_ptr<char[]> window_;
  IoBuffer source_;  // a source blob's chunk, for ReadInto
  int64_t used_ = 0;
  int64_t written_ = 0;
  WriteBehind behind_{WriteBehind::Pages::kKeep};
  ChunkHasher hasher_;
};

// Bytes fetched from other hosts at a time: a few messages of the peer
// stream, so that a long remote piece is written as it arrives.
constexpr int64_t kFetchBytes = 4 << 20;
// Pieces in flight while the last is written: enough to keep the network
// busy while the disk takes one (and to spread over the peers holding it).
constexpr int kFetchDepth = 4;

// Where a blob's sources are that this host does not hold, and how many
// bytes came from there.
struct Fetcher {
  const RemoteBytes* remote;
  std::atomic<int64_t> fetched{0};
};

absl::StatusOr<BlobRecord> WriteBlob(const std::string& path,
                                     const BlobJob& job, const StepView& view,
                                     int64_t step, Progress& progress,
                                     Fetcher& fetcher,
                                     const Materialization::Options& options) {
  const std::atomic<bool>* cancel = options.cancel;
  ASSIGN_OR_RETURN(UniqueFd out,
                   OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0600));
  BlobWriter writer(std::move(out), path, options.foreground, cancel);
  RETURN_IF_ERROR(writer.Append(job.header.data(), job.header.size()));
  const std::vector<TensorShard>& shards = view.placement().shards(job.group);
  // Every shard's sources first, so that the pieces held by other hosts are
  // fetched ahead of the writes, in the order they are written.
  std::vector<std::vector<Segment>> sources;
  std::vector<FetchAhead::Range> remote_pieces;
  const Placement& from = view.plan().from();
  for (int k : job.shards) {
    ASSIGN_OR_RETURN(sources.emplace_back(),
                     view.plan().Resolve(job.group, k, 0, shards[k].bytes));
    for (const Segment& seg : sources.back()) {
      if (!seg.src.valid() || view.stored().holds(seg.src.group)) continue;
      if (fetcher.remote == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("step ", step, ": shard group ", seg.src.group, " of ",
                         from.config().ToString(), " is not held here"));
      }
      for (int64_t at = 0; at < seg.length; at += kFetchBytes) {
        remote_pieces.push_back(
            {seg.src, from.shards(seg.src.group)[seg.src.shard].bytes,
             seg.src_offset + at, std::min(kFetchBytes, seg.length - at)});
      }
    }
  }
  std::optional<FetchAhead> ahead;
  if (!remote_pieces.empty()) {
    ahead.emplace(*fetcher.remote, step, from.config().ToString(),
                  std::move(remote_pieces), kFetchDepth);
  }
  UnchangedBlobs unchanged;
  for (const std::vector<Segment>& segments : sources) {
    RETURN_IF_ERROR(CheckCancel(cancel));
    int64_t since_check = 0;
    for (const Segment& seg : segments) {
      if (seg.src.valid() && !view.stored().holds(seg.src.group)) {
        for (int64_t at = 0; at < seg.length; at += kFetchBytes) {
          RETURN_IF_ERROR(CheckCancel(cancel));
          const int64_t n = std::min(kFetchBytes, seg.length - at);
          ASSIGN_OR_RETURN(const char* fetched, ahead->Next());
          fetcher.fetched += n;
          RETURN_IF_ERROR(writer.Append(fetched, n));
        }
      } else if (seg.src.valid()) {
        // A corrupt source is never copied into a blob with a fresh
        // checksum: the materialization fails naming it.
        const StepBytes::Tensor& t = view.stored().tensor(seg.src);
        if (seg.length >= kChunkBytes) {
          RETURN_IF_ERROR(writer.AppendFromBlob(
              *t.blob, t.offset + seg.src_offset, seg.length));
        } else {
          RETURN_IF_ERROR(t.Verify(seg.src_offset, seg.length, unchanged));
          // A fault leaves this blob half written; the materialization
          // fails and it is discarded.
          absl::Status appended;
          if (!ReadMapped([&] {
                appended = writer.Append(
                    reinterpret_cast<const char*>(t.data) + seg.src_offset,
                    seg.length);
              })) {
            return t.blob->CutShort();
          }
          RETURN_IF_ERROR(appended);
        }
      } else {
        RETURN_IF_ERROR(writer.AppendZeros(seg.length));
      }
      since_check += seg.length;
      if (since_check >= kProgressBytes) {
        RETURN_IF_ERROR(CheckCancel(cancel));
        progress.Add(since_check);
        since_check = 0;
      }
    }
    progress.Add(since_check);
  }
  RETURN_IF_ERROR(writer.Flush());
  return BlobRecord{job.bytes, writer.chunk_sums(), step};
}

// Where each kind of new shard (ReshardPlan::first_identical) was placed in
// this step: blob name and offset.
using Placed = std::map<std::pair<int, int>, std::pair<std::string, int64_t>>;

// Adds `name` to the shard record's blob list once; returns its index.
int BlobIndex(ShardRecord& record, const std::string& name) {
  for (size_t i = 0; i < record.blobs.size(); ++i) {
    if (record.blobs[i] == name) return static_cast<int>(i);
  }
  record.blobs.push_back(name);
  return static_cast<int>(record.blobs.size()) - 1;
}

// Where group `g` of the plan's new placement will lie: each shard that a
// stored one holds identically stays in that shard's blob (`stored`, per
// old group); the others are added to `job`, whose header places them.
absl::StatusOr<ShardRecord> PlanGroup(const ReshardPlan& plan, int g,
                                      const std::map<int, ShardRecord>& stored,
                                      Placed& placed,
                                      const std::set<std::string>& dropped,
                                      int64_t step, BlobJob& job) {
  const Placement& to = plan.to();
  const std::vector<TensorShard>& shards = to.shards(g);
  // A stored shard identical to the new one is used in place if this host
  // holds it (in a cluster it may be another's, and is then fetched) and
  // its blob is not being dropped.
  auto in_place = [&](size_t k) {
    ShardRef same = plan.in_place_source(g, static_cast<int>(k));
    if (!same.valid() || !stored.contains(same.group)) return ShardRef{};
    const ShardRecord& src = stored.at(same.group);
    const std::string& blob = src.blobs[src.tensors[same.shard].blob];
    return dropped.contains(blob) ? ShardRef{} : same;
  };
  // Else a replica of it placed before in this step (a layer norm of every
  // tensor-parallel rank) is written once, and both point at it.
  auto kind = [&](size_t k) {
    ShardRef first = plan.first_identical(g, static_cast<int>(k));
    return std::pair{first.group, first.shard};
  };
  auto planned_copy = [&](size_t k) { return placed.contains(kind(k)); };
  std::vector<SafetensorsEntry> entries;
  for (size_t k = 0; k < shards.size(); ++k) {
    if (in_place(k).valid() || planned_copy(k)) continue;
    job.shards.push_back(static_cast<int>(k));
    entries.push_back({shards[k].local_name,
                       to.model().tensor(shards[k].tensor).dtype,
                       shards[k].local_shape, 0, 0});
  }
  ASSIGN_OR_RETURN(
      SafetensorsHeader header,
      SafetensorsHeader::Build(std::move(entries),
                               {{"scalai.step", absl::StrCat(step)},
                                {"scalai.config", to.config().ToString()},
                                {"scalai.group", absl::StrCat(g)}}));
  job.header = header.Serialize();
  job.bytes = header.file_size();
  ShardRecord record;
  for (size_t k = 0, moved = 0; k < shards.size(); ++k) {
    ShardRef same = in_place(k);
    if (planned_copy(k)) {
      const auto& [blob, offset] = placed.at(kind(k));
      record.tensors.push_back({BlobIndex(record, blob), offset});
    } else if (same.valid()) {
      const ShardRecord& src = stored.at(same.group);
      const ShardRecord::Location& at = src.tensors[same.shard];
      record.tensors.push_back(
          {BlobIndex(record, src.blobs[at.blob]), at.offset});
    } else {
      const SafetensorsEntry& e = header.tensors()[moved++];
      record.tensors.push_back(
          {BlobIndex(record, job.name), header.data_start() + e.data_begin});
    }
    const ShardRecord::Location& at = record.tensors.back();
    placed.emplace(kind(k), std::pair{record.blobs[at.blob], at.offset});
  }
  return record;
}

// The old blobs that the planned records of `update` would keep for less
// than half their bytes (a few replicated shards left in place).
absl::StatusOr<std::set<std::string>> MostlyUnused(
    const Store& store, const ReshardPlan& plan,
    const Materialization::StepUpdate& update) {
  std::set<std::string> old;
  for (const auto& [g, shard] : update.before_shards)
    old.insert(shard.blobs.begin(), shard.blobs.end());
  std::map<std::string, std::set<std::pair<int64_t, int64_t>>> kept;
  for (const auto& [g, record] : update.shards) {
    for (size_t k = 0; k < record.tensors.size(); ++k) {
      const std::string& blob = record.blobs[record.tensors[k].blob];
      if (old.contains(blob)) {
        kept[blob].insert(
            {record.tensors[k].offset, plan.to().shards(g)[k].bytes});
      }
    }
  }
  std::set<std::string> dropped;
  for (const auto& [blob, pieces] : kept) {
    int64_t used = 0;
    for (const auto& [offset, bytes] : pieces) used += bytes;
    ASSIGN_OR_RETURN(BlobRecord record, store.Blob(blob));
    if (used * 2 < record.size) dropped.insert(blob);
  }
  return dropped;
}

}  // namespace

absl::StatusOr<Materialization> Materialization::Write(
    const Store& store, const ParallelConfig& config, const Options& options) {
  Materialization m;
  m.blob_dir_ = store.blob_dir();
  m.retain_ = options.retain;
  // The plans read each step's record and its shards' records at one moment
  // (a save or a release may commit meanwhile); the writing needs no lock.
  std::shared_lock<std::shared_mutex> consistent =
      store.catalog().HoldCommits();
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store.Steps());
  std::vector<std::unique_ptr<StepView>> views;
  std::vector<BlobJob> jobs;
  const std::string target = config.ToString();
  if (options.hold) {
    ASSIGN_OR_RETURN(Placement to,
                     Placement::Create(store.layout(), store.model(), config));
    for (int g : *options.hold) {
      if (g < 0 || g >= to.num_groups()) {
        return absl::InvalidArgumentError(
            absl::StrCat("no shard group ", g, " in ", target, " to hold"));
      }
    }
  }
  for (const StepRecord& step : steps) {
    if (step.config == target) continue;
    ASSIGN_OR_RETURN(std::unique_ptr<StepView> view,
                     StepView::Create(store, step, config));
    const ReshardPlan& plan = view->plan();
    const Placement& to = plan.to();
    StepUpdate update;
    update.before = step;
    update.after = step;  // the extra files stay as saved
    update.after.config = target;
    update.after.groups = to.num_groups();
    update.after.held = options.hold;
    update.after.bytes = 0;
    for (int g = 0; g < step.groups; ++g) {
      if (!step.holds(g)) continue;
      ASSIGN_OR_RETURN(update.before_shards[g], store.Shard(step.step, g));
    }
    // Planned twice when compacting: shards left in place in an old blob
    // that would stay mostly unused are copied instead, and the blob goes.
    std::set<std::string> dropped;
    std::vector<BlobJob> step_jobs;
    int64_t step_planned = 0;
    for (int pass = 0;; ++pass) {
      step_jobs.clear();
      update.shards.clear();
      Placed placed;
      update.after.bytes = 0;
      step_planned = 0;
      for (int g = 0; g < to.num_groups(); ++g) {
        if (!update.after.holds(g)) continue;
        BlobJob job{m.steps_.size(), g, Store::NewBlobName(), {}, "", 0};
        ASSIGN_OR_RETURN(ShardRecord record,
                         PlanGroup(plan, g, update.before_shards, placed,
                                   dropped, step.step, job));
        for (const TensorShard& shard : to.shards(g))
          update.after.bytes += shard.bytes;
        for (int k : job.shards) step_planned += to.shards(g)[k].bytes;
        if (!job.shards.empty()) step_jobs.push_back(std::move(job));
        update.shards[g] = std::move(record);
      }
      if (!options.compact || pass > 0) break;
      ASSIGN_OR_RETURN(dropped, MostlyUnused(store, plan, update));
      if (dropped.empty()) break;
    }
    m.bytes_planned_ += step_planned;
    for (BlobJob& job : step_jobs) jobs.push_back(std::move(job));
    m.steps_.push_back(std::move(update));
    views.push_back(std::move(view));
  }
  consistent.unlock();
  // From here on the destructor removes whatever was written.
  for (const BlobJob& job : jobs) m.new_blobs_[job.name] = {};
  Progress progress(m.bytes_planned_, options.progress);
  Fetcher fetcher{options.remote};
  // Workers reading the step through a mount meanwhile read the blobs this
  // reads: through the page cache, so that each is read from the disk once.
  ChunkHold::SharedPageCache shared;
  std::mutex mu;
  RETURN_IF_ERROR(ParallelFor(jobs.size(), IoThreads(), [&](size_t i) {
    const BlobJob& job = jobs[i];
    ASSIGN_OR_RETURN(
        BlobRecord blob,
        WriteBlob(store.BlobPath(job.name), job, *views[job.step],
                  m.steps_[job.step].after.step, progress, fetcher, options));
    std::lock_guard<std::mutex> lock(mu);
    m.new_blobs_[job.name] = blob;
    return absl::OkStatus();
  }));
  RETURN_IF_ERROR(CheckCancel(options.cancel));
  if (!jobs.empty()) RETURN_IF_ERROR(SyncFilesystem(m.blob_dir_));
  m.bytes_written_ = progress.done();
  m.bytes_fetched_ = fetcher.fetched.load();
  return m;
}

Materialization::Materialization(Materialization&& other) noexcept
    : blob_dir_(std::move(other.blob_dir_)),
      steps_(std::move(other.steps_)),
      new_blobs_(std::move(other.new_blobs_)),
      bytes_planned_(other.bytes_planned_),
      bytes_written_(other.bytes_written_),
      bytes_fetched_(other.bytes_fetched_),
      blobs_freed_(std::move(other.blobs_freed_)),
      retain_(other.retain_),
      committed_(other.committed_) {
  other.new_blobs_.clear();
  other.committed_ = true;
}

Materialization::~Materialization() {
  if (committed_) return;
  for (const auto& [name, blob] : new_blobs_) {
    unlink((blob_dir_ + "/" + name).c_str());
  }
}

absl::Status Materialization::Commit(Store& store) {
  if (committed_) return absl::OkStatus();
  Catalog::Batch batch;
  std::set<std::string> freed;
  for (const StepUpdate& u : steps_) {
    ASSIGN_OR_RETURN(std::optional<StepRecord> now,
                     store.FindStep(u.before.step));
    if (!now || now->config != u.before.config) {
      return absl::AbortedError(absl::StrCat(
          "step ", u.before.step, " changed while it was materialized"));
    }
    StepRecord after = u.after;
    if (retain_) {
      after.retained.push_back({u.before.config, u.before_shards});
    }
    batch.Put(Table::kSteps, StepKey(after.step), Store::EncodeStep(after));
    std::set<std::string> used;
    for (const auto& [g, shard] : u.shards) {
      batch.Put(Table::kShards, ShardKey(after.step, g),
                Store::EncodeShard(shard));
      used.insert(shard.blobs.begin(), shard.blobs.end());
    }
    for (const auto& [g, shard] : u.before_shards) {
      if (!u.shards.contains(g))
        batch.Delete(Table::kShards, ShardKey(after.step, g));
    }
    if (retain_) continue;  // its blobs stay until ReleaseRetained
    for (const RetainedShards& kept : after.retained) {
      for (const auto& [g, shard] : kept.groups)
        used.insert(shard.blobs.begin(), shard.blobs.end());
    }
    for (const auto& [g, shard] : u.before_shards) {
      for (const std::string& name : shard.blobs) {
        if (!used.contains(name)) freed.insert(name);
      }
    }
  }
  for (const auto& [name, blob] : new_blobs_) {
    batch.Put(Table::kBlobs, name, Store::EncodeBlob(blob));
  }
  for (const std::string& name : freed) batch.Delete(Table::kBlobs, name);
  RETURN_IF_ERROR(store.catalog().Commit(batch));
  committed_ = true;
  // The records no longer name these; a crash before the unlinks leaves
  // orphans that the next writable open sweeps.
  for (const std::string& name : freed) {
    if (unlink(store.BlobPath(name).c_str()) == 0 || errno == ENOENT) {
      blobs_freed_.push_back(name);
    }
  }
  if (!freed.empty()) RETURN_IF_ERROR(SyncDir(blob_dir_));
  return absl::OkStatus();
}

}  // namespace scalai
