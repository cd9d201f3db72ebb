// The mount's tree model (SPEC section 3), free of FUSE: inodes, names,
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

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ptc/parallel_config.h"
#include "transfer/step_view.h"
#include "transfer/store.h"

namespace scalai {

inline constexpr uint64_t kRootIno = 1;

enum class NodeKind { kDir, kFile, kSymlink };

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
};

class Tree {
 public:
  // `generation` numbers the trees a mount serves one after another; the
  // kernel sees it with every inode, so an inode of an older tree is never
  // mistaken for one of a newer tree.
  static absl::StatusOr<std::unique_ptr<Tree>> Build(
      const Store& store, const ParallelConfig& config,
      uint64_t generation = 1);
  // The same tree built again from the store's current records (after a
  // materialization re-pointed them at new blobs): the same generation, nodes
  // and inode numbers, and the kernel's references shared with `same`, so
  // that it can take `same`'s place without the kernel noticing.
  static absl::StatusOr<std::unique_ptr<Tree>> Rebuild(const Store& store,
                                                       const Tree& same);

  const ParallelConfig& config() const { return config_; }
  const Node* Get(uint64_t ino) const;
  const Node* Lookup(uint64_t parent, absl::string_view name) const;
  // Reads up to `length` bytes at `offset`; returns how many (0 at the end).
  absl::StatusOr<int64_t> Read(const Node& node, int64_t offset, int64_t length,
                               char* out) const;
  uint64_t generation() const { return generation_; }

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
  std::vector<const Node*> UnopenedReferencesDeepestFirst() const;

 private:
  Tree() = default;
  Node& Add(uint64_t parent, std::string name, NodeKind kind, mode_t mode);
  // Inode numbers carry the generation in their high 32 bits (the root is
  // always 1), so inodes of different trees never collide.
  uint64_t InoOf(size_t index) const;
  std::optional<size_t> IndexOf(uint64_t ino) const;
  void SortChildren();

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
  };
  std::shared_ptr<Counts> counts_;
  std::vector<std::unique_ptr<StepView>> views_;
  // Start of each tensor in a group's model.safetensors data: [view][group].
  std::vector<std::vector<std::vector<int64_t>>> tensor_starts_;
};

}  // namespace scalai

#endif  // SCALAI_FS_TREE_H_
