// The catalog opened for reading while another process writes it, the way
// `scalai inspect` and `scalai plan STORE` open a store a mount serves: the
// reader holds every commit made before its open, however the writer's
// flushes and compactions replace its files meanwhile, writes nothing, and
// still tells a catalog that lost commits. A writer removes the diagnostics
// files that older versions left.
#include "ptc/catalog.h"

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "tests/scratch_dir.h"

namespace scalai {
namespace {

std::set<std::string> Listing(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.insert(e.path().filename());
  return names;
}

// What Catalog::Commit leaves beside the catalog: the newest sequence
// number a commit reached, replaced whole.
void WriteMark(const std::string& catalog, uint64_t sequence) {
  const std::string mark = catalog + ".sequence";
  {
    std::ofstream out(mark + ".tmp");
    out << sequence;
  }
  std::rename((mark + ".tmp").c_str(), mark.c_str());
}

std::string Created(const ScratchDir& dir) {
  const std::string path = dir.path().string() + "/catalog";
  auto created = Catalog::Open(path, Catalog::Mode::kCreate);
  EXPECT_TRUE(created.ok()) << created.status();
  return path;
}

// A writer in the way a mount writes, made to replace its files as often as
// it can: small memtables, a flush every few commits (the log it replaces
// is removed) and a compaction every hundred (the tables it replaces are
// removed). Commit i puts step i; `committed` counts those made durable,
// each followed by the sequence mark.
class BusyWriter {
 public:
  explicit BusyWriter(const std::string& path) {
    rocksdb::DBOptions options;
    std::vector<rocksdb::ColumnFamilyDescriptor> families;
    rocksdb::ColumnFamilyOptions family;
    family.write_buffer_size = 16 << 10;
    for (const char* name :
         {"default", "meta", "steps", "shards", "blobs", "datasets"}) {
      families.emplace_back(name, family);
    }
    rocksdb::Status s =
        rocksdb::DB::Open(options, path, families, &handles_, &db_);
    EXPECT_TRUE(s.ok()) << s.ToString();
    thread_ = std::thread([this, path] { Run(path); });
  }
  ~BusyWriter() {
    stop_ = true;
    thread_.join();
    for (rocksdb::ColumnFamilyHandle* h : handles_)
      db_->DestroyColumnFamilyHandle(h);
    delete db_;
  }
  int64_t committed() const { return committed_.load(); }

 private:
  void Run(const std::string& path) {
    rocksdb::WriteOptions sync;
    sync.sync = true;
    rocksdb::ColumnFamilyHandle* steps = handles_[2];
    for (int64_t i = 0; !stop_; ++i) {
      ASSERT_TRUE(
          db_->Put(sync, steps, StepKey(i), std::string(1000, 's')).ok());
      WriteMark(path, db_->GetLatestSequenceNumber());
      committed_ = i + 1;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (i % 16 == 15) {
        ASSERT_TRUE(db_->Flush(rocksdb::FlushOptions()).ok());
      }
      if (i % 100 == 99) {
        ASSERT_TRUE(db_->CompactRange(rocksdb::CompactRangeOptions(), steps,
                                      nullptr, nullptr)
                        .ok());
      }
    }
  }

  rocksdb::DB* db_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> committed_{0};
  std::thread thread_;
};

TEST(Catalog, ReaderBesideAWriterHoldsEveryCommitMadeBeforeItsOpen) {
  ScratchDir dir("catalog_test");
  const std::string path = Created(dir);
  BusyWriter writer(path);
  while (writer.committed() < 50) std::this_thread::yield();
  for (int open = 0; open < 150; ++open) {
    const int64_t before = writer.committed();
    auto reader = Catalog::Open(path, Catalog::Mode::kReadOnly);
    ASSERT_TRUE(reader.ok()) << "open " << open << ": " << reader.status();
    auto steps = (*reader)->Scan(Table::kSteps);
    ASSERT_TRUE(steps.ok()) << steps.status();
    ASSERT_GE(static_cast<int64_t>(steps->size()), before) << "open " << open;
    // In step order, each step once: no commit seen twice across the
    // writer's moves.
    for (size_t i = 0; i < steps->size(); ++i)
      ASSERT_EQ(StepFromKey((*steps)[i].first), static_cast<int64_t>(i));
  }
}

TEST(Catalog, ReaderWritesNothingAndRefusesCommits) {
  ScratchDir dir("catalog_test");
  const std::string path = Created(dir);
  {
    auto writer = Catalog::Open(path, Catalog::Mode::kReadWrite);
    ASSERT_TRUE(writer.ok()) << writer.status();
    Catalog::Batch batch;
    batch.Put(Table::kMeta, "config", "tp=1,pp=1,dp=1");
    ASSERT_TRUE((*writer)->Commit(batch).ok());
  }
  const std::set<std::string> top = Listing(dir.path());
  const std::set<std::string> inside = Listing(path);
  {
    auto reader = Catalog::Open(path, Catalog::Mode::kReadOnly);
    ASSERT_TRUE(reader.ok()) << reader.status();
    auto config = (*reader)->Get(Table::kMeta, "config");
    ASSERT_TRUE(config.ok() && config->has_value());
    EXPECT_EQ(**config, "tp=1,pp=1,dp=1");
    Catalog::Batch batch;
    batch.Put(Table::kMeta, "config", "tp=2,pp=1,dp=1");
    EXPECT_EQ((*reader)->Commit(batch).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(Listing(dir.path()), top);
  EXPECT_EQ(Listing(path), inside);
}

// Catalogs written before RocksDB's diagnostics were dropped kept a LOG
// file and a LOG.old.* for each earlier open: the next writer removes them,
// a reader leaves them.
TEST(Catalog, AWriterRemovesTheDiagnosticsOfOlderVersions) {
  ScratchDir dir("catalog_test");
  const std::string path = Created(dir);
  const std::set<std::string> own = Listing(path);
  for (const char* name : {"LOG", "LOG.old.1764000000000000"})
    std::ofstream(path + "/" + name) << "rocksdb diagnostics\n";
  const std::set<std::string> with_logs = Listing(path);
  ASSERT_EQ(with_logs.size(), own.size() + 2);
  {
    auto reader = Catalog::Open(path, Catalog::Mode::kReadOnly);
    ASSERT_TRUE(reader.ok()) << reader.status();
  }
  EXPECT_EQ(Listing(path), with_logs);
  {
    auto writer = Catalog::Open(path, Catalog::Mode::kReadWrite);
    ASSERT_TRUE(writer.ok()) << writer.status();
  }
  for (const std::string& name : Listing(path)) {
    EXPECT_FALSE(name == "LOG" || name.starts_with("LOG.old.")) << name;
  }
  EXPECT_TRUE(Listing(path).contains("CURRENT"));
}

TEST(Catalog, LostCommitsAreToldInEitherMode) {
  ScratchDir dir("catalog_test");
  const std::string path = Created(dir);
  WriteMark(path, 1000);  // commits had reached 1000; the catalog holds none
  for (Catalog::Mode mode :
       {Catalog::Mode::kReadOnly, Catalog::Mode::kReadWrite}) {
    auto opened = Catalog::Open(path, mode);
    ASSERT_FALSE(opened.ok());
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(opened.status().message().find("has lost commits"),
              absl::string_view::npos)
        << opened.status();
  }
}

}  // namespace
}  // namespace scalai
