// The `scalai` command line: parses, runs one subcommand, and maps the result
// to exit codes (0 success, 1 user error with one line on stderr, 2 usage).
#include <malloc.h>
#include <sys/resource.h>

#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "tools/command.h"

int main(int argc, char** argv) {
  // A mount holds blob mappings and serves many open files at once; the
  // soft limit on descriptors (often 1024) is raised to the hard one.
  if (rlimit limit; getrlimit(RLIMIT_NOFILE, &limit) == 0 &&
                    limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
  // Peers, the mount and materializations allocate and free buffers of
  // megabytes all the time (socket reads, messages, blob windows). glibc's
  // defaults return such memory to the kernel as soon as it is freed, so
  // every new buffer's pages are faulted in again, and in a VM a fault costs
  // more than copying the page. Buffers up to 32 MiB come from the heap, up
  // to 64 MiB free at its top are kept, and all threads share two arenas:
  // glibc unmaps a per-thread arena's heap whenever it empties, which with
  // gRPC's many threads is all the time. Measured with
  // tools/bench_cluster_transfer.py, same runs: materialization across two
  // hosts went from 183-185 to 404-454 MB/s, a rank read from a peer through
  // the mount from 161-181 to 573-640 MB/s (docs/benchmarks.md).
  mallopt(M_ARENA_MAX, 2);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  CLI::App root(
      "Scalai: a job's training state as a parallelizable tensor collection, "
      "mounted as files that re-slice themselves when tp, pp or dp change.",
      "scalai");
  root.require_subcommand(1);
  root.set_version_flag("--version", "scalai 0.1.0");
  std::vector<scalai::Command> commands = {
      scalai::AddInitCommand(root),     scalai::AddImportCommand(root),
      scalai::AddExportCommand(root),   scalai::AddInspectCommand(root),
      scalai::AddFsckCommand(root),     scalai::AddPlanCommand(root),
      scalai::AddSynthCommand(root),    scalai::AddMountCommand(root),
      scalai::AddUmountCommand(root),   scalai::AddReconfigureCommand(root),
      scalai::AddDatasetCommand(root),  scalai::AddClusterCommand(root),
      scalai::AddGpuBenchCommand(root),
  };
  // CLI11 takes an unknown first word for a stray argument and says only that
  // a subcommand is required; name the word and the commands instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const scalai::Command& command : commands) {
      known = known || command.app->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + command.app->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "scalai: unknown command \"%s\" (commands: %s)\n",
                   argv[1], names.c_str());
      return 2;
    }
  }
  try {
    root.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return root.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return root.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return root.exit(e);
  } catch (const CLI::ParseError& e) {
    root.exit(e);
    return 2;
  }
  for (const scalai::Command& command : commands) {
    if (!command.app->parsed()) continue;
    absl::Status status = command.run();
    if (status.ok()) return 0;
    std::fprintf(stderr, "scalai %s: %s\n", command.app->get_name().c_str(),
                 std::string(status.message()).c_str());
    return 1;
  }
  return 2;
}
