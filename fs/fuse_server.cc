#define FUSE_USE_VERSION 314
#include "fs/fuse_server.h"

#include <fuse3/fuse_lowlevel.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace scalai {
namespace {

// Large requests are what make FUSE fast: one request per MiB.
constexpr unsigned kMaxIo = 1 << 20;
// Nothing in a tree changes while it is served, so the kernel may cache
// entries and attributes for long.
constexpr double kCacheSeconds = 3600;

struct Server {
  const Tree* tree;
  uid_t uid;
  gid_t gid;
  timespec start;
};

Server& Get(fuse_req_t req) {
  return *static_cast<Server*>(fuse_req_userdata(req));
}

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
    default:
      return EIO;
  }
}

struct stat Attr(const Server& s, const Node& n) {
  struct stat st = {};
  st.st_ino = n.ino;
  st.st_uid = s.uid;
  st.st_gid = s.gid;
  st.st_size = n.size;
  st.st_blksize = kMaxIo;
  st.st_blocks = (n.size + 511) / 512;
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

void OnInit(void*, fuse_conn_info* conn) {
  conn->max_read = kMaxIo;
  conn->max_readahead = kMaxIo;
  conn->max_write = kMaxIo;
  if (conn->capable & FUSE_CAP_SPLICE_WRITE)
    conn->want |= FUSE_CAP_SPLICE_WRITE;
}

void OnLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Server& s = Get(req);
  const Node* n = s.tree->Lookup(parent, name);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  fuse_entry_param e = {};
  e.ino = n->ino;
  e.generation = s.tree->generation();
  e.attr = Attr(s, *n);
  e.attr_timeout = e.entry_timeout = kCacheSeconds;
  s.tree->CountLookup(n->ino);
  if (fuse_reply_entry(req, &e) != 0) s.tree->Forget(n->ino, 1);
}

void OnGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Server& s = Get(req);
  const Node* n = s.tree->Get(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  struct stat st = Attr(s, *n);
  fuse_reply_attr(req, &st, kCacheSeconds);
}

void OnReadlink(fuse_req_t req, fuse_ino_t ino) {
  const Node* n = Get(req).tree->Get(ino);
  if (n == nullptr || n->kind != NodeKind::kSymlink) {
    fuse_reply_err(req, EINVAL);
    return;
  }
  fuse_reply_readlink(req, n->text.c_str());
}

void OnOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  const Node* n = Get(req).tree->Get(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
  } else if (n->kind != NodeKind::kDir) {
    fuse_reply_err(req, ENOTDIR);
  } else {
    fi->keep_cache = 1;
    fi->cache_readdir = 1;
    fuse_reply_open(req, fi);
  }
}

// Offsets: 0 ".", 1 "..", 2 + i the i-th child in name order. With `plus`,
// each entry carries its attributes, which saves `ls -l` a LOOKUP per name.
void ReplyDir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset,
              bool plus) {
  Server& s = Get(req);
  const Node* dir = s.tree->Get(ino);
  if (dir == nullptr || dir->kind != NodeKind::kDir) {
    fuse_reply_err(req, ENOTDIR);
    return;
  }
  std::vector<char> buf(size);
  size_t used = 0;
  const off_t total = 2 + static_cast<off_t>(dir->children.size());
  for (off_t i = offset; i < total; ++i) {
    fuse_entry_param e = {};
    const char* name;
    if (i < 2) {
      name = i == 0 ? "." : "..";
      const Node* n =
          i == 0 || dir->parent == 0 ? dir : s.tree->Get(dir->parent);
      e.attr = Attr(s, *n);
      // "." and ".." are not looked up by the kernel: no entry to count.
    } else {
      const Node* child = s.tree->Get(dir->children[i - 2]);
      name = child->name.c_str();
      e.ino = child->ino;
      e.generation = s.tree->generation();
      e.attr = Attr(s, *child);
      e.attr_timeout = e.entry_timeout = kCacheSeconds;
    }
    size_t n = plus ? fuse_add_direntry_plus(req, buf.data() + used,
                                             size - used, name, &e, i + 1)
                    : fuse_add_direntry(req, buf.data() + used, size - used,
                                        name, &e.attr, i + 1);
    if (n > size - used) break;
    used += n;
    if (plus && i >= 2) s.tree->CountLookup(e.ino);
  }
  fuse_reply_buf(req, buf.data(), used);
}

void OnForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  Get(req).tree->Forget(ino, nlookup);
  fuse_reply_none(req);
}

void OnForgetMulti(fuse_req_t req, size_t count, fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i)
    Get(req).tree->Forget(forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void OnReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset,
               fuse_file_info*) {
  ReplyDir(req, ino, size, offset, /*plus=*/false);
}

void OnReaddirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset,
                   fuse_file_info*) {
  ReplyDir(req, ino, size, offset, /*plus=*/true);
}

void OnOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  const Node* n = Get(req).tree->Get(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
  } else if (n->kind == NodeKind::kDir) {
    fuse_reply_err(req, EISDIR);
  } else if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) {
    fuse_reply_err(req, EACCES);
  } else {
    // The bytes of a served tree never change: the page cache may keep them,
    // and mapping works (no direct I/O).
    fi->keep_cache = 1;
    fuse_reply_open(req, fi);
  }
}

void OnRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset,
            fuse_file_info*) {
  const Tree& tree = *Get(req).tree;
  const Node* n = tree.Get(ino);
  if (n == nullptr) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  std::unique_ptr<char[]> buf(new char[size]);
  absl::StatusOr<int64_t> got =
      tree.Read(*n, offset, static_cast<int64_t>(size), buf.get());
  if (!got.ok()) {
    fuse_reply_err(req, ToErrno(got.status()));
    return;
  }
  fuse_reply_buf(req, buf.get(), *got);
}

void OnSetattr(fuse_req_t req, fuse_ino_t, struct stat*, int, fuse_file_info*) {
  fuse_reply_err(req, EACCES);
}

}  // namespace

absl::Status ServeMount(const Tree& tree, const MountOptions& options) {
  Server server{&tree, getuid(), getgid(), {}};
  clock_gettime(CLOCK_REALTIME, &server.start);
  fuse_lowlevel_ops ops = {};
  ops.init = OnInit;
  ops.lookup = OnLookup;
  ops.forget = OnForget;
  ops.forget_multi = OnForgetMulti;
  ops.getattr = OnGetattr;
  ops.setattr = OnSetattr;
  ops.readlink = OnReadlink;
  ops.opendir = OnOpendir;
  ops.readdir = OnReaddir;
  ops.readdirplus = OnReaddirplus;
  ops.open = OnOpen;
  ops.read = OnRead;

  std::string mount_opts =
      absl::StrCat("fsname=scalai,subtype=scalai,max_read=", kMaxIo);
  if (options.allow_other) absl::StrAppend(&mount_opts, ",allow_other");
  std::vector<std::string> argv_store = {"scalai", "-o", mount_opts};
  std::vector<char*> argv;
  for (std::string& a : argv_store) argv.push_back(a.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  fuse_session* se = fuse_session_new(&args, &ops, sizeof(ops), &server);
  if (se == nullptr) return absl::InternalError("fuse_session_new failed");
  absl::Cleanup destroy = [se] { fuse_session_destroy(se); };
  if (fuse_set_signal_handlers(se) != 0) {
    return absl::InternalError("cannot install signal handlers");
  }
  absl::Cleanup remove_handlers = [se] { fuse_remove_signal_handlers(se); };
  if (fuse_session_mount(se, options.mountpoint.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot mount at ", options.mountpoint,
                     " (is it an existing directory, and is "
                     "/dev/fuse available?)"));
  }
  absl::Cleanup unmount = [se] { fuse_session_unmount(se); };
  if (options.on_ready) options.on_ready();
  fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(config, 16);
  fuse_loop_cfg_set_idle_threads(config, 4);
  int rc = fuse_session_loop_mt(se, config);
  fuse_loop_cfg_destroy(config);
  if (rc < 0)
    return absl::InternalError(
        absl::StrCat("FUSE loop failed: ", std::strerror(-rc)));
  return absl::OkStatus();
}

}  // namespace scalai
