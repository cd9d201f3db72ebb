// The Catalog is a job store's index in RocksDB: one column family per kind of
// record, every logical change one atomic, synced WriteBatch. Values are JSON
// documents; keys are encoded by the functions below, and only there.
//
//   ASSIGN_OR_RETURN(auto catalog, Catalog::Open(path, Mode::kCreate));
//   Catalog::Batch batch;
//   batch.Put(Table::kSteps, StepKey(100), record.dump());
//   RETURN_IF_ERROR(catalog->Commit(batch));
#ifndef SCALAI_PTC_CATALOG_H_
#define SCALAI_PTC_CATALOG_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
class WriteBatch;
}  // namespace rocksdb

namespace scalai {

enum class Table {
  kMeta,      // "layout", "model", "config": the job's description
  kSteps,     // StepKey(step) -> the step's config and size
  kShards,    // ShardKey(step, group) -> where a shard group's tensors lie
  kBlobs,     // blob name -> size and checksum
  kDatasets,  // dataset name -> registration
};

// Big-endian, so that RocksDB's byte order is step order.
std::string StepKey(int64_t step);
std::string ShardKey(int64_t step, int group);
int64_t StepFromKey(absl::string_view key);

class Catalog {
 public:
  class Batch {
   public:
    Batch();
    ~Batch();
    void Put(Table table, absl::string_view key, absl::string_view value);
    void Delete(Table table, absl::string_view key);

   private:
    friend class Catalog;
    struct Op {
      Table table;
      std::string key;
      std::optional<std::string> value;  // nullopt: delete
    };
    std::vector<Op> ops_;
  };

  enum class Mode { kReadWrite, kCreate, kReadOnly };
  // Opens the catalog at `path`. kReadOnly reads it as it stood at the open,
  // safe while another process writes it, writes nothing (skipping the new
  // manifest and the syncs that a writable open costs, a tenth of a second)
  // and refuses Commit.
  static absl::StatusOr<std::unique_ptr<Catalog>> Open(const std::string& path,
                                                       Mode mode);
  ~Catalog();
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  absl::StatusOr<std::optional<std::string>> Get(Table table,
                                                 absl::string_view key) const;
  // Every record of `table` whose key starts with `prefix`, in key order.
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> Scan(
      Table table, absl::string_view prefix = "") const;

  // Applies the batch atomically and durably (WAL synced), or not at all.
  absl::Status Commit(const Batch& batch);

  // Commits wait while the returned lock is held, so that records read
  // under it (a step's and its shards') belong to one moment. Every writer
  // of a catalog is in the process that opened it (the store's lock).
  [[nodiscard]] std::shared_lock<std::shared_mutex> HoldCommits() const {
    return std::shared_lock<std::shared_mutex>(commits_);
  }

 private:
  Catalog() = default;
  // `path`.sequence holds the newest sequence number a commit reached, so
  // that an open can tell a catalog that lost commits (damage RocksDB took
  // for a log cut short by a crash) from one that never had them.
  std::string SequenceMarkPath() const { return path_ + ".sequence"; }
  void MarkSequence() const;
  std::optional<uint64_t> ReadSequenceMark() const;
  // Whether the catalog opened holds the commits that the mark, read before
  // the open, counted.
  absl::Status CheckSequence(std::optional<uint64_t> reached) const;

  std::string path_;
  rocksdb::DB* db_ = nullptr;
  bool read_only_ = false;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // indexed by Table
  mutable std::shared_mutex commits_;                  // see HoldCommits
};

}  // namespace scalai

#endif  // SCALAI_PTC_CATALOG_H_
