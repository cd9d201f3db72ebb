// A Store is one job's state on disk: a directory private to its owner with a
// RocksDB catalog and immutable blob files. A step's shards live in blobs that
// are fully written and fsynced before the one catalog batch that names them
// commits; blobs that no record names (a crash's leftovers) are removed when
// the store is opened. One writer at a time holds a store (a lock file);
// readers take no lock.
//
//   ASSIGN_OR_RETURN(auto store, Store::Open("/data/job"));
//   ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store->Steps());
//   ASSIGN_OR_RETURN(ShardRecord shard, store->Shard(steps.back().step, g));
#ifndef SCALAI_TRANSFER_STORE_H_
#define SCALAI_TRANSFER_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/catalog.h"
#include "ptc/layout.h"
#include "ptc/model.h"
#include "ptc/parallel_config.h"
#include "ptc/placement.h"
#include "transfer/files.h"

namespace scalai {

// An opaque file saved with a step under rank-R/extra/ (RNG state, args):
// stored whole in its own blob, never resharded.
struct ExtraFile {
  std::string path;  // below extra/, e.g. "rng/state.pt"
  std::string blob;
  int64_t size = 0;
};

// Where the tensors of one stored shard group lie: tensor k of the group's
// placement shards sits at byte `offset` of blob `blobs[blob]`.
struct ShardRecord {
  struct Location {
    int blob = 0;
    int64_t offset = 0;
  };
  std::vector<std::string> blobs;
  std::vector<Location> tensors;
};

// The shards of a step as this host stored them before its last
// materialization in a cluster: kept, and served to peers that may still
// read them, until every host has recorded that it finished (ReleaseRetained).
struct RetainedShards {
  std::string config;
  std::map<int, ShardRecord> groups;  // the groups of `config` held
};

// A committed step: the config its shards are stored under, or "full" for an
// unsharded model stored once.
struct StepRecord {
  int64_t step = 0;
  std::string config;
  int groups = 0;
  // In a cluster, the groups of `config` whose shards this store holds, in
  // order; the other hosts hold the rest. Unset: every group.
  std::optional<std::vector<int>> held;
  bool holds(int group) const;
  int64_t bytes = 0;  // tensor bytes of all stored shards
  // `scalai.consumed_samples` of rank 0's shard, when it had one: where the
  // job stands in its data (docs/reference.md).
  std::optional<int64_t> consumed_samples;
  // The extra/ files of each rank that saved some, by its rank under
  // `extra_config`, the config the step was saved under. Materializing the
  // shards under another config leaves these as they are.
  std::string extra_config;
  std::map<int, std::vector<ExtraFile>> extra;
  // Earlier holdings kept for peers until the cluster finished moving off
  // them, oldest first.
  std::vector<RetainedShards> retained;
  bool full() const { return config == "full"; }
  // Every blob the step's extra files use.
  std::vector<std::string> ExtraBlobs() const;
  // The extra files that rank `rank` of `config` sees (ExtraSourceRank);
  // empty when no saved rank it maps to saved any.
  absl::StatusOr<std::vector<ExtraFile>> ExtraFilesSeenBy(
      const ParallelConfig& config, int rank) const;
};

// What this host of a cluster holds of a step that waits for the cluster to
// commit it (every host's part saved) or drop it: the part its own workers
// saved whole, and the copies of other hosts' shards it keeps as their
// extra replica (`mount --replicas 2`). Durable, so that a host that said
// it holds them keeps them through a crash; seen by no reader (views,
// materialization, export) until Store::CommitAgreedStep. The catalog keeps
// the two parts apart (one written by the step's writer, one by the
// cluster's thread); readers see them as one.
struct PendingStep {
  StepRecord record;  // `held`: every group held here, saved or copied
  std::map<int, ShardRecord> shards;
  // This host's workers saved their part (else it holds only copies).
  bool saved = true;
  // The groups of `held` copied from other hosts.
  std::vector<int> copied;
  // Blobs of copies of groups that this host's workers also saved (the
  // saved shard stands for the group): kept until the step is recorded or
  // dropped, then removed.
  std::vector<std::string> duplicates;
  // Its step's directory was removed here (rm -r) before the cluster
  // decided (Store::MarkPendingRemoved): the part waits only for the step
  // to be withdrawn.
  bool removed = false;
  // Every blob it names: the shards' and the extra files'.
  std::vector<std::string> Blobs() const;
};

// A blob file: its size and the XXH3 of each of its chunks
// (transfer/blob_checksum.h), taken as it was written.
struct BlobRecord {
  int64_t size = 0;
  std::vector<uint64_t> chunks;
  int64_t step = 0;
  // Records written before chunk sums hold one XXH3 of the whole blob
  // instead; the next writable open of the store replaces them.
  std::optional<uint64_t> whole_xxh3 = std::nullopt;
};

// A source file a dataset reads in place, as it was when registered: a
// change of size or mtime means its bytes are no longer the ones indexed.
struct FileStamp {
  std::string path;  // absolute
  int64_t size = 0;
  int64_t mtime_ns = 0;
};

// A registered dataset (`scalai dataset add`). Its samples are the parts'
// samples in order: a JSONL file's lines, or a Megatron pair's sequences.
struct DatasetRecord {
  struct Part {
    int64_t samples = 0;
    // jsonl: the file; megatron: the .idx, then the .bin.
    std::vector<FileStamp> files;
  };
  std::string format;  // "jsonl" or "megatron"
  // megatron: the tokens' dtype (MegatronDTypeName), the same in every
  // part; "" for jsonl and for records written before it was kept.
  std::string token_dtype;
  std::vector<Part> parts;
  int64_t samples = 0;
  int64_t global_batch = 0;
  uint64_t seed = 0;
  int64_t epochs = 1;
  // jsonl: the line index in the store's dataset directory, one uint64
  // start per line and one past each file's last line (see DatasetSource).
  std::string index;
  int64_t index_size = 0;
  uint64_t index_xxh3 = 0;
  // XXH3 of the source files' bytes as registered (each file's size, then
  // its bytes, in order): what the hosts of a cluster compare. Unset for
  // records written before it was kept.
  std::optional<uint64_t> content_xxh3;
};

class Store;

// Opens a store, each time it is called: for a reader that may have to read
// the catalog again because a writer changed the store meanwhile.
using StoreOpener = std::function<absl::StatusOr<std::unique_ptr<Store>>()>;

class Store {
 public:
  // Makes a new store at `dir` (absent or empty), mode 0700.
  static absl::StatusOr<std::unique_ptr<Store>> Create(const std::string& dir,
                                                       const Layout& layout);
  // kReadOnly takes no part in the store's lock and writes nothing: it sees
  // the catalog as it stood at the open, also while a writer (a mount)
  // serves the store, and leaves orphans alone. A writer may retire a
  // step's blobs after that (a reconfiguration, a step removed): a reader
  // of blobs takes the step with StepSnapshot (step_snapshot.h), which
  // holds them from then on.
  // kReadWrite holds it alone and sweeps orphaned blobs first, unless the
  // catalog names no blob at all while blob files exist: a damaged catalog
  // looks like that, and then nothing is removed and the open fails.
  // kRepair (fsck --repair) sweeps them even then: the user has said they
  // are leftovers (of an interrupted first import).
  enum class Access { kReadWrite, kReadOnly, kRepair };
  static absl::StatusOr<std::unique_ptr<Store>> Open(
      const std::string& dir, Access access = Access::kReadWrite);
  // Whether `status` is Open's refusal of a writer because another process
  // (a mount) holds the store.
  static bool HeldByAnother(const absl::Status& status);

  const std::string& dir() const { return dir_; }
  // Records that a mount server serves this store at `mountpoint`: an open
  // that finds the store held while that mount point is gone (unmounted,
  // the server still exiting) waits for it to let go instead of failing.
  absl::Status NoteServedAt(const std::string& mountpoint) const;
  const Layout& layout() const { return layout_; }
  // The global tensors, known from the first import on; null before.
  std::shared_ptr<const Model> model() const { return model_; }
  const std::optional<ParallelConfig>& current_config() const {
    return config_;
  }
  Catalog& catalog() { return *catalog_; }
  const Catalog& catalog() const { return *catalog_; }

  std::string blob_dir() const { return dir_ + "/blobs"; }
  std::string BlobPath(const std::string& name) const {
    return blob_dir() + "/" + name;
  }
  // Dataset indexes (files of the store that datasets name).
  std::string dataset_dir() const { return dir_ + "/datasets"; }
  // A fresh random blob name; never reused.
  static std::string NewBlobName();
  // Blob files removed by the last open because no record named them.
  int orphans_removed() const { return orphans_removed_; }
  // Blobs whose records the last open gave chunk sums (written by a version
  // without them), and those it could not because their bytes no longer
  // match the whole-blob checksum (fsck names them).
  int blobs_upgraded() const { return blobs_upgraded_; }
  int blobs_not_upgraded() const { return blobs_not_upgraded_; }

  absl::StatusOr<std::vector<StepRecord>> Steps() const;
  absl::StatusOr<std::optional<StepRecord>> FindStep(int64_t step) const;
  // The newest step, or the one asked for; an error names what is missing.
  absl::StatusOr<StepRecord> ResolveStep(std::optional<int64_t> step) const;
  absl::StatusOr<ShardRecord> Shard(int64_t step, int group) const;
  absl::StatusOr<std::map<std::string, BlobRecord>> Blobs() const;
  absl::StatusOr<BlobRecord> Blob(const std::string& name) const;
  // Removes a step: its records, and the blobs no other step uses (their
  // files after the catalog commit).
  absl::Status DeleteStep(int64_t step);
  // Forgets every step's retained shards and removes the blobs nothing else
  // uses; returns how many blob files went.
  absl::StatusOr<int> ReleaseRetained();
  // Every blob some record of some step names (shards held, retained
  // shards, extra files, pending steps).
  absl::StatusOr<std::set<std::string>> BlobsInUse() const;

  // Steps saved here and waiting for the cluster (PendingStep), by step.
  absl::StatusOr<std::vector<PendingStep>> PendingSteps() const;
  // The pending step `step`, if this host has one.
  absl::StatusOr<std::optional<PendingStep>> FindPending(int64_t step) const;
  // Records the step the cluster committed, as `agreed` describes all of it
  // (config, groups, bytes, consumed samples, and the extra files other
  // hosts saved, copied here into the blobs `copied` records): with the
  // shards and extra files this host saved of it if it has them pending,
  // else holding no shard (its views read them from peers). One catalog
  // batch; a step already recorded under the same config is left as it is.
  absl::Status CommitAgreedStep(
      const StepRecord& agreed,
      const std::map<std::string, BlobRecord>& copied = {});
  // Drops a pending step the cluster will not commit, and its blobs.
  absl::Status DiscardPending(int64_t step);
  // Records that the directory of pending step `step` was removed here
  // before the cluster decided, so that a host mounted again still knows
  // its part waits only for the withdrawal (PendingStep::removed) until
  // DiscardPending or CommitAgreedStep. Nothing to record without a part
  // this host's workers saved.
  absl::Status MarkPendingRemoved(int64_t step);
  // Keeps copies of other hosts' shards of pending step `step` (saved
  // under `config`, of `groups` groups), in blobs `blobs` records, as part
  // of what this host holds of it. One catalog batch. A group already
  // copied keeps its first copy (the blobs of another are removed).
  absl::Status AddPendingCopies(int64_t step, const std::string& config,
                                int groups,
                                const std::map<int, ShardRecord>& shards,
                                const std::map<std::string, BlobRecord>& blobs);
  // Drops group `group` from what this host holds of pending step `step`
  // (a replica found to differ from the one the cluster keeps), and its
  // blobs.
  absl::Status DropPendingGroup(int64_t step, int group);
  // The catalog key and value of a pending step, for its writer's batch.
  static std::string PendingKey(int64_t step);
  static std::string PendingCopiesKey(int64_t step);
  static std::string PendingRemovedKey(int64_t step);
  static std::string EncodePending(const PendingStep& pending);
  // Every registered dataset, by name.
  absl::StatusOr<std::map<std::string, DatasetRecord>> Datasets() const;
  // A dataset this host must not serve, with why (a cluster found that its
  // copy differs from the one the cluster registered): the mount's views
  // leave it out. Held in memory only, so it is checked at every mount.
  void WithholdDataset(const std::string& name, std::string reason);
  std::map<std::string, std::string> withheld_datasets() const;
  // Makes `config` the store's current one once it is known to serve the
  // model (a placement exists) and every dataset (each global batch has a
  // sample for every data-parallel rank). The one place the current config
  // changes: a refusal changes nothing.
  absl::Status SetCurrentConfig(const ParallelConfig& config);
  // Whether every dataset's views can start at `consumed_samples`: the
  // position of a step must fall on a global batch of each.
  absl::Status CheckPosition(int64_t consumed_samples) const;
  // The placement that a step's shards are stored under.
  absl::StatusOr<std::shared_ptr<const Placement>> StepPlacement(
      const StepRecord& step) const;

  // Record codecs, shared by the writers of records.
  static std::string EncodeModel(const Model& model);
  static std::string EncodeStep(const StepRecord& step);
  static std::string EncodeShard(const ShardRecord& shard);
  static std::string EncodeBlob(const BlobRecord& blob);
  static std::string EncodeDataset(const DatasetRecord& dataset);

 private:
  Store() = default;
  absl::Status Load();
  // Drops the records of the blobs in `dropped` but not in `kept` within
  // `batch`, commits it, and then removes their files; returns how many.
  absl::StatusOr<int> CommitFreeing(Catalog::Batch& batch,
                                    const std::set<std::string>& dropped,
                                    const std::set<std::string>& kept);
  absl::Status RemoveOrphans(const std::map<std::string, BlobRecord>& blobs,
                             bool even_all);
  absl::Status AddChunkSums(std::map<std::string, BlobRecord> blobs);

  std::string dir_;
  UniqueFd lock_;
  std::unique_ptr<Catalog> catalog_;
  Layout layout_;
  std::shared_ptr<const Model> model_;
  std::optional<ParallelConfig> config_;
  int orphans_removed_ = 0;
  mutable std::mutex withheld_mu_;
  std::map<std::string, std::string> withheld_;  // guarded by withheld_mu_
  int blobs_upgraded_ = 0;
  int blobs_not_upgraded_ = 0;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_STORE_H_
