#include "ptc/catalog.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace scalai {
namespace {

// Column family names, in Table order. "default" holds nothing; RocksDB
// requires it.
const char* const kTableNames[] = {"meta", "steps", "shards", "blobs",
                                   "datasets"};
constexpr int kNumTables = 5;

// The one translator from RocksDB's status to ours.
absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  std::string message = absl::StrCat("catalog ", what, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(message);
  if (s.IsCorruption()) return absl::DataLossError(message);
  if (s.IsIOError()) return absl::UnavailableError(message);
  if (s.IsInvalidArgument()) return absl::InvalidArgumentError(message);
  return absl::InternalError(message);
}

void PutBigEndian(std::string& out, uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i)
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetBigEndian(absl::string_view in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes && i < static_cast<int>(in.size()); ++i) {
    v = (v << 8) | static_cast<uint8_t>(in[i]);
  }
  return v;
}

}  // namespace

std::string StepKey(int64_t step) {
  std::string key;
  PutBigEndian(key, static_cast<uint64_t>(step), 8);
  return key;
}

std::string ShardKey(int64_t step, int group) {
  std::string key = StepKey(step);
  PutBigEndian(key, static_cast<uint32_t>(group), 4);
  return key;
}

namespace {

// RocksDB's diagnostics, dropped. Its own log file's writer aborts the
// process (an assertion in Debian's build) at the first line written after
// a write to it failed, which a full disk does to every write, where the
// catalog's own writes return the error for the command to name.
class SilentLogger : public rocksdb::Logger {
 public:
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

// The names of the catalog's files, to tell whether its writer replaced
// any during a reader's open.
std::set<std::string> FileNames(const std::string& path) {
  std::set<std::string> names;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(path, error))
    names.insert(entry.path().filename());
  return names;
}

// RocksDB's diagnostics files (LOG, LOG.old.*) that catalogs written before
// SilentLogger kept, a new one each open, never read by anyone.
void RemoveInfoLogs(const std::string& path) {
  for (const std::string& name : FileNames(path)) {
    if (name == "LOG" || name.starts_with("LOG.old."))
      unlink((path + "/" + name).c_str());
  }
}

// A reader's open of a catalog that another process may be writing (a
// mount serving the store): a RocksDB secondary instance, caught up with
// the writer once. Every table file is opened at once (max_open_files -1),
// so that none the writer compacts away later is missed. An open can
// still race with the writer's flush: it reads the manifest, the writer
// moves a log's records into a new table, records that in the manifest and
// removes the log, and the open finds neither, while it does find the
// commits after them, in the next log (a gap the catalog_test shows). A
// flush always starts a new log, so an open during which no file was added
// or removed saw none, and is kept, failed or not (a failure then is the
// catalog's own); any other is tried again.
rocksdb::Status OpenBesideWriter(
    rocksdb::Options options, const std::string& path,
    const std::vector<rocksdb::ColumnFamilyDescriptor>& families,
    std::vector<rocksdb::ColumnFamilyHandle*>& handles, rocksdb::DB*& db) {
  options.max_open_files = -1;
  auto close = [&] {
    for (rocksdb::ColumnFamilyHandle* h : handles)
      db->DestroyColumnFamilyHandle(h);
    handles.clear();
    delete db;
    db = nullptr;
  };
  constexpr int kTries = 20;
  for (int tries = 0; tries < kTries; ++tries) {
    if (tries > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10 * tries));
    }
    const std::set<std::string> before = FileNames(path);
    // The secondary's own directory would hold its info log; with the
    // logger given, nothing is written there or anywhere.
    rocksdb::Status s = rocksdb::DB::OpenAsSecondary(
        options, path, path + ".reader", families, &handles, &db);
    if (s.ok()) s = db->TryCatchUpWithPrimary();
    const bool undisturbed = FileNames(path) == before;
    if (s.ok() && undisturbed) return s;
    close();
    if (undisturbed) return s;
  }
  return rocksdb::Status::Busy(
      absl::StrCat("its writer replaced its files during each of ", kTries,
                   " tries to read it"));
}

}  // namespace

int64_t StepFromKey(absl::string_view key) {
  return static_cast<int64_t>(GetBigEndian(key, 8));
}

Catalog::Batch::Batch() = default;
Catalog::Batch::~Batch() = default;

void Catalog::Batch::Put(Table table, absl::string_view key,
                         absl::string_view value) {
  ops_.push_back({table, std::string(key), std::string(value)});
}

void Catalog::Batch::Delete(Table table, absl::string_view key) {
  ops_.push_back({table, std::string(key), std::nullopt});
}

absl::StatusOr<std::unique_ptr<Catalog>> Catalog::Open(const std::string& path,
                                                       Mode mode) {
  const bool create = mode == Mode::kCreate;
  rocksdb::Options options;
  options.create_if_missing = create;
  options.create_missing_column_families = create;
  options.paranoid_checks = true;
  // Commits are synced, so only a record cut short by a crash may be
  // dropped from the log's end; any other damage fails the open rather
  // than silently losing the records after it (the default recovery stops
  // at the first bad record and opens what came before).
  options.wal_recovery_mode =
      rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
  // The catalog is small: keep RocksDB's footprint small too.
  options.max_open_files = 64;
  options.info_log = std::make_shared<SilentLogger>();
  std::vector<rocksdb::ColumnFamilyDescriptor> families;
  families.emplace_back(rocksdb::kDefaultColumnFamilyName,
                        rocksdb::ColumnFamilyOptions());
  for (const char* name : kTableNames) {
    families.emplace_back(name, rocksdb::ColumnFamilyOptions());
  }
  std::unique_ptr<Catalog> catalog(new Catalog());
  catalog->path_ = path;
  // Read before the open: a commit the mark counts is in the log by then.
  const std::optional<uint64_t> reached = catalog->ReadSequenceMark();
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::Status s;
  if (mode == Mode::kReadOnly) {
    s = OpenBesideWriter(options, path, families, handles, catalog->db_);
  } else {
    s = rocksdb::DB::Open(options, path, families, &handles, &catalog->db_);
  }
  catalog->read_only_ = mode == Mode::kReadOnly;
  if (s.IsCorruption()) {
    return absl::DataLossError(
        absl::StrCat("the catalog at ", path, " is damaged (", s.ToString(),
                     "): nothing was changed; restore it from a backup"));
  }
  if (!s.ok()) return FromRocks(s, absl::StrCat("open ", path));
  catalog->handles_ = std::move(handles);
  if (mode != Mode::kCreate) RETURN_IF_ERROR(catalog->CheckSequence(reached));
  if (mode == Mode::kReadWrite) RemoveInfoLogs(path);
  return catalog;
}

void Catalog::MarkSequence() const {
  // Written whole and renamed over the old mark, not synced: a mark lost
  // to a power cut is an older number, which only checks less.
  const std::string mark = SequenceMarkPath();
  const std::string tmp = mark + ".tmp";
  const std::string text = std::to_string(db_->GetLatestSequenceNumber());
  const int fd =
      open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  const bool written =
      write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  if (!written || rename(tmp.c_str(), mark.c_str()) != 0) unlink(tmp.c_str());
}

std::optional<uint64_t> Catalog::ReadSequenceMark() const {
  std::ifstream in(SequenceMarkPath());
  uint64_t reached = 0;
  if (!(in >> reached)) return std::nullopt;  // none yet (older stores)
  return reached;
}

absl::Status Catalog::CheckSequence(std::optional<uint64_t> reached) const {
  if (!reached) return absl::OkStatus();
  const uint64_t latest = db_->GetLatestSequenceNumber();
  if (latest >= *reached) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "the catalog at ", path_, " has lost commits (it ends at sequence ",
      latest, ", commits had reached ", *reached,
      "): nothing was changed; restore it from a backup"));
}

Catalog::~Catalog() {
  if (db_ == nullptr) return;
  // Column family handles go before the DB.
  for (rocksdb::ColumnFamilyHandle* h : handles_)
    db_->DestroyColumnFamilyHandle(h);
  delete db_;
}

absl::StatusOr<std::optional<std::string>> Catalog::Get(
    Table table, absl::string_view key) const {
  std::string value;
  rocksdb::Status s =
      db_->Get(rocksdb::ReadOptions(), handles_[static_cast<int>(table) + 1],
               rocksdb::Slice(key.data(), key.size()), &value);
  if (s.IsNotFound()) return std::nullopt;
  if (!s.ok()) return FromRocks(s, "read");
  return value;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> Catalog::Scan(
    Table table, absl::string_view prefix) const {
  std::vector<std::pair<std::string, std::string>> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(
      rocksdb::ReadOptions(), handles_[static_cast<int>(table) + 1]));
  for (it->Seek(rocksdb::Slice(prefix.data(), prefix.size())); it->Valid();
       it->Next()) {
    absl::string_view key(it->key().data(), it->key().size());
    if (key.substr(0, prefix.size()) != prefix) break;
    out.emplace_back(std::string(key), it->value().ToString());
  }
  if (!it->status().ok()) return FromRocks(it->status(), "scan");
  return out;
}

absl::Status Catalog::Commit(const Batch& batch) {
  if (read_only_)
    return absl::FailedPreconditionError("catalog opened read-only");
  rocksdb::WriteBatch wb;
  for (const Batch::Op& op : batch.ops_) {
    rocksdb::ColumnFamilyHandle* h = handles_[static_cast<int>(op.table) + 1];
    if (op.value) {
      wb.Put(h, op.key, *op.value);
    } else {
      wb.Delete(h, op.key);
    }
  }
  rocksdb::WriteOptions options;
  options.sync = true;
  std::unique_lock<std::shared_mutex> lock(commits_);
  RETURN_IF_ERROR(FromRocks(db_->Write(options, &wb), "commit"));
  MarkSequence();
  return absl::OkStatus();
}

static_assert(sizeof(kTableNames) / sizeof(kTableNames[0]) == kNumTables);

}  // namespace scalai
