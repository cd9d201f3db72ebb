#include "fs/cluster_join.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <memory>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fs/cluster_member.h"
#include "nlohmann/json.hpp"
#include "ptc/layout.h"
#include "ptc/status_macros.h"
#include "transfer/etcd_client.h"
#include "transfer/etcd_large_value.h"
#include "transfer/files.h"
#include "transfer/importer.h"
#include "transfer/peer_client.h"
#include "transfer/store.h"

namespace scalai {
namespace {

// Bytes asked of a peer per call.
constexpr int64_t kPieceBytes = 16 << 20;
// A job.json larger than this is not one.
constexpr int64_t kMaxJobJson = 64 << 20;

// The whole of `path` from `peer`'s mount, handed to `sink` piece by piece.
absl::Status ReadWhole(
    PeerClient& peer, const std::string& path,
    const std::function<absl::Status(const char*, int64_t)>& sink) {
  std::vector<char> buffer(kPieceBytes);
  for (int64_t offset = 0;; offset += kPieceBytes) {
    ASSIGN_OR_RETURN(int64_t got,
                     peer.ReadFile(path, offset, kPieceBytes, buffer.data()));
    if (got > 0) RETURN_IF_ERROR(sink(buffer.data(), got));
    if (got < kPieceBytes) return absl::OkStatus();
  }
}

absl::Status FillFrom(PeerClient& peer, const Layout& layout,
                      const std::optional<std::string>& model,
                      const std::string& store_dir) {
  std::string job_text;
  RETURN_IF_ERROR(ReadWhole(peer, "job.json",
                            [&](const char* data, int64_t n) -> absl::Status {
                              if (job_text.size() + n > kMaxJobJson) {
                                return absl::DataLossError("job.json too big");
                              }
                              job_text.append(data, n);
                              return absl::OkStatus();
                            }));
  nlohmann::json job = nlohmann::json::parse(job_text, nullptr, false);
  if (job.is_discarded() || !job.is_object() || !job.contains("config") ||
      !job.contains("steps") || !job["steps"].is_array()) {
    return absl::DataLossError(absl::StrCat("peer ", peer.peer().name,
                                            " sent a job.json that is not"));
  }
  if (job["steps"].empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("peer ", peer.peer().name,
                     " holds no step yet: there is nothing to take"));
  }
  ASSIGN_OR_RETURN(ParallelConfig config,
                   ParallelConfig::Parse(job["config"].get<std::string>()));
  const int64_t step = job["steps"].back().get<int64_t>();

  // The shards are written beside the store, imported, and removed.
  std::string pattern = store_dir + ".join-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) {
    return ErrnoError(errno, "create a directory beside", store_dir);
  }
  const std::string staging = pattern;
  absl::Cleanup remove = [&staging] {
    std::error_code ignored;
    std::filesystem::remove_all(staging, ignored);
  };
  for (int rank = 0; rank < config.world_size(); ++rank) {
    if (!config.SavesShard(rank)) continue;
    const std::string rank_dir = absl::StrFormat("rank-%05d", rank);
    const std::string path =
        absl::StrFormat("ckpt/step-%08d/%s/model.safetensors", step, rank_dir);
    if (mkdir((staging + "/" + rank_dir).c_str(), 0700) != 0) {
      return ErrnoError(errno, "create", staging + "/" + rank_dir);
    }
    const std::string file = staging + "/" + rank_dir + "/model.safetensors";
    ASSIGN_OR_RETURN(UniqueFd fd,
                     OpenFile(file, O_WRONLY | O_CREAT | O_EXCL, 0600));
    RETURN_IF_ERROR(ReadWhole(peer, path, [&](const char* data, int64_t n) {
      return WriteAll(fd.get(), data, n, file);
    }));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Store> store,
                   Store::Create(store_dir, layout));
  // Unless the import commits, an empty directory again, for the next try.
  bool filled = false;
  absl::Cleanup empty = [&] {
    if (filled) return;
    store.reset();
    std::error_code ignored;
    for (const auto& e :
         std::filesystem::directory_iterator(store_dir, ignored))
      std::filesystem::remove_all(e.path(), ignored);
  };
  if (model) {
    // The cluster's model, in its order, before the import: the shards are
    // checked against it rather than a model inferred from them.
    Catalog::Batch batch;
    batch.Put(Table::kMeta, "model", *model);
    RETURN_IF_ERROR(store->catalog().Commit(batch));
    store.reset();
    ASSIGN_OR_RETURN(store, Store::Open(store_dir));
  }
  ImportOptions options;
  options.src = staging;
  options.config = config;
  options.step = step;
  RETURN_IF_ERROR(ImportCheckpoint(*store, options).status());
  filled = true;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> StoreIsEmpty(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return ErrnoError(errno, "store", dir);
  if (!S_ISDIR(st.st_mode)) return false;
  ASSIGN_OR_RETURN(std::vector<std::string> entries, ListDir(dir));
  return entries.empty();
}

absl::Status FillStoreFromCluster(const ClusterFile& cluster,
                                  const std::string& host,
                                  const std::string& store_dir) {
  ASSIGN_OR_RETURN(
      std::unique_ptr<EtcdClient> etcd,
      EtcdClient::Connect(cluster.etcd, cluster.tls, absl::Seconds(5)));
  ASSIGN_OR_RETURN(std::optional<EtcdClient::KeyValue> layout_kv,
                   etcd->Get(ClusterMember::Key(cluster.job, "layout")));
  if (!layout_kv) {
    return absl::FailedPreconditionError(absl::StrCat(
        "store ", store_dir, " is empty and job ", cluster.job,
        " has no layout in etcd yet: the first host mounts a store that "
        "holds the job"));
  }
  ASSIGN_OR_RETURN(Layout layout,
                   Layout::FromJson(layout_kv->value, "the cluster's layout"));
  ASSIGN_OR_RETURN(std::optional<std::string> model,
                   GetLarge(*etcd, ClusterMember::Key(cluster.job, "model")));
  ASSIGN_OR_RETURN(
      EtcdClient::Snapshot members,
      etcd->GetPrefix(ClusterMember::Key(cluster.job, "members/")));
  const std::string prefix = ClusterMember::Key(cluster.job, "members/");
  PeerClient::Options calls;
  calls.host = host;
  calls.token = cluster.token;
  calls.tls = cluster.tls;
  calls.deadline = absl::Seconds(120);
  std::string errors;
  // Each live peer in the cluster file's order, until one serves.
  for (const ClusterHost& h : cluster.hosts) {
    bool live = false;
    for (const EtcdClient::KeyValue& kv : members.kvs) {
      live |= kv.key == prefix + h.name;
    }
    if (h.name == host || !live) continue;
    PeerClient peer(h, calls);
    absl::Status filled = FillFrom(peer, layout, model, store_dir);
    if (filled.ok()) return filled;
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", filled.message());
  }
  return absl::UnavailableError(absl::StrCat(
      "store ", store_dir, " is empty and no live host of job ", cluster.job,
      " could fill it", errors.empty() ? " (none is live)" : ": ", errors));
}

}  // namespace scalai
