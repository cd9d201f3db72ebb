// The FUSE handlers of saving (docs/reference.md, "Saving a checkpoint through
// the mount"): mkdir of steps and ranks, files created and written into
// their blobs, checked at close, and the step published once complete.
#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fs/fuse_state.h"
#include "ptc/status_macros.h"
#include "transfer/files.h"

namespace scalai::fuse {

// A node of a step being saved: never cached, since it grows as written.
struct stat SaveAttr(Server& s, const SaveNode& n) {
  struct stat st = {};
  st.st_ino = n.ino;
  st.st_uid = s.uid;
  st.st_gid = s.gid;
  st.st_mode = n.dir ? S_IFDIR | 0755 : S_IFREG | 0644;
  st.st_nlink = n.dir ? 2 : 1;
  st.st_size = n.size;
  st.st_blksize = kMaxIo;
  st.st_blocks = (n.size + 511) / 512;
  st.st_atim = st.st_mtim = st.st_ctim = s.start;
  return st;
}

fuse_entry_param SaveEntry(Server& s, const SaveNode& n) {
  fuse_entry_param e = {};
  e.ino = n.ino;
  e.attr = SaveAttr(s, n);
  return e;  // timeouts 0
}

// A refused save says why in `status` too: the writer's errno cannot.
void ReportSaveError(Server& s, const absl::Status& status) {
  s.job->ReportError(status.message());
}

// A file being saved: written straight into its blob, so never through the
// page cache (direct I/O: one request per write of up to 1 MiB).
void OpenSaved(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi,
               bool writing) {
  Server& s = Get(req);
  std::optional<SaveNode> n = s.job->saves().Get(ino);
  if (!n) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  if (n->dir) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  if (writing && n->committed && !(fi->flags & O_TRUNC)) {
    // Committed bytes never change; only a whole new copy may be written,
    // and it is compared with them (OnFlush).
    fuse_reply_err(req, EROFS);
    return;
  }
  std::shared_ptr<ShardFile> file = s.job->saves().FileOf(ino);
  if (writing && (fi->flags & O_TRUNC)) {
    absl::StatusOr<std::shared_ptr<ShardFile>> fresh =
        s.job->saves().Rewrite(ino);
    if (!fresh.ok()) {
      fuse_reply_err(req, ToErrno(fresh.status()));
      return;
    }
    file = *fresh;
  }
  if (file == nullptr) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  fi->fh = reinterpret_cast<uint64_t>(new Handle(ino, file, n->committed));
  fi->direct_io = 1;
  if (fuse_reply_open(req, fi) != 0) delete HandleOf(fi);
}

// In ckpt/, a step to save; in a step being saved, a rank's directory.
void OnMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t) {
  if (RefuseLongName(req, name)) return;
  Server& s = Get(req);
  absl::StatusOr<SaveNode> made = absl::PermissionDeniedError("read-only");
  bool saving = false;  // a refusal of the save area is shown in status
  if (SaveArea::Owns(parent)) {
    saving = true;
    made = s.job->saves().Mkdir(parent, name);
  } else {
    std::shared_ptr<const Tree> tree = s.job->TreeOf(parent);
    const Node* dir = tree ? tree->Get(parent) : nullptr;
    absl::StatusOr<const Node*> existing =
        tree ? tree->Lookup(parent, name)
             : absl::StatusOr<const Node*>(nullptr);
    if (dir == nullptr) {
      made = absl::NotFoundError("no such directory");
    } else if (existing.ok() && *existing != nullptr) {
      made = absl::AlreadyExistsError(absl::StrCat(name, " exists"));
    } else if (IsCkptDir(*dir)) {
      saving = true;
      made = s.job->saves().MkdirStep(name, tree->config());
    }
  }
  if (!made.ok()) {
    // (A directory that exists is no news: every worker's makedirs meets
    // its step's.)
    const absl::StatusCode code = made.status().code();
    if (code == absl::StatusCode::kInvalidArgument ||
        code == absl::StatusCode::kFailedPrecondition ||
        (saving && (code == absl::StatusCode::kPermissionDenied ||
                    code == absl::StatusCode::kUnavailable))) {
      ReportSaveError(s, made.status());
    }
    int error = ToErrno(made.status());
    if (code == absl::StatusCode::kFailedPrecondition) error = EROFS;
    if (code == absl::StatusCode::kUnavailable) error = EAGAIN;  // retry
    fuse_reply_err(req, error);
    return;
  }
  fuse_entry_param e = SaveEntry(s, *made);
  fuse_reply_entry(req, &e);
}

void OnCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t,
              fuse_file_info* fi) {
  if (RefuseLongName(req, name)) return;
  Server& s = Get(req);
  if (!SaveArea::Owns(parent)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  auto created = s.job->saves().Create(parent, name);
  if (!created.ok()) {
    ReportSaveError(s, created.status());
    // A committed step is read-only.
    fuse_reply_err(
        req, created.status().code() == absl::StatusCode::kFailedPrecondition
                 ? EROFS
                 : ToErrno(created.status()));
    return;
  }
  fi->fh = reinterpret_cast<uint64_t>(new Handle(
      created->first.ino, created->second, created->first.committed));
  fi->direct_io = 1;
  fuse_entry_param e = SaveEntry(s, created->first);
  if (fuse_reply_create(req, &e, fi) != 0) delete HandleOf(fi);
}

// Whether a shard written over a committed model.safetensors holds the
// same tensors' bytes (headers differ: scalai.rank).
absl::Status SameAsCommitted(const Tree& tree, const Node& node,
                             ShardFile& file) {
  const std::string label =
      absl::StrCat(tree.Get(tree.Get(node.parent)->parent)->name, "/",
                   tree.Get(node.parent)->name, "/model.safetensors");
  char first8[8];
  ASSIGN_OR_RETURN(int64_t got, file.Read(first8, 8, 0));
  uint64_t length = 0;
  if (got == 8) std::memcpy(&length, first8, 8);
  const int64_t start = 8 + static_cast<int64_t>(length);
  const int64_t committed_start = static_cast<int64_t>(node.text.size());
  const int64_t bytes = node.size - committed_start;
  bool same = got == 8 && file.size() - start == bytes;
  if (same) {
    ASSIGN_OR_RETURN(same, SameBytes(
                               file.Reader(), start,
                               [&](char* out, int64_t size, int64_t offset) {
                                 return tree.Read(node, offset, size, out);
                               },
                               committed_start, bytes));
  }
  if (same) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      label, ": differs from the committed shard (a committed step never ",
      "changes; a data-parallel copy must be identical)"));
}

// close(): a written shard is checked here, so that its writer sees EIO
// (RELEASE's result reaches nobody), and the step commits once complete.
void OnFlush(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Server& s = Get(req);
  Handle& h = *HandleOf(fi);
  if (h.file == nullptr || !h.dirty) {
    fuse_reply_err(req, 0);
    return;
  }
  h.dirty = false;
  if (!h.write_error.ok()) {
    ReportSaveError(s, h.write_error);
    fuse_reply_err(req, ToErrno(h.write_error));
    return;
  }
  absl::Status same = absl::OkStatus();
  absl::StatusOr<bool> complete = false;
  bool verify = h.verify_saved;
  if (h.node == nullptr && !verify) {
    complete = s.job->saves().Close(ino, h.file);
    verify = complete.status().code() == absl::StatusCode::kAborted;
  }
  if (h.node != nullptr) {
    same = SameAsCommitted(*h.tree, *h.node, *h.file);
  } else if (verify) {
    // The step committed while this file was open: find it in the tree.
    std::optional<SaveNode> n = s.job->saves().Get(ino);
    std::shared_ptr<const Tree> tree = s.job->TreeOf(kRootIno);
    const Node* file = nullptr;
    if (n) {
      const Node* at = tree->Get(kRootIno);
      for (const std::string& name :
           {std::string("ckpt"), absl::StrFormat("step-%08d", n->step),
            absl::StrFormat("rank-%05d", n->rank),
            std::string("model.safetensors")}) {
        absl::StatusOr<const Node*> next =
            at ? tree->Lookup(at->ino, name) : nullptr;
        at = next.ok() ? *next : nullptr;
      }
      file = at;
    }
    same = file != nullptr ? SameAsCommitted(*tree, *file, *h.file)
                           : absl::NotFoundError("the committed step is gone");
  }
  if (h.node != nullptr || verify) {
    if (!same.ok()) ReportSaveError(s, same);
    fuse_reply_err(req, same.ok() ? 0 : EIO);
    return;
  }
  absl::Status result = complete.status();
  if (complete.ok() && *complete) {
    std::optional<SaveNode> n = s.job->saves().Get(ino);
    if (n) result = s.job->PublishStep(n->step);
  }
  if (!result.ok()) {
    ReportSaveError(s, result);
    fuse_reply_err(req, result.code() == absl::StatusCode::kResourceExhausted
                            ? ENOSPC
                            : EIO);
    return;
  }
  fuse_reply_err(req, 0);
}

void OnFsync(fuse_req_t req, fuse_ino_t, int, fuse_file_info* fi) {
  const Handle& h = *HandleOf(fi);
  absl::Status synced = h.file != nullptr ? h.file->Sync() : absl::OkStatus();
  fuse_reply_err(req, synced.ok() ? 0 : ToErrno(synced));
}

// `rm -r` of a step being saved: its files, then its directories.
void OnUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Server& s = Get(req);
  if (!SaveArea::Owns(parent)) {
    fuse_reply_err(req, EACCES);
    return;
  }
  absl::Status removed = s.job->saves().Unlink(parent, name);
  int err = 0;
  if (!removed.ok()) {
    err = removed.code() == absl::StatusCode::kFailedPrecondition
              ? EISDIR
              : ToErrno(removed);
  }
  fuse_reply_err(req, err);
}

void OnRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Server& s = Get(req);
  uint64_t in = parent;
  if (!SaveArea::Owns(parent)) {
    std::shared_ptr<const Tree> tree = s.job->TreeOf(parent);
    const Node* dir = tree ? tree->Get(parent) : nullptr;
    if (dir == nullptr || !IsCkptDir(*dir) ||
        !s.job->saves().LookupStep(name)) {
      // Committed steps and the rest of the tree are read-only.
      fuse_reply_err(req, EACCES);
      return;
    }
    in = 0;  // a step's own directory
  }
  absl::Status removed = s.job->saves().Rmdir(in, name);
  int err = 0;
  if (!removed.ok()) {
    err = absl::StrContains(removed.message(), "not empty") ? ENOTEMPTY
          : absl::StrContains(removed.message(), "not a directory")
              ? ENOTDIR
              : ToErrno(removed);
  }
  fuse_reply_err(req, err);
}

}  // namespace scalai::fuse
