#include "ptc/parallel_config.h"

#include <charconv>
#include <numeric>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "ptc/excerpt.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

constexpr absl::string_view kExpected =
    "expected tp=N,pp=N,dp=N[,fsdp=S|,distopt=1][,stages=A:B:...]"
    "[,hosts=H1+H2+...]";

constexpr absl::string_view kFsdpWithDistopt =
    "fsdp and distopt=1 exclude each other: fsdp shards the parameters too, "
    "distopt only the optimizer state";

absl::Status ConfigError(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "config \"", Excerpt(text), "\": ", why, " (", kExpected, ")"));
}

// A positive decimal integer, nothing else (no sign, no spaces, no hex).
absl::StatusOr<int64_t> ParsePositive(absl::string_view text,
                                      absl::string_view key,
                                      absl::string_view value) {
  int64_t out = 0;
  auto [end, ec] =
      std::from_chars(value.data(), value.data() + value.size(), out);
  if (value.empty() || ec != std::errc() ||
      end != value.data() + value.size()) {
    return ConfigError(text, absl::StrCat(Excerpt(key), "=", Excerpt(value),
                                          " is not a number"));
  }
  if (out <= 0) {
    return ConfigError(text, absl::StrCat(Excerpt(key), "=", Excerpt(value),
                                          " must be at least 1"));
  }
  if (out > ParallelConfig::kMaxWorldSize) {
    return ConfigError(
        text, absl::StrCat(Excerpt(key), "=", Excerpt(value), " is too large"));
  }
  return out;
}

}  // namespace

absl::StatusOr<ParallelConfig> ParallelConfig::Parse(absl::string_view raw) {
  absl::string_view text = absl::StripAsciiWhitespace(raw);
  if (text.empty()) return ConfigError(text, "empty");
  int64_t degrees[3] = {0, 0, 0};  // tp, pp, dp
  constexpr absl::string_view kNames[3] = {"tp", "pp", "dp"};
  std::vector<int64_t> stages;
  bool have_stages = false;
  std::optional<std::vector<std::string>> hosts;
  int64_t fsdp = 0;
  std::optional<bool> distopt;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    auto [key, value] = kv;
    if (item.find('=') == absl::string_view::npos) {
      return ConfigError(
          text, absl::StrCat("\"", Excerpt(item), "\" is not key=value"));
    }
    if (key == "stages") {
      if (have_stages) return ConfigError(text, "stages given twice");
      have_stages = true;
      for (absl::string_view layers : absl::StrSplit(value, ':')) {
        ASSIGN_OR_RETURN(int64_t n, ParsePositive(text, "stages", layers));
        stages.push_back(n);
      }
      continue;
    }
    if (key == "fsdp") {
      if (fsdp != 0) return ConfigError(text, "fsdp given twice");
      ASSIGN_OR_RETURN(fsdp, ParsePositive(text, key, value));
      continue;
    }
    if (key == "distopt") {
      if (distopt) return ConfigError(text, "distopt given twice");
      if (value != "0" && value != "1") {
        return ConfigError(
            text, absl::StrCat("distopt=", Excerpt(value), " must be 0 or 1"));
      }
      distopt = value == "1";
      continue;
    }
    if (key == "hosts") {
      if (hosts) return ConfigError(text, "hosts given twice");
      hosts = std::vector<std::string>(absl::StrSplit(value, '+'));
      continue;
    }
    int index = -1;
    for (int i = 0; i < 3; ++i) {
      if (key == kNames[i]) index = i;
    }
    if (index < 0) {
      return ConfigError(text,
                         absl::StrCat("unknown key \"", Excerpt(key), "\""));
    }
    if (degrees[index] != 0) {
      return ConfigError(text, absl::StrCat(key, " given twice"));
    }
    ASSIGN_OR_RETURN(degrees[index], ParsePositive(text, key, value));
  }
  for (int i = 0; i < 3; ++i) {
    if (degrees[i] == 0) {
      return ConfigError(text, absl::StrCat("missing ", kNames[i], "="));
    }
  }
  auto config =
      Create(static_cast<int>(degrees[0]), static_cast<int>(degrees[1]),
             static_cast<int>(degrees[2]), std::move(stages));
  if (config.ok() && fsdp != 0)
    config = config->WithFsdp(static_cast<int>(fsdp));
  if (config.ok() && distopt) config = config->WithDistopt(*distopt);
  if (config.ok() && hosts) config = config->WithHosts(std::move(*hosts));
  if (!config.ok()) return ConfigError(text, config.status().message());
  return config;
}

bool IsHostName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' &&
        c != '-') {
      return false;
    }
  }
  return true;
}

absl::StatusOr<ParallelConfig> ParallelConfig::WithHosts(
    std::vector<std::string> hosts) const {
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (!IsHostName(hosts[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("host name \"", Excerpt(hosts[i]),
                       "\": use 1 to 64 letters, digits, '_' or '-'"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (hosts[j] == hosts[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("host ", hosts[i], " is listed twice"));
      }
    }
  }
  if (!hosts.empty() && world_size() % static_cast<int>(hosts.size()) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", world_size(), " cannot be split over ",
                     hosts.size(), " hosts: each host runs as many ranks"));
  }
  ParallelConfig config = *this;
  config.hosts_ = std::move(hosts);
  return config;
}

absl::StatusOr<ParallelConfig> ParallelConfig::WithFsdp(int fsdp) const {
  if (distopt_ && fsdp > 1) {
    return absl::InvalidArgumentError(kFsdpWithDistopt);
  }
  if (fsdp < 1 || dp_ % fsdp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsdp=", fsdp, " must divide dp=", dp_,
                     ": each run of fsdp data-parallel ranks holds one "
                     "whole copy of the state"));
  }
  ParallelConfig config = *this;
  config.fsdp_ = fsdp;
  return config;
}

absl::StatusOr<ParallelConfig> ParallelConfig::WithDistopt(bool distopt) const {
  if (distopt && fsdp_ > 1) {
    return absl::InvalidArgumentError(kFsdpWithDistopt);
  }
  ParallelConfig config = *this;
  config.distopt_ = distopt;
  return config;
}

int ParallelConfig::HostOfRank(int rank) const {
  if (hosts_.empty()) return 0;
  return rank / RanksPerHost();
}

std::pair<int, int> ParallelConfig::RanksOfHost(int host) const {
  if (hosts_.empty()) return {0, world_size() - 1};
  return {host * RanksPerHost(), (host + 1) * RanksPerHost() - 1};
}

absl::StatusOr<ParallelConfig> ParallelConfig::Create(
    int tp, int pp, int dp, std::vector<int64_t> stages) {
  if (tp < 1 || pp < 1 || dp < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "degrees must be at least 1, got tp=", tp, ",pp=", pp, ",dp=", dp));
  }
  int64_t world = int64_t{tp} * pp * dp;
  if (world > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world size tp*pp*dp = ", world, " exceeds ", kMaxWorldSize));
  }
  if (!stages.empty() && static_cast<int64_t>(stages.size()) != pp) {
    return absl::InvalidArgumentError(
        absl::StrCat("stages lists ", stages.size(), " stages but pp=", pp));
  }
  for (int64_t layers : stages) {
    if (layers < 1) {
      return absl::InvalidArgumentError("every stage needs at least 1 layer");
    }
  }
  ParallelConfig config;
  config.tp_ = tp;
  config.pp_ = pp;
  config.dp_ = dp;
  config.stages_ = std::move(stages);
  return config;
}

RankCoords ParallelConfig::Coords(int rank) const {
  RankCoords c;
  c.tp_rank = rank % tp_;
  c.dp_rank = (rank / tp_) % dp_;
  c.pp_rank = rank / (tp_ * dp_);
  return c;
}

int ParallelConfig::Rank(const RankCoords& c) const {
  return (c.pp_rank * dp_ + c.dp_rank) * tp_ + c.tp_rank;
}

std::string ParallelConfig::DescribeRank(int rank) const {
  const RankCoords c = Coords(rank);
  return absl::StrCat(
      "rank ", rank, " (tp_rank ", c.tp_rank, ", pp_rank ", c.pp_rank,
      fsdp_ > 1  ? absl::StrCat(", fsdp chunk ", c.dp_rank % fsdp_)
      : distopt_ ? absl::StrCat(", dp_rank ", c.dp_rank)
                 : std::string(),
      ")");
}

int ParallelConfig::ShardGroup(int rank) const {
  RankCoords c = Coords(rank);
  const int d = dp_shards();
  return (c.pp_rank * tp_ + c.tp_rank) * d + c.dp_rank % d;
}

int ParallelConfig::SaverOfGroup(int group) const {
  const int d = dp_shards();
  const int slice = group / d;  // pp_rank * tp + tp_rank
  return Rank({slice % tp_, group % d, slice / tp_});
}

absl::StatusOr<std::vector<int64_t>> ParallelConfig::LayersPerStage(
    int64_t num_layers) const {
  if (!stages_.empty()) {
    int64_t sum = std::accumulate(stages_.begin(), stages_.end(), int64_t{0});
    if (sum != num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("stages=", absl::StrJoin(stages_, ":"), " sum to ", sum,
                       " layers but the model has ", num_layers));
    }
    return stages_;
  }
  if (pp_ > num_layers && pp_ > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pp=", pp_, " needs at least ", pp_,
                     " layers but the model has ", num_layers));
  }
  std::vector<int64_t> layers(pp_, num_layers / pp_);
  for (int64_t s = 0; s < num_layers % pp_; ++s) ++layers[s];
  return layers;
}

std::string ParallelConfig::ToString() const {
  std::string out = absl::StrCat("tp=", tp_, ",pp=", pp_, ",dp=", dp_);
  if (fsdp_ > 1) absl::StrAppend(&out, ",fsdp=", fsdp_);
  if (distopt_) absl::StrAppend(&out, ",distopt=1");
  if (!stages_.empty())
    absl::StrAppend(&out, ",stages=", absl::StrJoin(stages_, ":"));
  if (!hosts_.empty())
    absl::StrAppend(&out, ",hosts=", absl::StrJoin(hosts_, "+"));
  return out;
}

std::optional<int> ExtraSourceRank(const ParallelConfig& saved,
                                   const std::set<int>& saved_ranks,
                                   const ParallelConfig& now, int rank) {
  const RankCoords c = now.Coords(rank);
  const bool same_shard = c.tp_rank < saved.tp() && c.pp_rank < saved.pp();
  std::vector<int> candidates;
  if (same_shard && c.dp_rank < saved.dp()) candidates.push_back(saved.Rank(c));
  if (same_shard) candidates.push_back(saved.Rank({c.tp_rank, 0, c.pp_rank}));
  candidates.push_back(0);
  for (int r : candidates) {
    if (saved_ranks.contains(r)) return r;
  }
  return std::nullopt;
}

}  // namespace scalai
