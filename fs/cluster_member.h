// A ClusterMember is one host's part in a job that spans hosts
// (docs/reference.md, "Clusters"). It keeps the host a live member in etcd
// (a lease it renews), serves the host's store to its peers over gRPC, makes
// a config written on this host current for the whole cluster in one etcd
// transaction (the job's agreement), and applies every config agreed
// elsewhere as its watch sees it; a host that was away catches up when it
// returns. It records this host's progress in etcd and shows every host's in
// `status` under "cluster".
//
//   Job job(*store, std::move(tree), {});
//   ASSIGN_OR_RETURN(auto member, ClusterMember::Join(job, cluster, "h0"));
//   RETURN_IF_ERROR(ServeMount(job, {.mountpoint = "/mnt/job"}));
#ifndef SCALAI_FS_CLUSTER_MEMBER_H_
#define SCALAI_FS_CLUSTER_MEMBER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "fs/cluster_coverage.h"
#include "fs/cluster_saves.h"
#include "fs/job.h"
#include "nlohmann/json.hpp"
#include "transfer/cluster_file.h"
#include "transfer/etcd_client.h"
#include "transfer/peer_bytes.h"
#include "transfer/peer_client.h"
#include "transfer/peer_server.h"

namespace scalai {

class ClusterMember {
 public:
  // How long a host stays live in etcd without renewing its lease.
  static constexpr absl::Duration kLeaseTtl = absl::Seconds(5);
  // How often the lease is renewed, progress recorded and the other
  // hosts' state read.
  static constexpr absl::Duration kBeat = absl::Milliseconds(500);
  // How often every peer is called, and how long each call may take: a
  // peer that does not answer in time is shown unreachable.
  static constexpr absl::Duration kPeerCheck = absl::Seconds(1);
  // How long one read of bytes from a peer (up to a few MiB) may take.
  static constexpr absl::Duration kPeerBytesDeadline = absl::Seconds(20);

  // Joins the job as host `host`: the cluster's config, when there is one,
  // becomes this host's (refused, naming why, if its store cannot serve
  // it); otherwise this host's config becomes the cluster's.
  struct Options {
    // How many hosts keep each shard (`mount --replicas`): 2 has the next
    // host in a config's list keep this host's shards too, as each step is
    // saved (ClusterSaves) and as each config is materialized.
    int replicas = 1;
  };
  static absl::StatusOr<std::unique_ptr<ClusterMember>> Join(
      Job& job, const ClusterFile& cluster, const std::string& host,
      Options options);
  static absl::StatusOr<std::unique_ptr<ClusterMember>> Join(
      Job& job, const ClusterFile& cluster, const std::string& host) {
    return Join(job, cluster, host, Options());
  }
  // Leaves: the job no longer asks etcd, the lease is revoked (the host is
  // no longer live at once), the peer service stops.
  ~ClusterMember();
  ClusterMember(const ClusterMember&) = delete;
  ClusterMember& operator=(const ClusterMember&) = delete;

  // etcd's key for `what` of job `job`.
  static std::string Key(const std::string& job, const std::string& what);

 private:
  ClusterMember(Job& job, ClusterFile cluster, std::string host,
                Options options);
  absl::Status Start();
  // The job's agreement: one etcd transaction, conditional on the config
  // this host last saw, makes `config` the cluster's; returns the revision
  // it was committed at.
  absl::StatusOr<int64_t> Propose(const ParallelConfig& config);
  // A file of this host's mount under its current config, for a peer
  // (PeerServer's ReadFile).
  absl::StatusOr<int64_t> ReadFile(const std::string& path, int64_t offset,
                                   int64_t length, char* out);
  // Applies an agreed config value from etcd, if newer than the one seen.
  void Apply(const EtcdClient::KeyValue& kv);
  absl::Status Watch(int64_t after);
  absl::Status Register();
  void Beat();
  // Ends the beat's wait: a config applied or a step saved is acted on now.
  void BeatNow();
  void RecordProgress();
  // Reads the members and their progress; returns the revision read at
  // (0 when etcd did not answer).
  int64_t ReadCluster();
  // Once per cluster_.etcd_history, compacts etcd's history to the
  // revision read one period before (`now_revision` is read now): etcd's
  // database would otherwise grow with every change, to its quota.
  void CompactHistory(int64_t now_revision);
  // Once every host the cluster's config needs is live and has finished
  // materializing it, the shards kept for peers are released.
  void ReleaseWhenAllFinished();
  // A failed materialization is started again when a peer that did not
  // answer does again.
  void RetryWhenPeerBack();
  // Whether host `name` is live, as the last reading of etcd saw it.
  bool IsLive(const std::string& name);
  // Whether host `name` is lost for good: not live, and left out of the
  // cluster's config (a config without it was accepted).
  bool IsLost(const std::string& name);
  // Whether host `name` has never mounted the job: etcd, as last read,
  // holds no progress of its (false before a first read).
  bool NeverMounted(const std::string& name);
  // The groups of `config` this host holds: those of its ranks (and with
  // replicas, those of the hosts it is the next host of), or all when the
  // config names no hosts.
  std::optional<std::vector<int>> HeldGroups(
      const ParallelConfig& config) const;
  // The peers to read bytes from: those that answered the last check
  // first.
  std::vector<PeerClient*> PeersForBytes();
  // Calls every other host (Hello) on its own thread, so that a silent peer
  // never delays the lease.
  void CheckPeers();
  nlohmann::json StatusSection();
  std::string Key(const std::string& what) const {
    return Key(cluster_.job, what);
  }

  Job& job_;
  const ClusterFile cluster_;
  const std::string host_;
  const Options options_;
  std::string address_;
  std::unique_ptr<EtcdClient> etcd_;
  std::unique_ptr<PeerServer> peers_;
  std::unique_ptr<ClusterSaves> saves_;  // used by Start, then the beat
  // Datasets whose copy here differs from the cluster's, with why; set by
  // Start.
  std::map<std::string, std::string> datasets_refused_;

  std::mutex mu_;  // guards what follows; never held while calling the job
  int64_t seen_revision_ = 0;  // of the config key, as last seen
  int64_t generation_ = 0;     // the cluster's, counting config changes
  std::optional<ParallelConfig> agreed_;  // the cluster's config, as seen
  int64_t lease_ = 0;
  nlohmann::json hosts_ = nlohmann::json::array();  // as last read
  // The hosts that recorded progress, as last read; unset before a read.
  std::optional<std::set<std::string>> mounted_;
  std::string etcd_error_;        // the last failure to reach etcd
  std::string progress_written_;  // the last progress value put
  // Only the beat thread (and Start, before it) records progress: these
  // need no lock. The store's blob bytes, counted for the job's state
  // `bytes_held_key_`.
  int64_t bytes_held_ = 0;
  std::vector<HostHolding> holdings_;  // what this host's store holds
  std::string bytes_held_key_;
  // Each host's progress value as last read, with the revision of its last
  // change (beat only): a beat reads again only the values that changed.
  struct SeenProgress {
    int64_t mod_revision = 0;
    nlohmann::json value;
  };
  std::map<std::string, SeenProgress> progress_seen_;
  // The revision to compact to next, and when it was read (beat only).
  int64_t history_mark_ = 0;
  absl::Time history_marked_ = absl::InfinitePast();
  std::unique_ptr<EtcdClient::Watch> watch_;
  std::unique_ptr<EtcdClient::Watch> saves_watch_;  // wakes the beat
  // The other hosts: a client each for the checks and one for bytes (with
  // a longer deadline; both thread-safe), and what the last check found.
  struct Peer {
    std::unique_ptr<PeerClient> client;
    std::unique_ptr<PeerClient> data;
    bool answered = false;
    // Of the last check; empty when it answered.
    std::string error = "not called yet";
  };
  std::map<std::string, Peer> peers_by_name_;
  std::unique_ptr<PeerBytes> remote_;  // over the peers' data clients
  bool peer_back_ = false;             // a peer answered again; guarded by mu_

  std::mutex propose_mu_;  // one proposal at a time from this host
  std::atomic<bool> stopping_{false};
  std::condition_variable wake_;  // with mu_: ends a beat's wait early
  bool beat_now_ = false;         // guarded by mu_; see wake_
  std::thread beat_;
  std::thread check_;
};

}  // namespace scalai

#endif  // SCALAI_FS_CLUSTER_MEMBER_H_
