// The plan oracle shared by the property tests of plans and of the live
// reshard: random models and configs, and every shard of a config derived
// from docs/reference.md by itself (which dims split, blocks, vocab padding,
// stages, local names, fsdp chunks, distopt's buffer) and cut from random
// full tensors, as a map of every local element to its global element.
#ifndef SCALAI_TESTS_PTC_PLAN_ORACLE_H_
#define SCALAI_TESTS_PTC_PLAN_ORACLE_H_

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "ptc/layout.h"
#include "ptc/model_spec.h"
#include "ptc/placement.h"

namespace scalai {
namespace oracle {

using Bytes = std::vector<std::byte>;

// How the presets (docs/reference.md) partition a tensor, written independently of Layout.
struct OracleRule {
  int split = -1;
  int blocks = 1;
  bool vocab = false;
  int stage = 0;  // for non-layer tensors: 0 first, 1 last
};

inline OracleRule OracleFor(const std::string& name, bool gated) {
  auto ends = [&](const char* suffix) {
    return name.size() >= strlen(suffix) &&
           name.compare(name.size() - strlen(suffix), std::string::npos,
                        suffix) == 0;
  };
  OracleRule r;
  if (ends("word_embeddings.weight") || ends("embed_tokens.weight"))
    return {0, 1, true, 0};
  if (ends("output_layer.weight") || ends("lm_head.weight"))
    return {0, 1, true, 1};
  if (ends("final_layernorm.weight") || ends("model.norm.weight"))
    return {-1, 1, false, 1};
  if (ends("linear_fc1.weight") || ends("linear_fc1.bias"))
    return {0, gated ? 2 : 1, false, 0};
  if (ends("linear_qkv.weight") || ends("linear_qkv.bias"))
    return {0, 1, false, 0};
  if (ends("linear_proj.weight") || ends("linear_fc2.weight"))
    return {1, 1, false, 0};
  for (const char* p :
       {"q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
        "up_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
        "gate_proj.bias", "up_proj.bias"}) {
    if (ends(p)) return {0, 1, false, 0};
  }
  if (ends("o_proj.weight") || ends("down_proj.weight"))
    return {1, 1, false, 0};
  return r;
}

struct Scenario {
  std::string layout_name;
  Layout layout;
  std::shared_ptr<const Model> model;
  bool gated = false;
  int64_t vocab_divisor = 1;
  int64_t layers = 0;
  int64_t heads = 0, groups = 0;
  std::vector<Bytes> full;  // random contents of every global tensor
};

inline Scenario RandomScenario(std::mt19937_64& rng) {
  auto pick = [&](std::vector<int64_t> v) { return v[rng() % v.size()]; };
  Scenario s;
  s.layout_name = rng() % 3 == 0 ? "hf-llama" : "megatron-core-gpt";
  s.layout = *Layout::Load(s.layout_name);
  ModelSpec spec;
  spec.layers = pick({1, 2, 3, 5, 8, 16});
  spec.heads = pick({4, 6, 8, 12, 16});
  spec.hidden = spec.heads * pick({2, 4});  // head dim 2 or 4
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= spec.heads; ++d) {
    if (spec.heads % d == 0) divisors.push_back(d);
  }
  spec.groups = pick(divisors);
  spec.ffn = pick({48, 96});
  spec.vocab = 17 + rng() % 300;
  spec.bias = rng() % 2;
  spec.optimizer = rng() % 3 == 0 ? "adam" : "";
  s.gated = s.layout_name == "megatron-core-gpt" && rng() % 2;
  if (s.gated) spec.layout_params.push_back({"gated_linear_unit", "1"});
  s.vocab_divisor = pick({1, 2, 4, 128});
  EXPECT_TRUE(spec.ApplyParams(s.layout).ok());
  EXPECT_TRUE(s.layout
                  .SetParam("make_vocab_size_divisible_by",
                            absl::StrCat(s.vocab_divisor))
                  .ok());
  DType dtype = std::vector<DType>{DType::kBF16, DType::kF32, DType::kI8,
                                   DType::kF64}[rng() % 4];
  auto model = spec.Build(s.layout, dtype);
  EXPECT_TRUE(model.ok()) << model.status();
  s.model = std::make_shared<const Model>(*std::move(model));
  s.layers = spec.layers;
  s.heads = spec.heads;
  s.groups = spec.groups;
  for (const TensorInfo& t : s.model->tensors()) {
    Bytes bytes(*TensorBytes(t.shape, t.dtype));
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
    s.full.push_back(std::move(bytes));
  }
  return s;
}

// A random config; explicit uneven stages now and then, and half the time
// its state sharded across a divisor of dp (fsdp), else a third of the
// time its optimizer state (distopt).
inline ParallelConfig RandomConfig(std::mt19937_64& rng, int64_t layers) {
  static const int kTp[] = {1, 2, 3, 4, 6, 8, 16};
  int tp = kTp[rng() % 7];
  int pp = 1 + static_cast<int>(rng() % std::min<int64_t>(layers, 16));
  int dp = 1 + static_cast<int>(rng() % 16);
  std::vector<int64_t> stages;
  if (pp > 1 && rng() % 2) {
    stages.assign(pp, 1);
    for (int64_t extra = layers - pp; extra > 0; --extra) ++stages[rng() % pp];
  }
  ParallelConfig c = *ParallelConfig::Create(tp, pp, dp, stages);
  if (rng() % 2) {
    std::vector<int> divisors;
    for (int d = 1; d <= dp; ++d) {
      if (dp % d == 0) divisors.push_back(d);
    }
    c = *c.WithFsdp(divisors[rng() % divisors.size()]);
  } else if (rng() % 3 == 0) {
    c = *c.WithDistopt(true);
  }
  return c;
}

// A random config of at most `max_world` ranks, drawn as RandomConfig
// draws them.
inline ParallelConfig RandomConfigUpTo(std::mt19937_64& rng, int64_t layers,
                                       int max_world) {
  for (;;) {
    ParallelConfig c = RandomConfig(rng, layers);
    if (c.world_size() <= max_world) return c;
  }
}

// The placement of `s` under a random config of at most `max_world` ranks
// that can hold it.
inline std::shared_ptr<const Placement> RandomPlacement(std::mt19937_64& rng,
                                                        const Scenario& s,
                                                        int max_world) {
  for (;;) {
    auto p = Placement::Create(s.layout, s.model,
                               RandomConfigUpTo(rng, s.layers, max_world));
    if (p.ok()) return std::make_shared<const Placement>(*std::move(p));
  }
}

// The oracle's view of one tensor on one tp rank: for each local index along
// the split dim, the global index it holds, or -1 for a padding row.

inline std::vector<int64_t> OracleRows(const TensorInfo& t, const OracleRule& r,
                                       int64_t divisor, int tp, int tp_rank) {
  std::vector<int64_t> rows;
  if (r.split < 0) return rows;
  const int64_t d = t.shape[r.split];
  if (r.vocab) {
    int64_t padded = (d + divisor * tp - 1) / (divisor * tp) * (divisor * tp);
    for (int64_t i = 0; i < padded / tp; ++i) {
      int64_t g = tp_rank * (padded / tp) + i;
      rows.push_back(g < d ? g : -1);
    }
    return rows;
  }
  const int64_t block = d / r.blocks, part = block / tp;
  for (int b = 0; b < r.blocks; ++b) {
    for (int64_t j = 0; j < part; ++j)
      rows.push_back(b * block + tp_rank * part + j);
  }
  return rows;
}

// The oracle's tp shard of one tensor as element numbers: for each local
// element in row-major order, the global element (row-major number) it
// holds, or -1 for padding.
inline std::vector<int64_t> OracleElements(const TensorInfo& t,
                                           const OracleRule& r,
                                           const std::vector<int64_t>& rows) {
  const int64_t total = *NumElements(t.shape);
  std::vector<int64_t> out;
  if (r.split < 0) {
    out.resize(total);
    std::iota(out.begin(), out.end(), 0);
    return out;
  }
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < r.split; ++d) outer *= t.shape[d];
  for (size_t d = r.split + 1; d < t.shape.size(); ++d) inner *= t.shape[d];
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < inner; ++k) {
        out.push_back(
            rows[i] < 0 ? -1 : (o * t.shape[r.split] + rows[i]) * inner + k);
      }
    }
  }
  return out;
}

// FSDP's chunk `chunk` of `fsdp` of a tp shard of `rows` rows (dimension
// 0), by torch.chunk: ceil(rows / fsdp) rows each, the last ones smaller or
// empty. A scalar is held whole by every chunk.
inline std::vector<int64_t> OracleChunk(const std::vector<int64_t>& elements,
                                        int64_t rows, bool scalar, int fsdp,
                                        int chunk) {
  if (scalar || fsdp == 1) return elements;
  const int64_t per_row =
      rows == 0 ? 0 : static_cast<int64_t>(elements.size()) / rows;
  const int64_t size = (rows + fsdp - 1) / fsdp;
  const int64_t begin = std::min(rows, chunk * size);
  const int64_t end = std::min(rows, begin + size);
  return std::vector<int64_t>(elements.begin() + begin * per_row,
                              elements.begin() + end * per_row);
}

inline Bytes OracleGather(const Bytes& full, const TensorInfo& t,
                          const std::vector<int64_t>& elements) {
  const int64_t elem = DTypeSize(t.dtype);
  Bytes out(elements.size() * elem, std::byte{0});
  for (size_t i = 0; i < elements.size(); ++i) {
    if (elements[i] >= 0)
      std::memcpy(&out[i * elem], &full[elements[i] * elem], elem);
  }
  return out;
}

// The oracle's shard group: local name -> (tensor index, elements, bytes).
struct OracleShard {
  int tensor;
  std::vector<int64_t> elements;
  Bytes bytes;
};
using OracleGroup = std::map<std::string, OracleShard>;

// Megatron-Core's distributed optimizer over the groups of (stage, tp
// rank): per group, its parameters in reverse model order, each starting at
// a multiple of 64 elements, the buffer's end padded to lcm(dp, 128); dp
// rank d owns the d-th of dp equal parts, and holds of each parameter's
// optimizer state ("optimizer.KEY.PARAM") the flat elements that fall in
// it. Parameters stay whole on every dp rank.
inline std::vector<OracleGroup> OracleDistopt(
    const Scenario& s, const ParallelConfig& c,
    const std::vector<OracleGroup>& base) {
  const int dp = c.dp();
  std::vector<OracleGroup> out(base.size() * dp);
  auto param_of = [&](const std::string& global) -> int {
    if (global.rfind("optimizer.", 0) != 0) return -1;
    const std::string rest = global.substr(global.find('.', 10) + 1);
    for (int t = 0; t < s.model->size(); ++t) {
      if (s.model->tensor(t).name == rest) return t;
    }
    return -1;
  };
  for (size_t b = 0; b < base.size(); ++b) {
    std::vector<std::pair<int, int64_t>> params;  // (tensor, elements)
    for (const auto& [name, shard] : base[b]) {
      if (param_of(s.model->tensor(shard.tensor).name) < 0) {
        params.push_back(
            {shard.tensor, static_cast<int64_t>(shard.elements.size())});
      }
    }
    std::sort(params.rbegin(), params.rend());
    std::map<int, int64_t> start;
    int64_t end = 0;
    for (const auto& [tensor, n] : params) {
      end = (end + 63) / 64 * 64;
      start[tensor] = end;
      end += n;
    }
    const int64_t multiple = std::lcm(int64_t{dp}, int64_t{128});
    end = (end + multiple - 1) / multiple * multiple;
    for (int d = 0; d < dp; ++d) {
      const int64_t lo = end / dp * d, hi = lo + end / dp;
      OracleGroup& g = out[b * dp + d];
      for (const auto& [name, shard] : base[b]) {
        const TensorInfo& t = s.model->tensor(shard.tensor);
        const int param = param_of(t.name);
        if (param < 0) {
          g[name] = shard;
          continue;
        }
        const int64_t first = std::max(lo, start.at(param));
        const int64_t last = std::min(
            hi, start.at(param) + static_cast<int64_t>(shard.elements.size()));
        if (first >= last) continue;
        std::vector<int64_t> held(
            shard.elements.begin() + (first - start.at(param)),
            shard.elements.begin() + (last - start.at(param)));
        Bytes bytes = OracleGather(s.full[shard.tensor], t, held);
        g[name] = {shard.tensor, std::move(held), std::move(bytes)};
      }
    }
  }
  return out;
}

inline std::vector<OracleGroup> OracleGroups(const Scenario& s,
                                             const ParallelConfig& c) {
  std::vector<int64_t> per_stage = c.stages();
  if (per_stage.empty()) {
    for (int p = 0; p < c.pp(); ++p)
      per_stage.push_back(s.layers / c.pp() + (p < s.layers % c.pp()));
  }
  std::vector<int64_t> first(c.pp() + 1, 0);
  std::partial_sum(per_stage.begin(), per_stage.end(), first.begin() + 1);
  std::regex layer_re(s.layout_name == "hf-llama"
                          ? "model\\.layers\\.(\\d+)\\."
                          : "decoder\\.layers\\.(\\d+)\\.");
  // Group (stage * tp + tp_rank) * fsdp + chunk, as
  // ParallelConfig::ShardGroup numbers them (checked against it below);
  // under distopt, OracleDistopt makes one of each per dp rank.
  const int fsdp = c.fsdp();
  std::vector<OracleGroup> groups(c.tp() * c.pp() * fsdp);
  for (int i = 0; i < s.model->size(); ++i) {
    const TensorInfo& t = s.model->tensor(i);
    OracleRule r = OracleFor(t.name, s.gated);
    std::smatch m;
    std::vector<int> stages;
    std::string local = t.name;
    if (std::regex_search(t.name, m, layer_re)) {
      int64_t layer = std::stoll(m[1].str());
      int stage =
          static_cast<int>(std::upper_bound(first.begin(), first.end(), layer) -
                           first.begin()) -
          1;
      stages = {stage};
      if (s.layout_name == "megatron-core-gpt") {
        local = t.name.substr(0, m.position(1)) +
                std::to_string(layer - first[stage]) +
                t.name.substr(m.position(1) + m.length(1));
      }
    } else {
      stages = {r.stage == 0 ? 0 : c.pp() - 1};
    }
    for (int stage : stages) {
      for (int tr = 0; tr < c.tp(); ++tr) {
        std::vector<int64_t> rows =
            OracleRows(t, r, s.vocab_divisor, c.tp(), tr);
        const std::vector<int64_t> elements = OracleElements(t, r, rows);
        const int64_t local_rows =
            t.shape.empty() ? 1
                            : (r.split == 0 ? static_cast<int64_t>(rows.size())
                                            : t.shape[0]);
        for (int chunk = 0; chunk < fsdp; ++chunk) {
          std::vector<int64_t> held =
              OracleChunk(elements, local_rows, t.shape.empty(), fsdp, chunk);
          Bytes bytes = OracleGather(s.full[i], t, held);
          groups[(stage * c.tp() + tr) * fsdp + chunk][local] = {
              i, std::move(held), std::move(bytes)};
        }
      }
    }
  }
  if (c.distopt()) return OracleDistopt(s, c, groups);
  return groups;
}

inline std::vector<std::vector<Bytes>> OracleBytes(
    const Placement& p, const std::vector<OracleGroup>& oracle) {
  std::vector<std::vector<Bytes>> out(p.num_groups());
  for (int g = 0; g < p.num_groups(); ++g) {
    for (const TensorShard& s : p.shards(g))
      out[g].push_back(oracle[g].at(s.local_name).bytes);
  }
  return out;
}

}  // namespace oracle
}  // namespace scalai

#endif  // SCALAI_TESTS_PTC_PLAN_ORACLE_H_
