// A ParallelConfig is a job's tensor/pipeline/data parallel degrees, with an
// optional sharding of its state across data-parallel ranks (fsdp=S, or
// distopt=1 for the optimizer state alone), an
// optional explicit split of layers over pipeline stages and, for a job that
// spans hosts, the hosts that run it. Ranks are numbered in Megatron order:
// tp varies fastest, then dp, then pp; host i of H runs the contiguous block
// of ranks [i*W/H, (i+1)*W/H), as launchers number them.
//
//   ASSIGN_OR_RETURN(auto c, ParallelConfig::Parse("tp=2,pp=2,dp=4,fsdp=2"));
//   RankCoords rc = c.Coords(5);  // tp_rank 1, dp_rank 2, pp_rank 0
//   int g = c.ShardGroup(5);      // (tp 1, pp 0, chunk 0): 2
//   ASSIGN_OR_RETURN(std::vector<int64_t> layers, c.LayersPerStage(24));
#ifndef SCALAI_PTC_PARALLEL_CONFIG_H_
#define SCALAI_PTC_PARALLEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace scalai {

struct RankCoords {
  int tp_rank = 0;
  int dp_rank = 0;
  int pp_rank = 0;
  friend bool operator==(const RankCoords&, const RankCoords&) = default;
};

class ParallelConfig {
 public:
  // The largest degree and world size accepted (65536 ranks): beyond the
  // largest jobs run today, and small enough that a mount's tree of every
  // rank fits in memory; an absurd config is refused before anything is
  // allocated for it.
  static constexpr int64_t kMaxWorldSize = int64_t{1} << 16;

  // Parses "tp=2,pp=4,dp=8", optionally with ",fsdp=4" or ",distopt=1",
  // ",stages=6:6:6:6" and ",hosts=h0+h1". Keys may come in any order; tp,
  // pp and dp are required.
  // Surrounding whitespace (the newline of `echo`) is ignored.
  static absl::StatusOr<ParallelConfig> Parse(absl::string_view text);

  // Builds and validates a config from degrees; `stages` may be empty.
  static absl::StatusOr<ParallelConfig> Create(
      int tp, int pp, int dp, std::vector<int64_t> stages = {});

  int tp() const { return tp_; }
  int pp() const { return pp_; }
  int dp() const { return dp_; }
  int world_size() const { return tp_ * pp_ * dp_; }
  // Into how many chunks every tensor is cut on dimension 0 after its
  // tensor-parallel split (FSDP, ZeRO-3, HSDP): data-parallel rank d holds
  // chunk d % fsdp(). 1 (the default) when dp ranks hold whole replicas.
  int fsdp() const { return fsdp_; }
  // The same config with its state sharded across runs of `fsdp`
  // consecutive dp ranks; fsdp must divide dp.
  absl::StatusOr<ParallelConfig> WithFsdp(int fsdp) const;
  // Megatron-Core's distributed optimizer: parameters replicated across dp
  // ranks, their optimizer state cut across them (Placement says how).
  bool distopt() const { return distopt_; }
  absl::StatusOr<ParallelConfig> WithDistopt(bool distopt) const;
  // How many different shards the dp ranks of one (tp_rank, pp_rank) hold:
  // fsdp(), or dp() under distopt (each its own part of the state).
  int dp_shards() const { return distopt_ ? dp_ : fsdp_; }
  // Explicit layers per stage, or empty for the default split.
  const std::vector<int64_t>& stages() const { return stages_; }
  // The hosts that run the job, in order, or empty: every rank on one host.
  const std::vector<std::string>& hosts() const { return hosts_; }
  // The same config run by `hosts`: each a host name (IsHostName), listed
  // once, their number dividing the world size.
  absl::StatusOr<ParallelConfig> WithHosts(
      std::vector<std::string> hosts) const;
  // The index in hosts() of the host that runs `rank` (0 without hosts).
  int HostOfRank(int rank) const;
  // The ranks [first, last] that host hosts()[host] runs: a contiguous
  // block, as launchers number them (every rank without hosts).
  std::pair<int, int> RanksOfHost(int host) const;

  RankCoords Coords(int rank) const;
  int Rank(const RankCoords& coords) const;
  // How errors name what a rank holds: "rank 5 (tp_rank 1, pp_rank 0)",
  // with ", fsdp chunk 0" under fsdp and ", dp_rank 2" under distopt.
  std::string DescribeRank(int rank) const;

  // Ranks with the same (tp_rank, pp_rank, dp_rank % D), D = dp_shards(),
  // hold the same model shard; this numbers those groups 0..tp*pp*D-1 as
  // (pp_rank * tp + tp_rank) * D + dp_rank % D (with D = 1, the number
  // stores have always used).
  int ShardGroup(int rank) const;
  int num_shard_groups() const { return tp_ * pp_ * dp_shards(); }
  // The dp shard (dp_rank % D: the fsdp chunk, or the distopt dp rank) the
  // ranks of `group` hold.
  int ChunkOfGroup(int group) const { return group % dp_shards(); }
  // The rank that saves `group`'s shard: the one of the first run of
  // data-parallel ranks (dp_rank < D).
  int SaverOfGroup(int group) const;
  // Whether `rank` saves its group's shard (dp_rank < D); the others
  // hold replicas of a saver's shard.
  bool SavesShard(int rank) const { return Coords(rank).dp_rank < dp_shards(); }

  // Layers held by each pipeline stage for a model of `num_layers` layers:
  // the explicit stages when given (checked against num_layers), else as even
  // as possible with earlier stages taking the remainder.
  absl::StatusOr<std::vector<int64_t>> LayersPerStage(int64_t num_layers) const;

  // "tp=2,pp=4,dp=8" (with ",fsdp=...", ",distopt=1", ",stages=..." and
  // ",hosts=..." when given; fsdp=1 and distopt=0 are the defaults and
  // never written).
  std::string ToString() const;

  friend bool operator==(const ParallelConfig&,
                         const ParallelConfig&) = default;

 private:
  // With hosts: world_size() / hosts().size() (WithHosts checks it divides).
  int RanksPerHost() const {
    return world_size() / static_cast<int>(hosts_.size());
  }
  int tp_ = 1;
  int pp_ = 1;
  int dp_ = 1;
  int fsdp_ = 1;
  bool distopt_ = false;
  std::vector<int64_t> stages_;
  std::vector<std::string> hosts_;
};

// Whether `name` may name a host (or a job): 1 to 64 letters, digits, '_' or
// '-', so that hosts join with '+' and configs with ','.
bool IsHostName(absl::string_view name);

// Whose saved extra/ files (docs/reference.md) rank `rank` of `now` sees, of a
// step saved under `saved` by the ranks in `saved_ranks`: the saved rank
// with the same coordinates, else the one with the same (tp_rank, pp_rank)
// and dp_rank 0, else saved rank 0; among those, the first that saved any.
// nullopt when none did.
std::optional<int> ExtraSourceRank(const ParallelConfig& saved,
                                   const std::set<int>& saved_ranks,
                                   const ParallelConfig& now, int rank);

}  // namespace scalai

#endif  // SCALAI_PTC_PARALLEL_CONFIG_H_
