// The mount's tree model (docs/reference.md), free of FUSE: inodes, names,
// attributes and the bytes of every file, built from a store for its current
// config. The FUSE adapter only translates requests to calls on it, and unit
// tests drive it directly.
//
//   ASSIGN_OR_RETURN(auto tree, Tree::Build(store, config));
//   const Node* ckpt = tree->Lookup(kRootIno, "ckpt");
//   const Node* step = tree->Lookup(ckpt->ino, "step-00000100");
//   ASSIGN_OR_RETURN(int64_t n, tree->Read(*file, offset, length, buf));
#ifndef SCALAI_FS_TREE_H_
#define SCALAI_FS_TREE_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "ptc/parallel_config.h"
#include "transfer/blob_reader.h"
#include "transfer/dataset_view.h"
#include "transfer/step_view.h"
#include "transfer/store.h"

namespace scalai {

inline constexpr uint64_t kRootIno = 1;

enum class NodeKind { kDir, kFile, kSymlink };

// The files of `data/NAME/rank-R/` whose bytes a dataset view computes.
enum class DataFile { kNone, kSampleIds, kSamplesDir, kSample, kStream };

struct Node {
  uint64_t ino = 0;
  uint64_t parent = 0;
  std::string name;
  NodeKind kind = NodeKind::kFile;
  mode_t mode = 0444;
  int64_t size = 0;
  std::vector<uint64_t> children;  // sorted by name
  // A small file's whole content, the header of a model.safetensors, or a
  // symlink's target.
  std::string text;
  // Files computed from a step view: one tensor (shard >= 0) or a rank's
  // model.safetensors (shard == -1: `text`, then the group's tensors).
  int view = -1;
  int group = -1;
  int shard = -1;
  // `status`: its bytes change while served; the server makes them.
  bool live = false;
  // Data views: the tree's dataset view, the dp rank, and for kSample, K.
  DataFile data = DataFile::kNone;
  int dataset = -1;
  int dp_rank = -1;
  int64_t sample = -1;
  // A file saved under a rank's extra/: its index in the tree's extra blobs.
  int extra = -1;
};

// What the kernel must be told about a node to drop it.
struct NodeRef {
  uint64_t parent = 0;
  uint64_t ino = 0;
  std::string name;
};

// One name of a directory listing.
struct DirEntry {
  std::string name;
  uint64_t ino = 0;
  const Node* node = nullptr;    // null for a sample not looked up
  mode_t mode = S_IFREG | 0444;  // when node is null
};

class Tree {
 public:
  // `generation` numbers the trees a mount serves one after another; the
  // kernel sees it with every inode, so an inode of an older tree is never
  // mistaken for one of a newer tree.
  // In a cluster, `remote` (which outlives the tree) reads the bytes this
  // store does not hold.
  static absl::StatusOr<std::unique_ptr<Tree>> Build(
      const Store& store, const ParallelConfig& config, uint64_t generation = 1,
      const RemoteBytes* remote = nullptr);
  // The same tree built again from the store's current records (after a
  // materialization re-pointed them at new blobs): the same generation, nodes
  // and inode numbers, and the kernel's references shared with `same`, so
  // that it can take `same`'s place without the kernel noticing.
  static absl::StatusOr<std::unique_ptr<Tree>> Rebuild(const Store& store,
                                                       const Tree& same);
  // The same, reading what this store does not hold through `remote`.
  static absl::StatusOr<std::unique_ptr<Tree>> Rebuild(
      const Store& store, const Tree& same, const RemoteBytes* remote);

  const ParallelConfig& config() const { return config_; }
  const RemoteBytes* remote() const { return remote_; }
  // A node of the tree, or a samples/K file the kernel holds; else null.
  const Node* Get(uint64_t ino) const;
  // The child called `name`, or null. A samples/K node is made here and
  // lives only while the kernel holds it or it is open: the server uses
  // Enter, which counts the kernel's reference in the same step.
  absl::StatusOr<const Node*> Lookup(uint64_t parent,
                                     absl::string_view name) const;
  absl::StatusOr<const Node*> Enter(uint64_t parent,
                                    absl::string_view name) const;
  // A directory's listing by position. `samples/` lists K = 0, 1, ...
  // without making their nodes.
  int64_t EntryCount(const Node& dir) const;
  DirEntry EntryAt(const Node& dir, int64_t i) const;
  // A file's size: most are known when built; `samples.jsonl` is summed at
  // its first use.
  int64_t SizeOf(const Node& node) const;
  // Reads up to `length` bytes at `offset`; returns how many (0 at the end).
  absl::StatusOr<int64_t> Read(const Node& node, int64_t offset, int64_t length,
                               char* out) const;
  uint64_t generation() const { return generation_; }
  // Inode numbers: the generation in the high 24 bits, an index below.
  static constexpr int kIndexBits = 40;
  static constexpr uint64_t kMaxGeneration = (uint64_t{1} << 24) - 1;
  // The most nodes a tree may have (some hundreds of bytes each, with the
  // headers and rank.json texts): a config whose views would need more is
  // refused before they are built.
  static constexpr int64_t kMaxNodes = int64_t{1} << 21;
  static uint64_t GenerationOf(uint64_t ino) { return ino >> kIndexBits; }

  // The kernel's references to inodes: each entry it receives (lookup,
  // readdirplus) counts one, FORGET drops n. A tree may be released once no
  // inode is referenced and no file is open.
  void CountLookup(uint64_t ino) const;
  void Forget(uint64_t ino, uint64_t n) const;
  uint64_t lookups(uint64_t ino) const;
  uint64_t total_lookups() const { return counts_->total_lookups.load(); }
  // Open handles of a node: +1 at open, -1 at release.
  void CountOpen(uint64_t ino, int delta) const;
  // The nodes the kernel holds and no handle has open, each after everything
  // below it: what may be reported deleted once the tree is replaced.
  std::vector<NodeRef> UnopenedReferencesDeepestFirst() const;
  // Whether a handle has a file of ckpt/step-N open (retention spares it).
  bool StepOpen(int64_t step) const;

 private:
  Tree() = default;
  Node& Add(uint64_t parent, std::string name, NodeKind kind, mode_t mode);
  // Inode numbers carry the generation (the root is always 1), so inodes of
  // different trees never collide. Below it is a node's index or, past the
  // nodes, a samples/K file: nodes + its dataset's base + its global
  // position - the view's start (positions are unique across ranks).
  uint64_t InoOf(uint64_t index) const;
  std::optional<size_t> IndexOf(uint64_t ino) const;
  void SortChildren();
  absl::Status AddDatasets(const Store& store,
                           const std::vector<StepRecord>& steps,
                           uint64_t data_dir, nlohmann::json& job);
  absl::Status NumberSamples();
  // Fills rank `rank`'s extra/ directory with the extra files of `step` its
  // rank sees (ExtraSourceRank); `blobs` maps each blob of the step mapped
  // so far to its index in extras_.
  absl::Status AddExtraFiles(const Store& store, const StepRecord& step,
                             int rank, uint64_t extra_dir,
                             std::map<std::string, int>& blobs);
  uint64_t SampleIno(const Node& samples_dir, int64_t k) const;
  absl::StatusOr<const Node*> LookupSample(const Node& samples_dir,
                                           absl::string_view name,
                                           bool count) const;

  ParallelConfig config_;
  uint64_t generation_ = 1;
  std::vector<Node> nodes_;  // by index; see InoOf
  // Counted from the FUSE threads; atomics, so no lock. Shared by the trees
  // of one generation (Rebuild).
  struct Counts {
    explicit Counts(size_t nodes)
        : lookups(new std::atomic<uint64_t>[nodes]()),
          opens(new std::atomic<int64_t>[nodes]()) {}
    std::unique_ptr<std::atomic<uint64_t>[]> lookups;
    std::unique_ptr<std::atomic<int64_t>[]> opens;
    std::atomic<uint64_t> total_lookups{0};
    // samples/K nodes, made when looked up and dropped once the kernel has
    // forgotten them and no handle has them open; total_lookups counts
    // their lookups too.
    struct Sample {
      std::unique_ptr<Node> node;
      uint64_t lookups = 0;
      int64_t opens = 0;
    };
    mutable std::mutex samples_mu;
    absl::flat_hash_map<uint64_t, Sample> samples;  // guarded by samples_mu
  };
  std::shared_ptr<Counts> counts_;
  std::vector<std::unique_ptr<StepView>> views_;
  const RemoteBytes* remote_ = nullptr;
  struct Dataset {
    std::unique_ptr<DatasetView> view;
    std::vector<uint64_t> samples_dirs;  // by dp rank
    uint64_t ino_base = 0;               // see InoOf
  };
  std::vector<Dataset> datasets_;
  // The blobs of extra/ files, each opened once at its first read.
  struct ExtraBlob {
    std::string path;
    std::string name;
    absl::StatusOr<BlobRecord> record;
    std::once_flag once;
    std::shared_ptr<const BlobReader> reader;  // set once, under `once`
  };
  std::vector<std::unique_ptr<ExtraBlob>> extras_;
  const BlobReader& ExtraReader(int extra) const;
  // The bytes of a shard's node before its tensors: model.safetensors'
  // header; none for a tensors/ file.
  int64_t HeaderSize(const Node& node) const;
  // Calls `part(shard, within, n)` for each tensor's bytes that bytes
  // [offset, offset + length) of a shard's node hold past its header, in
  // order, while it returns true; returns false if it stopped.
  absl::StatusOr<bool> ForEachTensorPart(
      const Node& node, int64_t offset, int64_t length,
      const std::function<absl::StatusOr<bool>(int, int64_t, int64_t)>& part)
      const;
  // The nodes of each step's directory, by index: [first, end).
  std::map<int64_t, std::pair<size_t, size_t>> step_nodes_;
  // Start of each tensor in a group's model.safetensors data: [view][group].
  std::vector<std::vector<std::vector<int64_t>>> tensor_starts_;
};

}  // namespace scalai

#endif  // SCALAI_FS_TREE_H_
