#include "transfer/importer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/excerpt.h"
#include "ptc/placement.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "ptc/utf8.h"
#include "transfer/blob_checksum.h"
#include "transfer/megatron_checkpoint.h"
#include "transfer/shard_check.h"
#include "transfer/write_behind.h"

namespace scalai {
namespace {

using nlohmann::json;

// A file to be stored as one blob: a safetensors file copied verbatim, or a
// Megatron rank file whose tensors are written out as one.
struct SourceFile {
  std::string path;
  std::string label;  // how errors name it: "rank-00003/model.safetensors"
  SafetensorsHeader header;
  std::shared_ptr<const MegatronRankFile> megatron;
};

// What an import will commit, worked out before any byte is copied.
struct ImportPlan {
  std::shared_ptr<const Model> model;
  bool new_model = false;
  std::string stored_config;        // a config, or "full"
  std::vector<SourceFile> files;    // each becomes blob i
  std::vector<ShardRecord> groups;  // blob indices refer to `files`
  std::vector<std::pair<SourceFile, int>>
      replicas;  // dp_rank > 0 shard, its group's file
  std::optional<int64_t> step_in_metadata;
  std::optional<int64_t> consumed_samples;  // rank 0's, when it says
  // Files under SRC/rank-R/extra/, stored whole: (rank, path below extra/,
  // the file).
  struct Extra {
    int rank = 0;
    std::string path;
    std::string source;  // a file, or empty when `content` holds the bytes
    std::string content;
  };
  std::vector<Extra> extras;
};

absl::Status UserError(absl::string_view label, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", why));
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

absl::StatusOr<SourceFile> ReadSource(const std::string& path,
                                      const std::string& label) {
  auto header = ReadSafetensorsHeader(path);
  if (!header.ok()) {
    // The codec names the path already; say it with the label users know.
    std::string message(header.status().message());
    if (absl::StartsWith(message, path))
      message = label + message.substr(path.size());
    return absl::Status(header.status().code(), message);
  }
  return SourceFile{path, label, *std::move(header), nullptr};
}

// A non-negative integer of the header's metadata, when it has one.
std::optional<int64_t> MetadataCount(const SafetensorsHeader& h,
                                     const std::string& key) {
  auto it = h.metadata().find(key);
  if (it == h.metadata().end()) return std::nullopt;
  int64_t n = 0;
  const std::string& v = it->second;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || end != v.data() + v.size() || n < 0)
    return std::nullopt;
  return n;
}

// Where each of `shards`' tensors lies in `file`, which must hold exactly
// them (MatchShardHeader).
absl::StatusOr<std::vector<ShardRecord::Location>> MatchShards(
    const Model& model, const std::vector<TensorShard>& shards,
    const SourceFile& file, int blob, absl::string_view where) {
  ASSIGN_OR_RETURN(
      std::vector<int64_t> offsets,
      MatchShardHeader(model, shards, file.header, file.label, where));
  std::vector<ShardRecord::Location> locations;
  for (int64_t at : offsets) locations.push_back({blob, at});
  return locations;
}

// Infers the global tensors from per-group shard files: global layer numbers
// from local ones, global extents from local ones times tp (or vocab_size).
absl::StatusOr<Model> InferModel(
    const Layout& layout, const ParallelConfig& config,
    const std::vector<const SourceFile*>& group_files) {
  const int tp = config.tp(), pp = config.pp(), fsdp = config.fsdp();
  // The pipeline stage of a group.
  auto stage = [&](size_t g) {
    return static_cast<int>(g) / config.dp_shards() / tp;
  };
  // Under distopt, optimizer state is 1-D, a part of its parameter on each
  // dp rank: it takes its parameter's shape once every parameter is known.
  auto distopt_state = [&](const SourceFile& file, const std::string& name) {
    if (!config.distopt()) return false;
    const std::string param = ParamOfOptimizerState(name);
    if (param.empty()) return false;
    for (const SafetensorsEntry& e : file.header.tensors()) {
      if (e.name == param) return true;
    }
    return false;
  };
  std::vector<std::pair<std::string, const SafetensorsEntry*>> states;
  struct Seen {
    TensorRule rule;
    int64_t local_layer = 0;
  };
  // Layers per stage from the local layer numbers each stage holds.
  std::vector<int64_t> max_layer(pp, -1);
  std::vector<std::vector<Seen>> seen(group_files.size());
  for (size_t g = 0; g < group_files.size(); ++g) {
    for (const SafetensorsEntry& e : group_files[g]->header.tensors()) {
      auto rule = layout.Classify(e.name);
      if (!rule.ok())
        return UserError(group_files[g]->label, rule.status().message());
      Seen s{*rule, rule->layer.value_or(0)};
      if (rule->layer)
        max_layer[stage(g)] = std::max(max_layer[stage(g)], *rule->layer);
      seen[g].push_back(s);
    }
  }
  std::vector<int64_t> first(pp + 1, 0);
  if (layout.local_layer_numbering()) {
    std::vector<int64_t> counts(pp);
    for (int p = 0; p < pp; ++p) counts[p] = max_layer[p] + 1;
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    auto expected = config.LayersPerStage(total);
    if (!expected.ok())
      return UserError("checkpoint", expected.status().message());
    if (*expected != counts) {
      std::string got, want;
      for (int p = 0; p < pp; ++p) {
        absl::StrAppend(&got, p ? ":" : "", counts[p]);
        absl::StrAppend(&want, p ? ":" : "", (*expected)[p]);
      }
      return UserError(
          "checkpoint",
          absl::StrCat("stages hold ", got, " layers but ", config.ToString(),
                       " splits ", total, " layers as ", want,
                       " (give the config's stages=)"));
    }
    for (int p = 0; p < pp; ++p) first[p + 1] = first[p] + counts[p];
  }
  const std::optional<int64_t> vocab_size = layout.IntParam("vocab_size");
  // A tied model's last stage holds the input embedding under the output's
  // name: the same tensor, not one of its own.
  const std::optional<Layout::Tie> tie = layout.ActiveTie();
  Model model;
  std::map<std::string, std::string> first_holder;  // global name -> label
  for (size_t g = 0; g < group_files.size(); ++g) {
    const SourceFile& file = *group_files[g];
    for (size_t i = 0; i < file.header.tensors().size(); ++i) {
      const SafetensorsEntry& e = file.header.tensors()[i];
      const Seen& s = seen[g][i];
      if (tie && pp > 1 && e.name == tie->output) continue;
      std::string global_name = e.name;
      if (s.rule.layer && layout.local_layer_numbering()) {
        global_name = absl::StrCat(
            e.name.substr(0, s.rule.layer_digits_pos),
            s.local_layer + first[stage(g)],
            e.name.substr(s.rule.layer_digits_pos + s.rule.layer_digits_len));
      }
      if (distopt_state(file, e.name)) {
        states.push_back({global_name, &e});
        continue;
      }
      // Under fsdp, the first chunk's group names every tensor of its
      // (tp, pp) slice; the rows of all its chunks make the slice's rows.
      // Under distopt, every dp rank holds the parameters whole.
      if (config.ChunkOfGroup(static_cast<int>(g)) != 0) continue;
      Shape shape = e.shape;
      for (int c = 1; c < fsdp && !shape.empty(); ++c) {
        for (const SafetensorsEntry& other :
             group_files[g + c]->header.tensors()) {
          if (other.name == e.name && !other.shape.empty())
            shape[0] += other.shape[0];
        }
      }
      const LayoutRule& rule = *s.rule.rule;
      if (rule.split >= 0 && rule.split < static_cast<int>(shape.size())) {
        if (rule.vocab) {
          if (!vocab_size) {
            return UserError(
                file.label,
                absl::StrCat(
                    "tensor ", e.name, " has padded vocabulary rows; the",
                    " layout parameter vocab_size must be set (scalai ",
                    "init --param vocab_size=N)"));
          }
          shape[rule.split] = *vocab_size;
        } else {
          shape[rule.split] *= tp;
        }
      }
      if (const TensorInfo* known = model.Find(global_name)) {
        if (known->dtype != e.dtype) {
          return UserError(
              file.label,
              absl::StrCat("tensor ", e.name, " is ", DTypeName(e.dtype),
                           " but ", first_holder[global_name], " has ",
                           DTypeName(known->dtype)));
        }
        continue;  // shapes are checked against the placement afterwards
      }
      first_holder[global_name] = file.label;
      RETURN_IF_ERROR(model.Add({global_name, e.dtype, shape}));
    }
  }
  for (const auto& [global_name, e] : states) {
    if (model.Find(global_name) != nullptr) continue;
    const TensorInfo* param = model.Find(ParamOfOptimizerState(global_name));
    if (param == nullptr) continue;  // the placement names what is amiss
    RETURN_IF_ERROR(model.Add({global_name, e->dtype, param->shape}));
  }
  return model;
}

// Every regular file below `dir`, as paths relative to it, in name order.
// A symbolic link is refused, not followed: the files are served to every
// reader of the mount, and a link could name any file of the importing
// user's (/etc/shadow, as root).
absl::Status ListFiles(const std::string& dir, const std::string& prefix,
                       std::vector<std::string>& out) {
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) return ErrnoError(errno, "stat", path);
    if (S_ISLNK(st.st_mode)) {
      return UserError(path,
                       "is a symbolic link (extra/ takes regular files only)");
    }
    if (!IsUtf8(name)) {
      // The step's record keeps the paths, in JSON.
      return UserError(Excerpt(path), "the name is not UTF-8");
    }
    if (S_ISDIR(st.st_mode)) {
      RETURN_IF_ERROR(ListFiles(path, prefix + name + "/", out));
    } else if (S_ISREG(st.st_mode)) {
      out.push_back(prefix + name);
    } else {
      return UserError(path, "is neither a file nor a directory");
    }
  }
  return absl::OkStatus();
}

// A tied model's last stage holds the input embedding again (pp > 1): each
// tp slice must equal the first stage's, or a later view could take either.
absl::Status CompareTiedCopies(const Placement& p,
                               const std::vector<SourceFile>& files,
                               const std::vector<ShardRecord>& groups) {
  for (const Placement::TiedCopy& c : p.tied_copies()) {
    const SourceFile& in = files[c.input_group];
    const SourceFile& out = files[c.output_group];
    ASSIGN_OR_RETURN(MappedFile fa, MappedFile::Open(in.path));
    ASSIGN_OR_RETURN(MappedFile fb, MappedFile::Open(out.path));
    const int64_t bytes = p.shards(c.input_group)[c.input_shard].bytes;
    const int64_t at_a = groups[c.input_group].tensors[c.input_shard].offset;
    const int64_t at_b = groups[c.output_group].tensors[c.output_shard].offset;
    if (at_a + bytes > fa.size() || at_b + bytes > fb.size() ||
        std::memcmp(fa.data() + at_a, fb.data() + at_b, bytes) != 0) {
      return UserError(
          out.label,
          absl::StrCat(p.shards(c.output_group)[c.output_shard].local_name,
                       " differs from ",
                       p.shards(c.input_group)[c.input_shard].local_name,
                       " in ", in.label, " (tied embeddings must be equal)"));
    }
  }
  return absl::OkStatus();
}

absl::Status PlanGroups(const Store& store, const ImportOptions& o,
                        const std::vector<SourceFile>& group_files,
                        ImportPlan& plan);

absl::Status PlanShards(const Store& store, const ImportOptions& o,
                        ImportPlan& plan) {
  const ParallelConfig& config = o.config;
  std::map<int, std::string> rank_dirs;
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(o.src));
  for (const std::string& name : names) {
    int rank = 0;
    if (name.size() == 10 && name.rfind("rank-", 0) == 0 &&
        std::all_of(name.begin() + 5, name.end(), ::isdigit)) {
      std::from_chars(name.data() + 5, name.data() + 10, rank);
      rank_dirs[rank] = name;
    }
  }
  for (const auto& [rank, name] : rank_dirs) {
    if (rank >= config.world_size()) {
      return UserError(o.src + "/" + name,
                       absl::StrCat("an extra rank: config ", config.ToString(),
                                    " has ranks 0..", config.world_size() - 1));
    }
  }
  // The files of the groups' savers (dp_rank 0; the first fsdp dp ranks;
  // every rank under distopt), one per shard group.
  std::vector<SourceFile> group_files(config.num_shard_groups());
  for (int g = 0; g < config.num_shard_groups(); ++g) {
    const int rank = config.SaverOfGroup(g);
    std::string label = absl::StrFormat("rank-%05d/model.safetensors", rank);
    std::string path = o.src + "/" + label;
    if (!rank_dirs.contains(rank) || !Exists(path)) {
      return UserError(
          o.src, absl::StrCat(label, " is missing (config ", config.ToString(),
                              " needs every rank with dp_rank < ",
                              config.dp_shards(), ")"));
    }
    ASSIGN_OR_RETURN(group_files[g], ReadSource(path, label));
  }
  RETURN_IF_ERROR(PlanGroups(store, o, group_files, plan));
  for (const auto& [rank, name] : rank_dirs) {
    if (config.SavesShard(rank)) continue;
    std::string label = name + "/model.safetensors";
    if (!Exists(o.src + "/" + label)) continue;
    ASSIGN_OR_RETURN(SourceFile replica,
                     ReadSource(o.src + "/" + label, label));
    int g = config.ShardGroup(rank);
    if (replica.header.tensors() != group_files[g].header.tensors()) {
      return UserError(
          label, absl::StrCat("differs from its replica ", group_files[g].label,
                              " (a data-parallel copy must be identical)"));
    }
    plan.replicas.emplace_back(std::move(replica), g);
  }
  for (const auto& [rank, name] : rank_dirs) {
    const std::string extra = o.src + "/" + name + "/extra";
    if (struct stat st; lstat(extra.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      return UserError(extra,
                       "is a symbolic link (extra/ must be a directory)");
    }
    if (!IsDirectory(extra)) continue;
    std::vector<std::string> paths;
    RETURN_IF_ERROR(ListFiles(extra, "", paths));
    for (std::string& path : paths)
      plan.extras.push_back({rank, path, extra + "/" + path, ""});
  }
  plan.files = std::move(group_files);
  return absl::OkStatus();
}

// A Megatron-LM checkpoint: each rank file's tensors become its group's
// shard, its remainder an extra file of the group's saving rank.
absl::Status PlanMegatron(const Store& store, const ImportOptions& o,
                          ImportPlan& plan) {
  ASSIGN_OR_RETURN(MegatronCheckpoint c,
                   ReadMegatronCheckpoint(o.src, o.config));
  std::vector<SourceFile> group_files;
  for (MegatronRankFile& r : c.ranks) {
    auto rank = std::make_shared<MegatronRankFile>(std::move(r));
    group_files.push_back({rank->path, rank->label, rank->header, rank});
  }
  RETURN_IF_ERROR(PlanGroups(store, o, group_files, plan));
  for (size_t g = 0; g < group_files.size(); ++g) {
    plan.extras.push_back({o.config.SaverOfGroup(static_cast<int>(g)),
                           kMegatronRemainderPath, "",
                           group_files[g].megatron->remainder});
  }
  plan.files = std::move(group_files);
  return absl::OkStatus();
}

// What per-group files share: the model (inferred from them for a new
// store), each file matched to its group's shards, tied copies compared,
// the step and position their metadata give.
absl::Status PlanGroups(const Store& store, const ImportOptions& o,
                        const std::vector<SourceFile>& group_files,
                        ImportPlan& plan) {
  const ParallelConfig& config = o.config;
  if (store.model() != nullptr) {
    plan.model = store.model();
  } else {
    std::vector<const SourceFile*> files;
    for (const SourceFile& f : group_files) files.push_back(&f);
    ASSIGN_OR_RETURN(Model model, InferModel(store.layout(), config, files));
    plan.model = std::make_shared<const Model>(std::move(model));
    plan.new_model = true;
  }
  auto placement = Placement::Create(store.layout(), plan.model, config);
  if (!placement.ok()) return UserError(o.src, placement.status().message());
  for (int g = 0; g < config.num_shard_groups(); ++g) {
    const std::string where = config.DescribeRank(config.SaverOfGroup(g));
    ASSIGN_OR_RETURN(std::vector<ShardRecord::Location> locations,
                     MatchShards(*plan.model, placement->shards(g),
                                 group_files[g], g, where));
    plan.groups.push_back({{}, std::move(locations)});
  }
  RETURN_IF_ERROR(CompareTiedCopies(*placement, group_files, plan.groups));
  plan.step_in_metadata = MetadataCount(group_files[0].header, "scalai.step");
  plan.consumed_samples =
      MetadataCount(group_files[0].header, "scalai.consumed_samples");
  plan.stored_config = config.ToString();
  return absl::OkStatus();
}

// A full model given as files: one .safetensors, or a Hugging Face index.
absl::Status PlanFull(const Store& store, const std::vector<std::string>& paths,
                      const std::vector<std::string>& labels,
                      const std::map<std::string, std::string>* weight_map,
                      ImportPlan& plan) {
  Model found;
  std::vector<std::pair<int, int64_t>> where;  // per found tensor: file, offset
  for (size_t f = 0; f < paths.size(); ++f) {
    ASSIGN_OR_RETURN(SourceFile file, ReadSource(paths[f], labels[f]));
    for (const SafetensorsEntry& e : file.header.tensors()) {
      if (weight_map != nullptr) {
        auto it = weight_map->find(e.name);
        if (it == weight_map->end() || it->second != labels[f]) {
          return UserError(
              labels[f], absl::StrCat("holds tensor ", e.name,
                                      ", which the index does not map to it"));
        }
      }
      if (found.Find(e.name) != nullptr) {
        return UserError(labels[f], absl::StrCat("tensor ", e.name,
                                                 " appears in two files"));
      }
      RETURN_IF_ERROR(found.Add({e.name, e.dtype, e.shape}));
      where.emplace_back(static_cast<int>(f),
                         file.header.data_start() + e.data_begin);
    }
    plan.files.push_back(std::move(file));
  }
  if (weight_map != nullptr) {
    for (const auto& [name, file] : *weight_map) {
      if (found.Find(name) == nullptr) {
        return UserError(file, absl::StrCat("the index maps tensor ", name,
                                            " to this file, which lacks it"));
      }
    }
  }
  if (store.model() != nullptr) {
    plan.model = store.model();
    for (const TensorInfo& t : plan.model->tensors()) {
      const TensorInfo* f = found.Find(t.name);
      if (f == nullptr)
        return UserError("model",
                         absl::StrCat("tensor ", t.name, " is missing"));
      if (f->dtype != t.dtype || f->shape != t.shape) {
        return UserError(
            "model", absl::StrCat("tensor ", t.name, ": the store has ",
                                  DTypeName(t.dtype), ShapeToString(t.shape),
                                  ", the file ", DTypeName(f->dtype),
                                  ShapeToString(f->shape)));
      }
    }
    if (found.size() != plan.model->size()) {
      for (const TensorInfo& t : found.tensors()) {
        if (plan.model->Find(t.name) == nullptr) {
          return UserError(
              "model",
              absl::StrCat("tensor ", t.name, " is not in the store's model"));
        }
      }
    }
  } else {
    plan.model = std::make_shared<const Model>(found);
    plan.new_model = true;
  }
  // The layout must serve the model: every tensor classified, vocab_size met.
  auto check = Placement::Create(store.layout(), plan.model,
                                 *ParallelConfig::Create(1, 1, 1));
  if (!check.ok()) return UserError("model", check.status().message());
  ShardRecord group;
  for (const TensorInfo& t : plan.model->tensors()) {
    auto [file, offset] = where[found.IndexOf(t.name)];
    group.tensors.push_back({file, offset});
  }
  plan.groups.push_back(std::move(group));
  plan.stored_config = "full";
  plan.step_in_metadata = MetadataCount(plan.files[0].header, "scalai.step");
  plan.consumed_samples =
      MetadataCount(plan.files[0].header, "scalai.consumed_samples");
  return absl::OkStatus();
}

absl::Status PlanIndex(const Store& store, const std::string& dir,
                       ImportPlan& plan) {
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::ifstream in(index_path);
  std::stringstream text;
  text << in.rdbuf();
  json j = json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
      !j["weight_map"].is_object()) {
    return UserError("model.safetensors.index.json",
                     "not a JSON object with a \"weight_map\"");
  }
  std::map<std::string, std::string> weight_map;
  std::set<std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string() ||
        file.get<std::string>().find('/') != std::string::npos) {
      return UserError(
          "model.safetensors.index.json",
          absl::StrCat("tensor ", name,
                       " maps to something other than a file name"));
    }
    weight_map[name] = file.get<std::string>();
    files.insert(file.get<std::string>());
  }
  if (files.empty())
    return UserError("model.safetensors.index.json", "the weight_map is empty");
  std::vector<std::string> paths, labels;
  for (const std::string& f : files) {
    if (!Exists(dir + "/" + f)) {
      return UserError("model.safetensors.index.json",
                       absl::StrCat("names ", f, ", which is missing"));
    }
    paths.push_back(dir + "/" + f);
    labels.push_back(f);
  }
  return PlanFull(store, paths, labels, &weight_map, plan);
}

// Copies the file at `path` to a new blob file, hashing on the way; the
// caller syncs.

// Writes bytes from `produce` (which calls its sink in order) to a new
// blob file, hashing on the way; the caller syncs.
absl::StatusOr<BlobRecord> WriteBlob(
    const std::string& blob_path, Progress* progress,
    const std::function<absl::Status(
        const std::function<absl::Status(const char*, int64_t)>&)>& produce) {
  ASSIGN_OR_RETURN(UniqueFd out,
                   OpenFile(blob_path, O_WRONLY | O_CREAT | O_EXCL, 0600));
  ChunkHasher hasher;
  int64_t size = 0;
  WriteBehind behind;
  RETURN_IF_ERROR(produce([&](const char* data, int64_t n) {
    hasher.Update(data, n);
    RETURN_IF_ERROR(WriteAll(out.get(), data, n, blob_path));
    size += n;
    if (progress != nullptr) progress->Add(n);
    return WriteBehind::Apply(out.get(), behind.Advance(size), blob_path);
  }));
  return BlobRecord{size, hasher.Finish(), 0};
}

absl::StatusOr<BlobRecord> CopyFileToBlob(const std::string& path,
                                          const std::string& blob_path,
                                          Progress* progress) {
  return WriteBlob(blob_path, progress,
                   [&](const auto& sink) { return ReadChunks(path, sink); });
}

absl::StatusOr<BlobRecord> CopyToBlob(const SourceFile& src,
                                      const std::string& blob_path,
                                      Progress& progress) {
  if (src.megatron != nullptr) {
    return WriteBlob(blob_path, &progress, [&](const auto& sink) {
      return StreamMegatronShard(*src.megatron, sink);
    });
  }
  ASSIGN_OR_RETURN(BlobRecord blob,
                   CopyFileToBlob(src.path, blob_path, &progress));
  if (blob.size != src.header.file_size()) {
    return UserError(src.label, "changed while it was imported");
  }
  return blob;
}

absl::Status CompareReplica(const SourceFile& replica,
                            const SourceFile& primary) {
  ASSIGN_OR_RETURN(MappedFile a, MappedFile::Open(replica.path));
  ASSIGN_OR_RETURN(MappedFile b, MappedFile::Open(primary.path));
  const int64_t da = replica.header.data_start(),
                db = primary.header.data_start();
  if (a.size() - da != b.size() - db ||
      std::memcmp(a.data() + da, b.data() + db, a.size() - da) != 0) {
    return UserError(replica.label,
                     absl::StrCat("differs from its replica ", primary.label,
                                  " (a data-parallel copy must be identical)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ImportResult> ImportCheckpoint(Store& store,
                                              const ImportOptions& o) {
  ImportPlan plan;
  if (!Exists(o.src))
    return absl::NotFoundError(
        absl::StrCat(o.src, ": no such file or directory"));
  if (!IsDirectory(o.src)) {
    RETURN_IF_ERROR(PlanFull(store, {o.src}, {o.src}, nullptr, plan));
  } else if (IsMegatronCheckpoint(o.src)) {
    RETURN_IF_ERROR(PlanMegatron(store, o, plan));
  } else if (Exists(o.src + "/model.safetensors.index.json")) {
    RETURN_IF_ERROR(PlanIndex(store, o.src, plan));
  } else if (Exists(o.src + "/rank-00000") ||
             !Exists(o.src + "/model.safetensors")) {
    RETURN_IF_ERROR(PlanShards(store, o, plan));
  } else {
    RETURN_IF_ERROR(PlanFull(store, {o.src + "/model.safetensors"},
                             {"model.safetensors"}, nullptr, plan));
  }
  if (plan.stored_config == "full") {
    // The config becomes the store's current one: it must serve the model.
    auto placement = Placement::Create(store.layout(), plan.model, o.config);
    if (!placement.ok()) return UserError(o.src, placement.status().message());
  }
  const int64_t step = o.step.value_or(plan.step_in_metadata.value_or(0));
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", step, ": steps are numbered from 0"));
  }
  if (plan.consumed_samples) {
    if (absl::Status s = store.CheckPosition(*plan.consumed_samples); !s.ok()) {
      return UserError(plan.files[0].label, s.message());
    }
  }
  ASSIGN_OR_RETURN(std::optional<StepRecord> existing, store.FindStep(step));
  if (existing) {
    return absl::AlreadyExistsError(
        absl::StrCat("step ", step, " already exists in ", store.dir()));
  }
  for (const auto& [replica, group] : plan.replicas) {
    RETURN_IF_ERROR(CompareReplica(replica, plan.files[group]));
  }

  // Copy. Blobs made so far are removed on any failure; a kill leaves them
  // to the orphan sweep of the next open.
  std::vector<std::string> names(plan.files.size());
  for (std::string& n : names) n = Store::NewBlobName();
  std::vector<std::string> extra_names(plan.extras.size());
  for (std::string& n : extra_names) n = Store::NewBlobName();
  bool committed = false;
  absl::Cleanup remove_blobs = [&] {
    if (committed) return;
    for (const std::string& n : names) unlink(store.BlobPath(n).c_str());
    for (const std::string& n : extra_names) unlink(store.BlobPath(n).c_str());
  };
  int64_t total = 0;
  for (const SourceFile& f : plan.files) total += f.header.file_size();
  Progress progress(total, o.progress);
  std::vector<BlobRecord> blobs(plan.files.size());
  RETURN_IF_ERROR(ParallelFor(
      plan.files.size(), IoThreads(), [&](size_t i) -> absl::Status {
        ASSIGN_OR_RETURN(
            blobs[i],
            CopyToBlob(plan.files[i], store.BlobPath(names[i]), progress));
        blobs[i].step = step;
        return absl::OkStatus();
      }));
  StepRecord record;
  Catalog::Batch batch;
  for (size_t i = 0; i < plan.extras.size(); ++i) {
    const ImportPlan::Extra& e = plan.extras[i];
    absl::StatusOr<BlobRecord> copied =
        e.source.empty()
            ? WriteBlob(store.BlobPath(extra_names[i]), nullptr,
                        [&](const auto& sink) {
                          return sink(e.content.data(), e.content.size());
                        })
            : CopyFileToBlob(e.source, store.BlobPath(extra_names[i]), nullptr);
    ASSIGN_OR_RETURN(BlobRecord blob, std::move(copied));
    blob.step = step;
    batch.Put(Table::kBlobs, extra_names[i], Store::EncodeBlob(blob));
    record.extra[e.rank].push_back({e.path, extra_names[i], blob.size});
    record.extra_config = plan.stored_config;
  }
  // The blobs and their names become durable before the record naming them.
  RETURN_IF_ERROR(SyncFilesystem(store.blob_dir()));

  record.step = step;
  record.config = plan.stored_config;
  record.groups = static_cast<int>(plan.groups.size());
  record.consumed_samples = plan.consumed_samples;
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    ShardRecord& shard = plan.groups[g];
    // Per-rank shards: group g is file g; a full model spans every file.
    if (plan.stored_config == "full") {
      shard.blobs = names;
    } else {
      shard.blobs = {names[g]};
      for (ShardRecord::Location& loc : shard.tensors) loc.blob = 0;
    }
    batch.Put(Table::kShards, ShardKey(step, static_cast<int>(g)),
              Store::EncodeShard(shard));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    batch.Put(Table::kBlobs, names[i], Store::EncodeBlob(blobs[i]));
    record.bytes += plan.files[i].header.data_bytes();
  }
  batch.Put(Table::kSteps, StepKey(step), Store::EncodeStep(record));
  if (plan.new_model)
    batch.Put(Table::kMeta, "model", Store::EncodeModel(*plan.model));
  if (!store.current_config())
    batch.Put(Table::kMeta, "config", o.config.ToString());
  RETURN_IF_ERROR(store.catalog().Commit(batch));
  committed = true;
  return ImportResult{record, static_cast<int>(names.size()), progress.done()};
}

}  // namespace scalai
