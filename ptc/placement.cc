#include "ptc/placement.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ptc/checked_math.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

absl::Status TensorError(const TensorInfo& t, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("tensor ", t.name, " ", ShapeToString(t.shape), ": ", why));
}

// The pieces tensor-parallel rank `tp_rank` of `tp` holds of `t` under `rule`,
// with the local extent along the split dimension.
struct SplitResult {
  std::vector<ShardPiece> pieces;
  int64_t local_extent = 0;
};

absl::StatusOr<SplitResult> SplitTensor(const TensorInfo& t,
                                        const LayoutRule& rule,
                                        int64_t vocab_divisor,
                                        std::optional<int64_t> units, int tp,
                                        int tp_rank) {
  const int dim = rule.split;
  const int64_t extent = t.shape[dim];
  if (units) {
    // Megatron-Core's own rule (num_query_groups % tp == 0): a rank that
    // held part of a head or a query group could not compute attention.
    const std::string name = Layout::UnitName(rule.units);
    if (*units < 1 || extent % *units != 0) {
      return TensorError(
          t, absl::StrCat("dim ", dim, " (size ", extent, ") does not hold ",
                          *units, " ", name, " (", rule.units, ")"));
    }
    if (*units % tp != 0) {
      return TensorError(t, absl::StrCat(*units, " ", name,
                                         " cannot be split across tp=", tp));
    }
  }
  SplitResult out;
  auto piece = [&](int64_t local_begin, int64_t global_begin, int64_t len,
                   bool zero) {
    Shape local_origin(t.shape.size(), 0), global_origin(t.shape.size(), 0);
    Shape shape = t.shape;
    local_origin[dim] = local_begin;
    global_origin[dim] = global_begin;
    shape[dim] = len;
    out.pieces.push_back(
        {Box(local_origin, shape), Box(global_origin, shape), zero, -1, {}});
  };
  if (rule.vocab) {
    // Rows padded to a multiple of divisor * tp; the padding rows are zeros
    // that exist only in shards.
    ASSIGN_OR_RETURN(int64_t multiple, CheckedMul(vocab_divisor, tp));
    int64_t padded = (extent + multiple - 1) / multiple * multiple;
    out.local_extent = padded / tp;
    int64_t begin = tp_rank * out.local_extent;
    int64_t data = std::max<int64_t>(
        0, std::min(extent, begin + out.local_extent) - begin);
    if (data > 0) piece(0, begin, data, false);
    // Padding's global box lies past the true rows, in the tensor as padded
    // for this tp.
    if (data < out.local_extent)
      piece(data, begin + data, out.local_extent - data, true);
    return out;
  }
  if (extent % rule.blocks != 0) {
    return TensorError(
        t, absl::StrCat("dim ", dim, " (size ", extent, ") does not hold ",
                        rule.blocks, " equal blocks"));
  }
  const int64_t block = extent / rule.blocks;
  if (block % tp != 0) {
    if (rule.blocks == 1) {
      return TensorError(t, absl::StrCat("dim ", dim, " (size ", extent,
                                         ") is not divisible by tp=", tp));
    }
    return TensorError(
        t, absl::StrCat("dim ", dim, " holds ", rule.blocks, " blocks of ",
                        block, ", not divisible by tp=", tp));
  }
  const int64_t part = block / tp;
  for (int b = 0; b < rule.blocks; ++b) {
    piece(b * part, b * block + tp_rank * part, part, false);
  }
  out.local_extent = part * rule.blocks;
  return out;
}

// Appends to `out` the parts of `pieces` inside `region` of the local
// tensor, with local boxes relative to the region's origin: in the local
// tensor again (view_offset -1) or in a view of it.
void AppendCut(const std::vector<ShardPiece>& pieces, const Box& region,
               int64_t view_offset, const Shape& view_shape,
               std::vector<ShardPiece>& out) {
  for (const ShardPiece& piece : pieces) {
    const Box common = Intersect(piece.local, region);
    if (common.empty()) continue;
    Shape local = common.origin(), global = piece.global.origin();
    for (int d = 0; d < common.rank(); ++d) {
      global[d] += common.begin(d) - piece.local.begin(d);
      local[d] -= region.begin(d);
    }
    out.push_back({Box(std::move(local), common.shape()),
                   Box(std::move(global), common.shape()), piece.zero_fill,
                   view_offset, view_shape});
  }
}

// Chunk `chunk` of `fsdp` of a tensor-parallel shard, cut on dimension 0 by
// torch.chunk's rule: chunks of ceil(rows / fsdp) rows, the last ones
// smaller or empty. A scalar has no rows to cut: every chunk holds it whole.
absl::StatusOr<TensorShard> ChunkOf(const TensorShard& shard, DType dtype,
                                    int fsdp, int chunk) {
  if (fsdp == 1 || shard.local_shape.empty()) return shard;
  const int64_t rows = shard.local_shape[0];
  const int64_t per = (rows + fsdp - 1) / fsdp;
  const int64_t begin = std::min(rows, chunk * per);
  const int64_t end = std::min(rows, begin + per);
  TensorShard out = shard;
  out.local_shape[0] = end - begin;
  out.pieces.clear();
  Shape origin(shard.local_shape.size(), 0);
  origin[0] = begin;
  AppendCut(shard.pieces, Box(std::move(origin), out.local_shape), -1, {},
            out.pieces);
  ASSIGN_OR_RETURN(out.bytes, TensorBytes(out.local_shape, dtype));
  return out;
}

// Elements [begin, end) of a tp shard flattened row-major, as a 1-D shard:
// the range cut into boxes of whole rows and parts of rows (a head, a body,
// a tail), each a view of the 1-D tensor, then cut again by the tp shard's
// pieces.
absl::StatusOr<TensorShard> FlatRange(const TensorShard& shard,
                                      const TensorInfo& t, int64_t begin,
                                      int64_t end) {
  const Shape& shape = shard.local_shape;
  if (shape.size() > 2) {
    return TensorError(
        t, absl::StrCat("distopt=1 cuts optimizer state flat, over at most 2 "
                        "dimensions; this tensor has ",
                        shape.size()));
  }
  std::vector<Box> boxes;
  if (shape.size() < 2) {
    boxes.push_back(shape.empty() ? Box({}, {}) : Box({begin}, {end - begin}));
  } else {
    const int64_t cols = shape[1];
    int64_t r0 = begin / cols, c0 = begin % cols;
    const int64_t r1 = end / cols, c1 = end % cols;
    if (r0 == r1) {
      boxes.push_back(Box({r0, c0}, {1, c1 - c0}));
    } else {
      if (c0 > 0) boxes.push_back(Box({r0++, c0}, {1, cols - c0}));
      if (r1 > r0) boxes.push_back(Box({r0, 0}, {r1 - r0, cols}));
      if (c1 > 0) boxes.push_back(Box({r1, 0}, {1, c1}));
    }
  }
  TensorShard out = shard;
  out.local_shape = {end - begin};
  out.pieces.clear();
  out.flat_begin = begin;
  const Shape strides = RowMajorStrides(shape);
  for (const Box& view : boxes) {
    int64_t at = -begin;  // the view's first element in the 1-D tensor
    for (int d = 0; d < view.rank(); ++d) at += view.begin(d) * strides[d];
    AppendCut(shard.pieces, view, at, view.shape(), out.pieces);
  }
  ASSIGN_OR_RETURN(out.bytes, TensorBytes(out.local_shape, t.dtype));
  return out;
}

}  // namespace

std::string ParamOfOptimizerState(const std::string& name) {
  constexpr absl::string_view kPrefix = "optimizer.";
  if (!absl::StartsWith(name, kPrefix)) return "";
  const size_t dot = name.find('.', kPrefix.size());
  return dot == std::string::npos ? "" : name.substr(dot + 1);
}

int OptimizerStateOf(const Model& model, int tensor) {
  const std::string param_name =
      ParamOfOptimizerState(model.tensor(tensor).name);
  if (param_name.empty()) return -1;
  const TensorInfo* param = model.Find(param_name);
  if (param == nullptr) return -1;
  return static_cast<int>(param - model.tensors().data());
}

absl::StatusOr<Placement> Placement::Create(const Layout& layout,
                                            std::shared_ptr<const Model> model,
                                            const ParallelConfig& config) {
  Placement p;
  p.config_ = config;
  p.model_ = std::move(model);
  const Model& m = *p.model_;

  std::vector<TensorRule> rules;
  rules.reserve(m.size());
  for (const TensorInfo& t : m.tensors()) {
    ASSIGN_OR_RETURN(TensorRule rule, layout.Classify(t.name));
    if (rule.layer) {
      if (*rule.layer >= (int64_t{1} << 32)) {
        return TensorError(
            t, absl::StrCat("layer number ", *rule.layer, " is too large"));
      }
      p.num_layers_ = std::max(p.num_layers_, *rule.layer + 1);
    }
    rules.push_back(rule);
  }
  {
    auto layers = config.LayersPerStage(p.num_layers_);
    if (!layers.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config ", config.ToString(), ": ", layers.status().message()));
    }
    p.layers_per_stage_ = *std::move(layers);
  }
  std::vector<int64_t> stage_first(config.pp() + 1, 0);
  for (int s = 0; s < config.pp(); ++s) {
    stage_first[s + 1] = stage_first[s] + p.layers_per_stage_[s];
  }

  const std::optional<Layout::Tie> tie = layout.ActiveTie();
  if (tie) {
    if (const TensorInfo* output = m.Find(tie->output)) {
      return TensorError(
          *output,
          absl::StrCat("the model is tied (", tie->when, "=1): ", tie->output,
                       " is ", tie->input,
                       ", stored once, so the model must not hold it"));
    }
  }
  const int64_t vocab_divisor =
      layout.IntParam("make_vocab_size_divisible_by").value_or(1);
  const std::optional<int64_t> vocab_size = layout.IntParam("vocab_size");
  // The groups of (stage, tp rank, fsdp chunk); distopt then gives each dp
  // rank its own (ExpandDistopt).
  p.groups_.resize(config.tp() * config.pp() * config.fsdp());
  if (config.distopt() && tie && config.pp() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("config ", config.ToString(),
                     ": distopt=1 with embeddings tied across "
                     "pipeline stages (",
                     tie->when, "=1) is not supported yet"));
  }

  for (int i = 0; i < m.size(); ++i) {
    const TensorInfo& t = m.tensor(i);
    const TensorRule& tr = rules[i];
    const LayoutRule& rule = *tr.rule;
    if (rule.split >= static_cast<int>(t.shape.size())) {
      return TensorError(
          t, absl::StrCat("layout rule \"", rule.match, "\" splits dim ",
                          rule.split, " but the tensor has ", t.shape.size(),
                          " dims"));
    }
    if (rule.vocab && vocab_size && *vocab_size != t.shape[rule.split]) {
      return TensorError(
          t, absl::StrCat("has ", t.shape[rule.split],
                          " vocabulary rows but vocab_size=", *vocab_size));
    }
    // Stages that hold the tensor.
    int first_stage = 0, last_stage = 0;
    int64_t local_layer = 0;
    if (tr.layer) {
      auto it =
          std::upper_bound(stage_first.begin(), stage_first.end(), *tr.layer);
      first_stage = last_stage = static_cast<int>(it - stage_first.begin()) - 1;
      local_layer = *tr.layer - stage_first[first_stage];
    } else {
      switch (rule.stage) {
        case StagePolicy::kFirst:
          first_stage = last_stage = 0;
          break;
        case StagePolicy::kLast:
          first_stage = last_stage = config.pp() - 1;
          break;
        case StagePolicy::kFirstAndLast:
        case StagePolicy::kAll:
          first_stage = 0;
          last_stage = config.pp() - 1;
          break;
      }
    }
    // The tied input embedding: also on the last stage, under the output's
    // name, when that stage does not hold it already.
    const bool tied_input = tie && t.name == tie->input && config.pp() > 1;
    if (tied_input) last_stage = config.pp() - 1;
    std::string local_name = layout.LocalName(t.name, tr, local_layer);
    ASSIGN_OR_RETURN(int64_t full_bytes, TensorBytes(t.shape, t.dtype));
    for (int tp_rank = 0; tp_rank < config.tp(); ++tp_rank) {
      TensorShard shard;
      shard.tensor = i;
      shard.local_name = local_name;
      shard.local_shape = t.shape;
      shard.split_dim = rule.split;
      if (rule.split < 0) {
        shard.pieces.push_back(
            {Box::Full(t.shape), Box::Full(t.shape), false, -1, {}});
        shard.bytes = full_bytes;
      } else {
        const std::optional<int64_t> units =
            rule.units.empty() ? std::nullopt : layout.IntParam(rule.units);
        ASSIGN_OR_RETURN(
            SplitResult split,
            SplitTensor(t, rule, vocab_divisor, units, config.tp(), tp_rank));
        shard.local_shape[rule.split] = split.local_extent;
        shard.pieces = std::move(split.pieces);
        ASSIGN_OR_RETURN(shard.bytes, TensorBytes(shard.local_shape, t.dtype));
      }
      for (int chunk = 0; chunk < config.fsdp(); ++chunk) {
        ASSIGN_OR_RETURN(TensorShard held,
                         ChunkOf(shard, t.dtype, config.fsdp(), chunk));
        TiedCopy copy;
        for (int s = first_stage; s <= last_stage; ++s) {
          if ((rule.stage == StagePolicy::kFirstAndLast || tied_input) &&
              !tr.layer && s != first_stage && s != last_stage) {
            continue;
          }
          const int group = (s * config.tp() + tp_rank) * config.fsdp() + chunk;
          Group& g = p.groups_[group];
          ASSIGN_OR_RETURN(g.bytes, CheckedAdd(g.bytes, held.bytes));
          g.shards.push_back(held);
          // Shards are appended in model order and never move.
          const int index = static_cast<int>(g.shards.size()) - 1;
          if (tied_input && s == first_stage) {
            copy.input_group = group;
            copy.input_shard = index;
          } else if (tied_input && s == last_stage) {
            g.shards.back().local_name = tie->output;
            copy.output_group = group;
            copy.output_shard = index;
          }
        }
        if (tied_input) p.tied_copies_.push_back(copy);
      }
    }
  }
  if (config.distopt()) RETURN_IF_ERROR(p.ExpandDistopt());
  return p;
}

absl::Status Placement::ExpandDistopt() {
  const Model& m = *model_;
  const int dp = config_.dp();
  std::vector<Group> base = std::move(groups_);
  groups_.assign(base.size() * dp, Group());
  const int64_t bucket_multiple = std::lcm(int64_t{dp}, int64_t{128});
  for (size_t b = 0; b < base.size(); ++b) {
    const std::vector<TensorShard>& shards = base[b].shards;
    std::vector<int> param_of(shards.size());  // OptimizerStateOf, by shard
    for (size_t k = 0; k < shards.size(); ++k)
      param_of[k] = OptimizerStateOf(m, shards[k].tensor);
    // Where each shard of a parameter of the stage's model chunk starts in
    // its buffer: walked in reverse order, each start padded to 64
    // elements; the buffer's end padded to lcm(dp, 128).
    std::map<int, int64_t> start;  // by model tensor
    int64_t end = 0;
    for (size_t k = shards.size(); k-- > 0;) {
      if (param_of[k] >= 0) continue;
      end = (end + 63) / 64 * 64;
      start[shards[k].tensor] = end;
      ASSIGN_OR_RETURN(int64_t n, NumElements(shards[k].local_shape));
      ASSIGN_OR_RETURN(end, CheckedAdd(end, n));
    }
    end = (end + bucket_multiple - 1) / bucket_multiple * bucket_multiple;
    const int64_t per_rank = end / dp;
    for (int d = 0; d < dp; ++d) {
      const int64_t lo = d * per_rank, hi = lo + per_rank;
      Group& g = groups_[b * dp + d];
      for (size_t k = 0; k < shards.size(); ++k) {
        const TensorShard& shard = shards[k];
        const int param = param_of[k];
        if (param < 0) {
          g.shards.push_back(shard);
        } else {
          auto it = start.find(param);
          if (it == start.end()) {
            return absl::InvalidArgumentError(
                absl::StrCat("tensor ", m.tensor(shard.tensor).name,
                             " is optimizer state of ", m.tensor(param).name,
                             ", which its stage does not hold"));
          }
          ASSIGN_OR_RETURN(int64_t n, NumElements(shard.local_shape));
          const int64_t first = std::max(lo, it->second);
          const int64_t last = std::min(hi, it->second + n);
          if (first >= last) continue;  // another dp rank's
          ASSIGN_OR_RETURN(TensorShard flat,
                           FlatRange(shard, m.tensor(shard.tensor),
                                     first - it->second, last - it->second));
          flat.bucket_offset = first - lo;
          g.shards.push_back(std::move(flat));
        }
        ASSIGN_OR_RETURN(g.bytes, CheckedAdd(g.bytes, g.shards.back().bytes));
      }
    }
  }
  return absl::OkStatus();
}

Placement Placement::CreateFull(std::shared_ptr<const Model> model) {
  Placement p;
  p.model_ = std::move(model);
  p.groups_.resize(1);
  for (int i = 0; i < p.model_->size(); ++i) {
    const TensorInfo& t = p.model_->tensor(i);
    TensorShard shard;
    shard.tensor = i;
    shard.local_name = t.name;
    shard.local_shape = t.shape;
    shard.pieces.push_back(
        {Box::Full(t.shape), Box::Full(t.shape), false, -1, {}});
    shard.bytes = *TensorBytes(t.shape, t.dtype);  // checked by Model::Add
    p.groups_[0].bytes += shard.bytes;
    p.groups_[0].shards.push_back(std::move(shard));
  }
  return p;
}

int Placement::ShardIndex(int group, int tensor) const {
  const std::vector<TensorShard>& s = groups_[group].shards;
  auto it = std::lower_bound(
      s.begin(), s.end(), tensor,
      [](const TensorShard& a, int t) { return a.tensor < t; });
  if (it == s.end() || it->tensor != tensor) return -1;
  return static_cast<int>(it - s.begin());
}

}  // namespace scalai
