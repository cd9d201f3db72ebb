#include "ptc/placement.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ptc/model_spec.h"

namespace scalai {
namespace {

using ::testing::HasSubstr;

struct Fixture {
  Layout layout;
  std::shared_ptr<const Model> model;
};

Fixture Make(const std::string& layout_name, const std::string& spec_text) {
  Fixture f{*Layout::Load(layout_name), nullptr};
  auto spec = ModelSpec::Parse(spec_text);
  EXPECT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->ApplyParams(f.layout).ok());
  f.model = std::make_shared<const Model>(*spec->Build(f.layout, DType::kBF16));
  return f;
}

absl::Status PlaceStatus(const Fixture& f, const std::string& config) {
  auto c = ParallelConfig::Parse(config);
  if (!c.ok()) return c.status();
  return Placement::Create(f.layout, f.model, *c).status();
}

const TensorShard* FindLocal(const Placement& p, int group,
                             const std::string& name) {
  for (const TensorShard& s : p.shards(group)) {
    if (s.local_name == name) return &s;
  }
  return nullptr;
}

TEST(Placement, VocabRowsArePaddedForTp) {
  Fixture f =
      Make("megatron-core-gpt", "layers=2,hidden=64,heads=4,vocab=1000");
  auto p = Placement::Create(f.layout, f.model,
                             *ParallelConfig::Parse("tp=4,pp=1,dp=1"));
  ASSERT_TRUE(p.ok()) << p.status();
  // 1000 rows padded to a multiple of 128*4 = 512: 1024, 256 rows a rank.
  const TensorShard* last =
      FindLocal(*p, 3, "embedding.word_embeddings.weight");
  ASSERT_NE(last, nullptr);
  EXPECT_EQ(last->local_shape, (Shape{256, 64}));
  ASSERT_EQ(last->pieces.size(), 2u);
  EXPECT_EQ(last->pieces[0].global, Box({768, 0}, {232, 64}));
  EXPECT_TRUE(last->pieces[1].zero_fill);
  EXPECT_EQ(last->pieces[1].local, Box({232, 0}, {24, 64}));
}

TEST(Placement, SwiGluBlocksAreSplitSeparately) {
  Fixture f =
      Make("megatron-core-gpt",
           "layers=1,hidden=8,heads=2,ffn=12,vocab=16,gated_linear_unit=1");
  auto p = *Placement::Create(f.layout, f.model,
                              *ParallelConfig::Parse("tp=2,pp=1,dp=1"));
  const TensorShard* fc1 =
      FindLocal(p, 1, "decoder.layers.0.mlp.linear_fc1.weight");
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(fc1->local_shape, (Shape{12, 8}));
  ASSERT_EQ(fc1->pieces.size(), 2u);
  EXPECT_EQ(fc1->pieces[0].global, Box({6, 0}, {6, 8}));   // gate rows 6..11
  EXPECT_EQ(fc1->pieces[1].global, Box({18, 0}, {6, 8}));  // up rows 18..23
  EXPECT_EQ(fc1->pieces[1].local, Box({6, 0}, {6, 8}));
}

TEST(Placement, StagesGetLocalLayerNumbersAndEndTensors) {
  Fixture f = Make("megatron-core-gpt", "layers=5,hidden=8,heads=2,vocab=16");
  auto p = *Placement::Create(f.layout, f.model,
                              *ParallelConfig::Parse("tp=1,pp=2,dp=3"));
  EXPECT_EQ(p.layers_per_stage(), (std::vector<int64_t>{3, 2}));
  EXPECT_NE(FindLocal(p, 0, "embedding.word_embeddings.weight"), nullptr);
  EXPECT_EQ(FindLocal(p, 1, "embedding.word_embeddings.weight"), nullptr);
  EXPECT_NE(FindLocal(p, 1, "output_layer.weight"), nullptr);
  EXPECT_NE(FindLocal(p, 1, "decoder.final_layernorm.weight"), nullptr);
  const TensorShard* l3 =
      FindLocal(p, 1, "decoder.layers.0.mlp.linear_fc2.weight");
  ASSERT_NE(l3, nullptr);
  EXPECT_EQ(f.model->tensor(l3->tensor).name,
            "decoder.layers.3.mlp.linear_fc2.weight");
  EXPECT_EQ(FindLocal(p, 1, "decoder.layers.2.mlp.linear_fc2.weight"), nullptr);
}

TEST(Placement, TiedEmbeddingsSitOnFirstAndLastStage) {
  auto layout = *Layout::FromJson(R"({"name": "tied",
      "layer": {"pattern": "layers\\.(\\d+)\\."},
      "params": {"make_vocab_size_divisible_by": 1},
      "rules": [{"match": "embed$", "split": 0, "vocab": true, "stage": "first_and_last"},
                {"match": "."}]})");
  Model model;
  ASSERT_TRUE(model.Add({"embed", DType::kF32, {10, 4}}).ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        model.Add({"layers." + std::to_string(i) + ".w", DType::kF32, {4}})
            .ok());
  }
  auto p = *Placement::Create(layout, std::make_shared<const Model>(model),
                              *ParallelConfig::Parse("tp=1,pp=3,dp=1"));
  EXPECT_NE(FindLocal(p, 0, "embed"), nullptr);
  EXPECT_EQ(FindLocal(p, 1, "embed"), nullptr);
  EXPECT_NE(FindLocal(p, 2, "embed"), nullptr);
}

struct Refusal {
  const char* layout;
  const char* model;
  const char* config;
  const char* message;
};

class PlacementRefuses : public ::testing::TestWithParam<Refusal> {};

TEST_P(PlacementRefuses, NamingTheTensorOrValue) {
  Fixture f = Make(GetParam().layout, GetParam().model);
  absl::Status s = PlaceStatus(f, GetParam().config);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PlacementRefuses,
    ::testing::Values(
        Refusal{"megatron-core-gpt", "layers=2,hidden=96,heads=4,vocab=100",
                "tp=5,pp=1,dp=1",
                "tensor decoder.layers.0.self_attention.linear_qkv.weight "
                "[288, 96]: 4 query groups cannot be split across tp=5"},
        Refusal{"megatron-core-gpt",
                "layers=2,hidden=12,heads=4,ffn=6,vocab=100,"
                "gated_linear_unit=1",
                "tp=4,pp=1,dp=1",
                "tensor decoder.layers.0.mlp.linear_fc1.weight [12, 12]: dim 0 "
                "holds 2 "
                "blocks of 6, not divisible by tp=4"},
        Refusal{"megatron-core-gpt", "layers=3,hidden=8,heads=2,vocab=10",
                "tp=1,pp=4,dp=1",
                "pp=4 needs at least 4 layers but the model has 3"},
        Refusal{"megatron-core-gpt", "layers=3,hidden=8,heads=2,vocab=10",
                "tp=1,pp=2,dp=1,stages=1:1",
                "stages=1:1 sum to 2 layers but the model has 3"},
        Refusal{"hf-llama", "layers=1,hidden=12,heads=6,groups=3,vocab=10",
                "tp=4,pp=1,dp=1",
                "tensor model.layers.0.self_attn.q_proj.weight [12, 12]: 6 "
                "attention heads cannot be split across tp=4"}));

TEST(Placement, VocabSizeParamMustMatchTheTensor) {
  Fixture f = Make("megatron-core-gpt", "layers=1,hidden=8,heads=2,vocab=10");
  ASSERT_TRUE(f.layout.SetParam("vocab_size", "12").ok());
  absl::Status s = PlaceStatus(f, "tp=1,pp=1,dp=1");
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("embedding.word_embeddings.weight [10, 8]: has 10 "
                        "vocabulary rows but "
                        "vocab_size=12"));
}

TEST(Placement, SplitDimensionBeyondTheTensorIsRefused) {
  auto layout = *Layout::FromJson(
      R"({"name": "x", "rules": [{"match": ".", "split": 2}]})");
  Model model;
  ASSERT_TRUE(model.Add({"w", DType::kF32, {4, 4}}).ok());
  auto p = Placement::Create(layout, std::make_shared<const Model>(model),
                             *ParallelConfig::Parse("tp=2,pp=1,dp=1"));
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("splits dim 2 but the tensor has 2"));
}

TEST(ModelSpec, RefusesJunk) {
  EXPECT_FALSE(ModelSpec::Parse("layers=2,hidden=64").ok());  // no heads, vocab
  EXPECT_FALSE(ModelSpec::Parse("layers=2,hidden=64,heads=5,vocab=10").ok());
  EXPECT_FALSE(ModelSpec::Parse("layers=x,hidden=64,heads=4,vocab=10").ok());
  EXPECT_FALSE(
      ModelSpec::Parse("layers=2,hidden=64,heads=4,vocab=10,bias=2").ok());
  auto spec =
      *ModelSpec::Parse("layers=2,hidden=64,heads=4,vocab=10,colour=blue");
  auto layout = *Layout::Load("megatron-core-gpt");
  EXPECT_THAT(std::string(spec.ApplyParams(layout).message()),
              HasSubstr("colour"));
}

TEST(ModelSpec, BuildsSpecShapes) {
  Fixture f = Make("megatron-core-gpt",
                   "layers=2,hidden=64,heads=8,groups=2,ffn=100,vocab=50,"
                   "bias=1,gated_linear_unit=1");
  const Model& m = *f.model;
  EXPECT_EQ(m.Find("decoder.layers.1.self_attention.linear_qkv.weight")->shape,
            (Shape{(8 + 2 * 2) * 8, 64}));
  EXPECT_EQ(m.Find("decoder.layers.1.mlp.linear_fc1.weight")->shape,
            (Shape{200, 64}));
  EXPECT_EQ(m.Find("decoder.layers.1.mlp.linear_fc1.bias")->shape,
            (Shape{200}));
  EXPECT_EQ(m.Find("decoder.layers.0.mlp.linear_fc2.weight")->shape,
            (Shape{64, 100}));
  EXPECT_EQ(m.Find("output_layer.weight")->shape, (Shape{50, 64}));
  EXPECT_EQ(m.size(), 1 + 2 * 10 + 2);
}

}  // namespace
}  // namespace scalai

namespace scalai {
namespace {

// Issue 16: a tp that cuts an attention head or a query group is refused,
// naming the tensor, the unit and the count; every tp that keeps them whole
// (and divides the other split dimensions) is accepted.
TEST(Placement, TpMustKeepHeadsAndQueryGroupsWhole) {
  for (const std::string layout : {"megatron-core-gpt", "hf-llama"}) {
    SCOPED_TRACE(layout);
    // heads=8, groups=2, head dim 8; ffn and vocab divisible by every tp.
    Fixture f =
        Make(layout, "layers=2,hidden=64,heads=8,groups=2,ffn=256,vocab=512");
    for (int tp : {1, 2}) {
      EXPECT_TRUE(PlaceStatus(f, absl::StrCat("tp=", tp, ",pp=1,dp=1")).ok())
          << "tp=" << tp;
    }
    for (int tp : {4, 8}) {
      absl::Status s = PlaceStatus(f, absl::StrCat("tp=", tp, ",pp=1,dp=1"));
      EXPECT_FALSE(s.ok()) << "tp=" << tp;
      EXPECT_THAT(s.message(),
                  HasSubstr(absl::StrCat("2 query groups cannot be split "
                                         "across tp=",
                                         tp)));
      EXPECT_THAT(s.message(),
                  HasSubstr(layout == "hf-llama" ? "self_attn.k_proj.weight"
                                                 : "linear_qkv.weight"));
    }
    // heads=6 (no grouping): tp=4 would cut heads although every split
    // dimension (qkv rows 18*8, hidden 48) divides by 4... except heads.
    Fixture g = Make(layout, "layers=2,hidden=48,heads=6,ffn=192,vocab=512");
    for (int tp : {1, 2, 3, 6}) {
      EXPECT_TRUE(PlaceStatus(g, absl::StrCat("tp=", tp, ",pp=1,dp=1")).ok())
          << "tp=" << tp;
    }
    absl::Status s = PlaceStatus(g, "tp=4,pp=1,dp=1");
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(s.message(), HasSubstr("6 "));
    EXPECT_THAT(s.message(), HasSubstr("cannot be split across tp=4"));
  }
}

// A layout without the unit parameters (a store made before them) keeps
// checking only divisibility.
TEST(Placement, UnknownUnitsAreNotChecked) {
  Fixture f = Make("megatron-core-gpt",
                   "layers=2,hidden=64,heads=8,groups=2,ffn=256,vocab=512");
  Layout plain = *Layout::Load("megatron-core-gpt");
  ASSERT_TRUE(plain.SetParam("vocab_size", "512").ok());
  EXPECT_TRUE(Placement::Create(plain, f.model,
                                *ParallelConfig::Parse("tp=4,pp=1,dp=1"))
                  .ok());
  // ... and refuses what does not divide, as before.
  absl::Status s = Placement::Create(plain, f.model,
                                     *ParallelConfig::Parse("tp=5,pp=1,dp=1"))
                       .status();
  EXPECT_THAT(s.message(), HasSubstr("is not divisible by tp=5"));
}

}  // namespace
}  // namespace scalai
