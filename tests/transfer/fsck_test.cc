// fsck beside the store's writer (CheckStoreBesideWriter): a blob the writer
// retires during the check is no fault, a blob lost from the disk and a
// flipped byte are, and so is a dataset index lost, where one replaced
// meanwhile is not.
#include "transfer/fsck.h"

#include <fstream>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "tests/store_fixture.h"
#include "transfer/dataset_import.h"

namespace scalai {
namespace {

class FsckTest : public StoreFixture {
 protected:
  // Checks beside a writer: the first open is `first` (a catalog read
  // before the writer's change), the later ones see the store as it is.
  absl::StatusOr<CheckBesideWriter> Check(
      absl::StatusOr<std::unique_ptr<Store>> first) {
    opens_ = 0;
    return CheckStoreBesideWriter(
        [&]() -> absl::StatusOr<std::unique_ptr<Store>> {
          if (++opens_ == 1) return std::move(first);
          return Store::Open(store_dir(), Store::Access::kReadOnly);
        },
        {});
  }
  absl::StatusOr<std::unique_ptr<Store>> Reader() {
    return Store::Open(store_dir(), Store::Access::kReadOnly);
  }
  // Registers dataset "web" (ten JSONL lines), again when `replace`.
  void AddWeb(bool replace) {
    const std::string path = (dir_ / "web.jsonl").string();
    std::ofstream out(path);
    for (int i = 0; i < 10; ++i) out << "{\"i\": " << i << "}\n";
    out.close();
    DatasetImportOptions o;
    o.name = "web";
    o.format = "jsonl";
    o.files = {path};
    o.global_batch = 2;
    o.replace = replace;
    auto added = AddDataset(*store_, o);
    ASSERT_TRUE(added.ok()) << added.status();
  }

  int opens_ = 0;
};

bool Names(const std::vector<std::string>& problems, const std::string& what) {
  for (const std::string& p : problems) {
    if (p.find(what) != std::string::npos) return true;
  }
  return false;
}

TEST_F(FsckTest, ABlobRetiredDuringTheCheckIsNoFault) {
  auto before = Reader();
  auto plain = Reader();
  ASSERT_TRUE(before.ok() && plain.ok());
  const std::set<std::string> freed = Reconfigure("tp=1,pp=1,dp=1");
  auto check = Check(std::move(before));
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_TRUE(check->problems.empty()) << check->problems[0];
  EXPECT_EQ(check->retired, freed.size());
  EXPECT_EQ(opens_, 2);  // the second catalog says they were retired
  // Without that second look, the same catalog names them missing.
  auto problems = CheckStore(**plain, {});
  ASSERT_TRUE(problems.ok());
  for (const std::string& name : freed)
    EXPECT_TRUE(Names(*problems, name + " (step 42): missing")) << name;
}

TEST_F(FsckTest, ABlobLostFromTheDiskIsAFault) {
  const std::string lost = store_->Shard(42, 1)->blobs[0];
  fs::remove(store_->BlobPath(lost));
  auto check = Check(Reader());
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_TRUE(Names(check->problems, lost + " (step 42): missing"))
      << testing::PrintToString(check->problems);
  EXPECT_EQ(check->retired, 0u);
  EXPECT_EQ(opens_, 2);
}

TEST_F(FsckTest, AFlippedByteIsAFault) {
  const std::string blob = store_->Shard(42, 0)->blobs[0];
  {
    std::fstream f(store_->BlobPath(blob),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    f.seekp(100);
    c ^= 0x10;
    f.write(&c, 1);
  }
  auto check = Check(Reader());
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_TRUE(Names(check->problems, blob + " (step 42): chunk 0"))
      << testing::PrintToString(check->problems);
  EXPECT_EQ(opens_, 1);  // nothing was gone: no second look
}

TEST_F(FsckTest, ADatasetIndexReplacedMeanwhileIsNoFaultALostOneIs) {
  AddWeb(false);
  auto before = Reader();
  ASSERT_TRUE(before.ok()) << before.status();
  const std::string old_index = (*store_->Datasets())["web"].index;
  AddWeb(true);
  ASSERT_FALSE(fs::exists(store_->dataset_dir() + "/" + old_index));
  auto check = Check(std::move(before));
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_TRUE(check->problems.empty()) << check->problems[0];
  EXPECT_EQ(opens_, 2);

  fs::remove(store_->dataset_dir() + "/" + (*store_->Datasets())["web"].index);
  check = Check(Reader());
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_TRUE(Names(check->problems, "dataset web: its line index"))
      << testing::PrintToString(check->problems);
}

}  // namespace
}  // namespace scalai
