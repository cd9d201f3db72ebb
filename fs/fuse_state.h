// The state the FUSE handlers share, and the handlers that take in steps
// saved through the mount (fs/save_handlers.cc). Private to fs/: only
// fuse_server.cc, which owns the session and the ops table, and
// save_handlers.cc include it.
#ifndef SCALAI_FS_FUSE_STATE_H_
#define SCALAI_FS_FUSE_STATE_H_

#define FUSE_USE_VERSION 314
#include <fuse3/fuse_lowlevel.h>
#include <limits.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "fs/save_area.h"
#include "fs/tree.h"
#include "nlohmann/json.hpp"
#include "transfer/step_writer.h"
#include "transfer/store.h"

namespace scalai::fuse {

// Large requests are what make FUSE fast: one request per MiB.
inline constexpr unsigned kMaxIo = 1 << 20;

// The state shared by all FUSE threads and the materialization workers.
// Lock order: mu only. Every catalog change happens under mu, so a tree is
// always built from one consistent set of records.
struct Server {
  Store* store;
  std::unique_ptr<SaveArea> saves;  // steps being saved; thread-safe
  int keep_steps = 0;               // 0: keep every step
  uid_t uid;
  gid_t gid;
  timespec start;
  fuse_session* session = nullptr;
  std::mutex mu;
  std::shared_ptr<const Tree> current;  // guarded by mu
  // Trees the kernel may still name inodes of, by generation; guarded by mu.
  std::map<uint64_t, std::shared_ptr<const Tree>> trees;
  std::string error;  // guarded by mu

  // The newest materialization worker and its cancel flag; guarded by mu.
  // Each worker joins the one it superseded, so joining the newest joins all.
  std::thread worker;
  std::shared_ptr<std::atomic<bool>> cancel;
  bool materializing = false;  // guarded by mu
  // The last materialization failed (a damaged source, a full disk): the
  // views read from the stored shards until the same config is written
  // again, which retries it. Guarded by mu.
  bool materialization_failed = false;
  // Bytes written and to write by the running (or last) materialization.
  std::atomic<int64_t> moved{0};
  std::atomic<int64_t> to_move{0};
  // Invalidation threads still running; the session outlives them.
  std::atomic<int> notifying{0};

  // The tree that owns `ino`: the current one for the root.
  std::shared_ptr<const Tree> TreeOf(uint64_t ino) {
    std::lock_guard<std::mutex> lock(mu);
    if (ino == kRootIno) return current;
    auto it = trees.find(Tree::GenerationOf(ino));
    return it == trees.end() ? nullptr : it->second;
  }
  // The node `ino` names, with the tree that keeps it alive; `node` is null
  // when no live tree has it.
  struct Found {
    std::shared_ptr<const Tree> tree;
    const Node* node = nullptr;
  };
  Found Find(uint64_t ino) {
    Found f{TreeOf(ino)};
    if (f.tree != nullptr) f.node = f.tree->Get(ino);
    return f;
  }

  // Lets go of an old tree once the kernel names none of its inodes: no
  // lookup is left, so no file of it is open either. Requires mu. The
  // caller holds `tree` until it has unlocked: the last reference closes
  // the tree's blob mappings, and for blobs already unlinked that is when
  // the filesystem frees their space, which is slow.
  void RetireIfUnused(const std::shared_ptr<const Tree>& tree) {
    if (tree != nullptr && tree != current && tree->total_lookups() == 0) {
      trees.erase(tree->generation());
    }
  }

  std::string StatusText() {
    std::lock_guard<std::mutex> lock(mu);
    const int64_t done = moved.load();
    const int64_t total = to_move.load();
    double progress = 1.0;
    if (materializing || materialization_failed) {
      progress = total > 0 ? static_cast<double>(done) / total : 0.0;
    }
    const char* state = materializing            ? "materializing"
                        : materialization_failed ? "failed"
                                                 : "ready";
    nlohmann::json j = {{"generation", current->generation()},
                        {"config", current->config().ToString()},
                        {"state", state},
                        {"progress", progress},
                        {"error", nullptr},
                        {"bytes_to_move", total},
                        {"bytes_moved", done}};
    if (!error.empty()) j["error"] = error;
    // Steps being saved, and the dp_rank 0 ranks each still waits for.
    j["saving"] = nlohmann::json::array();
    for (const auto& [step, missing] : saves->Pending())
      j["saving"].push_back({{"step", step}, {"waiting_for", missing}});
    // An error may quote bytes that are not UTF-8 (a name a client chose):
    // they are replaced rather than thrown over.
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
           "\n";
  }
};

inline Server& Get(fuse_req_t req) {
  return *static_cast<Server*>(fuse_req_userdata(req));
}

// The one translator from absl::Status to errno for FUSE replies.
int ToErrno(const absl::Status& s);

// An open file or directory holds its tree: a reconfiguration never changes
// bytes under a reader, and the node is not reported deleted while open. A
// handle of `status` holds the text as it was at open, so that reads in
// pieces never mix two states.
struct Handle {
  Handle(std::shared_ptr<const Tree> t, const Node* n, std::string text = "")
      : tree(std::move(t)), node(n), snapshot(std::move(text)) {
    tree->CountOpen(node->ino, +1);
  }
  // A file being saved (SaveArea); `verify`: of a step that has committed
  // meanwhile, so only compared with the committed shard.
  Handle(uint64_t ino, std::shared_ptr<ShardFile> f, bool verify = false)
      : save_ino(ino), file(std::move(f)), verify_saved(verify) {}
  // A committed model.safetensors written again (a late data-parallel
  // replica, a repeated save): the bytes go to a scratch file and are
  // compared with the committed shard at close.
  Handle(std::shared_ptr<const Tree> t, const Node* n,
         std::shared_ptr<ShardFile> f)
      : tree(std::move(t)), node(n), file(std::move(f)) {
    tree->CountOpen(node->ino, +1);
  }
  // A directory whose entries are not all one tree's (ckpt/ and the
  // directories of steps being saved): listed as it was at opendir.
  Handle(uint64_t ino, std::vector<DirEntry> entries,
         std::shared_ptr<const Tree> t = nullptr)
      : tree(std::move(t)), save_ino(ino), listing(std::move(entries)) {}
  ~Handle() {
    if (tree != nullptr && node != nullptr) tree->CountOpen(node->ino, -1);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  const std::shared_ptr<const Tree> tree;
  const Node* const node = nullptr;
  const std::string snapshot;
  const uint64_t save_ino = 0;
  const std::shared_ptr<ShardFile> file;
  // Written since the last flush, which checks the file then: a shell's
  // `>` closes a duplicate before anything is written.
  bool dirty = false;
  const bool verify_saved = false;
  // A failed write (a full disk): close() reports it again rather than
  // checking a file known to be incomplete.
  absl::Status write_error;
  const std::optional<std::vector<DirEntry>> listing;
};

// A name longer than a Linux file system takes (NAME_MAX, 255 bytes) is
// refused as ext4 refuses it, before it is looked up or made: such a file
// could be saved but never exported. Replies ENAMETOOLONG and returns true.
inline bool RefuseLongName(fuse_req_t req, const char* name) {
  if (std::strlen(name) <= NAME_MAX) return false;
  fuse_reply_err(req, ENAMETOOLONG);
  return true;
}

inline Handle* HandleOf(fuse_file_info* fi) {
  return reinterpret_cast<Handle*>(fi->fh);
}

inline bool IsCkptDir(const Node& n) {
  return n.parent == kRootIno && n.name == "ckpt";
}

// Of fuse_server.cc, for the save handlers.
// Tells the kernel that the inodes of older generations are gone.
void ReapOldTrees(Server& s);
// The names in the root of the current tree. Requires mu.
std::vector<std::string> RootNames(const Server& s);
// Tells the kernel to forget the root's entries.
void InvalidateRoot(Server& s, std::vector<std::string> names);
// Makes `tree` the one new opens see. Requires mu. Returns the older trees,
// for the caller to drop once it has unlocked.
std::vector<std::shared_ptr<const Tree>> Switch(
    Server& s, std::shared_ptr<const Tree> tree);
// Starts materializing the current config. Requires mu.
void StartMaterialization(Server& s);

// Of save_handlers.cc.
struct stat SaveAttr(Server& s, const SaveNode& n);
fuse_entry_param SaveEntry(Server& s, const SaveNode& n);
void OpenSaved(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi,
               bool writing);
void OnMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t);
void OnCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t,
              fuse_file_info* fi);
void OnFlush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi);
void OnFsync(fuse_req_t req, fuse_ino_t, int, fuse_file_info* fi);
void OnUnlink(fuse_req_t req, fuse_ino_t parent, const char* name);
void OnRmdir(fuse_req_t req, fuse_ino_t parent, const char* name);

}  // namespace scalai::fuse

#endif  // SCALAI_FS_FUSE_STATE_H_
