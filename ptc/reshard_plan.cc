#include "ptc/reshard_plan.h"

#include <algorithm>
#include <functional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "ptc/checked_math.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

// A box of a tensor that old shards hold, with every shard piece holding
// exactly that box.
struct SourceBox {
  Box box;
  struct Holder {
    ShardRef shard;
    int piece = 0;
  };
  std::vector<Holder> holders;
};

// A stretch of rows (dimension 0) of a tensor, and the boxes that tile it,
// sorted along the tensor's inner dimension.
struct SourceBand {
  int64_t begin = 0;
  int64_t end = 0;
  std::vector<SourceBox> boxes;
};

// The index of one tensor's old pieces. In one placement, two pieces of a
// tensor hold the same rows or disjoint rows (tp may cut dimension 0, fsdp
// cuts the rows of every tp shard alike, distopt's flat ranges cut rows
// whole or one row at a time), and within a stretch of rows they differ
// only along one dimension: the tp split dimension when it is not 0, else
// dimension 1 (where distopt cuts a row). So the index is sorted, disjoint
// bands of rows, each holding sorted, disjoint boxes along `inner` (-1 for
// tensors of fewer than 2 dimensions: one box per band).
// Lookups are binary searches, which keeps planning near-linear in the
// number of pieces.
struct TensorIndex {
  int inner = -1;
  std::vector<SourceBand> bands;
};

// The extent of `box` along `dim`; [0, 1) for dim -1 or a scalar's rows.
std::pair<int64_t, int64_t> Span(const Box& box, int dim) {
  if (dim < 0 || dim >= box.rank()) return {0, 1};
  return {box.begin(dim), box.end(dim)};
}

// Sorts by (begin, end) and merges equal spans into one entry; a partial
// overlap is an internal error naming `tensor`.
template <typename T, typename SpanOf, typename Merge>
absl::Status SortAndMerge(std::vector<T>& items, const std::string& tensor,
                          SpanOf span, Merge merge) {
  std::sort(items.begin(), items.end(),
            [&](const T& a, const T& b) { return span(a) < span(b); });
  std::vector<T> merged;
  for (T& item : items) {
    if (!merged.empty() && span(merged.back()) == span(item)) {
      merge(merged.back(), item);
      continue;
    }
    if (!merged.empty() && span(merged.back()).second > span(item).first) {
      return absl::InternalError(
          absl::StrCat("tensor ", tensor, ": old shards overlap partially"));
    }
    merged.push_back(std::move(item));
  }
  items = std::move(merged);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TensorIndex>> BuildIndex(const Placement& from) {
  const Model& model = from.model();
  std::vector<TensorIndex> index(model.size());
  for (int g = 0; g < from.num_groups(); ++g) {
    const std::vector<TensorShard>& shards = from.shards(g);
    for (int k = 0; k < static_cast<int>(shards.size()); ++k) {
      const TensorShard& s = shards[k];
      TensorIndex& ti = index[s.tensor];
      const size_t dims = model.tensor(s.tensor).shape.size();
      ti.inner = s.split_dim > 0 ? s.split_dim : (dims >= 2 ? 1 : -1);
      for (int p = 0; p < static_cast<int>(s.pieces.size()); ++p) {
        const ShardPiece& piece = s.pieces[p];
        if (piece.zero_fill) continue;
        auto [b, e] = Span(piece.global, 0);
        ti.bands.push_back({b, e, {{piece.global, {{ShardRef{g, k}, p}}}}});
      }
    }
  }
  for (int t = 0; t < model.size(); ++t) {
    const std::string& name = model.tensor(t).name;
    TensorIndex& ti = index[t];
    RETURN_IF_ERROR(SortAndMerge(
        ti.bands, name,
        [](const SourceBand& b) { return std::make_pair(b.begin, b.end); },
        [](SourceBand& into, SourceBand& b) {
          for (SourceBox& x : b.boxes) into.boxes.push_back(std::move(x));
        }));
    for (SourceBand& band : ti.bands) {
      RETURN_IF_ERROR(SortAndMerge(
          band.boxes, name,
          [&](const SourceBox& x) { return Span(x.box, ti.inner); },
          [](SourceBox& into, SourceBox& x) {
            into.holders.push_back(x.holders.front());
          }));
    }
  }
  return index;
}

// The first band of `ti` that ends after row b: where the bands that meet
// rows from b on begin.
std::vector<SourceBand>::const_iterator FirstBandFrom(const TensorIndex& ti,
                                                      int64_t b) {
  return std::upper_bound(
      ti.bands.begin(), ti.bands.end(), b,
      [](int64_t v, const SourceBand& band) { return v < band.end; });
}

bool SamePieces(const TensorShard& a, const TensorShard& b) {
  if (a.local_shape != b.local_shape || a.pieces.size() != b.pieces.size())
    return false;
  for (size_t p = 0; p < a.pieces.size(); ++p) {
    const ShardPiece& x = a.pieces[p];
    const ShardPiece& y = b.pieces[p];
    if (x.zero_fill != y.zero_fill || x.local != y.local ||
        x.view_offset != y.view_offset || x.view_shape != y.view_shape) {
      return false;
    }
    if (!x.zero_fill && x.global != y.global) return false;
  }
  return true;
}

// How much a source group is worth reading from: one this host holds
// (others are fetched from peers), then the preferred one; the first of
// equals wins.
using SourceRank = std::function<int(int group)>;

// An old shard with the same pieces in the same local places as `dst`, so
// that its bytes serve `dst` as they are; the best-ranked group wins.
ShardRef FindIdentical(const Placement& from, const TensorIndex& ti,
                       const TensorShard& dst, const SourceRank& rank) {
  ShardRef found;
  auto consider = [&](ShardRef cand) {
    if (SamePieces(dst, from.shards(cand.group)[cand.shard]) &&
        (!found.valid() || rank(cand.group) > rank(found.group))) {
      found = cand;
    }
  };
  for (const ShardPiece& piece : dst.pieces) {
    if (piece.zero_fill) continue;
    // Candidates hold the first data piece's box exactly.
    auto band = FirstBandFrom(ti, Span(piece.global, 0).first);
    if (band == ti.bands.end()) return found;
    const auto inner = Span(piece.global, ti.inner);
    auto it = std::lower_bound(
        band->boxes.begin(), band->boxes.end(), inner,
        [&](const SourceBox& x, auto v) { return Span(x.box, ti.inner) < v; });
    if (it != band->boxes.end() && it->box == piece.global) {
      for (const SourceBox::Holder& h : it->holders) consider(h.shard);
    }
    return found;
  }
  // A shard of padding only (a rank past the vocabulary) is in no interval:
  // look at every old shard of the tensor.
  for (int g = 0; g < from.num_groups(); ++g) {
    int k = from.ShardIndex(g, dst.tensor);
    if (k >= 0) consider(ShardRef{g, k});
  }
  return found;
}

// Elements contiguous in row-major memory from `idx` onward while staying
// inside `box` of a tensor of `shape`.
int64_t ContiguousRun(const Box& box, const Shape& shape, const Shape& idx) {
  int64_t run = 0, stride = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    run += (box.end(d) - idx[d] - 1) * stride;
    if (box.shape()[d] != shape[d]) break;
    stride *= shape[d];
  }
  return run + 1;
}

}  // namespace

absl::StatusOr<ReshardPlan> ReshardPlan::Create(
    std::shared_ptr<const Placement> from, std::shared_ptr<const Placement> to,
    const std::optional<std::vector<int>>& held) {
  const Model& model = from->model();
  if (&model != &to->model()) {
    if (model.size() != to->model().size()) {
      return absl::InvalidArgumentError("placements are of different models");
    }
    for (int t = 0; t < model.size(); ++t) {
      const TensorInfo& a = model.tensor(t);
      const TensorInfo& b = to->model().tensor(t);
      if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "placements are of different models: tensor ", a.name));
      }
    }
  }
  ASSIGN_OR_RETURN(std::vector<TensorIndex> index, BuildIndex(*from));

  ReshardPlan plan;
  plan.from_ = from;
  plan.to_ = to;
  plan.groups_.resize(to->num_groups());
  const ParallelConfig& cfrom = from->config();
  const ParallelConfig& cto = to->config();
  // The first destination shard of each kind, by tensor (first_identical).
  std::vector<std::vector<ShardRef>> seen(model.size());
  for (int g = 0; g < to->num_groups(); ++g) {
    // Prefer the old shard group of the same-numbered rank (the one that
    // saves this group): its bytes are already where they are needed.
    const int first_rank = cto.SaverOfGroup(g);
    const int preferred =
        first_rank < cfrom.world_size() ? cfrom.ShardGroup(first_rank) : -1;
    const SourceRank rank = [&](int group) {
      const bool here =
          !held || std::binary_search(held->begin(), held->end(), group);
      return (here ? 2 : 0) + (group == preferred ? 1 : 0);
    };
    GroupPlan& gp = plan.groups_[g];
    const std::vector<TensorShard>& shards = to->shards(g);
    gp.ops.resize(shards.size());
    gp.in_place.resize(shards.size());
    gp.first_identical.resize(shards.size());
    for (size_t k = 0; k < shards.size(); ++k) {
      const TensorShard& dst = shards[k];
      const TensorIndex& ti = index[dst.tensor];
      std::vector<CopyOp>& ops = gp.ops[k];
      for (int pi = 0; pi < static_cast<int>(dst.pieces.size()); ++pi) {
        const ShardPiece& piece = dst.pieces[pi];
        if (piece.zero_fill) {
          ops.push_back({piece.local, ShardRef{}, {}, pi, 0});
          continue;
        }
        // Every band of rows the piece meets, and in each every box along
        // the inner dimension, must follow the last without a gap.
        auto [b, e] = Span(piece.global, 0);
        auto [ib, ie] = Span(piece.global, ti.inner);
        int64_t covered = b;
        bool gap = false;
        for (auto band = FirstBandFrom(ti, b);
             band != ti.bands.end() && band->begin < e && !gap; ++band) {
          if (band->begin > covered) break;
          auto it = std::upper_bound(band->boxes.begin(), band->boxes.end(), ib,
                                     [&](int64_t v, const SourceBox& x) {
                                       return v < Span(x.box, ti.inner).second;
                                     });
          int64_t inner_covered = ib;
          for (; it != band->boxes.end() && Span(it->box, ti.inner).first < ie;
               ++it) {
            if (Span(it->box, ti.inner).first > inner_covered) break;
            const SourceBox::Holder* h = &it->holders.front();
            for (const SourceBox::Holder& cand : it->holders) {
              if (rank(cand.shard.group) > rank(h->shard.group)) h = &cand;
            }
            const ShardPiece& sp =
                from->shards(h->shard.group)[h->shard.shard].pieces[h->piece];
            Box common = Intersect(piece.global, sp.global);
            Shape dst_origin = common.origin(), src_origin = common.origin();
            for (int d = 0; d < common.rank(); ++d) {
              dst_origin[d] += piece.local.begin(d) - piece.global.begin(d);
              src_origin[d] += sp.local.begin(d) - sp.global.begin(d);
            }
            ops.push_back({Box(std::move(dst_origin), common.shape()), h->shard,
                           std::move(src_origin), pi, h->piece});
            inner_covered = Span(it->box, ti.inner).second;
          }
          if (inner_covered < ie) gap = true;
          covered = band->end;
        }
        if (gap || covered < e) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", model.tensor(dst.tensor).name,
                           ": no old shard holds ", piece.global.ToString()));
        }
      }
      gp.in_place[k] = FindIdentical(*from, ti, dst, rank);
      gp.first_identical[k] = {g, static_cast<int>(k)};
      bool first = true;
      for (ShardRef other : seen[dst.tensor]) {
        if (SamePieces(dst, to->shards(other.group)[other.shard])) {
          gp.first_identical[k] = other;
          first = false;
          break;
        }
      }
      // Only the first of each kind is compared against later.
      if (first) seen[dst.tensor].push_back({g, static_cast<int>(k)});
    }
  }
  return plan;
}

absl::StatusOr<std::vector<Segment>> ReshardPlan::Resolve(
    int group, int shard, int64_t offset, int64_t length) const {
  const TensorShard& dst = to_->shards(group)[shard];
  const int64_t elem = DTypeSize(to_->model().tensor(dst.tensor).dtype);
  ASSIGN_OR_RETURN(int64_t end, CheckedAdd(offset, length));
  if (offset < 0 || length < 0 || end > dst.bytes) {
    return absl::OutOfRangeError(absl::StrCat("byte range [", offset, ", ", end,
                                              ") is outside the shard of ",
                                              dst.bytes, " bytes"));
  }
  const std::vector<CopyOp>& ops = groups_[group].ops[shard];
  std::vector<Segment> out;
  Shape idx, src_idx;
  size_t op_index = 0;
  // A flat shard's pieces lie in views of it (distopt); every other
  // shard's in the local tensor, where an element's index is found once.
  const bool viewed =
      std::any_of(dst.pieces.begin(), dst.pieces.end(),
                  [](const ShardPiece& p) { return p.view_offset >= 0; });
  const Shape local_strides = RowMajorStrides(dst.local_shape);
  // Each piece's view: its strides and element count, found once.
  std::vector<Shape> view_strides;
  std::vector<int64_t> view_elements;
  if (viewed) {
    for (int p = 0; p < static_cast<int>(dst.pieces.size()); ++p) {
      view_strides.push_back(RowMajorStrides(dst.ViewShape(p)));
      int64_t n = 1;
      for (int64_t e : dst.ViewShape(p)) n *= e;
      view_elements.push_back(n);
    }
  }
  // Where element `element` of the local tensor lies in the view of piece
  // `piece`: its index there, or false when outside the view.
  auto index_in = [&](int piece, int64_t element) {
    if (!viewed) {
      idx.resize(dst.local_shape.size());
      for (size_t d = 0; d < idx.size(); ++d) {
        idx[d] = element / local_strides[d];
        element %= local_strides[d];
      }
      return true;
    }
    const int64_t at = element - dst.ViewOffset(piece);
    if (at < 0 || at >= view_elements[piece]) return false;
    const Shape& strides = view_strides[piece];
    idx.resize(strides.size());
    int64_t rest = at;
    for (size_t d = 0; d < strides.size(); ++d) {
      idx[d] = rest / strides[d];
      rest %= strides[d];
    }
    return true;
  };
  for (int64_t pos = offset; pos < end;) {
    const int64_t element = pos / elem, intra = pos % elem;
    if (!viewed) index_in(0, element);
    // Ops are ordered by position, so the next one usually follows the last.
    auto inside = [&](const CopyOp& op) {
      if (viewed && !index_in(op.dst_piece, element)) return false;
      for (size_t d = 0; d < idx.size(); ++d) {
        if (idx[d] < op.dst.begin(d) || idx[d] >= op.dst.end(d)) return false;
      }
      return true;
    };
    if (op_index >= ops.size() || !inside(ops[op_index])) {
      op_index = 0;
      while (op_index < ops.size() && !inside(ops[op_index])) ++op_index;
      if (op_index == ops.size()) {
        return absl::InternalError(
            "plan leaves a destination element uncovered");
      }
    }
    const CopyOp& op = ops[op_index];
    int64_t run = ContiguousRun(op.dst, dst.ViewShape(op.dst_piece), idx);
    Segment seg;
    seg.dst_offset = pos;
    seg.src = op.src;
    if (op.src.valid()) {
      const TensorShard& src = from_->shards(op.src.group)[op.src.shard];
      const Shape& src_view = src.ViewShape(op.src_piece);
      const Shape src_strides = RowMajorStrides(src_view);
      int64_t src_element = src.ViewOffset(op.src_piece);
      src_idx.resize(idx.size());
      for (size_t d = 0; d < idx.size(); ++d) {
        src_idx[d] = op.src_origin[d] + idx[d] - op.dst.begin(d);
        src_element += src_idx[d] * src_strides[d];
      }
      run = std::min(run, ContiguousRun(Box(op.src_origin, op.dst.shape()),
                                        src_view, src_idx));
      seg.src_offset = src_element * elem + intra;
    }
    seg.length = std::min(run * elem - intra, end - pos);
    // Adjacent segments that continue each other merge into one.
    if (!out.empty()) {
      Segment& last = out.back();
      if (last.src == seg.src &&
          last.dst_offset + last.length == seg.dst_offset &&
          (!seg.src.valid() ||
           last.src_offset + last.length == seg.src_offset)) {
        last.length += seg.length;
        pos += seg.length;
        continue;
      }
    }
    out.push_back(seg);
    pos += seg.length;
  }
  return out;
}

PlanSummary ReshardPlan::Summarize() const {
  PlanSummary summary;
  const Model& model = to_->model();
  // Bytes of destination group g that old group h holds (h = -1: none).
  absl::flat_hash_map<std::pair<int, int>, int64_t> kept_cache;
  auto kept = [&](int g, int h) {
    auto [it, inserted] = kept_cache.try_emplace({g, h}, 0);
    if (!inserted) return it->second;
    int64_t bytes = 0;
    for (const TensorShard& dst : to_->shards(g)) {
      const int64_t elem = DTypeSize(model.tensor(dst.tensor).dtype);
      int src_index = h < 0 ? -1 : from_->ShardIndex(h, dst.tensor);
      for (const ShardPiece& piece : dst.pieces) {
        if (piece.zero_fill) {
          bytes += *piece.local.NumElements() * elem;
          continue;
        }
        if (src_index < 0) continue;
        for (const ShardPiece& sp : from_->shards(h)[src_index].pieces) {
          if (sp.zero_fill) continue;
          Box common = Intersect(piece.global, sp.global);
          if (!common.empty()) bytes += *common.NumElements() * elem;
        }
      }
    }
    it->second = bytes;
    return bytes;
  };
  const ParallelConfig& cto = to_->config();
  const ParallelConfig& cfrom = from_->config();
  summary.ranks.reserve(cto.world_size());
  for (int r = 0; r < cto.world_size(); ++r) {
    int g = cto.ShardGroup(r);
    RankTraffic t;
    t.rank = r;
    t.bytes_total = to_->group_bytes(g);
    t.bytes_kept = kept(g, r < cfrom.world_size() ? cfrom.ShardGroup(r) : -1);
    t.bytes_fetched = t.bytes_total - t.bytes_kept;
    summary.bytes_total += t.bytes_total;
    summary.bytes_kept += t.bytes_kept;
    summary.bytes_fetched += t.bytes_fetched;
    summary.ranks.push_back(t);
  }
  for (int g = 0; g < to_->num_groups(); ++g) {
    const std::vector<TensorShard>& shards = to_->shards(g);
    for (size_t k = 0; k < shards.size(); ++k) {
      // Identical shards (a replicated tensor's under tp, or its fsdp chunk)
      // are written once.
      const ShardRef self{g, static_cast<int>(k)};
      if (!groups_[g].in_place[k].valid() &&
          groups_[g].first_identical[k] == self) {
        summary.bytes_to_write += shards[k].bytes;
      }
    }
  }
  return summary;
}

}  // namespace scalai
