// A ClusterFile is the JSON file, the same on every host, that says which
// hosts run one job, how they reach each other (gRPC addresses) and etcd,
// and the secrets their calls carry: the job's token and, optionally, the
// TLS certificates. Paths in it are relative to the file's own directory.
// Everything is checked when it is read, so a mistake is one clear line at
// mount time rather than a peer refused later.
//
//   ASSIGN_OR_RETURN(ClusterFile cluster, ClusterFile::Load("/etc/job.json"));
//   ASSIGN_OR_RETURN(const ClusterHost* me, cluster.FindHost("h0"));
//   Listen(me->address, cluster.token);
#ifndef SCALAI_TRANSFER_CLUSTER_FILE_H_
#define SCALAI_TRANSFER_CLUSTER_FILE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "ptc/parallel_config.h"

namespace scalai {

struct ClusterHost {
  std::string name;     // letters, digits, '_' and '-'
  std::string address;  // "host:port", as gRPC dials it
};

// PEM texts: this host's certificate and key, and the CA that signed every
// host's (and etcd's) certificate.
struct ClusterTls {
  std::string cert;
  std::string key;
  std::string ca;
};

struct ClusterFile {
  std::string job;                // names the job's keys in etcd
  std::vector<std::string> etcd;  // endpoints, "http(s)://host:port"
  // How far back etcd keeps the job's changes: the hosts compact what is
  // older, so that etcd's database stays bounded over a long job.
  absl::Duration etcd_history = absl::Minutes(5);
  std::string token;  // the token_file's text, trimmed
  std::optional<ClusterTls> tls;
  std::vector<ClusterHost> hosts;  // in the file's order

  static absl::StatusOr<ClusterFile> Load(const std::string& path);
  // The same from text; `dir` resolves the relative paths in it.
  static absl::StatusOr<ClusterFile> Parse(absl::string_view text,
                                           const std::string& dir);
  // The host named `name`; the error lists the hosts there are.
  absl::StatusOr<const ClusterHost*> FindHost(absl::string_view name) const;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CLUSTER_FILE_H_
