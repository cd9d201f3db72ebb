// The mount's tree model, driven without FUSE: a store made from synthetic
// shards, seen under other configs. Every view's bytes must equal the shards
// that synth cuts directly for that config.
#include "fs/tree.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "ptc/model_spec.h"
#include "ptc/safetensors.h"
#include "tests/store_fixture.h"
#include "tools/synth.h"
#include "transfer/dataset_import.h"
#include "transfer/importer.h"

namespace scalai {
namespace {

using TreeTest = StoreFixture;

TEST_F(TreeTest, ViewsEqualShardsCutDirectlyForTheMountedConfig) {
  for (const char* text :
       {"tp=1,pp=3,dp=2", "tp=4,pp=1,dp=1", "tp=2,pp=2,dp=1,stages=1:2"}) {
    SCOPED_TRACE(text);
    const ParallelConfig config = *ParallelConfig::Parse(text);
    auto tree = Tree::Build(*store_, config);
    ASSERT_TRUE(tree.ok()) << tree.status();
    Placement direct = *Placement::Create(layout_, model_, config);
    for (int rank = 0; rank < config.world_size(); ++rank) {
      const std::string rank_name = absl::StrFormat("rank-%05d", rank);
      const Node* file = Walk(**tree, {"ckpt", "step-00000042",
                                       rank_name.c_str(), "model.safetensors"});
      ASSERT_NE(file, nullptr) << rank_name;
      // Odd-sized chunks cross header and tensor boundaries.
      std::string got = ReadNode(**tree, *file, 4093);
      std::string want_path = (dir_ / "want.safetensors").string();
      ASSERT_TRUE(WriteSynthShard(direct, rank, 3, want_path).ok());
      std::string want = ReadAll(want_path);
      auto got_header =
          SafetensorsHeader::Parse(got, static_cast<int64_t>(got.size()));
      auto want_header =
          SafetensorsHeader::Parse(want, static_cast<int64_t>(want.size()));
      ASSERT_TRUE(got_header.ok()) << got_header.status();
      ASSERT_EQ(got_header->tensors(), want_header->tensors());
      EXPECT_EQ(got_header->metadata().at("scalai.step"), "42");
      EXPECT_EQ(got.substr(got_header->data_start()),
                want.substr(want_header->data_start()));
      // Each tensors/NAME file holds the same bytes as its slot in the model
      // file.
      for (const SafetensorsEntry& e : got_header->tensors()) {
        const Node* t =
            Walk(**tree, {"ckpt", "step-00000042", rank_name.c_str(), "tensors",
                          e.name.c_str()});
        ASSERT_NE(t, nullptr) << e.name;
        EXPECT_EQ(ReadNode(**tree, *t, 1 << 20),
                  got.substr(got_header->data_start() + e.data_begin,
                             e.data_end - e.data_begin));
      }
    }
  }
}

// A read at any offset and of any length returns those bytes of the whole
// file: of the stored config (every byte from one blob), of a config whose
// shards are runs of the stored ones, and of one that cuts rows.
TEST_F(TreeTest, ReadsAtAnyOffsetReturnThoseBytesOfTheWholeFile) {
  std::mt19937_64 rng(7);
  for (const char* text :
       {"tp=2,pp=1,dp=1", "tp=1,pp=3,dp=1", "tp=4,pp=1,dp=1"}) {
    SCOPED_TRACE(text);
    const ParallelConfig config = *ParallelConfig::Parse(text);
    auto tree = Tree::Build(*store_, config);
    ASSERT_TRUE(tree.ok()) << tree.status();
    for (int rank = 0; rank < config.world_size(); ++rank) {
      const std::string rank_name = absl::StrFormat("rank-%05d", rank);
      std::vector<const Node*> files = {Walk(
          **tree,
          {"ckpt", "step-00000042", rank_name.c_str(), "model.safetensors"})};
      const Node* tensors =
          Walk(**tree, {"ckpt", "step-00000042", rank_name.c_str(), "tensors"});
      ASSERT_NE(tensors, nullptr);
      const std::string first = (*tree)->EntryAt(*tensors, 0).name;
      files.push_back(Walk(**tree, {"ckpt", "step-00000042", rank_name.c_str(),
                                    "tensors", first.c_str()}));
      for (const Node* file : files) {
        ASSERT_NE(file, nullptr);
        const std::string whole = ReadNode(**tree, *file, 1 << 20);
        ASSERT_EQ(static_cast<int64_t>(whole.size()), file->size);
        for (int i = 0; i < 40; ++i) {
          const int64_t offset = static_cast<int64_t>(rng() % file->size);
          const int64_t length = 1 + static_cast<int64_t>(rng() % 20000);
          std::string got(length, '\0');
          auto n = (*tree)->Read(*file, offset, length, got.data());
          ASSERT_TRUE(n.ok()) << n.status();
          got.resize(*n);
          ASSERT_EQ(got, whole.substr(offset, length))
              << offset << "+" << length;
        }
      }
    }
  }
}

TEST_F(TreeTest, TreeHasTheSpecNamesSortedAndRefusesUnknownOnes) {
  auto tree = *Tree::Build(*store_, *ParallelConfig::Parse("tp=2,pp=1,dp=2"));
  const Node* root = tree->Get(kRootIno);
  std::vector<std::string> names;
  for (uint64_t c : root->children) names.push_back(tree->Get(c)->name);
  EXPECT_EQ(names, (std::vector<std::string>{"ckpt", "config", "data",
                                             "job.json", "status"}));
  const Node* latest = Walk(*tree, {"ckpt", "latest"});
  ASSERT_NE(latest, nullptr);
  EXPECT_EQ(latest->kind, NodeKind::kSymlink);
  EXPECT_EQ(latest->text, "step-00000042");
  EXPECT_EQ(Walk(*tree, {"ckpt", "step-00000042", "rank-00004"}), nullptr);
  EXPECT_NE(Walk(*tree, {"ckpt", "step-00000042", "rank-00003", "rank.json"}),
            nullptr);
  const Node* config = Walk(*tree, {"config"});
  EXPECT_EQ(ReadNode(*tree, *config, 100), "tp=2,pp=1,dp=2\n");
  char buf[8];
  EXPECT_EQ(*tree->Read(*config, config->size, 8, buf),
            0);  // at the end: nothing
}

TEST_F(TreeTest, LookupsAreCountedAndForgotten) {
  auto tree =
      *Tree::Build(*store_, *ParallelConfig::Parse("tp=1,pp=1,dp=1"), 7);
  EXPECT_EQ(tree->generation(), 7u);
  const Node* ckpt = Walk(*tree, {"ckpt"});
  tree->CountLookup(ckpt->ino);
  tree->CountLookup(ckpt->ino);
  tree->CountLookup(kRootIno);
  EXPECT_EQ(tree->lookups(ckpt->ino), 2u);
  EXPECT_EQ(tree->total_lookups(), 3u);
  tree->Forget(ckpt->ino, 2);
  tree->Forget(kRootIno, 5);  // more than given: clamped
  EXPECT_EQ(tree->lookups(ckpt->ino), 0u);
  EXPECT_EQ(tree->total_lookups(), 0u);
  tree->Forget(999999, 1);  // an unknown inode is ignored
  EXPECT_TRUE(Walk(*tree, {"status"})->live);
  EXPECT_EQ(Walk(*tree, {"config"})->mode, 0644u);
  // Inodes carry their generation: another tree's inode is not found here.
  EXPECT_EQ(Tree::GenerationOf(Walk(*tree, {"ckpt"})->ino), 7u);
  EXPECT_EQ(tree->Get((uint64_t{8} << Tree::kIndexBits) | 2), nullptr);
}

TEST_F(TreeTest, RebuiltTreeKeepsInodesAndSharesTheKernelsReferences) {
  auto tree =
      *Tree::Build(*store_, *ParallelConfig::Parse("tp=1,pp=1,dp=1"), 4);
  const Node* file = Walk(*tree, {"ckpt", "latest"});
  tree->CountLookup(file->ino);
  auto again = Tree::Rebuild(*store_, *tree);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->generation(), 4u);
  const Node* same = Walk(**again, {"ckpt", "latest"});
  EXPECT_EQ(same->ino, file->ino);
  EXPECT_EQ((*again)->lookups(same->ino), 1u);
  (*again)->Forget(same->ino, 1);
  EXPECT_EQ(tree->total_lookups(), 0u);
  // Only nodes the kernel holds and nobody has open may be reported deleted.
  tree->CountLookup(file->ino);
  EXPECT_EQ(tree->UnopenedReferencesDeepestFirst().size(), 1u);
  (*again)->CountOpen(file->ino, +1);
  EXPECT_TRUE(tree->UnopenedReferencesDeepestFirst().empty());
  (*again)->CountOpen(file->ino, -1);
  EXPECT_EQ(tree->UnopenedReferencesDeepestFirst().size(), 1u);
}

// samples/K nodes are made on lookup and live exactly as long as the kernel
// holds them or a handle has them open; their inode numbers are distinct
// across ranks, and the kernel's references survive a rebuild.
TEST_F(TreeTest, SampleNodesLiveWhileTheKernelHoldsThem) {
  {
    std::ofstream out(dir_ / "lines.jsonl");
    for (int i = 0; i < 30; ++i) out << "{\"i\": " << i << "}\n";
  }
  // A store without steps: the views start at position 0.
  auto store = Store::Create((dir_ / "data-store").string(), layout_);
  ASSERT_TRUE(store.ok()) << store.status();
  DatasetImportOptions o;
  o.name = "web";
  o.format = "jsonl";
  o.files = {(dir_ / "lines.jsonl").string()};
  o.global_batch = 7;  // 4 batches, 2 samples dropped
  ASSERT_TRUE(AddDataset(**store, o).ok());
  auto tree = *Tree::Build(**store, *ParallelConfig::Parse("tp=1,pp=1,dp=2"));
  const Node* dir0 = Walk(*tree, {"data", "web", "rank-00000", "samples"});
  const Node* dir1 = Walk(*tree, {"data", "web", "rank-00001", "samples"});
  ASSERT_NE(dir0, nullptr);
  EXPECT_EQ(tree->EntryCount(*dir0), 16);  // 4 of every 7
  EXPECT_EQ(tree->EntryCount(*dir1), 12);
  std::set<uint64_t> inos;
  for (const Node* dir : {dir0, dir1}) {
    for (int64_t k = 0; k < tree->EntryCount(*dir); ++k) {
      inos.insert(tree->EntryAt(*dir, k).ino);
      EXPECT_EQ(tree->EntryAt(*dir, k).node, nullptr);  // listing makes none
    }
  }
  EXPECT_EQ(inos.size(), 28u);
  EXPECT_EQ(*tree->Lookup(dir1->ino, "12"), nullptr);  // past the end
  EXPECT_EQ(*tree->Lookup(dir1->ino, "01"), nullptr);  // one name per file
  EXPECT_EQ(*tree->Lookup(dir1->ino, "-1"), nullptr);

  const Node* a = *tree->Enter(dir1->ino, "5");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->ino, tree->EntryAt(*dir1, 5).ino);
  EXPECT_EQ(*tree->Enter(dir1->ino, "5"), a);
  EXPECT_EQ(tree->lookups(a->ino), 2u);
  EXPECT_EQ(tree->total_lookups(), 2u);
  // Its bytes are the line of its sample id, without the newline.
  std::string ids(8 * 12, '\0');
  const Node* id_file =
      Walk(*tree, {"data", "web", "rank-00001", "sample-ids.u64"});
  ASSERT_EQ(*tree->Read(*id_file, 0, 8 * 12, ids.data()), 8 * 12);
  uint64_t id5;
  std::memcpy(&id5, ids.data() + 8 * 5, 8);
  EXPECT_EQ(ReadNode(*tree, *a, 3), absl::StrFormat("{\"i\": %d}", id5));
  EXPECT_EQ(tree->UnopenedReferencesDeepestFirst().size(), 1u);

  // Rebuilt (as after a materialization): the same node, the same counts.
  auto again = *Tree::Rebuild(**store, *tree);
  EXPECT_EQ(again->Get(a->ino), a);
  again->CountOpen(a->ino, +1);
  again->Forget(a->ino, 2);
  EXPECT_EQ(tree->total_lookups(), 0u);
  EXPECT_EQ(tree->Get(a->ino), a);  // open: kept
  EXPECT_TRUE(tree->UnopenedReferencesDeepestFirst().empty());
  const uint64_t a_ino = a->ino;  // `a` itself goes with the next line
  again->CountOpen(a_ino, -1);
  EXPECT_EQ(tree->Get(a_ino), nullptr);  // forgotten and closed: gone
}

}  // namespace
}  // namespace scalai
