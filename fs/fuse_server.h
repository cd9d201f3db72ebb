// Serves a Tree through the libfuse3 low-level API until unmounted or
// signalled. The handlers are trampolines: decode, ask the tree, reply once.
//
//   MountOptions o{.mountpoint = "/mnt/job"};
//   o.on_ready = [&] { tell_parent(); };
//   RETURN_IF_ERROR(ServeMount(*tree, o));   // returns after unmount
#ifndef SCALAI_FS_FUSE_SERVER_H_
#define SCALAI_FS_FUSE_SERVER_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "fs/tree.h"

namespace scalai {

struct MountOptions {
  std::string mountpoint;
  bool allow_other = false;
  // Called once the mount exists, just before requests are served.
  std::function<void()> on_ready;
};

absl::Status ServeMount(const Tree& tree, const MountOptions& options);

}  // namespace scalai

#endif  // SCALAI_FS_FUSE_SERVER_H_
