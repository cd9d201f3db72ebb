// An EtcdClient talks to an etcd v3 cluster over its gRPC API
// (transfer/etcd.proto): reads of a key or a prefix, transactions that apply
// whole or not at all, leases that mark a host live while it keeps them,
// and watches that report every change after a revision. It is what the
// hosts of a cluster agree through; every call has a deadline, and an error
// names the endpoints and the key.
//
//   ASSIGN_OR_RETURN(auto etcd, EtcdClient::Connect({"http://10.0.0.9:2379"}));
//   EtcdClient::Txn txn;
//   txn.conditions.push_back({.key = "/job/config", .mod_revision = rev});
//   txn.puts.push_back({.key = "/job/config", .value = "tp=2,pp=1,dp=4"});
//   ASSIGN_OR_RETURN(EtcdClient::Committed c, etcd->Commit(txn));
#ifndef SCALAI_TRANSFER_ETCD_CLIENT_H_
#define SCALAI_TRANSFER_ETCD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transfer/cluster_file.h"

namespace grpc {
class Status;
}

namespace scalai {

class EtcdClient {
 public:
  struct KeyValue {
    std::string key;
    std::string value;
    int64_t create_revision = 0;
    int64_t mod_revision = 0;  // the revision of its last change
    int64_t lease = 0;         // 0: none
  };
  // Keys with their values, and the store's revision they were read at.
  struct Snapshot {
    std::vector<KeyValue> kvs;
    int64_t revision = 0;
  };
  // A transaction: when every condition holds, every put and delete
  // applies at one revision; otherwise nothing does.
  struct Condition {
    std::string key;
    // The key's last change was at this revision; 0: the key is absent.
    int64_t mod_revision = 0;
  };
  struct Put {
    std::string key;
    std::string value;
    int64_t lease = 0;
  };
  // No key under `prefix` was put after `revision` (one deleted since
  // does not count): what was read there at `revision` still holds.
  struct Unchanged {
    std::string prefix;
    int64_t revision = 0;
  };
  struct Txn {
    std::vector<Condition> conditions;
    std::vector<Unchanged> unchanged;
    std::vector<Put> puts;
    std::vector<std::string> deletes;          // keys
    std::vector<std::string> delete_prefixes;  // every key under each
  };
  struct Event {
    bool deleted = false;
    KeyValue kv;
  };
  // A running watch; destroying it stops it (and joins its thread).
  class Watch {
   public:
    virtual ~Watch() = default;
    // OK while it runs; the error that ended it (the server went away, the
    // revision was compacted) otherwise.
    virtual absl::Status status() const = 0;
  };

  // `endpoints` as a cluster file lists them ("http://host:port"); every
  // call is made within `deadline`.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(
      const std::vector<std::string>& endpoints,
      const std::optional<ClusterTls>& tls = std::nullopt,
      absl::Duration deadline = absl::Seconds(10));
  ~EtcdClient();

  absl::StatusOr<std::optional<KeyValue>> Get(const std::string& key);
  // The key, if present, and the store's revision it was read at: a watch
  // started from there misses no later change, and that revision is never
  // compacted before the read (the key's own last change may be).
  struct KeyAt {
    std::optional<KeyValue> kv;
    int64_t revision = 0;
  };
  absl::StatusOr<KeyAt> GetAt(const std::string& key);
  // Every key starting with `prefix`, in key order.
  absl::StatusOr<Snapshot> GetPrefix(const std::string& prefix);
  // Every key in [from, end), in key order.
  absl::StatusOr<Snapshot> GetRange(const std::string& from,
                                    const std::string& end);
  // Every key starting with `prefix`, in key order, with its revisions and
  // lease but not its value: which keys changed since a read is learned
  // for the size of their names.
  absl::StatusOr<Snapshot> ListPrefix(const std::string& prefix);
  // The keys named that are present, in the order given, read in one
  // round trip per kMaxTxnOps keys (each batch one transaction, so at one
  // revision; the snapshot's revision is the last batch's): what changed
  // since a ListPrefix is read without the values that did not.
  absl::StatusOr<Snapshot> GetMany(const std::vector<std::string>& keys);
  // etcd's default limit on the operations of one transaction
  // (--max-txn-ops).
  static constexpr size_t kMaxTxnOps = 128;
  // Returns the revision of the change.
  absl::StatusOr<int64_t> PutValue(const std::string& key,
                                   const std::string& value, int64_t lease = 0);
  // Whether the transaction applied (false: a condition did not hold), and
  // the store's revision after it: the revision of its changes if it did.
  struct Committed {
    bool applied = false;
    int64_t revision = 0;
  };
  absl::StatusOr<Committed> Commit(const Txn& txn);
  // Forgets the history of changes before `revision` (etcd's compaction),
  // so that etcd's database stops growing with every change: a watch can
  // no longer start before it. A revision compacted already is no error.
  absl::Status Compact(int64_t revision);

  // A lease that expires `ttl` after its last keep-alive; keys put with it
  // go when it does.
  absl::StatusOr<int64_t> GrantLease(absl::Duration ttl);
  // Renews the lease; NotFound once it has expired.
  absl::Status KeepAlive(int64_t lease);
  absl::Status RevokeLease(int64_t lease);

  // Calls `on_event` (on the watch's own thread) for each change to a key
  // under `prefix` after revision `after`, in revision order.
  absl::StatusOr<std::unique_ptr<Watch>> WatchPrefix(
      const std::string& prefix, int64_t after,
      std::function<void(const Event&)> on_event);

  const std::string& endpoints() const { return endpoints_; }

 private:
  struct Stubs;
  EtcdClient() = default;
  // A failed call as an error naming the endpoints and what was being done.
  absl::Status Failed(const grpc::Status& s, absl::string_view what) const;
  absl::StatusOr<Snapshot> Range(const std::string& from,
                                 const std::string& end, bool keys_only);

  std::string endpoints_;  // as given, for errors
  absl::Duration deadline_;
  std::unique_ptr<Stubs> stubs_;
};

// The end of the range of keys that start with `prefix`, as etcd takes it.
std::string PrefixEnd(const std::string& prefix);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_ETCD_CLIENT_H_
