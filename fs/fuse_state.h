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
#include "fs/job.h"
#include "fs/save_area.h"
#include "fs/tree.h"
#include "nlohmann/json.hpp"
#include "transfer/step_writer.h"
#include "transfer/store.h"

namespace scalai::fuse {

// Large requests are what make FUSE fast: one request per MiB.
inline constexpr unsigned kMaxIo = 1 << 20;
// Reads a little less: the size the read benchmarks since 2026-12-05 were
// measured with (it let a reply spliced from a blob's file fit a 1 MiB
// pipe). Replies are copied now; 1 MiB, three rounds alternating with this
// size (2026-12-06), was faster for one reader and slower for eight: no
// clear gain.
inline constexpr unsigned kMaxRead = kMaxIo - 16 * 4096;
// How far ahead the kernel reads a file being read in order: several
// requests in flight at once, served by several threads.
inline constexpr unsigned kReadAhead = 4 << 20;
// Read-ahead requests the kernel keeps in flight for the whole mount (its
// default is 12): eight readers each 4 MiB ahead want about 40 of them, and
// from a cold cache each waits on the disk, which serves more at once.
inline constexpr unsigned kMaxBackground = 64;

// What the FUSE threads share: the job they present, and what only the
// adapter needs (the session, the owner, the notifications in flight).
struct Server {
  Job* job;
  uid_t uid;
  gid_t gid;
  timespec start;
  fuse_session* session = nullptr;
  // Invalidation threads still running; the session outlives them.
  std::atomic<int> notifying{0};
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
// Tells the kernel to forget the root's entries.
void InvalidateRoot(Server& s, std::vector<std::string> names);

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
