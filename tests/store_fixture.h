// A store made from synthetic shards of a small GPT (tp=2 at step 42, or a
// model, config and step of the test's own), for the tests of the mount's
// FUSE-free model, of peers and of the store's readers and writers, and the
// helpers they share to walk a tree and read its files.
#ifndef SCALAI_TESTS_STORE_FIXTURE_H_
#define SCALAI_TESTS_STORE_FIXTURE_H_

#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_format.h"
#include "fs/tree.h"
#include "gtest/gtest.h"
#include "ptc/model_spec.h"
#include "ptc/safetensors.h"
#include "tests/scratch_dir.h"
#include "tools/synth.h"
#include "transfer/importer.h"
#include "transfer/materializer.h"

namespace scalai {

namespace fs = std::filesystem;

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class StoreFixture : public ::testing::Test {
 protected:
  // The config the fixture's step 42 is imported under.
  static ParallelConfig saved_config() {
    return *ParallelConfig::Parse("tp=2,pp=1,dp=1");
  }

  void SetUp() override {
    MakeStore(
        "layers=3,hidden=32,heads=4,groups=4,vocab=50,gated_linear_unit=1",
        saved_config(), 42);
  }
  void TearDown() override { store_.reset(); }

  // Writes synthetic shards (seed 3) of the megatron-core-gpt model `spec`
  // in f32, saved under `saved`, into dir_/src, imports them into the new
  // store dir_/store as step `step`, and opens it again as a mount does.
  void MakeStore(const char* spec, const ParallelConfig& saved, int64_t step) {
    fs::create_directories(dir_ / "src");
    layout_ = *Layout::Load("megatron-core-gpt");
    spec_ = *ModelSpec::Parse(spec);
    ASSERT_TRUE(spec_.ApplyParams(layout_).ok());
    model_ = std::make_shared<const Model>(*spec_.Build(layout_, DType::kF32));
    Placement p = *Placement::Create(layout_, model_, saved);
    for (int g = 0; g < saved.num_shard_groups(); ++g) {
      const int rank = saved.SaverOfGroup(g);
      fs::path rank_dir = dir_ / "src" / absl::StrFormat("rank-%05d", rank);
      fs::create_directories(rank_dir);
      ASSERT_TRUE(
          WriteSynthShard(p, rank, 3, (rank_dir / "model.safetensors").string())
              .ok());
    }
    auto store = Store::Create((dir_ / "store").string(), layout_);
    ASSERT_TRUE(store.ok()) << store.status();
    ImportOptions o;
    o.src = (dir_ / "src").string();
    o.config = saved;
    o.step = step;
    auto imported = ImportCheckpoint(**store, o);
    ASSERT_TRUE(imported.ok()) << imported.status();
    store->reset();
    store_ = *Store::Open((dir_ / "store").string());
  }

  const Node* Walk(const Tree& tree, std::initializer_list<const char*> path) {
    uint64_t ino = kRootIno;
    const Node* n = tree.Get(ino);
    for (const char* name : path) {
      auto found = tree.Lookup(ino, name);
      if (!found.ok() || *found == nullptr) return nullptr;
      n = *found;
      ino = n->ino;
    }
    return n;
  }

  std::string ReadNode(const Tree& tree, const Node& n, int64_t chunk) {
    std::string out(n.size, '\0');
    for (int64_t at = 0; at < n.size; at += chunk) {
      auto got = tree.Read(n, at, chunk, out.data() + at);
      EXPECT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, std::min(chunk, n.size - at));
    }
    return out;
  }

  std::string store_dir() const { return (dir_ / "store").string(); }

  // The step stored anew under `config` and committed, as a mount does when
  // its config is rewritten; returns the blobs that retired (removed).
  std::set<std::string> Reconfigure(const char* config) {
    auto m =
        Materialization::Write(*store_, *ParallelConfig::Parse(config), {});
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return {};
    EXPECT_TRUE(m->Commit(*store_).ok());
    const std::set<std::string> freed(m->blobs_freed().begin(),
                                      m->blobs_freed().end());
    EXPECT_FALSE(freed.empty());
    for (const std::string& name : freed)
      EXPECT_FALSE(fs::exists(store_->BlobPath(name))) << name;
    return freed;
  }

  // Rank `rank`'s model.safetensors under `config`, as synth cuts it
  // directly from the full tensors: the independent reference.
  std::string DirectShardFile(const ParallelConfig& config, int rank) {
    Placement direct = *Placement::Create(layout_, model_, config);
    const std::string path = (dir_ / "want.safetensors").string();
    EXPECT_TRUE(WriteSynthShard(direct, rank, 3, path).ok());
    return ReadAll(path);
  }

  ScratchDir scratch_{"store-fixture"};  // first: it outlives the store
  const fs::path dir_ = scratch_.path();
  Layout layout_;
  ModelSpec spec_;
  std::shared_ptr<const Model> model_;
  std::unique_ptr<Store> store_;
};

}  // namespace scalai

#endif  // SCALAI_TESTS_STORE_FIXTURE_H_
