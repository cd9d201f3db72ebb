// A Layout holds the rules that say how each tensor of a model is partitioned
// across tensor- and pipeline-parallel ranks (docs/reference.md): the first rule
// whose regex is found in a tensor's name applies.
//
//   ASSIGN_OR_RETURN(Layout layout, Layout::Load("megatron-core-gpt"));
//   RETURN_IF_ERROR(layout.SetParam("gated_linear_unit", "1"));
//   ASSIGN_OR_RETURN(TensorRule rule, layout.Classify(name));
#ifndef SCALAI_PTC_LAYOUT_H_
#define SCALAI_PTC_LAYOUT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace re2 {
class RE2;
}

namespace scalai {

// Which pipeline stages hold a tensor that is not inside a numbered layer.
enum class StagePolicy { kFirst, kLast, kFirstAndLast, kAll };

struct LayoutRule {
  std::string match;
  std::shared_ptr<const re2::RE2> regex;
  int split = -1;      // dimension split across tp ranks; -1 = replicated
  int blocks = 1;      // concatenated blocks along `split`, each split alone
  bool vocab = false;  // rows padded to a multiple of divisor * tp
  std::string when;    // boolean parameter that enables the rule; "" = always
  // Integer parameter counting the units (attention heads, query groups)
  // that the split dimension holds: each unit stays whole on one rank, so
  // tp must divide their number. "" = no such unit.
  std::string units;
  StagePolicy stage = StagePolicy::kFirst;
};

// What the layout says about one tensor.
struct TensorRule {
  const LayoutRule* rule = nullptr;
  int rule_index = 0;
  // The global layer number for tensors inside the layer pattern.
  std::optional<int64_t> layer;
  // Where the layer number sits in the name, to rename it for local numbering.
  size_t layer_digits_pos = 0;
  size_t layer_digits_len = 0;
};

class Layout {
 public:
  // The names accepted by Load() without a file.
  static std::vector<std::string> PresetNames();

  // A preset name ("megatron-core-gpt", "hf-llama") or a path to a JSON file.
  static absl::StatusOr<Layout> Load(absl::string_view name_or_path);

  // Parses layout JSON; `source` names it in errors.
  static absl::StatusOr<Layout> FromJson(absl::string_view text,
                                         absl::string_view source = "layout");

  const std::string& name() const { return name_; }
  bool local_layer_numbering() const { return local_numbering_; }

  // Sets a parameter declared in the layout's "params". Booleans take
  // 0/1/true/false, others integers.
  absl::Status SetParam(absl::string_view key, absl::string_view value);
  bool HasParam(absl::string_view key) const;
  // The parameter's value, or nullopt while it is null.
  std::optional<int64_t> IntParam(absl::string_view key) const;
  // How errors name the units a parameter counts: "query groups" for
  // num_query_groups, "attention heads" for num_attention_heads, else the
  // parameter's own name.
  static std::string UnitName(absl::string_view param);
  const nlohmann::json& params() const { return params_; }

  absl::StatusOr<TensorRule> Classify(absl::string_view tensor_name) const;

  // Tied input and output embeddings (Megatron's
  // share_embeddings_and_output_weights, Hugging Face's tie_word_embeddings):
  // while the boolean parameter `when` is true, the model stores `input`
  // only, and a last pipeline stage that does not hold it (pp > 1) holds
  // it as `output` too, as the frameworks save it.
  struct Tie {
    std::string when;
    std::string input;
    std::string output;
  };
  std::optional<Tie> ActiveTie() const;

  // The tensor's name as a rank holding layer `local_layer` of its stage sees
  // it: the layer number replaced under local numbering, else unchanged.
  std::string LocalName(absl::string_view tensor_name, const TensorRule& rule,
                        int64_t local_layer) const;

  // The layout as JSON, with the current parameter values.
  nlohmann::json ToJson() const;

 private:
  std::string name_;
  std::string layer_pattern_;
  std::shared_ptr<const re2::RE2> layer_regex_;
  bool local_numbering_ = true;
  nlohmann::json params_;
  // Shared so that Layout copies stay cheap; rules never change after parsing.
  std::shared_ptr<const std::vector<LayoutRule>> rules_;
  nlohmann::json rules_json_;
  std::optional<Tie> tie_;
};

}  // namespace scalai

#endif  // SCALAI_PTC_LAYOUT_H_
