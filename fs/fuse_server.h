// Serves a store's trees through the libfuse3 low-level API until unmounted
// or signalled. Handlers are trampolines: decode, ask the tree, reply once.
// Writing a config to MOUNT/config builds the next generation's tree and
// switches new opens to it at once; open handles keep the tree they opened.
//
//   MountOptions o{.mountpoint = "/mnt/job"};
//   RETURN_IF_ERROR(ServeMount(*store, std::move(tree), o));  // until unmount
#ifndef SCALAI_FS_FUSE_SERVER_H_
#define SCALAI_FS_FUSE_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "fs/tree.h"
#include "transfer/store.h"

namespace scalai {

struct MountOptions {
  std::string mountpoint;
  bool allow_other = false;
  // After each step saved through the mount, keep the newest K steps
  // (0: all); a step with a file open is kept until a later commit.
  int keep_steps = 0;
  // Called once the mount exists, just before requests are served.
  std::function<void()> on_ready;
};

absl::Status ServeMount(Store& store, std::unique_ptr<Tree> tree,
                        const MountOptions& options);

}  // namespace scalai

#endif  // SCALAI_FS_FUSE_SERVER_H_
