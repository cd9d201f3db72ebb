#include "ptc/layout.h"

#include <cstdio>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace scalai {
namespace {

using ::testing::HasSubstr;

TEST(Layout, MegatronPresetClassifiesSpecNames) {
  auto layout = Layout::Load("megatron-core-gpt");
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto split_of = [&](const std::string& name) {
    return layout->Classify(name)->rule->split;
  };
  EXPECT_EQ(split_of("embedding.word_embeddings.weight"), 0);
  EXPECT_TRUE(layout->Classify("output_layer.weight")->rule->vocab);
  EXPECT_EQ(split_of("decoder.layers.3.self_attention.linear_qkv.weight"), 0);
  EXPECT_EQ(split_of("decoder.layers.3.self_attention.linear_proj.weight"), 1);
  EXPECT_EQ(split_of("decoder.layers.3.self_attention.linear_proj.bias"), -1);
  EXPECT_EQ(split_of("decoder.layers.3.mlp.linear_fc2.weight"), 1);
  EXPECT_EQ(split_of("decoder.layers.3.mlp.linear_fc1.layer_norm_weight"), -1);
  EXPECT_EQ(
      layout->Classify("decoder.layers.3.mlp.linear_fc1.weight")->rule->blocks,
      1);
  EXPECT_EQ(layout->Classify("decoder.final_layernorm.weight")->rule->stage,
            StagePolicy::kLast);
  EXPECT_EQ(*layout->Classify("decoder.layers.17.mlp.linear_fc2.weight")->layer,
            17);
}

TEST(Layout, WhenEnablesSwiGluBlocks) {
  auto layout = *Layout::Load("megatron-core-gpt");
  ASSERT_TRUE(layout.SetParam("gated_linear_unit", "1").ok());
  EXPECT_EQ(
      layout.Classify("decoder.layers.0.mlp.linear_fc1.weight")->rule->blocks,
      2);
  EXPECT_EQ(
      layout.Classify("decoder.layers.0.mlp.linear_fc1.bias")->rule->blocks, 2);
}

TEST(Layout, OptimizerStateFollowsItsParameter) {
  auto layout = *Layout::Load("megatron-core-gpt");
  auto rule = layout.Classify(
      "optimizer.exp_avg.decoder.layers.2.mlp.linear_fc2.weight");
  ASSERT_TRUE(rule.ok());
  EXPECT_EQ(rule->rule->split, 1);
  EXPECT_EQ(*rule->layer, 2);
  EXPECT_EQ(
      layout.LocalName(
          "optimizer.exp_avg.decoder.layers.12.mlp.linear_fc2.weight",
          *layout.Classify(
              "optimizer.exp_avg.decoder.layers.12.mlp.linear_fc2.weight"),
          0),
      "optimizer.exp_avg.decoder.layers.0.mlp.linear_fc2.weight");
}

TEST(Layout, LocalAndGlobalNumbering) {
  auto megatron = *Layout::Load("megatron-core-gpt");
  std::string name = "decoder.layers.12.mlp.linear_fc2.weight";
  EXPECT_EQ(megatron.LocalName(name, *megatron.Classify(name), 4),
            "decoder.layers.4.mlp.linear_fc2.weight");
  auto llama = *Layout::Load("hf-llama");
  std::string hf = "model.layers.12.mlp.down_proj.weight";
  EXPECT_EQ(llama.LocalName(hf, *llama.Classify(hf), 4), hf);
  EXPECT_EQ(llama.Classify(hf)->rule->split, 1);
  EXPECT_EQ(
      llama.Classify("model.layers.0.self_attn.k_proj.weight")->rule->split, 0);
  EXPECT_TRUE(llama.Classify("lm_head.weight")->rule->vocab);
}

TEST(Layout, ParamsAreTypedAndKnown) {
  auto layout = *Layout::Load("megatron-core-gpt");
  EXPECT_TRUE(layout.SetParam("vocab_size", "50257").ok());
  EXPECT_EQ(*layout.IntParam("vocab_size"), 50257);
  EXPECT_EQ(*layout.IntParam("make_vocab_size_divisible_by"), 128);
  auto unknown = layout.SetParam("hidden_sizee", "3");
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.message()),
              HasSubstr("no parameter \"hidden_sizee\""));
  EXPECT_FALSE(layout.SetParam("gated_linear_unit", "maybe").ok());
  EXPECT_FALSE(layout.SetParam("vocab_size", "-4").ok());
  EXPECT_FALSE(layout.SetParam("vocab_size", "12abc").ok());
}

struct BadLayout {
  const char* json;
  const char* message;
};

class LayoutRefuses : public ::testing::TestWithParam<BadLayout> {};

TEST_P(LayoutRefuses, WithAClearMessage) {
  auto layout = Layout::FromJson(GetParam().json, "test.json");
  ASSERT_FALSE(layout.ok()) << GetParam().json;
  EXPECT_THAT(std::string(layout.status().message()),
              HasSubstr(GetParam().message));
  EXPECT_THAT(std::string(layout.status().message()), HasSubstr("test.json"));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LayoutRefuses,
    ::testing::Values(
        BadLayout{"{", "not valid JSON"}, BadLayout{"[]", "not a JSON object"},
        BadLayout{R"({"name": "x"})", "\"rules\" must be a non-empty array"},
        BadLayout{R"({"name": "x", "rules": [{"match": "("}]})",
                  "invalid regex"},
        BadLayout{R"({"name": "x", "rules": [{"match": ".", "split": -1}]})",
                  "\"split\""},
        BadLayout{
            R"({"name": "x", "rules": [{"match": ".", "split": 0, "blocks": 0}]})",
            "\"blocks\""},
        BadLayout{
            R"({"name": "x", "rules": [{"match": ".", "stage": "middle"}]})",
            "stage \"middle\""},
        BadLayout{R"({"name": "x", "rules": [{"match": ".", "when": "nope"}]})",
                  "\"when\" names \"nope\""},
        BadLayout{R"({"name": "x", "rules": [{"match": ".", "vocab": true}]})",
                  "need a split dimension"},
        BadLayout{R"({"name": "x", "rules": [{"match": ".", "splt": 0}]})",
                  "unknown key \"splt\""},
        BadLayout{
            R"({"name": "x", "layer": {"pattern": "layers\\.\\d+"}, "rules": [{"match": "."}]})",
            "exactly one group"},
        BadLayout{
            R"({"name": "x", "params": {"a": "s"}, "rules": [{"match": "."}]})",
            "param \"a\""}));

TEST(Layout, LoadsAJsonFileAndNamesAMissingOne) {
  std::string path = ::testing::TempDir() + "/layout.json";
  std::ofstream(path)
      << R"({"name": "mine", "rules": [{"match": "w$", "split": 1},
                                                        {"match": "."}]})";
  auto layout = Layout::Load(path);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->Classify("a.w")->rule->split, 1);
  auto missing = Layout::Load("/nonexistent/layout.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("/nonexistent/layout.json"));
}

// Patterns that std::regex, which layouts used before RE2, could not take:
// 30,000 nested groups overflowed the stack while compiling, counts past
// memory (or past 2^63) were copied out, and nested quantifiers made
// matching one name take exponential time. Patterns past 1000 characters
// are refused before they are compiled, RE2 refuses counts past its bounds,
// and matching is linear.
TEST(Layout, PatternsAreBoundedAndMatchedInLinearTime) {
  auto with_match = [](const std::string& pattern) {
    return R"({"name": "x", "rules": [{"match": ")" + pattern +
           R"(", "split": null}]})";
  };
  const int n = 30000;
  auto deep = Layout::FromJson(
      with_match(std::string(n, '(') + "a" + std::string(n, ')')), "deep.json");
  ASSERT_FALSE(deep.ok());
  EXPECT_THAT(
      std::string(deep.status().message()),
      HasSubstr("deep.json: a regex of 60001 characters (at most 1000)"));
  auto fine = Layout::FromJson(
      with_match(std::string(400, '(') + "." + std::string(400, ')')), "ok");
  EXPECT_TRUE(fine.ok()) << fine.status();
  for (const char* pattern :
       {"a{999999999}", "(a{1,100}){100}", "((a{16}){16}){17}"}) {
    auto counted = Layout::FromJson(with_match(pattern), "count.json");
    ASSERT_FALSE(counted.ok()) << pattern;
    EXPECT_THAT(std::string(counted.status().message()),
                HasSubstr("count.json: invalid regex"));
  }
  for (const char* pattern : {"layers\\\\.\\\\d{1,4}\\\\.", "a{1000}",
                              "(a{10}){100}", "a\\\\{99999}"}) {
    auto counted = Layout::FromJson(with_match(pattern), "count.json");
    EXPECT_TRUE(counted.ok()) << pattern << ": " << counted.status();
  }
  // Found by the layout fuzz target: under std::regex, classifying one
  // 60-character name by this rule took longer than the fuzzer's 10 s. RE2
  // refuses its stacked quantifiers.
  auto stacked = Layout::FromJson(
      with_match("embeddi\\\\.????????????????????????"
                 "(weight|b********:*******************==**********ias)$"),
      "stacked.json");
  ASSERT_FALSE(stacked.ok());
  EXPECT_THAT(std::string(stacked.status().message()),
              HasSubstr("bad repetition operator"));
  // Nested quantifiers RE2 takes: a name of 64 x's fails "(x+x+)+y" in
  // linear time, where a backtracking matcher tries 2^64 ways.
  auto nested = Layout::FromJson(with_match("^(x+x+)+y$"), "nested.json");
  ASSERT_TRUE(nested.ok()) << nested.status();
  auto rule = nested->Classify(std::string(64, 'x'));
  EXPECT_FALSE(rule.ok());
  EXPECT_THAT(std::string(rule.status().message()),
              HasSubstr("no rule of layout x matches it"));
}

TEST(Layout, ATensorNoRuleMatchesIsNamed) {
  auto layout =
      *Layout::FromJson(R"({"name": "x", "rules": [{"match": "weight$"}]})");
  auto r = layout.Classify("a.bias");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("tensor a.bias"));
}

}  // namespace
}  // namespace scalai
