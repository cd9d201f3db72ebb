#include "ptc/model_spec.h"

#include <charconv>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

absl::Status SpecError(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--model \"", text, "\": ", why));
}

struct Builder {
  Model model;
  DType dtype;
  absl::Status status;
  void Add(std::string name, Shape shape) {
    if (status.ok())
      status = model.Add({std::move(name), dtype, std::move(shape)});
  }
};

}  // namespace

absl::StatusOr<ModelSpec> ModelSpec::Parse(absl::string_view raw) {
  absl::string_view text = absl::StripAsciiWhitespace(raw);
  ModelSpec spec;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return SpecError(text, absl::StrCat("\"", item, "\" is not key=value"));
    }
    absl::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    int64_t* field = nullptr;
    if (key == "layers") field = &spec.layers;
    if (key == "hidden") field = &spec.hidden;
    if (key == "heads") field = &spec.heads;
    if (key == "groups") field = &spec.groups;
    if (key == "ffn") field = &spec.ffn;
    if (key == "vocab") field = &spec.vocab;
    if (key == "optimizer") {
      if (value != "adam" && value != "none") {
        return SpecError(text, "optimizer must be adam or none");
      }
      spec.optimizer = value == "adam" ? "adam" : "";
      continue;
    }
    int64_t n = 0;
    bool is_number = false;
    {
      auto [end, ec] =
          std::from_chars(value.data(), value.data() + value.size(), n);
      is_number = !value.empty() && ec == std::errc() &&
                  end == value.data() + value.size();
    }
    if (key == "bias") {
      if (!is_number || (n != 0 && n != 1))
        return SpecError(text, "bias must be 0 or 1");
      spec.bias = n == 1;
      continue;
    }
    if (field == nullptr) {
      spec.layout_params.emplace_back(key, value);
      continue;
    }
    if (!is_number || n < 1 || n > (int64_t{1} << 32)) {
      return SpecError(
          text, absl::StrCat(key, "=", value, " must be a positive integer"));
    }
    *field = n;
  }
  for (auto [name, value] : {std::pair{"layers", spec.layers},
                             {"hidden", spec.hidden},
                             {"heads", spec.heads},
                             {"vocab", spec.vocab}}) {
    if (value == 0) return SpecError(text, absl::StrCat("missing ", name, "="));
  }
  if (spec.groups == 0) spec.groups = spec.heads;
  if (spec.ffn == 0) spec.ffn = 4 * spec.hidden;
  if (spec.hidden % spec.heads != 0) {
    return SpecError(text,
                     absl::StrCat("hidden=", spec.hidden,
                                  " is not divisible by heads=", spec.heads));
  }
  if (spec.heads % spec.groups != 0) {
    return SpecError(text,
                     absl::StrCat("heads=", spec.heads,
                                  " is not divisible by groups=", spec.groups));
  }
  return spec;
}

absl::Status ModelSpec::ApplyParams(Layout& layout) const {
  for (const auto& [key, value] : layout_params) {
    RETURN_IF_ERROR(layout.SetParam(key, value));
  }
  if (layout.HasParam("vocab_size")) {
    RETURN_IF_ERROR(layout.SetParam("vocab_size", absl::StrCat(vocab)));
  }
  // The units that attention tensors' splits must keep whole.
  if (layout.HasParam("num_attention_heads")) {
    RETURN_IF_ERROR(
        layout.SetParam("num_attention_heads", absl::StrCat(heads)));
  }
  if (layout.HasParam("num_query_groups")) {
    RETURN_IF_ERROR(layout.SetParam("num_query_groups", absl::StrCat(groups)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Model> ModelSpec::Build(const Layout& layout,
                                       DType dtype) const {
  const int64_t hd = hidden / heads;
  const int64_t qkv_rows = (heads + 2 * groups) * hd;
  Builder b{Model(), dtype, absl::OkStatus()};
  if (layout.name() == "megatron-core-gpt") {
    const bool gated = layout.IntParam("gated_linear_unit").value_or(0) != 0;
    const int64_t fc1_rows = ffn * (gated ? 2 : 1);
    b.Add("embedding.word_embeddings.weight", {vocab, hidden});
    for (int64_t n = 0; n < layers; ++n) {
      std::string p = absl::StrCat("decoder.layers.", n, ".");
      b.Add(p + "self_attention.linear_qkv.layer_norm_weight", {hidden});
      b.Add(p + "self_attention.linear_qkv.weight", {qkv_rows, hidden});
      if (bias) b.Add(p + "self_attention.linear_qkv.bias", {qkv_rows});
      b.Add(p + "self_attention.linear_proj.weight", {hidden, hidden});
      if (bias) b.Add(p + "self_attention.linear_proj.bias", {hidden});
      b.Add(p + "mlp.linear_fc1.layer_norm_weight", {hidden});
      b.Add(p + "mlp.linear_fc1.weight", {fc1_rows, hidden});
      if (bias) b.Add(p + "mlp.linear_fc1.bias", {fc1_rows});
      b.Add(p + "mlp.linear_fc2.weight", {hidden, ffn});
      if (bias) b.Add(p + "mlp.linear_fc2.bias", {hidden});
    }
    b.Add("decoder.final_layernorm.weight", {hidden});
    if (!layout.ActiveTie()) b.Add("output_layer.weight", {vocab, hidden});
  } else if (layout.name() == "hf-llama") {
    b.Add("model.embed_tokens.weight", {vocab, hidden});
    for (int64_t n = 0; n < layers; ++n) {
      std::string p = absl::StrCat("model.layers.", n, ".");
      b.Add(p + "input_layernorm.weight", {hidden});
      for (auto [proj, rows] : {std::pair{"q_proj", heads * hd},
                                {"k_proj", groups * hd},
                                {"v_proj", groups * hd}}) {
        b.Add(absl::StrCat(p, "self_attn.", proj, ".weight"), {rows, hidden});
        if (bias) b.Add(absl::StrCat(p, "self_attn.", proj, ".bias"), {rows});
      }
      b.Add(p + "self_attn.o_proj.weight", {hidden, heads * hd});
      if (bias) b.Add(p + "self_attn.o_proj.bias", {hidden});
      b.Add(p + "post_attention_layernorm.weight", {hidden});
      for (const char* proj : {"gate_proj", "up_proj"}) {
        b.Add(absl::StrCat(p, "mlp.", proj, ".weight"), {ffn, hidden});
        if (bias) b.Add(absl::StrCat(p, "mlp.", proj, ".bias"), {ffn});
      }
      b.Add(p + "mlp.down_proj.weight", {hidden, ffn});
      if (bias) b.Add(p + "mlp.down_proj.bias", {hidden});
    }
    b.Add("model.norm.weight", {hidden});
    if (!layout.ActiveTie()) b.Add("lm_head.weight", {vocab, hidden});
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model describes megatron-core-gpt or hf-llama models; layout \"",
        layout.name(), "\" names its tensors otherwise"));
  }
  RETURN_IF_ERROR(b.status);
  if (optimizer.empty()) return std::move(b.model);
  Model with_state = b.model;
  for (const char* prefix : {"optimizer.exp_avg.", "optimizer.exp_avg_sq."}) {
    for (const TensorInfo& t : b.model.tensors()) {
      RETURN_IF_ERROR(with_state.Add({prefix + t.name, DType::kF32, t.shape}));
    }
  }
  return with_state;
}

}  // namespace scalai
