#include "ptc/layout.h"

#include <charconv>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ptc/status_macros.h"
#include "re2/re2.h"

namespace scalai {
namespace {

using nlohmann::json;

// Megatron-Core GPT, as docs/reference.md ("Layouts") shows it.
constexpr absl::string_view kMegatronCoreGpt = R"json({
  "name": "megatron-core-gpt",
  "layer": {"pattern": "decoder\\.layers\\.(\\d+)\\.", "numbering": "local"},
  "params": {"vocab_size": null, "make_vocab_size_divisible_by": 128,
             "gated_linear_unit": false, "tied": false,
             "num_attention_heads": null, "num_query_groups": null},
  "tie": {"when": "tied", "input": "embedding.word_embeddings.weight",
          "output": "output_layer.weight"},
  "rules": [
    {"match": "embedding\\.word_embeddings\\.weight$", "split": 0, "vocab": true, "stage": "first"},
    {"match": "output_layer\\.weight$", "split": 0, "vocab": true, "stage": "last"},
    {"match": "linear_fc1\\.(weight|bias)$", "split": 0, "blocks": 2, "when": "gated_linear_unit"},
    {"match": "linear_qkv\\.(weight|bias)$", "split": 0, "units": "num_query_groups"},
    {"match": "linear_fc1\\.(weight|bias)$", "split": 0},
    {"match": "linear_proj\\.weight$", "split": 1, "units": "num_attention_heads"},
    {"match": "linear_fc2\\.weight$", "split": 1},
    {"match": "final_layernorm\\.", "stage": "last"},
    {"match": ".", "split": null}
  ]
})json";

// Hugging Face Llama: q/k/v and gate/up are column-parallel, o/down
// row-parallel; layers keep the model's own numbers, as HF files do.
constexpr absl::string_view kHfLlama = R"json({
  "name": "hf-llama",
  "layer": {"pattern": "model\\.layers\\.(\\d+)\\.", "numbering": "global"},
  "params": {"vocab_size": null, "make_vocab_size_divisible_by": 1,
             "tied": false,
             "num_attention_heads": null, "num_query_groups": null},
  "tie": {"when": "tied", "input": "model.embed_tokens.weight",
          "output": "lm_head.weight"},
  "rules": [
    {"match": "embed_tokens\\.weight$", "split": 0, "vocab": true, "stage": "first"},
    {"match": "lm_head\\.weight$", "split": 0, "vocab": true, "stage": "last"},
    {"match": "q_proj\\.(weight|bias)$", "split": 0, "units": "num_attention_heads"},
    {"match": "(k_proj|v_proj)\\.(weight|bias)$", "split": 0, "units": "num_query_groups"},
    {"match": "(gate_proj|up_proj)\\.(weight|bias)$", "split": 0},
    {"match": "o_proj\\.weight$", "split": 1, "units": "num_attention_heads"},
    {"match": "down_proj\\.weight$", "split": 1},
    {"match": "model\\.norm\\.", "stage": "last"},
    {"match": ".", "split": null}
  ]
})json";

absl::Status LayoutError(absl::string_view source, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", why));
}

// A layout's regexes are RE2's: matching takes time linear in the name
// whatever the pattern (std::regex backtracked exponentially on a rule such
// as "a??????(b*****c)$" and recursed once per nested group while compiling),
// and compiling takes at most kRegexMemory, refusing the rest. Rules match
// tensor names: tens of characters, a count of a few digits at most.
constexpr size_t kMaxPatternChars = 1000;
constexpr int64_t kRegexMemory = 1 << 20;

absl::StatusOr<std::shared_ptr<const re2::RE2>> CompileRegex(
    absl::string_view source, const std::string& pattern) {
  if (pattern.size() > kMaxPatternChars) {
    return LayoutError(
        source, absl::StrCat("a regex of ", pattern.size(),
                             " characters (at most ", kMaxPatternChars, "): \"",
                             pattern.substr(0, 40), "...\""));
  }
  re2::RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(kRegexMemory);
  auto regex = std::make_shared<const re2::RE2>(pattern, options);
  if (!regex->ok()) {
    return LayoutError(source, absl::StrCat("invalid regex \"", pattern,
                                            "\": ", regex->error()));
  }
  return regex;
}

absl::Status CheckKeys(absl::string_view source, absl::string_view what,
                       const json& object,
                       std::initializer_list<absl::string_view> allowed) {
  for (const auto& [key, value] : object.items()) {
    bool known = false;
    for (absl::string_view a : allowed) known |= (a == key);
    if (!known) {
      return LayoutError(
          source, absl::StrCat(what, ": unknown key \"", key, "\" (allowed: ",
                               absl::StrJoin(allowed, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StagePolicy> ParseStage(absl::string_view source,
                                       const std::string& stage) {
  if (stage == "first") return StagePolicy::kFirst;
  if (stage == "last") return StagePolicy::kLast;
  if (stage == "first_and_last") return StagePolicy::kFirstAndLast;
  if (stage == "all") return StagePolicy::kAll;
  return LayoutError(source, absl::StrCat("stage \"", stage,
                                          "\" is not first, last, "
                                          "first_and_last or all"));
}

absl::StatusOr<LayoutRule> ParseRule(absl::string_view source, size_t index,
                                     const json& j, const json& params) {
  std::string what = absl::StrCat("rules[", index, "]");
  if (!j.is_object())
    return LayoutError(source, absl::StrCat(what, " is not an object"));
  RETURN_IF_ERROR(CheckKeys(
      source, what, j,
      {"match", "split", "blocks", "vocab", "when", "stage", "units"}));
  LayoutRule rule;
  if (!j.contains("match") || !j["match"].is_string()) {
    return LayoutError(
        source, absl::StrCat(what, ": \"match\" must be a regex string"));
  }
  rule.match = j["match"].get<std::string>();
  ASSIGN_OR_RETURN(rule.regex, CompileRegex(source, rule.match));
  if (j.contains("split") && !j["split"].is_null()) {
    if (!j["split"].is_number_integer() || j["split"].get<int64_t>() < 0 ||
        j["split"].get<int64_t>() > 64) {
      return LayoutError(source, absl::StrCat(what,
                                              ": \"split\" must be null or "
                                              "a dimension index >= 0"));
    }
    rule.split = j["split"].get<int>();
  }
  if (j.contains("blocks")) {
    if (!j["blocks"].is_number_integer() || j["blocks"].get<int64_t>() < 1 ||
        j["blocks"].get<int64_t>() > 1024) {
      return LayoutError(
          source, absl::StrCat(what, ": \"blocks\" must be an integer >= 1"));
    }
    rule.blocks = j["blocks"].get<int>();
  }
  if (j.contains("vocab")) {
    if (!j["vocab"].is_boolean()) {
      return LayoutError(
          source, absl::StrCat(what, ": \"vocab\" must be true or false"));
    }
    rule.vocab = j["vocab"].get<bool>();
  }
  if (j.contains("when")) {
    if (!j["when"].is_string()) {
      return LayoutError(
          source, absl::StrCat(what, ": \"when\" must name a parameter"));
    }
    rule.when = j["when"].get<std::string>();
    if (!params.contains(rule.when) || !params[rule.when].is_boolean()) {
      return LayoutError(
          source, absl::StrCat(what, ": \"when\" names \"", rule.when,
                               "\", which is not a boolean in \"params\""));
    }
  }
  if (j.contains("units")) {
    if (!j["units"].is_string()) {
      return LayoutError(
          source, absl::StrCat(what, ": \"units\" must name a parameter"));
    }
    rule.units = j["units"].get<std::string>();
    if (!params.contains(rule.units) ||
        !(params[rule.units].is_null() ||
          params[rule.units].is_number_integer())) {
      return LayoutError(
          source, absl::StrCat(what, ": \"units\" names \"", rule.units,
                               "\", which is not an integer in \"params\""));
    }
  }
  if (j.contains("stage")) {
    if (!j["stage"].is_string()) {
      return LayoutError(source,
                         absl::StrCat(what, ": \"stage\" must be a string"));
    }
    ASSIGN_OR_RETURN(rule.stage,
                     ParseStage(source, j["stage"].get<std::string>()));
  }
  if ((rule.vocab || rule.blocks > 1) && rule.split < 0) {
    return LayoutError(
        source, absl::StrCat(
                    what, ": \"vocab\" and \"blocks\" need a split dimension"));
  }
  if (!rule.units.empty() &&
      (rule.split < 0 || rule.vocab || rule.blocks > 1)) {
    return LayoutError(
        source, absl::StrCat(what,
                             ": \"units\" needs a split dimension without "
                             "\"vocab\" or \"blocks\""));
  }
  if (rule.vocab && rule.blocks > 1) {
    return LayoutError(
        source,
        absl::StrCat(what, ": \"vocab\" and \"blocks\" cannot be combined"));
  }
  if (rule.vocab && !params.contains("make_vocab_size_divisible_by")) {
    return LayoutError(source,
                       absl::StrCat(what,
                                    ": a vocab rule needs the parameter "
                                    "\"make_vocab_size_divisible_by\""));
  }
  return rule;
}

}  // namespace

std::string Layout::UnitName(absl::string_view param) {
  if (param == "num_query_groups") return "query groups";
  if (param == "num_attention_heads") return "attention heads";
  return std::string(param);
}

std::vector<std::string> Layout::PresetNames() {
  return {"megatron-core-gpt", "hf-llama"};
}

absl::StatusOr<Layout> Layout::Load(absl::string_view name_or_path) {
  if (name_or_path == "megatron-core-gpt")
    return FromJson(kMegatronCoreGpt, name_or_path);
  if (name_or_path == "hf-llama") return FromJson(kHfLlama, name_or_path);
  std::ifstream in{std::string(name_or_path)};
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        "layout \"", name_or_path, "\" is neither a preset (",
        absl::StrJoin(PresetNames(), ", "), ") nor a readable JSON file"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return FromJson(text.str(), name_or_path);
}

absl::StatusOr<Layout> Layout::FromJson(absl::string_view text,
                                        absl::string_view source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return LayoutError(source, "not valid JSON");
  if (!j.is_object()) return LayoutError(source, "not a JSON object");
  RETURN_IF_ERROR(CheckKeys(source, "layout", j,
                            {"name", "layer", "params", "tie", "rules"}));
  Layout layout;
  if (!j.contains("name") || !j["name"].is_string()) {
    return LayoutError(source, "\"name\" must be a string");
  }
  layout.name_ = j["name"].get<std::string>();
  layout.params_ = json::object();
  if (j.contains("params")) {
    if (!j["params"].is_object())
      return LayoutError(source, "\"params\" must be an object");
    for (const auto& [key, value] : j["params"].items()) {
      if (!value.is_null() && !value.is_boolean() &&
          !value.is_number_integer()) {
        return LayoutError(
            source, absl::StrCat("param \"", key,
                                 "\" must be null, a boolean or an integer"));
      }
    }
    layout.params_ = j["params"];
  }
  if (j.contains("layer")) {
    const json& layer = j["layer"];
    if (!layer.is_object())
      return LayoutError(source, "\"layer\" must be an object");
    RETURN_IF_ERROR(
        CheckKeys(source, "layer", layer, {"pattern", "numbering"}));
    if (!layer.contains("pattern") || !layer["pattern"].is_string()) {
      return LayoutError(source, "layer: \"pattern\" must be a regex string");
    }
    layout.layer_pattern_ = layer["pattern"].get<std::string>();
    ASSIGN_OR_RETURN(layout.layer_regex_,
                     CompileRegex(source, layout.layer_pattern_));
    if (layout.layer_regex_->NumberOfCapturingGroups() != 1) {
      return LayoutError(source,
                         "layer: \"pattern\" must have exactly one group "
                         "capturing the layer number");
    }
    std::string numbering = layer.value("numbering", std::string("local"));
    if (numbering != "local" && numbering != "global") {
      return LayoutError(
          source, "layer: \"numbering\" must be \"local\" or \"global\"");
    }
    layout.local_numbering_ = numbering == "local";
  }
  if (!j.contains("rules") || !j["rules"].is_array() || j["rules"].empty()) {
    return LayoutError(source, "\"rules\" must be a non-empty array");
  }
  auto rules = std::make_shared<std::vector<LayoutRule>>();
  for (size_t i = 0; i < j["rules"].size(); ++i) {
    ASSIGN_OR_RETURN(LayoutRule rule,
                     ParseRule(source, i, j["rules"][i], layout.params_));
    rules->push_back(std::move(rule));
  }
  layout.rules_ = std::move(rules);
  layout.rules_json_ = j["rules"];
  if (j.contains("tie")) {
    const json& tie = j["tie"];
    if (!tie.is_object())
      return LayoutError(source, "\"tie\" must be an object");
    RETURN_IF_ERROR(CheckKeys(source, "tie", tie, {"when", "input", "output"}));
    for (const char* key : {"when", "input", "output"}) {
      if (!tie.contains(key) || !tie[key].is_string()) {
        return LayoutError(source,
                           absl::StrCat("tie: \"", key, "\" must be a string"));
      }
    }
    layout.tie_ = {tie["when"].get<std::string>(),
                   tie["input"].get<std::string>(),
                   tie["output"].get<std::string>()};
    if (!layout.params_.contains(layout.tie_->when) ||
        !layout.params_[layout.tie_->when].is_boolean()) {
      return LayoutError(
          source, absl::StrCat("tie: \"when\" names \"", layout.tie_->when,
                               "\", not a boolean parameter"));
    }
  }
  return layout;
}

std::optional<Layout::Tie> Layout::ActiveTie() const {
  if (!tie_ || !params_[tie_->when].get<bool>()) return std::nullopt;
  return tie_;
}

absl::Status Layout::SetParam(absl::string_view key, absl::string_view value) {
  std::string k(key);
  if (!params_.contains(k)) {
    std::vector<std::string> known;
    for (const auto& [name, v] : params_.items()) known.push_back(name);
    return absl::InvalidArgumentError(absl::StrCat(
        "layout ", name_, " has no parameter \"", key, "\" (known: ",
        known.empty() ? "none" : absl::StrJoin(known, ", "), ")"));
  }
  if (params_[k].is_boolean()) {
    if (value == "1" || value == "true") {
      params_[k] = true;
    } else if (value == "0" || value == "false") {
      params_[k] = false;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", key, "=", value, ": expected 0, 1, true or false"));
    }
    return absl::OkStatus();
  }
  int64_t n = 0;
  auto [end, ec] =
      std::from_chars(value.data(), value.data() + value.size(), n);
  if (value.empty() || ec != std::errc() ||
      end != value.data() + value.size() || n < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter ", key, "=", value, ": expected a positive integer"));
  }
  params_[k] = n;
  return absl::OkStatus();
}

bool Layout::HasParam(absl::string_view key) const {
  return params_.contains(std::string(key));
}

std::optional<int64_t> Layout::IntParam(absl::string_view key) const {
  std::string k(key);
  if (!params_.contains(k) || params_[k].is_null()) return std::nullopt;
  if (params_[k].is_boolean()) return params_[k].get<bool>() ? 1 : 0;
  return params_[k].get<int64_t>();
}

absl::StatusOr<TensorRule> Layout::Classify(
    absl::string_view tensor_name) const {
  TensorRule out;
  const re2::StringPiece name(tensor_name.data(), tensor_name.size());
  if (!layer_pattern_.empty()) {
    re2::StringPiece digits;
    // An optional group that took no part in the match is null.
    if (re2::RE2::PartialMatch(name, *layer_regex_, &digits) &&
        digits.data() != nullptr) {
      int64_t layer = 0;
      const char* end = digits.data() + digits.size();
      auto [p, ec] = std::from_chars(digits.data(), end, layer);
      if (ec != std::errc() || p != end) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", tensor_name, ": layer number \"",
                         absl::string_view(digits.data(), digits.size()),
                         "\" is not a number"));
      }
      out.layer = layer;
      out.layer_digits_pos = digits.data() - tensor_name.data();
      out.layer_digits_len = digits.size();
    }
  }
  for (size_t i = 0; i < rules_->size(); ++i) {
    const LayoutRule& rule = (*rules_)[i];
    if (!rule.when.empty() && !params_[rule.when].get<bool>()) continue;
    if (re2::RE2::PartialMatch(name, *rule.regex)) {
      out.rule = &rule;
      out.rule_index = static_cast<int>(i);
      return out;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor ", tensor_name, ": no rule of layout ", name_, " matches it"));
}

std::string Layout::LocalName(absl::string_view tensor_name,
                              const TensorRule& rule,
                              int64_t local_layer) const {
  if (!rule.layer || !local_numbering_) return std::string(tensor_name);
  return absl::StrCat(
      tensor_name.substr(0, rule.layer_digits_pos), local_layer,
      tensor_name.substr(rule.layer_digits_pos + rule.layer_digits_len));
}

nlohmann::json Layout::ToJson() const {
  json j = {{"name", name_}, {"params", params_}, {"rules", rules_json_}};
  if (tie_) {
    j["tie"] = {
        {"when", tie_->when}, {"input", tie_->input}, {"output", tie_->output}};
  }
  if (!layer_pattern_.empty()) {
    j["layer"] = {{"pattern", layer_pattern_},
                  {"numbering", local_numbering_ ? "local" : "global"}};
  }
  return j;
}

}  // namespace scalai
