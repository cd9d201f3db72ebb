#include "transfer/megatron_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ptc/placement.h"
#include "ptc/status_macros.h"
#include "transfer/files.h"
#include "transfer/torch_archive.h"

namespace scalai {
namespace {

using Kind = PickleValue::Kind;

constexpr char kIterationFile[] = "latest_checkpointed_iteration.txt";
constexpr char kRankFile[] = "model_optim_rng.pt";

std::string Basename(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

absl::Status FileError(const std::string& label, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", why));
}

// The iteration directory and its number: DIR itself when it is iter_N (or
// "release", Megatron's name for iteration 0), else the one DIR's
// latest_checkpointed_iteration.txt names.
absl::StatusOr<std::pair<std::string, int64_t>> FindIteration(
    const std::string& dir) {
  const std::string base = Basename(dir);
  int64_t n = 0;
  if (base.rfind("iter_", 0) == 0 && absl::SimpleAtoi(base.substr(5), &n)) {
    return std::make_pair(dir, n);
  }
  if (base == "release") return std::make_pair(dir, int64_t{0});
  std::ifstream in(dir + "/" + kIterationFile);
  if (!in) {
    return FileError(dir, absl::StrCat("has no ", kIterationFile,
                                       " and is not an iter_* directory"));
  }
  std::stringstream text;
  text << in.rdbuf();
  const std::string said(absl::StripAsciiWhitespace(text.str()));
  std::string iter_dir;
  if (said == "release") {
    iter_dir = dir + "/release";
  } else if (absl::SimpleAtoi(said, &n) && n >= 0) {
    iter_dir = absl::StrFormat("%s/iter_%07d", dir, n);
  } else {
    return FileError(
        dir + "/" + kIterationFile,
        absl::StrCat("names \"", said, "\", not an iteration or \"release\""));
  }
  if (!IsDirectory(iter_dir)) {
    return FileError(dir + "/" + kIterationFile,
                     absl::StrCat("names iteration ", said, ", but ",
                                  Basename(iter_dir), " is missing"));
  }
  return std::make_pair(iter_dir, n);
}

std::string RankDir(int tp_rank, int pp_rank, int pp) {
  return pp == 1 ? absl::StrFormat("mp_rank_%02d", tp_rank)
                 : absl::StrFormat("mp_rank_%02d_%03d", tp_rank, pp_rank);
}

// An int of the namespace `args`, when it has one.
std::optional<int64_t> ArgInt(const PickleValue* args, absl::string_view key) {
  if (args == nullptr) return std::nullopt;
  const PickleValue* v = args->Find(key);
  if (v == nullptr || v->kind != Kind::kInt) return std::nullopt;
  return v->integer;
}

// Megatron's param groups of a rank's parameters (name, number of dims):
// weight-decayed ones (neither a bias nor 1-D) and the rest, each group in
// model order, the groups in the order their first parameter appears.
struct ParamGroups {
  std::vector<std::vector<size_t>> members;  // indices into the parameters
  std::vector<bool> decays;                  // by group
};

ParamGroups MegatronParamGroups(
    const std::vector<std::pair<std::string, size_t>>& params) {
  ParamGroups g;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool decays =
        !(params[i].first.ends_with(".bias") || params[i].second == 1);
    auto it = std::find(g.decays.begin(), g.decays.end(), decays);
    if (it == g.decays.end()) {
      g.decays.push_back(decays);
      g.members.emplace_back();
      it = g.decays.end() - 1;
    }
    g.members[it - g.decays.begin()].push_back(i);
  }
  return g;
}

// Whether a saved param group decays its weights, when it says: Megatron's
// wd_mult, else torch's weight_decay.
std::optional<bool> GroupDecays(const PickleValue& group) {
  for (const char* key : {"wd_mult", "weight_decay"}) {
    const PickleValue* v = group.Find(key);
    if (v == nullptr) continue;
    if (v->kind == Kind::kFloat) return v->number != 0;
    if (v->kind == Kind::kInt) return v->integer != 0;
  }
  return std::nullopt;
}

// The members of each saved param group. Megatron-Core orders its groups
// as their first parameter appears; older Megatron puts the weight-decayed
// group first. The order that fits the saved groups' sizes and weight
// decays is the one used.
absl::StatusOr<std::vector<std::vector<size_t>>> MatchParamGroups(
    const ParamGroups& groups, const PickleValue& saved,
    const std::string& label) {
  std::vector<size_t> appearance(groups.members.size()), decayed_first;
  for (size_t g = 0; g < appearance.size(); ++g) appearance[g] = g;
  for (bool decays : {true, false}) {
    for (size_t g = 0; g < groups.decays.size(); ++g)
      if (groups.decays[g] == decays) decayed_first.push_back(g);
  }
  std::vector<size_t> sizes;
  for (const PickleRef& group : saved.items) {
    const PickleValue* numbers =
        group->kind == Kind::kDict ? group->Find("params") : nullptr;
    if (numbers == nullptr || numbers->kind != Kind::kList) {
      return FileError(label, "a param group without its list of params");
    }
    for (const PickleRef& n : numbers->items) {
      if (n->kind != Kind::kInt)
        return FileError(label, "a param group's params are not numbers");
    }
    sizes.push_back(numbers->items.size());
  }
  for (const std::vector<size_t>& order : {appearance, decayed_first}) {
    bool fits = order.size() == sizes.size();
    for (size_t g = 0; fits && g < order.size(); ++g) {
      const std::optional<bool> decays = GroupDecays(*saved.items[g]);
      fits = sizes[g] == groups.members[order[g]].size() &&
             (!decays || *decays == groups.decays[order[g]]);
    }
    if (!fits) continue;
    std::vector<std::vector<size_t>> members;
    for (size_t g : order) members.push_back(groups.members[g]);
    return members;
  }
  std::vector<size_t> want;
  for (const auto& m : groups.members) want.push_back(m.size());
  return FileError(
      label,
      absl::StrCat("the optimizer's param groups hold [",
                   absl::StrJoin(sizes, ", "),
                   "] parameters; Megatron's grouping of the model (weight "
                   "decay, and biases and 1-D tensors without) gives [",
                   absl::StrJoin(want, ", "), "] in some order"));
}

// Moves each parameter's optimizer state out of the optimizer's state dict
// into `r.tensors`. Megatron numbers a rank's parameters by its param
// groups: weight-decayed parameters (neither a bias nor 1-D) and the rest,
// each group in model order, the groups in the order their first parameter
// appears; param_groups[g]["params"] gives the numbers.
absl::Status MoveOptimizerState(PickleValue& root, MegatronRankFile& r,
                                size_t params) {
  PickleValue* outer = root.Find("optimizer");
  if (outer == nullptr || outer->kind != Kind::kDict) return absl::OkStatus();
  PickleValue* inner = outer->Find("optimizer");
  if (inner == nullptr || inner->kind != Kind::kDict) return absl::OkStatus();
  PickleValue* state = inner->Find("state");
  PickleValue* groups = inner->Find("param_groups");
  if (state == nullptr || groups == nullptr || state->kind != Kind::kDict ||
      groups->kind != Kind::kList) {
    return FileError(r.label,
                     "optimizer.optimizer lacks state or param_groups");
  }
  std::vector<std::pair<std::string, size_t>> named;
  for (size_t i = 0; i < params; ++i)
    named.emplace_back(r.tensors[i].name, r.tensors[i].tensor.shape.size());
  ASSIGN_OR_RETURN(
      const std::vector<std::vector<size_t>> members,
      MatchParamGroups(MegatronParamGroups(named), *groups, r.label));
  std::map<int64_t, size_t> param_of;  // optimizer number -> parameter
  for (size_t g = 0; g < members.size(); ++g) {
    const PickleValue* numbers = groups->items[g]->Find("params");
    // (MatchParamGroups checked that these are numbers.)
    for (size_t j = 0; j < members[g].size(); ++j)
      param_of[numbers->items[j]->integer] = members[g][j];
  }
  std::vector<MegatronTensor> moved;
  for (auto& [key, per_param] : state->entries) {
    auto it =
        key->kind == Kind::kInt ? param_of.find(key->integer) : param_of.end();
    if (it == param_of.end() || per_param->kind != Kind::kDict) {
      return FileError(r.label,
                       "optimizer state for a parameter no param "
                       "group lists");
    }
    const MegatronTensor& param = r.tensors[it->second];
    std::vector<std::pair<PickleRef, PickleRef>> kept;
    for (auto& [name, value] : per_param->entries) {
      if (name->kind == Kind::kString && value->kind == Kind::kTensor &&
          value->tensor.shape == param.tensor.shape) {
        moved.push_back(
            {absl::StrCat("optimizer.", name->text, ".", param.name),
             value->tensor});
      } else {
        kept.emplace_back(name, value);
      }
    }
    per_param->entries = std::move(kept);
  }
  // The fp32 master copies of fp16/bf16 parameters, by group and place.
  if (PickleValue* masters = outer->Find("fp32_from_fp16_params");
      masters != nullptr && masters->kind == Kind::kList) {
    if (masters->items.size() != members.size()) {
      return FileError(r.label,
                       "fp32_from_fp16_params has another number of "
                       "groups than param_groups");
    }
    for (size_t g = 0; g < members.size(); ++g) {
      PickleValue& list = *masters->items[g];
      if (list.kind != Kind::kList || list.items.size() != members[g].size()) {
        return FileError(r.label,
                         absl::StrCat("fp32_from_fp16_params group ", g,
                                      " does not list its group's ",
                                      members[g].size(), " parameters"));
      }
      for (size_t j = 0; j < list.items.size(); ++j) {
        const MegatronTensor& param = r.tensors[members[g][j]];
        PickleRef& master = list.items[j];
        if (master->kind != Kind::kTensor ||
            master->tensor.shape != param.tensor.shape) {
          return FileError(r.label,
                           absl::StrCat("the fp32 master copy of ", param.name,
                                        " does not have its shape"));
        }
        moved.push_back({"optimizer.fp32_param." + param.name, master->tensor});
        master = PickleValue::None();
      }
    }
  }
  for (MegatronTensor& t : moved) r.tensors.push_back(std::move(t));
  return absl::OkStatus();
}

absl::Status ReadRank(const ParallelConfig& config, MegatronRankFile& r,
                      int64_t& iteration) {
  ASSIGN_OR_RETURN(auto archive, TorchArchive::Open(r.path, r.label));
  ASSIGN_OR_RETURN(std::string pickle, archive->ReadRecord("data.pkl"));
  absl::StatusOr<PickleRef> parsed = Unpickle(pickle);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(r.label, ": ", parsed.status().message()));
  }
  PickleValue& root = **parsed;
  if (root.kind != Kind::kDict)
    return FileError(r.label, "holds no dict (not a Megatron checkpoint)");
  const PickleValue* args = root.Find("args");
  const std::pair<const char*, int64_t> sizes[] = {
      {"tensor_model_parallel_size", config.tp()},
      {"pipeline_model_parallel_size", config.pp()}};
  for (const auto& [key, want] : sizes) {
    if (std::optional<int64_t> saved = ArgInt(args, key);
        saved && *saved != want) {
      return FileError(
          r.label, absl::StrCat("args.", key, " is ", *saved, "; the config ",
                                config.ToString(), " says ", want));
    }
  }
  if (const PickleValue* it = root.Find("iteration")) {
    if (it->kind != Kind::kInt)
      return FileError(r.label, "iteration is not an int");
    iteration = it->integer;
  }
  PickleValue* model = root.Find("model");
  if (model == nullptr) {
    return FileError(r.label,
                     root.Find("model0") != nullptr
                         ? "holds model0, model1, ... (virtual pipeline "
                           "stages), which are not read"
                         : "has no model");
  }
  if (model->kind != Kind::kDict)
    return FileError(r.label, "model is not a dict");
  std::vector<std::pair<PickleRef, PickleRef>> kept;
  for (auto& [key, value] : model->entries) {
    if (key->kind != Kind::kString)
      return FileError(r.label, "model has a key that is not a string");
    if (value->kind == Kind::kTensor) {
      r.tensors.push_back({key->text, value->tensor});
    } else {
      kept.emplace_back(key, value);  // _extra_state and the like
    }
  }
  model->entries = std::move(kept);
  RETURN_IF_ERROR(MoveOptimizerState(root, r, r.tensors.size()));

  std::vector<SafetensorsEntry> entries;
  for (const MegatronTensor& t : r.tensors) {
    SafetensorsEntry e;
    e.name = t.name;
    e.dtype = t.tensor.dtype;
    e.shape = t.tensor.shape;
    entries.push_back(std::move(e));
  }
  auto header = SafetensorsHeader::Build(
      std::move(entries), {{"scalai.step", absl::StrCat(iteration)}});
  if (!header.ok()) return FileError(r.label, header.status().message());
  r.header = *std::move(header);

  // The remainder, with the storages its tensors still read.
  std::map<std::string, PickleTensor> storages;
  RETURN_IF_ERROR(ForEachTensor(root, [&](PickleValue& t) {
    storages.emplace(t.tensor.storage_key, t.tensor);
  }));
  std::vector<std::pair<std::string, std::string>> records;
  ASSIGN_OR_RETURN(std::string rest, Pickle(root));
  records.emplace_back("data.pkl", std::move(rest));
  for (const auto& [key, t] : storages) {
    ASSIGN_OR_RETURN(
        std::string bytes,
        archive->ReadStorage(key, t.storage_elements * DTypeSize(t.dtype)));
    records.emplace_back("data/" + key, std::move(bytes));
  }
  ASSIGN_OR_RETURN(r.remainder, TorchArchiveBytes("archive", records));
  return absl::OkStatus();
}

// Copies the elements of view `t` of `storage` to `out`, in C order.
// (A non-contiguous view: contiguous ones are written from the storage.)
void Gather(const PickleTensor& t, const char* storage, char* out) {
  const int64_t elem = DTypeSize(t.dtype);
  const int rank = static_cast<int>(t.shape.size());
  std::vector<int64_t> idx(rank, 0);
  for (int64_t n = t.elements(); n > 0; --n) {
    int64_t at = t.offset;
    for (int d = 0; d < rank; ++d) at += idx[d] * t.stride[d];
    std::memcpy(out, storage + at * elem, elem);
    out += elem;
    for (int d = rank - 1; d >= 0 && ++idx[d] == t.shape[d]; --d) idx[d] = 0;
  }
}

}  // namespace

bool IsMegatronCheckpoint(const std::string& dir) {
  const std::string base = Basename(dir);
  struct stat st;
  return (base.rfind("iter_", 0) == 0 || base == "release" ||
          stat((dir + "/" + kIterationFile).c_str(), &st) == 0) &&
         IsDirectory(dir);
}

absl::StatusOr<MegatronCheckpoint> ReadMegatronCheckpoint(
    const std::string& dir, const ParallelConfig& config) {
  if (config.fsdp() > 1 || config.distopt()) {
    return FileError(
        dir, absl::StrCat("a Megatron model_optim_rng.pt checkpoint is read "
                          "under a config without fsdp or distopt, not ",
                          config.ToString(),
                          " (the distributed optimizer's own "
                          "distrib_optim.pt files are not read)"));
  }
  ASSIGN_OR_RETURN(auto found, FindIteration(dir));
  MegatronCheckpoint c;
  c.iter_dir = found.first;
  c.iteration = found.second;
  const std::string iter_name = Basename(c.iter_dir);
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(c.iter_dir));
  std::set<std::string> expected;
  for (int pp_rank = 0; pp_rank < config.pp(); ++pp_rank) {
    for (int tp_rank = 0; tp_rank < config.tp(); ++tp_rank)
      expected.insert(RankDir(tp_rank, pp_rank, config.pp()));
  }
  for (const std::string& name : names) {
    if (name.rfind("mp_rank_", 0) == 0 && !expected.contains(name)) {
      return FileError(
          c.iter_dir + "/" + name,
          absl::StrCat("is not a rank of tp=", config.tp(), ",pp=", config.pp(),
                       " (expected ", absl::StrJoin(expected, ", "), ")"));
    }
  }
  for (int pp_rank = 0; pp_rank < config.pp(); ++pp_rank) {
    for (int tp_rank = 0; tp_rank < config.tp(); ++tp_rank) {
      MegatronRankFile r;
      r.tp_rank = tp_rank;
      r.pp_rank = pp_rank;
      const std::string rank_dir = RankDir(tp_rank, pp_rank, config.pp());
      r.label = absl::StrCat(iter_name, "/", rank_dir, "/", kRankFile);
      r.path = absl::StrCat(c.iter_dir, "/", rank_dir, "/", kRankFile);
      struct stat st;
      if (stat(r.path.c_str(), &st) != 0) {
        return FileError(
            c.iter_dir,
            absl::StrCat(rank_dir, "/", kRankFile,
                         " is missing (tp=", config.tp(), ",pp=", config.pp(),
                         " has ", config.tp() * config.pp(), " rank files)"));
      }
      int64_t iteration = c.iteration;
      RETURN_IF_ERROR(ReadRank(config, r, iteration));
      if (iteration != c.iteration) {
        return FileError(r.label,
                         absl::StrCat("says iteration ", iteration,
                                      "; its directory says ", c.iteration));
      }
      c.ranks.push_back(std::move(r));
    }
  }
  return c;
}

absl::Status StreamMegatronShard(
    const MegatronRankFile& rank,
    const std::function<absl::Status(const char*, int64_t)>& sink) {
  const std::string head = rank.header.Serialize();
  RETURN_IF_ERROR(sink(head.data(), head.size()));
  ASSIGN_OR_RETURN(auto archive, TorchArchive::Open(rank.path, rank.label));
  // One buffer for every storage, grown as needed and never filled;
  // page-aligned, as the archive's records are read into it (IoBuffer).
  IoBuffer storage;
  int64_t capacity = 0;
  std::string key, out;
  for (const MegatronTensor& t : rank.tensors) {
    const int64_t elem = DTypeSize(t.tensor.dtype);
    const int64_t storage_bytes = t.tensor.storage_elements * elem;
    if (t.tensor.storage_key != key || key.empty()) {
      key = t.tensor.storage_key;
      if (storage_bytes > capacity) {
        capacity = std::max(storage_bytes, capacity * 2);
        storage = NewIoBuffer(capacity);
      }
      RETURN_IF_ERROR(
          archive->ReadStorageInto(key, storage_bytes, storage.get()));
    }
    const int64_t bytes = t.tensor.elements() * elem;
    if (t.tensor.contiguous()) {  // the common case: no copy
      RETURN_IF_ERROR(sink(storage.get() + t.tensor.offset * elem, bytes));
      continue;
    }
    out.resize(bytes);
    Gather(t.tensor, storage.get(), out.data());
    RETURN_IF_ERROR(sink(out.data(), out.size()));
  }
  return absl::OkStatus();
}

namespace {

PickleRef TensorValue(const SafetensorsEntry& e, size_t key) {
  auto t = PickleValue::Make(Kind::kTensor);
  t->tensor.storage_key = absl::StrCat(key);
  t->tensor.dtype = e.dtype;
  t->tensor.shape = e.shape;
  t->tensor.stride = RowMajorStrides(e.shape);
  t->tensor.storage_elements = 1;
  for (int64_t d : e.shape) t->tensor.storage_elements *= d;
  return t;
}

PickleRef Dict(bool ordered = false) {
  auto d = PickleValue::Make(Kind::kDict);
  d->ordered_dict = ordered;
  return d;
}

// A dict's or list's copy one level deep (values shared).
PickleRef ShallowCopy(const PickleValue& v) {
  auto c = std::make_shared<PickleValue>(v);
  return c;
}

// Puts the optimizer state tensors back: optimizer.optimizer.state by
// parameter number, param_groups renumbered (hyperparameters kept from the
// remainder's groups), fp32_from_fp16_params by group.
absl::Status PutOptimizerState(
    PickleValue& root, const std::vector<SafetensorsEntry>& tensors,
    const std::vector<size_t>& params,
    const std::map<std::string, std::vector<std::pair<std::string, size_t>>>&
        state_of) {
  PickleValue* outer = root.Find("optimizer");
  if (outer == nullptr || outer->kind != Kind::kDict) {
    root.Set("optimizer", Dict());
    outer = root.Find("optimizer");
  }
  PickleValue* inner = outer->Find("optimizer");
  if (inner == nullptr || inner->kind != Kind::kDict) {
    outer->Set("optimizer", Dict());
    inner = outer->Find("optimizer");
  }
  std::vector<std::pair<std::string, size_t>> named;
  for (size_t i : params)
    named.emplace_back(tensors[i].name, tensors[i].shape.size());
  ParamGroups groups = MegatronParamGroups(named);
  // The groups in the order the remainder's say (older Megatron puts the
  // weight-decayed one first), else as their first parameter appears.
  const PickleValue* old_groups = inner->Find("param_groups");
  if (old_groups != nullptr && old_groups->kind == Kind::kList &&
      old_groups->items.size() == groups.members.size() &&
      !old_groups->items.empty()) {
    const std::optional<bool> first = GroupDecays(*old_groups->items[0]);
    if (first && groups.decays[0] != *first) {
      std::reverse(groups.members.begin(), groups.members.end());
      std::reverse(groups.decays.begin(), groups.decays.end());
    }
  }
  // The hyperparameters of each new group: the remainder's group at the
  // same place, else one with the same weight decay, else none.
  auto hyper = [&](size_t g) -> PickleRef {
    if (old_groups == nullptr || old_groups->kind != Kind::kList) return Dict();
    if (old_groups->items.size() == groups.members.size())
      return ShallowCopy(*old_groups->items[g]);
    for (const PickleRef& old : old_groups->items) {
      if (GroupDecays(*old) == groups.decays[g]) return ShallowCopy(*old);
    }
    return Dict();
  };
  // What every parameter's state holds besides tensors (Adam's step).
  std::vector<std::pair<PickleRef, PickleRef>> scalars;
  if (const PickleValue* old_state = inner->Find("state");
      old_state != nullptr && old_state->kind == Kind::kDict &&
      !old_state->entries.empty() &&
      old_state->entries[0].second->kind == Kind::kDict) {
    scalars = old_state->entries[0].second->entries;
  }
  auto state = Dict();
  auto param_groups = PickleValue::Make(Kind::kList);
  auto masters = PickleValue::Make(Kind::kList);
  bool any_master = false;
  int64_t number = 0;
  for (size_t g = 0; g < groups.members.size(); ++g) {
    PickleRef group = hyper(g);
    if (group->kind != Kind::kDict) group = Dict();
    auto numbers = PickleValue::Make(Kind::kList);
    auto group_masters = PickleValue::Make(Kind::kList);
    for (size_t m : groups.members[g]) {
      const std::string& name = tensors[params[m]].name;
      auto per_param = Dict();
      per_param->entries = scalars;
      PickleRef master = PickleValue::None();
      if (auto it = state_of.find(name); it != state_of.end()) {
        for (const auto& [key, index] : it->second) {
          if (key == "fp32_param") {
            master = TensorValue(tensors[index], index);
            any_master = true;
          } else {
            per_param->Set(key, TensorValue(tensors[index], index));
          }
        }
      }
      state->entries.emplace_back(PickleValue::Int(number), per_param);
      numbers->items.push_back(PickleValue::Int(number++));
      group_masters->items.push_back(master);
    }
    group->Set("params", numbers);
    param_groups->items.push_back(group);
    masters->items.push_back(group_masters);
  }
  inner->Set("state", state);
  inner->Set("param_groups", param_groups);
  if (any_master) outer->Set("fp32_from_fp16_params", masters);
  return absl::OkStatus();
}

}  // namespace

std::string MegatronRankPath(int64_t iteration, int tp_rank, int pp_rank,
                             int pp) {
  return absl::StrFormat("iter_%07d/%s/%s", iteration,
                         RankDir(tp_rank, pp_rank, pp), kRankFile);
}

absl::StatusOr<MegatronRankOutput> BuildMegatronRank(
    const std::vector<SafetensorsEntry>& tensors,
    std::optional<std::string> remainder, const ParallelConfig& config,
    int64_t step) {
  MegatronRankOutput out;
  PickleRef root = Dict();
  std::unique_ptr<TorchArchive> archive;
  if (remainder) {
    ASSIGN_OR_RETURN(archive, TorchArchive::FromBytes(std::move(*remainder),
                                                      kMegatronRemainderPath));
    ASSIGN_OR_RETURN(std::string pickle, archive->ReadRecord("data.pkl"));
    ASSIGN_OR_RETURN(root, Unpickle(pickle));
    if (root->kind != Kind::kDict) {
      return absl::DataLossError(
          absl::StrCat(kMegatronRemainderPath, " holds no dict"));
    }
  }
  std::map<std::string, std::string> old_of;
  // Every storage the remainder reads gets a key that cannot meet the new
  // tensors' ("0", "1", ...); a node shared with one renamed already is
  // left as it is.
  RETURN_IF_ERROR(ForEachTensor(*root, [&](PickleValue& t) {
    std::string& key = t.tensor.storage_key;
    if (old_of.contains(key)) return;
    const std::string renamed = "rest_" + key;
    old_of[renamed] = key;
    key = renamed;
  }));
  for (const auto& [key, old] : old_of) {
    // A storage's size is in the pickle; the record is read whole.
    ASSIGN_OR_RETURN(std::string bytes,
                     archive->ReadRecord("data/" + old, int64_t{1} << 32));
    out.storages.emplace_back(key, std::move(bytes));
  }

  PickleValue* args = root->Find("args");
  if (args == nullptr || args->kind != Kind::kNamespace) {
    root->Set("args", PickleValue::Make(Kind::kNamespace));
    args = root->Find("args");
  }
  args->Set("tensor_model_parallel_size", PickleValue::Int(config.tp()));
  args->Set("pipeline_model_parallel_size", PickleValue::Int(config.pp()));
  if (root->Find("checkpoint_version") == nullptr)
    root->Set("checkpoint_version", PickleValue::Float(3.0));
  root->Set("iteration", PickleValue::Int(step));

  // The model: the shard's parameters in order; the optimizer state of
  // each goes back into the optimizer's structure.
  auto model = Dict(/*ordered=*/true);
  std::vector<size_t> params;
  std::map<std::string, std::vector<std::pair<std::string, size_t>>> state_of;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string param = ParamOfOptimizerState(tensors[i].name);
    if (param.empty()) {
      params.push_back(i);
      model->Set(tensors[i].name, TensorValue(tensors[i], i));
      continue;
    }
    // optimizer.KEY.PARAM
    const std::string key = tensors[i].name.substr(
        10, tensors[i].name.size() - 10 - param.size() - 1);
    state_of[param].emplace_back(key, i);
  }
  root->Set("model", model);
  if (!state_of.empty()) {
    RETURN_IF_ERROR(PutOptimizerState(*root, tensors, params, state_of));
  }
  ASSIGN_OR_RETURN(out.pickle, Pickle(*root));
  return out;
}

}  // namespace scalai
