// `scalai mount` and `scalai umount`: serve a store's state as files
// (docs/reference.md), in the background unless --foreground.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "fs/cluster_join.h"
#include "fs/cluster_member.h"
#include "fs/fuse_server.h"
#include "fs/tree.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/human_bytes.h"
#include "tools/progress_bar.h"
#include "transfer/store.h"

namespace scalai {
namespace {

struct MountCliOptions {
  std::string store, mountpoint, config;
  std::string cluster, host;  // both, for a host of a cluster
  bool foreground = false;
  bool allow_other = false;
  int keep_steps = 0;
  int replicas = 1;  // hosts that keep each shard, in a cluster
};

absl::StatusOr<std::string> Absolute(const std::string& path) {
  char buf[PATH_MAX];
  if (realpath(path.c_str(), buf) == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot resolve ", path));
  }
  return std::string(buf);
}

// Opens the store, switches its current config if asked, builds the tree and
// serves it; `ready` is called once the mount exists.
absl::Status Serve(const MountCliOptions& o,
                   const std::function<void()>& ready) {
  std::optional<ClusterFile> cluster;
  if (!o.cluster.empty()) {
    ASSIGN_OR_RETURN(cluster, ClusterFile::Load(o.cluster));
    // A new host: its empty store is filled from the cluster first.
    ASSIGN_OR_RETURN(bool empty, StoreIsEmpty(o.store));
    if (empty) RETURN_IF_ERROR(FillStoreFromCluster(*cluster, o.host, o.store));
  }
  ASSIGN_OR_RETURN(auto store, Store::Open(o.store));
  std::optional<ParallelConfig> config = store->current_config();
  if (!o.config.empty()) {
    ASSIGN_OR_RETURN(config, ParallelConfig::Parse(o.config));
  }
  if (!config) {
    return absl::FailedPreconditionError(absl::StrCat(
        "store ", o.store,
        " has no parallel config yet: import a checkpoint or pass --config"));
  }
  if (o.cluster.empty() && !config->hosts().empty()) {
    if (!o.config.empty()) {
      return absl::InvalidArgumentError(
          "--config: hosts= names the hosts of a job that spans hosts; mount "
          "with --cluster and --host for that");
    }
    // A store last mounted as one host of a cluster: alone, it runs every
    // rank.
    ASSIGN_OR_RETURN(config, config->WithHosts({}));
  }
  // The views are built first and the config committed after: a config the
  // store cannot serve changes nothing.
  ASSIGN_OR_RETURN(std::unique_ptr<Tree> tree, Tree::Build(*store, *config));
  RETURN_IF_ERROR(store->SetCurrentConfig(*config));
  Job::Options job_options;
  job_options.keep_steps = o.keep_steps;
  Job job(*store, std::move(tree), job_options);
  // A host of a cluster joins it before the mount answers: the views are
  // the cluster's config from the first read.
  std::unique_ptr<ClusterMember> member;
  if (cluster) {
    ASSIGN_OR_RETURN(member, ClusterMember::Join(job, *cluster, o.host,
                                                 {.replicas = o.replicas}));
  }
  MountOptions mount;
  mount.mountpoint = o.mountpoint;
  mount.allow_other = o.allow_other;
  mount.on_ready = [&] {
    // Best effort: without the note, a mount right after `umount` fails as
    // it did before, naming the store in use.
    store->NoteServedAt(o.mountpoint).IgnoreError();
    ready();
  };
  return ServeMount(job, mount);
}

// `fusermount3 -u MOUNTPOINT`, exec'd with an argument vector: a path is
// never read by a shell, whatever characters it holds.
absl::Status RunFusermountUnmount(const std::string& mountpoint) {
  const pid_t pid = fork();
  if (pid < 0) return absl::ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    const char* argv[] = {"fusermount3", "-u", "--", mountpoint.c_str(),
                          nullptr};
    execvp(argv[0], const_cast<char* const*>(argv));
    _exit(127);
  }
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return absl::ErrnoToStatus(errno, "waitpid");
  }
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot unmount ", mountpoint,
                     WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 127
                         ? ": fusermount3 not found"
                         : ": fusermount3 failed"));
  }
  return absl::OkStatus();
}

// The kernel mounts FUSE on a regular file as well; a scalai mount is a
// tree, so anything but a directory is refused before the store is opened.
absl::Status RequireDirectory(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("mountpoint ", path));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mountpoint ", path, " is not a directory"));
  }
  return absl::OkStatus();
}

absl::Status RunMount(MountCliOptions o) {
  if (o.cluster.empty() != o.host.empty()) {
    return absl::InvalidArgumentError(
        "--cluster and --host go together: the cluster file, and which of "
        "its hosts this is");
  }
  if (o.replicas != 1 && o.cluster.empty()) {
    return absl::InvalidArgumentError(
        "--replicas keeps copies on other hosts of a cluster: it needs "
        "--cluster and --host");
  }
  if (!o.cluster.empty()) {
    // Checked here, so that a mistake in it is reported before anything
    // starts.
    ASSIGN_OR_RETURN(o.cluster, Absolute(o.cluster));
    ASSIGN_OR_RETURN(ClusterFile cluster, ClusterFile::Load(o.cluster));
    RETURN_IF_ERROR(cluster.FindHost(o.host).status());
  }
  ASSIGN_OR_RETURN(o.store, Absolute(o.store));
  ASSIGN_OR_RETURN(o.mountpoint, Absolute(o.mountpoint));
  RETURN_IF_ERROR(RequireDirectory(o.mountpoint));
  if (o.foreground) {
    return Serve(o, [&] {
      std::printf("mounted %s at %s\n", o.store.c_str(), o.mountpoint.c_str());
      std::fflush(stdout);
    });
  }
  // The server runs in a child: RocksDB's threads must start after the fork.
  // The child reports "ok" or its error through a pipe, then detaches.
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe");
  pid_t pid = fork();
  if (pid < 0) return absl::ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    close(pipefd[0]);
    setsid();
    int out = pipefd[1];
    absl::Status s = Serve(o, [out] {
      (void)!write(out, "ok", 2);
      close(out);
      int null = open("/dev/null", O_RDWR);
      dup2(null, 0);
      dup2(null, 1);
      dup2(null, 2);
    });
    if (!s.ok()) {
      std::string message(s.message());
      (void)!write(out, message.data(), message.size());
    }
    _exit(s.ok() ? 0 : 1);
  }
  close(pipefd[1]);
  std::string reply;
  char buf[512];
  for (ssize_t n; (n = read(pipefd[0], buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    reply.append(buf, n);
    if (reply == "ok") break;
  }
  close(pipefd[0]);
  if (reply != "ok") {
    waitpid(pid, nullptr, 0);
    return absl::FailedPreconditionError(
        reply.empty() ? "the mount process died" : reply);
  }
  // Return once the mount answers; one that does not is taken down again,
  // so that a failed mount never holds the store.
  struct stat st;
  if (stat((o.mountpoint + "/config").c_str(), &st) != 0) {
    const int err = errno;
    if (umount2(o.mountpoint.c_str(), MNT_DETACH) != 0) {
      (void)RunFusermountUnmount(o.mountpoint);
    }
    kill(pid, SIGTERM);
    waitpid(pid, nullptr, 0);
    return absl::ErrnoToStatus(
        err, absl::StrCat("the mount at ", o.mountpoint, " does not answer"));
  }
  std::printf("mounted %s at %s\n", o.store.c_str(), o.mountpoint.c_str());
  return absl::OkStatus();
}

absl::Status RunUmount(const std::string& mountpoint_arg) {
  ASSIGN_OR_RETURN(std::string mountpoint, Absolute(mountpoint_arg));
  std::stringstream text;
  {
    // Closed before unmounting: an open file keeps the mount busy.
    std::ifstream job(mountpoint + "/job.json");
    text << job.rdbuf();
  }
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("store")) {
    return absl::InvalidArgumentError(
        absl::StrCat(mountpoint, " is not a scalai mount"));
  }
  const std::string store = j["store"].get<std::string>();
  if (umount2(mountpoint.c_str(), 0) != 0) {
    // Not root: the setuid helper unmounts FUSE mounts of their owner.
    RETURN_IF_ERROR(RunFusermountUnmount(mountpoint));
  }
  // Wait for the server to finish and let go of the store.
  int fd = open((store + "/LOCK").c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return absl::OkStatus();
  for (int i = 0; i < 600; ++i) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
      close(fd);
      return absl::OkStatus();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  close(fd);
  return absl::DeadlineExceededError(absl::StrCat(
      "unmounted ", mountpoint, ", but its server still holds ", store));
}

// The same as writing C to MOUNTPOINT/config; on a refusal, the reason from
// MOUNTPOINT/status.
absl::Status RunReconfigure(const std::string& mountpoint,
                            const std::string& config, bool wait) {
  const std::string path = mountpoint + "/config";
  int fd = open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat(mountpoint, " is not a scalai mount"));
  }
  const std::string text = config + "\n";
  ssize_t n = write(fd, text.data(), text.size());
  int err = errno;
  close(fd);
  auto status = [&]() {
    std::ifstream in(mountpoint + "/status");
    std::stringstream s;
    s << in.rdbuf();
    return nlohmann::json::parse(s.str(), nullptr, false);
  };
  if (n != static_cast<ssize_t>(text.size())) {
    nlohmann::json j = status();
    if (!j.is_discarded() && j.contains("error") && j["error"].is_string()) {
      return absl::InvalidArgumentError(j["error"].get<std::string>());
    }
    return absl::ErrnoToStatus(err, absl::StrCat("write ", path));
  }
  // The views switch at once; with --wait, also until materialization ends.
  nlohmann::json j = status();
  if (wait) {
    ProgressBar bar("materialize");
    ProgressFn draw = bar.Callback();
    while (!j.is_discarded() && j.value("state", "") == "materializing") {
      if (draw) {
        draw(j.value("bytes_moved", int64_t{0}),
             j.value("bytes_to_move", int64_t{0}));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      j = status();
    }
    bar.Finish();
    if (j.is_discarded()) {
      return absl::UnavailableError(
          absl::StrCat(mountpoint, "/status is unreadable"));
    }
    if (j.value("state", "") == "failed") {
      return absl::InternalError(
          j.contains("error") && j["error"].is_string()
              ? j["error"].get<std::string>()
              : "materialization failed, and status gives no reason");
    }
  }
  std::printf("%s: %s (generation %s)", mountpoint.c_str(),
              j.value("config", std::string("?")).c_str(),
              j.contains("generation") ? j["generation"].dump().c_str() : "?");
  if (wait) {
    std::printf(", materialized: %s written, the plan's minimum %s",
                HumanBytes(j.value("bytes_moved", int64_t{0})).c_str(),
                HumanBytes(j.value("bytes_to_move", int64_t{0})).c_str());
  }
  std::printf("\n");
  return absl::OkStatus();
}

}  // namespace

Command AddReconfigureCommand(CLI::App& root) {
  struct Options {
    std::string mountpoint, config;
    bool wait = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = root.add_subcommand(
      "reconfigure",
      "Switch a mount to a new parallel config (as writing MOUNTPOINT/config)");
  app->add_option("MOUNTPOINT", o->mountpoint, "a scalai mount")->required();
  app->add_option("CONFIG", o->config, "e.g. tp=4,pp=2,dp=2")->required();
  app->add_flag("--wait", o->wait, "return after materialization finished");
  return {app,
          [o] { return RunReconfigure(o->mountpoint, o->config, o->wait); }};
}

Command AddMountCommand(CLI::App& root) {
  auto o = std::make_shared<MountCliOptions>();
  CLI::App* app =
      root.add_subcommand("mount", "Serve a store as files at MOUNTPOINT");
  app->add_option("STORE", o->store, "store directory")->required();
  app->add_option("MOUNTPOINT", o->mountpoint, "an existing empty directory")
      ->required();
  app->add_option("--config", o->config,
                  "switch the store to this config first");
  app->add_flag("--foreground", o->foreground,
                "serve in this process until unmounted");
  app->add_flag("--allow-other", o->allow_other,
                "let other users see the mount");
  app->add_option("--cluster", o->cluster,
                  "the cluster file: this mount is one host of a job that "
                  "spans hosts");
  app->add_option("--host", o->host, "which host of the cluster file this is");
  app->add_option("--replicas", o->replicas,
                  "in a cluster, how many hosts keep each shard: 2 has the "
                  "next host in the config's list keep a copy of this host's "
                  "(default 1)")
      ->check(CLI::Range(1, 2));
  app->add_option("--keep-steps", o->keep_steps,
                  "after each step saved through the mount, keep the newest "
                  "K steps (default: all)")
      ->check(CLI::PositiveNumber);
  return {app, [o] { return RunMount(*o); }};
}

Command AddUmountCommand(CLI::App& root) {
  auto mountpoint = std::make_shared<std::string>();
  CLI::App* app =
      root.add_subcommand("umount", "Unmount a scalai mount cleanly");
  app->add_option("MOUNTPOINT", *mountpoint, "where the store is mounted")
      ->required();
  return {app, [mountpoint] { return RunUmount(*mountpoint); }};
}

}  // namespace scalai
