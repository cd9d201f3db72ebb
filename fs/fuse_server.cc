#define FUSE_USE_VERSION 314
#include "fs/fuse_server.h"

#include <fuse3/fuse_lowlevel.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fs/fuse_state.h"
#include "fs/save_area.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "transfer/files.h"

namespace scalai {
namespace fuse {

// Nothing in a tree changes while it is served, so the kernel may cache
// entries and attributes for long.
constexpr double kCacheSeconds = 3600;

// The one translator from absl::Status to errno for FUSE replies.
int ToErrno(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kNotFound:
      return ENOENT;
    case absl::StatusCode::kInvalidArgument:
      return EINVAL;
    case absl::StatusCode::kPermissionDenied:
      return EACCES;
    case absl::StatusCode::kOutOfRange:
      return EINVAL;
    case absl::StatusCode::kAlreadyExists:
      return EEXIST;
    case absl::StatusCode::kResourceExhausted:
      return ENOSPC;
    default:
      return EIO;
  }
}

struct stat Attr(Server& s, const Tree& tree, const Node& n) {
  struct stat st = {};
  st.st_ino = n.ino;
  st.st_uid = s.uid;
  st.st_gid = s.gid;
  st.st_size =
      n.live ? static_cast<off_t>(s.job->StatusText().size()) : tree.SizeOf(n);
  st.st_blksize = kMaxIo;
  st.st_blocks = (st.st_size + 511) / 512;
  st.st_atim = st.st_mtim = st.st_ctim = s.start;
  switch (n.kind) {
    case NodeKind::kDir:
      st.st_mode = S_IFDIR | n.mode;
      st.st_nlink = 2;
      break;
    case NodeKind::kFile:
      st.st_mode = S_IFREG | n.mode;
      st.st_nlink = 1;
      break;
    case NodeKind::kSymlink:
      st.st_mode = S_IFLNK | n.mode;
      st.st_nlink = 1;
      break;
  }
  return st;
}

bool IsConfig(const Node& n) {
  return n.parent == kRootIno && n.name == "config";
}

bool IsShard(const Node& n) { return n.view >= 0 && n.shard < 0; }

// Files whose bytes may change while served: never cached by the kernel.
bool Volatile(const Node& n) { return n.live || IsConfig(n); }

double AttrTimeout(const Node& n) { return Volatile(n) ? 0 : kCacheSeconds; }

// The kernel reads ahead of a reader at most its bdi's read_ahead_kb, 128
// KiB unless raised, whatever the mount asks at INIT (it takes the lower):
// raised here, before the INIT request is answered, where this process may
// (as root). `mountpoint` is resolved before mounting: nothing under it may
// be looked at before this server answers.
void RaiseReadAhead(const std::string& mountpoint) {
  const std::string device = MountedDevice(mountpoint);
  if (device.empty()) return;
  std::ofstream knob(absl::StrCat("/sys/class/bdi/", device, "/read_ahead_kb"));
  knob << kReadAhead / 1024 << std::flush;
}

void OnInit(void*, fuse_conn_info* conn) {
  conn->max_read = kMaxRead;
  conn->max_readahead = kReadAhead;
  conn->max_background = kMaxBackground;
  conn->congestion_threshold = kMaxBackground * 3 / 4;
  conn->max_write = kMaxIo;
}

fuse_entry_param Entry(Server& s, const Tree& tree, const Node& n) {
  fuse_entry_param e = {};
  e.ino = n.ino;
  e.generation = tree.generation();
  e.attr = Attr(s, tree, n);
  e.attr_timeout = AttrTimeout(n);
  // Root entries change with the generation; deeper ones never do.
  e.entry_timeout = n.parent == kRootIno ? 0 : kCacheSeconds;
  return e;
}

// A read that fails on damaged bytes (a blob, a dataset's source file
// changed) or on bytes no reachable peer holds: `status` says which.
void ReportReadFailure(Server& s, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kDataLoss &&
      status.code() != absl::StatusCode::kUnavailable) {
    return;
  }
  s.job->ReportError(status.message());
}

void OnLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (RefuseLongName(req, name)) return;
  Server& s = Get(req);
  if (SaveArea::Owns(parent)) {
    std::optional<SaveNode> n = s.job->saves().Lookup(parent, name);
    if (!n) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    fuse_entry_param e = SaveEntry(s, *n);
    fuse_reply_entry(req, &e);
    return;
  }
  std::shared_ptr<const Tree> tree = s.job->TreeOf(parent);
  absl::StatusOr<const Node*> n =
      tree ? tree->Enter(parent, name) : absl::StatusOr<const Node*>(nullptr);
  if (!n.ok()) {
    ReportReadFailure(s, n.status());
    fuse_reply_err(req, ToErrno(n.status()));
    return;
  }
  if (*n == nullptr) {
    // In ckpt/, a step being saved.
    const Node* dir = tree ? tree->Get(parent) : nullptr;
    std::optional<SaveNode> step;
    if (dir != nullptr && IsCkptDir(*dir))
      step = s.job->saves().LookupStep(name);
    if (!step) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    fuse_entry_param e = SaveEntry(s, *step);
    fuse_reply_entry(req, &e);
    return;
  }
  fuse_entry_param e = Entry(s, *tree, **n);
  if (fuse_reply_entry(req, &e) != 0) tree->Forget((*n)->ino, 1);
}

void OnGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Server& s = Get(req);
  if (SaveArea::Owns(ino)) {
    std::optional<SaveNode> n = s.job->saves().Get(ino);
    if (!n) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    struct stat st = SaveAttr(s, *n);
    fuse_reply_attr(req, &st, 0);
    return;
  }
  auto [tree, n] = s.job->Find(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  struct stat st = Attr(s, *tree, *n);
  fuse_reply_attr(req, &st, AttrTimeout(*n));
}

void OnReadlink(fuse_req_t req, fuse_ino_t ino) {
  auto [tree, n] = Get(req).job->Find(ino);
  if (n == nullptr || n->kind != NodeKind::kSymlink) {
    fuse_reply_err(req, EINVAL);
    return;
  }
  fuse_reply_readlink(req, n->text.c_str());
}

// Runs kernel notifications on a thread of their own: one sent from inside
// a request handler may deadlock. ServeMount waits for them to end before
// the session goes.
void Notify(Server& s, std::function<void()> fn) {
  s.notifying.fetch_add(1);
  std::thread([&s, fn = std::move(fn)] {
    fn();
    s.notifying.fetch_sub(1);
  }).detach();
}

// Path walks that began before a switch get this long to open what they
// looked up before the old tree's nodes are reported deleted.
constexpr auto kReapGrace = std::chrono::milliseconds(300);

// Tells the kernel that the inodes of older generations are gone, deepest
// first, so that it drops them as soon as nothing uses them and sends
// FORGET; the last FORGET retires the tree (RetireIfUnused) and closes its
// blobs. A tree the kernel named nothing of by then gets no FORGET: the
// pass retires it. Open nodes, and directories above them, stay until a
// later pass: each switch and each release of an old handle starts one.
void ReapOldTrees(Server& s) {
  std::vector<std::shared_ptr<const Tree>> old = s.job->OlderTrees();
  if (old.empty()) return;
  Notify(s, [&s, old = std::move(old)] {
    std::this_thread::sleep_for(kReapGrace);
    for (const auto& tree : old) {
      for (const NodeRef& n : tree->UnopenedReferencesDeepestFirst()) {
        fuse_lowlevel_notify_delete(s.session, n.parent, n.ino, n.name.c_str(),
                                    n.name.size());
      }
    }
    s.job->RetireUnusedOlderTrees();
  });
}

DirEntry ListedSave(const SaveNode& n) {
  return {n.name, n.ino, nullptr,
          static_cast<mode_t>(n.dir ? S_IFDIR | 0755 : S_IFREG | 0644)};
}

void OnOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Server& s = Get(req);
  if (SaveArea::Owns(ino)) {
    if (!s.job->saves().Get(ino)) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    std::vector<DirEntry> entries;
    for (const SaveNode& n : s.job->saves().Children(ino))
      entries.push_back(ListedSave(n));
    fi->fh = reinterpret_cast<uint64_t>(new Handle(ino, std::move(entries)));
    if (fuse_reply_open(req, fi) != 0) delete HandleOf(fi);
    return;
  }
  auto [tree, n] = s.job->Find(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
  } else if (n->kind != NodeKind::kDir) {
    fuse_reply_err(req, ENOTDIR);
  } else if (IsCkptDir(*n)) {
    // Committed steps, then the steps being saved; never cached.
    std::vector<DirEntry> entries;
    for (int64_t i = 0; i < tree->EntryCount(*n); ++i)
      entries.push_back(tree->EntryAt(*n, i));
    for (const SaveNode& step : s.job->saves().Steps())
      entries.push_back(ListedSave(step));
    std::sort(
        entries.begin(), entries.end(),
        [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
    fi->fh =
        reinterpret_cast<uint64_t>(new Handle(ino, std::move(entries), tree));
    if (fuse_reply_open(req, fi) != 0) delete HandleOf(fi);
  } else {
    fi->fh = reinterpret_cast<uint64_t>(new Handle(tree, n));
    // The root's listing is the same in every generation; others never change.
    fi->keep_cache = 1;
    fi->cache_readdir = 1;
    if (fuse_reply_open(req, fi) != 0) delete HandleOf(fi);
  }
}

void OnReleasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  delete HandleOf(fi);
  fuse_reply_err(req, 0);
}

// Offsets: 0 ".", 1 "..", 2 + i the i-th child in name order. With `plus`,
// each entry carries its attributes, which saves `ls -l` a LOOKUP per name.
void ReplyDir(fuse_req_t req, size_t size, off_t offset, fuse_file_info* fi,
              bool plus) {
  Server& s = Get(req);
  const Handle& h = *HandleOf(fi);
  const Tree* tree = h.tree.get();
  const Node* dir = h.node;
  std::vector<char> buf(size);
  size_t used = 0;
  const off_t total = 2 + (h.listing ? static_cast<off_t>(h.listing->size())
                                     : tree->EntryCount(*dir));
  for (off_t i = offset; i < total; ++i) {
    fuse_entry_param e = {};
    DirEntry entry;
    if (i < 2) {
      entry.name = i == 0 ? "." : "..";
      if (dir != nullptr) {
        const Node* n =
            i == 0 || dir->parent == 0 ? dir : tree->Get(dir->parent);
        e.attr = Attr(s, *tree, *n);
      } else {
        e.attr.st_ino = i == 0 ? h.save_ino : kRootIno;
        e.attr.st_mode = S_IFDIR | 0755;
      }
      // "." and ".." are not looked up by the kernel: no entry to count.
    } else {
      entry = h.listing ? (*h.listing)[i - 2] : tree->EntryAt(*dir, i - 2);
      if (entry.node != nullptr) {
        e = Entry(s, *tree, *entry.node);
      } else {
        // A sample or a file being saved: named with its inode number but
        // no entry (ino 0), so that listing makes no nodes; a lookup will.
        e.attr.st_ino = entry.ino;
        e.attr.st_mode = entry.mode;
      }
    }
    size_t n = plus
                   ? fuse_add_direntry_plus(req, buf.data() + used, size - used,
                                            entry.name.c_str(), &e, i + 1)
                   : fuse_add_direntry(req, buf.data() + used, size - used,
                                       entry.name.c_str(), &e.attr, i + 1);
    if (n > size - used) break;
    used += n;
    if (plus && i >= 2 && e.ino != 0) tree->CountLookup(e.ino);
  }
  fuse_reply_buf(req, buf.data(), used);
}

void OnReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t offset,
               fuse_file_info* fi) {
  ReplyDir(req, size, offset, fi, /*plus=*/false);
}

void OnReaddirplus(fuse_req_t req, fuse_ino_t, size_t size, off_t offset,
                   fuse_file_info* fi) {
  ReplyDir(req, size, offset, fi, /*plus=*/true);
}

void OnForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  Get(req).job->Forget(ino, nlookup);
  fuse_reply_none(req);
}

void OnForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i) {
    Get(req).job->Forget(forgets[i].ino, forgets[i].nlookup);
  }
  fuse_reply_none(req);
}

void OnOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  const bool writing =
      (fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC);
  if (SaveArea::Owns(ino)) {
    OpenSaved(req, ino, fi, writing);
    return;
  }
  auto [tree, n] = Get(req).job->Find(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
  } else if (n->kind == NodeKind::kDir) {
    fuse_reply_err(req, EISDIR);
  } else if (writing && IsShard(*n) && !(fi->flags & O_TRUNC)) {
    // Committed bytes never change: only a whole new copy may be written.
    fuse_reply_err(req, EROFS);
  } else if (writing && IsShard(*n)) {
    // A save of a committed step's shard (a replica that closes after the
    // commit, a repeated save): accepted only if identical.
    absl::StatusOr<std::shared_ptr<ShardFile>> scratch = ShardFile::Scratch(
        Get(req).job->store().blob_dir(),
        ShardFile::SizeLimit(n->size - static_cast<int64_t>(n->text.size())));
    if (!scratch.ok()) {
      fuse_reply_err(req, ToErrno(scratch.status()));
      return;
    }
    fi->fh = reinterpret_cast<uint64_t>(new Handle(tree, n, *scratch));
    fi->direct_io = 1;
    if (fuse_reply_open(req, fi) != 0) delete HandleOf(fi);
  } else if (writing && !IsConfig(*n)) {
    fuse_reply_err(req, EACCES);
  } else {
    fi->fh = reinterpret_cast<uint64_t>(
        new Handle(tree, n, n->live ? Get(req).job->StatusText() : ""));
    if (Volatile(*n)) {
      fi->direct_io = 1;
    } else if (n->data != DataFile::kSample && n->data != DataFile::kStream) {
      // These bytes never change: the page cache may keep them, and mapping
      // works (no direct I/O).
      fi->keep_cache = 1;
    }
    // A sample's bytes come from a source file the user may change: each
    // open drops the cached pages, so that reads reach the stamp check.
    if (fuse_reply_open(req, fi) != 0) delete HandleOf(fi);
  }
}

void OnRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  Server& s = Get(req);
  const bool old =
      HandleOf(fi)->tree != nullptr &&
      HandleOf(fi)->tree->generation() < s.job->TreeOf(kRootIno)->generation();
  delete HandleOf(fi);
  fuse_reply_err(req, 0);
  if (old) ReapOldTrees(s);
}

// A buffer for the replies a FUSE thread copies: a new one for each read
// would pay for faulting in its pages every time. Every read is copied
// through it, bytes of stored blobs too: on this project's machines the
// kernel copied a reply from a thread's warm buffer several times faster
// than from the blob's own pages handed to it through a pipe (splice), and
// the mount used 40% less CPU (docs/benchmarks.md).
char* ReplyBuffer(size_t size) {
  thread_local IoBuffer buffer;
  thread_local size_t capacity = 0;
  if (capacity < size) {
    buffer = NewIoBuffer(size);
    capacity = size;
  }
  return buffer.get();
}

void OnRead(fuse_req_t req, fuse_ino_t, size_t size, off_t offset,
            fuse_file_info* fi) {
  Handle& h = *HandleOf(fi);
  if (h.file != nullptr) {
    char* buf = ReplyBuffer(size);
    absl::StatusOr<int64_t> got =
        h.file->Read(buf, static_cast<int64_t>(size), offset);
    if (!got.ok()) {
      fuse_reply_err(req, ToErrno(got.status()));
      return;
    }
    fuse_reply_buf(req, buf, *got);
    return;
  }
  if (h.node->live) {
    // Copied out first: once the kernel has this reply, the file's release
    // may run on another thread and free the handle before the call returns.
    const std::string& text = h.snapshot;
    const size_t at = std::min<size_t>(offset, text.size());
    const size_t n = std::min(size, text.size() - at);
    char* buf = ReplyBuffer(std::max<size_t>(n, 1));
    std::memcpy(buf, text.data() + at, n);
    fuse_reply_buf(req, buf, n);
    return;
  }
  // A checkpoint's bytes, which a worker waits on: the materialization
  // gives way (a dataset's samples, read all through training, do not).
  ForegroundReads::Reading reading(h.node->data == DataFile::kNone
                                       ? &Get(req).job->foreground_reads()
                                       : nullptr);
  char* buf = ReplyBuffer(size);
  absl::StatusOr<int64_t> got =
      h.tree->Read(*h.node, offset, static_cast<int64_t>(size), buf);
  if (!got.ok()) {
    ReportReadFailure(Get(req), got.status());
    fuse_reply_err(req, ToErrno(got.status()));
    return;
  }
  fuse_reply_buf(req, buf, *got);
}

// `echo C > config` truncates first; the truncation itself changes nothing.
void OnSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set,
               fuse_file_info* fi) {
  Server& s = Get(req);
  if (SaveArea::Owns(ino)) {
    // A file being saved may be emptied (O_TRUNC without atomic truncation);
    // modes and times are accepted and not kept. ftruncate empties the
    // file its handle writes; truncate, the one the name has now.
    std::optional<SaveNode> n = s.job->saves().Get(ino);
    std::shared_ptr<ShardFile> file =
        fi != nullptr && HandleOf(fi)->file != nullptr
            ? HandleOf(fi)->file
            : s.job->saves().FileOf(ino);
    if (!n) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    if (to_set & FUSE_SET_ATTR_SIZE) {
      if (file == nullptr || attr->st_size != 0) {
        fuse_reply_err(req, EINVAL);
        return;
      }
      if (absl::Status t = file->Truncate(); !t.ok()) {
        fuse_reply_err(req, t.code() == absl::StatusCode::kFailedPrecondition
                                ? EROFS  // a committed shard
                                : ToErrno(t));
        return;
      }
      n->size = 0;
    }
    struct stat st = SaveAttr(s, *n);
    fuse_reply_attr(req, &st, 0);
    return;
  }
  auto [tree, n] = s.job->Find(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  const int allowed = FUSE_SET_ATTR_SIZE | FUSE_SET_ATTR_MTIME |
                      FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME_NOW |
                      FUSE_SET_ATTR_ATIME_NOW;
  if (IsShard(*n)) {
    fuse_reply_err(req, EROFS);  // a committed shard never changes
    return;
  }
  if (!IsConfig(*n) || (to_set & ~allowed) ||
      ((to_set & FUSE_SET_ATTR_SIZE) && attr->st_size != 0)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  struct stat st = Attr(s, *tree, *n);
  fuse_reply_attr(req, &st, 0);
}

// Tells the kernel to forget the root's entries, so that the next path walk
// finds the new generation.
void InvalidateRoot(Server& s, std::vector<std::string> names) {
  Notify(s, [&s, names = std::move(names)] {
    for (const std::string& name : names) {
      fuse_lowlevel_notify_inval_entry(s.session, kRootIno, name.c_str(),
                                       name.size());
    }
    fuse_lowlevel_notify_inval_inode(s.session, kRootIno, 0, 0);
  });
}

// Writing a config switches every view at once, or changes nothing and says
// why in `status`.
void OnWrite(fuse_req_t req, fuse_ino_t ino, const char* data, size_t size,
             off_t offset, fuse_file_info* fi) {
  Server& s = Get(req);
  Handle& h = *HandleOf(fi);
  if (h.file != nullptr) {
    absl::Status w = h.file->Write(data, static_cast<int64_t>(size), offset);
    if (w.code() == absl::StatusCode::kFailedPrecondition) {
      // A committed shard: refused, and nothing changed for close to report.
      fuse_reply_err(req, EROFS);
      return;
    }
    if (!w.ok()) {
      if (h.write_error.ok()) h.write_error = w;
      h.dirty = true;
      if (w.code() == absl::StatusCode::kOutOfRange) {
        // Past the largest valid shard: refused before a byte is written.
        s.job->ReportError(w.message());
      }
      fuse_reply_err(
          req, w.code() == absl::StatusCode::kOutOfRange ? EFBIG : ToErrno(w));
      return;
    }
    h.dirty = true;
    fuse_reply_write(req, size);
    return;
  }
  if (!IsConfig(*h.node)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  (void)ino;
  absl::Status result =
      offset != 0 ? absl::InvalidArgumentError(
                        "write the whole config at once, from offset 0")
                  : absl::OkStatus();
  absl::StatusOr<ParallelConfig> config =
      ParallelConfig::Parse(absl::string_view(data, size));
  if (result.ok()) result = config.status();
  if (result.ok()) {
    result = s.job->Reconfigure(*config);  // reports its own refusal
  } else {
    s.job->ReportError(result.message());
  }
  if (!result.ok()) {
    fuse_reply_err(req, EINVAL);
    return;
  }
  fuse_reply_write(req, size);
}

// `df MOUNT` shows the file system of the store: the tree takes no space
// of its own, and shards saved through the mount are written there.
void OnStatfs(fuse_req_t req, fuse_ino_t) {
  struct statvfs st = {};
  if (statvfs(Get(req).job->store().blob_dir().c_str(), &st) != 0) {
    fuse_reply_err(req, errno);
    return;
  }
  fuse_reply_statfs(req, &st);
}

// No exception may leave a FUSE handler: it would end the process, and
// every worker's mount with it. Nothing in the handlers is meant to throw
// (JSON is dumped with replacement, allocations are bounded); if one does
// all the same, its request fails with EIO and `status` says why. Handlers
// reply last, so a throw comes before the reply.
template <auto Handler>
struct Guarded;
template <typename... Args, void (*Handler)(fuse_req_t, Args...)>
struct Guarded<Handler> {
  static void Run(fuse_req_t req, Args... args) {
    try {
      Handler(req, args...);
    } catch (const std::exception& e) {
      Get(req).job->ReportError(
          absl::StrCat("internal error, request refused: ", e.what()));
      fuse_reply_err(req, EIO);
    }
  }
};

absl::Status Serve(Job& job, const MountOptions& options) {
  Server server;
  server.uid = getuid();
  server.gid = getgid();
  clock_gettime(CLOCK_REALTIME, &server.start);
  server.job = &job;
  // After a switch the next path walk must find the new generation, and the
  // older trees' inodes are reported gone.
  job.SetOnSwitch([&server](std::vector<std::string> names) {
    InvalidateRoot(server, std::move(names));
    ReapOldTrees(server);
  });
  absl::Cleanup forget_server = [&job] { job.SetOnSwitch(nullptr); };
  fuse_lowlevel_ops ops = {};
  ops.init = OnInit;
  ops.lookup = Guarded<OnLookup>::Run;
  ops.forget = OnForget;
  ops.forget_multi = OnForgetMulti;
  ops.getattr = Guarded<OnGetattr>::Run;
  ops.setattr = Guarded<OnSetattr>::Run;
  ops.readlink = Guarded<OnReadlink>::Run;
  ops.opendir = Guarded<OnOpendir>::Run;
  ops.readdir = Guarded<OnReaddir>::Run;
  ops.readdirplus = Guarded<OnReaddirplus>::Run;
  ops.releasedir = Guarded<OnReleasedir>::Run;
  ops.open = Guarded<OnOpen>::Run;
  ops.read = Guarded<OnRead>::Run;
  ops.write = Guarded<OnWrite>::Run;
  ops.release = Guarded<OnRelease>::Run;
  ops.mkdir = Guarded<OnMkdir>::Run;
  ops.create = Guarded<OnCreate>::Run;
  ops.flush = Guarded<OnFlush>::Run;
  ops.fsync = Guarded<OnFsync>::Run;
  ops.unlink = Guarded<OnUnlink>::Run;
  ops.rmdir = Guarded<OnRmdir>::Run;
  ops.statfs = Guarded<OnStatfs>::Run;

  // default_permissions: the kernel checks each access against the modes
  // and owner the mount reports, so another user (with --allow-other) may
  // read but not write the owner's files.
  std::string mount_opts = absl::StrCat(
      "fsname=scalai,subtype=scalai,default_permissions,max_read=", kMaxRead);
  if (options.allow_other) absl::StrAppend(&mount_opts, ",allow_other");
  std::vector<std::string> argv_store = {"scalai", "-o", mount_opts};
  std::vector<char*> argv;
  for (std::string& a : argv_store) argv.push_back(a.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  // Parsing copies the arguments it keeps into memory of libfuse's.
  absl::Cleanup free_args = [&args] { fuse_opt_free_args(&args); };
  fuse_session* se = fuse_session_new(&args, &ops, sizeof(ops), &server);
  if (se == nullptr) return absl::InternalError("fuse_session_new failed");
  server.session = se;
  absl::Cleanup destroy = [se] { fuse_session_destroy(se); };
  if (fuse_set_signal_handlers(se) != 0) {
    return absl::InternalError("cannot install signal handlers");
  }
  absl::Cleanup remove_handlers = [se] { fuse_remove_signal_handlers(se); };
  char resolved[PATH_MAX];
  const std::string mountpoint =
      realpath(options.mountpoint.c_str(), resolved) != nullptr
          ? resolved
          : options.mountpoint;
  if (fuse_session_mount(se, options.mountpoint.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot mount at ", options.mountpoint,
                     " (is it an existing directory, and is "
                     "/dev/fuse available?)"));
  }
  absl::Cleanup unmount = [se] { fuse_session_unmount(se); };
  RaiseReadAhead(mountpoint);
  if (options.on_ready) options.on_ready();
  // A store whose steps are not yet stored under its config (switched by
  // `mount --config`, or a materialization cut short) catches up now.
  job.StartMaterialization();
  absl::Cleanup stop = [&server, &job] {
    // A switch from now on (a cluster's config arriving) tells no kernel.
    job.SetOnSwitch(nullptr);
    job.StopMaterialization();
    // Steps not committed are discarded: their blobs go now.
    job.saves().Clear();
    while (server.notifying.load() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  };
  fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(config, 16);
  // Threads kept waiting: many readers at once need them again at once.
  fuse_loop_cfg_set_idle_threads(config, 16);
  int rc = fuse_session_loop_mt(se, config);
  fuse_loop_cfg_destroy(config);
  if (rc < 0)
    return absl::InternalError(
        absl::StrCat("FUSE loop failed: ", std::strerror(-rc)));
  return absl::OkStatus();
}

}  // namespace fuse

absl::Status ServeMount(Job& job, const MountOptions& options) {
  return fuse::Serve(job, options);
}

}  // namespace scalai
