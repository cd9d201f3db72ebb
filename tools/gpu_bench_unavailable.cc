// `scalai gpu-bench` in a build without the GPU backend: the command exists,
// so that it says why it cannot run rather than being unknown.
#include <memory>

#include "tools/command.h"

namespace scalai {

Command AddGpuBenchCommand(CLI::App& root) {
  CLI::App* app = root.add_subcommand(
      "gpu-bench",
      "Measure the GPU backend (not in this build: it needs CUDA and NCCL "
      "under /usr/local/cuda)");
  app->allow_extras();
  return {app, [] {
            return absl::FailedPreconditionError(
                "this scalai was built without the GPU backend: CUDA, NCCL "
                "and nvcc under /usr/local/cuda are needed, then `meson "
                "setup --reconfigure build`");
          }};
}

}  // namespace scalai
