// One etcd member run by a test: `/usr/bin/etcd` on free loopback ports with
// its own data directory, stopped (SIGKILL, then reaped) when destroyed,
// however the test ends.
//
//   EtcdMember etcd(dir);
//   ASSERT_TRUE(etcd.WaitReady().ok());
//   auto client = EtcdClient::Connect({etcd.endpoint()});
#ifndef SCALAI_TESTS_ETCD_MEMBER_H_
#define SCALAI_TESTS_ETCD_MEMBER_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/etcd_client.h"

namespace scalai {

// A loopback port nothing listens on now (the kernel's pick for port 0).
inline int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

class EtcdMember {
 public:
  explicit EtcdMember(const std::filesystem::path& dir)
      : client_port_(FreeLoopbackPort()), peer_port_(FreeLoopbackPort()) {
    std::filesystem::create_directories(dir);
    log_ = (dir / "etcd.log").string();
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port_);
    std::vector<std::string> args = {
        "/usr/bin/etcd",
        "--name=member",
        absl::StrCat("--data-dir=", (dir / "data").string()),
        absl::StrCat("--listen-client-urls=", endpoint()),
        absl::StrCat("--advertise-client-urls=", endpoint()),
        absl::StrCat("--listen-peer-urls=", peer),
        absl::StrCat("--initial-advertise-peer-urls=", peer),
        absl::StrCat("--initial-cluster=member=", peer),
    };
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~EtcdMember() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  EtcdMember(const EtcdMember&) = delete;
  EtcdMember& operator=(const EtcdMember&) = delete;

  std::string endpoint() const {
    return absl::StrCat("http://127.0.0.1:", client_port_);
  }
  const std::string& log() const { return log_; }

  // Answers a read within 30 seconds, or the error says why not.
  absl::Status WaitReady() {
    ASSIGN_OR_RETURN(
        std::unique_ptr<EtcdClient> client,
        EtcdClient::Connect({endpoint()}, std::nullopt, absl::Seconds(30)));
    return client->Get("/ready").status();
  }

 private:
  const int client_port_;
  const int peer_port_;
  std::string log_;
  pid_t pid_ = -1;
};

}  // namespace scalai

#endif  // SCALAI_TESTS_ETCD_MEMBER_H_
