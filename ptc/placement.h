// A Placement says, for a model, a layout and a parallel config, which box of
// which global tensor every rank holds and under which local name and shape.
// Ranks with the same (tp_rank, pp_rank) hold identical shards (with fsdp=S,
// those with the same (tp_rank, pp_rank, dp_rank % S)), so shards are kept
// per shard group (ParallelConfig::ShardGroup), not per rank.
//
//   ASSIGN_OR_RETURN(Placement p, Placement::Create(layout, model, config));
//   for (const TensorShard& s : p.shards(config.ShardGroup(rank))) ...
//   // s.local_name, s.local_shape, s.pieces (local box <- global box)
#ifndef SCALAI_PTC_PLACEMENT_H_
#define SCALAI_PTC_PLACEMENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/box.h"
#include "ptc/layout.h"
#include "ptc/model.h"
#include "ptc/parallel_config.h"

namespace scalai {

// One contiguous part of a local tensor: `local` holds the elements of the
// global tensor in `global` (same shape), or zeros for vocab padding.
struct ShardPiece {
  Box local;
  // With zero_fill: where the padding lies in the tensor as padded for the
  // config's tp (past the true rows), which no other shard holds.
  Box global;
  bool zero_fill = false;
  // Where `local` is a box: in the local tensor (view_offset -1), or in a
  // view of it, the view_shape tensor whose elements lie row-major from
  // element view_offset on (the pieces of a flat range, under distopt).
  int64_t view_offset = -1;
  Shape view_shape;
};

// One tensor as one rank holds it.
struct TensorShard {
  int tensor = 0;  // index in the model
  std::string local_name;
  Shape local_shape;
  int split_dim = -1;  // -1 when every tp rank holds the whole tensor
  // Ordered by local position (along split_dim, then dimension 0); together
  // they tile the local tensor exactly once. With fsdp, the tp shard's
  // pieces cut to the chunk's rows: none for an empty chunk.
  std::vector<ShardPiece> pieces;
  int64_t bytes = 0;
  // Under distopt, an optimizer state shard is 1-D: the elements
  // [flat_begin, flat_begin + local_shape[0]) of the tp shard flattened,
  // at element bucket_offset of the rank's part of its stage's buffer
  // (Megatron's gbuf_local range). -1 otherwise.
  int64_t flat_begin = -1;
  int64_t bucket_offset = -1;

  // The tensor a piece's local box indexes: its element offset in the
  // local tensor and its shape.
  int64_t ViewOffset(int piece) const {
    return pieces[piece].view_offset < 0 ? 0 : pieces[piece].view_offset;
  }
  const Shape& ViewShape(int piece) const {
    return pieces[piece].view_offset < 0 ? local_shape
                                         : pieces[piece].view_shape;
  }
};

class Placement {
 public:
  // Refuses a config the layout cannot serve (a split dimension or block not
  // divisible by tp, stages that do not fit the layers) naming the tensor or
  // value at fault.
  static absl::StatusOr<Placement> Create(const Layout& layout,
                                          std::shared_ptr<const Model> model,
                                          const ParallelConfig& config);

  // The unsharded model as one shard group: every tensor whole, under its
  // global name, without vocabulary padding. Plans to and from it import and
  // export full models.
  static Placement CreateFull(std::shared_ptr<const Model> model);

  const ParallelConfig& config() const { return config_; }
  const Model& model() const { return *model_; }
  int num_groups() const { return config_.num_shard_groups(); }
  int64_t num_layers() const { return num_layers_; }
  const std::vector<int64_t>& layers_per_stage() const {
    return layers_per_stage_;
  }

  // The shards of a shard group, in model order.
  const std::vector<TensorShard>& shards(int group) const {
    return groups_[group].shards;
  }
  // The index in shards(group) of the model's tensor `tensor`, or -1.
  int ShardIndex(int group, int tensor) const;
  int64_t group_bytes(int group) const { return groups_[group].bytes; }

  // A tied model's two copies of one tp slice of its input embedding
  // (pp > 1, Layout::ActiveTie): the first stage's, and the last stage's
  // under the output's name, each as (group, index in shards(group)). They
  // must hold equal bytes.
  struct TiedCopy {
    int input_group = 0;
    int input_shard = 0;
    int output_group = 0;
    int output_shard = 0;
  };
  const std::vector<TiedCopy>& tied_copies() const { return tied_copies_; }

 private:
  struct Group {
    std::vector<TensorShard> shards;
    int64_t bytes = 0;
  };
  ParallelConfig config_;
  std::shared_ptr<const Model> model_;
  int64_t num_layers_ = 0;
  std::vector<int64_t> layers_per_stage_;
  std::vector<Group> groups_;
  std::vector<TiedCopy> tied_copies_;

  // Turns the groups of (stage, tp rank) into one per dp rank: parameters
  // whole, optimizer state cut as Megatron-Core's distributed optimizer
  // cuts it.
  absl::Status ExpandDistopt();
};

// PARAM of a name "optimizer.KEY.PARAM" (optimizer state, by the naming
// docs/reference.md gives it), or "" for any other name.
std::string ParamOfOptimizerState(const std::string& name);

// The parameter whose optimizer state tensor `tensor` is: its
// ParamOfOptimizerState when the model holds that tensor; -1 for a tensor
// that is not optimizer state.
int OptimizerStateOf(const Model& model, int tensor);

}  // namespace scalai

#endif  // SCALAI_PTC_PLACEMENT_H_
