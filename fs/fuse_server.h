// Serves a job's trees (fs/job.h) through the libfuse3 low-level API until
// unmounted or signalled. Handlers are trampolines: decode, ask the job or
// its tree, reply once. Writing a config to MOUNT/config asks the job to
// reconfigure; open handles keep the tree they opened.
//
//   Job job(*store, std::move(tree), {.keep_steps = 3});
//   RETURN_IF_ERROR(ServeMount(job, {.mountpoint = "/mnt/job"}));
#ifndef SCALAI_FS_FUSE_SERVER_H_
#define SCALAI_FS_FUSE_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "fs/job.h"

namespace scalai {

struct MountOptions {
  std::string mountpoint;
  bool allow_other = false;
  // Called once the mount exists, just before requests are served.
  std::function<void()> on_ready;
};

absl::Status ServeMount(Job& job, const MountOptions& options);

}  // namespace scalai

#endif  // SCALAI_FS_FUSE_SERVER_H_
