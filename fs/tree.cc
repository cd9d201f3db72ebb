#include "fs/tree.h"

#include <algorithm>
#include <charconv>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "transfer/blob_reader.h"
#include "transfer/dataset_source.h"

namespace scalai {
namespace {

using nlohmann::json;

std::string StepName(int64_t step) {
  return absl::StrFormat("step-%08d", step);
}

json ModelSummary(const Store& store) {
  const Model& m = *store.model();
  json tensors = json::array();
  for (const TensorInfo& t : m.tensors()) {
    tensors.push_back(
        {{"name", t.name}, {"dtype", DTypeName(t.dtype)}, {"shape", t.shape}});
  }
  return {{"tensors", tensors}, {"bytes", m.total_bytes()}};
}

}  // namespace

Node& Tree::Add(uint64_t parent, std::string name, NodeKind kind, mode_t mode) {
  Node node;
  node.ino = InoOf(nodes_.size());
  node.parent = parent;
  node.name = std::move(name);
  node.kind = kind;
  node.mode = mode;
  nodes_.push_back(std::move(node));
  if (parent != 0)
    nodes_[*IndexOf(parent)].children.push_back(nodes_.back().ino);
  return nodes_.back();
}

void Tree::SortChildren() {
  for (Node& n : nodes_) {
    std::sort(
        n.children.begin(), n.children.end(),
        [&](uint64_t a, uint64_t b) { return Get(a)->name < Get(b)->name; });
  }
}

namespace {

// A tensor's entry in rank.json: its global place, and one piece a block
// (SwiGLU's [gate; up] cut on each block) or run of padding rows, each with
// its offset in the local tensor, its offset in the global one and its
// shape, so that a client can rebuild the global tensor from every rank.
json RankJsonTensor(const TensorInfo& t, const TensorShard& s) {
  json pieces = json::array();
  for (const ShardPiece& piece : s.pieces) {
    json p = {{"offset", piece.local.origin()},
              {"global_offset", piece.global.origin()},
              {"shape", piece.local.shape()}};
    if (piece.zero_fill) p["padding"] = true;
    if (piece.view_offset >= 0) {
      // A flat shard's piece: `offset` is in a view, the view_shape
      // elements from element view_offset on.
      p["view_offset"] = piece.view_offset;
      p["view_shape"] = piece.view_shape;
    }
    pieces.push_back(std::move(p));
  }
  json out = {
      {"global_name", t.name},
      {"dtype", DTypeName(t.dtype)},
      {"shape", s.local_shape},
      {"global_shape", t.shape},
      {"global_offset", s.pieces.empty() ? Shape(t.shape.size(), 0)
                                         : s.pieces.front().global.origin()},
      {"pieces", std::move(pieces)}};
  if (s.flat_begin >= 0) {
    out["flat_begin"] = s.flat_begin;
    out["bucket_offset"] = s.bucket_offset;
  }
  return out;
}

// Counts the nodes the views of `config` would take, from the placement
// alone, and refuses a config past kMaxNodes before any is made.
absl::Status CheckSize(const Store& store, const ParallelConfig& config,
                       const std::vector<StepRecord>& steps) {
  int64_t nodes = 16;
  if (!steps.empty() && store.model() != nullptr) {
    ASSIGN_OR_RETURN(Placement p,
                     Placement::Create(store.layout(), store.model(), config));
    int64_t per_step = 1;
    for (int rank = 0; rank < config.world_size(); ++rank) {
      // The rank's directory, model.safetensors, rank.json, tensors/, extra/.
      per_step +=
          5 + static_cast<int64_t>(p.shards(config.ShardGroup(rank)).size());
    }
    nodes += per_step * static_cast<int64_t>(steps.size());
  }
  ASSIGN_OR_RETURN(auto datasets, store.Datasets());
  nodes += static_cast<int64_t>(datasets.size()) * (2 + 5 * config.dp());
  if (nodes <= Tree::kMaxNodes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "config ", config.ToString(), ": its views would take ", nodes,
      " files (", steps.size(), " steps of ", config.world_size(),
      " ranks), more than a mount serves (", Tree::kMaxNodes,
      "); keep fewer steps (mount --keep-steps) or choose a smaller config"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tree>> Tree::Build(const Store& store,
                                                  const ParallelConfig& config,
                                                  uint64_t generation,
                                                  const RemoteBytes* remote) {
  std::unique_ptr<Tree> tree(new Tree());
  tree->config_ = config;
  tree->remote_ = remote;
  tree->generation_ = generation;
  tree->Add(0, "", NodeKind::kDir, 0555);
  auto add_text = [&](uint64_t parent, std::string name,
                      std::string text) -> Node& {
    Node& n = tree->Add(parent, std::move(name), NodeKind::kFile, 0444);
    n.text = std::move(text);
    n.size = static_cast<int64_t>(n.text.size());
    return n;
  };
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store.Steps());
  RETURN_IF_ERROR(CheckSize(store, config, steps));
  add_text(kRootIno, "config", config.ToString() + "\n").mode = 0644;
  add_text(kRootIno, "status", "").live = true;
  json job = {
      {"store", store.dir()},        {"layout", store.layout().ToJson()},
      {"config", config.ToString()}, {"world_size", config.world_size()},
      {"steps", json::array()},      {"datasets", json::array()}};
  if (store.model() != nullptr) job["model"] = ModelSummary(store);
  for (const StepRecord& s : steps) job["steps"].push_back(s.step);
  Node& job_file = add_text(kRootIno, "job.json", "");
  const uint64_t job_ino = job_file.ino;
  // Modes mean what they say (the mount checks them, default_permissions):
  // the owner may save steps in ckpt/, write `config`, and write a
  // committed model.safetensors again (compared, never changed: a late
  // data-parallel replica); everything else is read-only.
  const uint64_t ckpt = tree->Add(kRootIno, "ckpt", NodeKind::kDir, 0755).ino;
  const uint64_t data = tree->Add(kRootIno, "data", NodeKind::kDir, 0555).ino;
  RETURN_IF_ERROR(tree->AddDatasets(store, steps, data, job));
  if (!steps.empty()) {
    Node& latest = tree->Add(ckpt, "latest", NodeKind::kSymlink, 0777);
    latest.text = StepName(steps.back().step);
    latest.size = static_cast<int64_t>(latest.text.size());
  }
  for (const StepRecord& step : steps) {
    ASSIGN_OR_RETURN(std::unique_ptr<StepView> view,
                     StepView::Create(store, step, config, remote));
    const int view_index = static_cast<int>(tree->views_.size());
    const Placement& p = view->placement();
    const Model& model = p.model();
    std::vector<std::vector<int64_t>> starts(p.num_groups());
    for (int g = 0; g < p.num_groups(); ++g) {
      int64_t at = 0;
      for (const TensorShard& s : p.shards(g)) {
        starts[g].push_back(at);
        at += s.bytes;
      }
    }
    const size_t first_node = tree->nodes_.size();
    std::map<std::string, int> extra_blobs;
    const uint64_t step_dir =
        tree->Add(ckpt, StepName(step.step), NodeKind::kDir, 0555).ino;
    for (int rank = 0; rank < config.world_size(); ++rank) {
      const RankCoords c = config.Coords(rank);
      const int g = config.ShardGroup(rank);
      const uint64_t rank_dir =
          tree->Add(step_dir, absl::StrFormat("rank-%05d", rank),
                    NodeKind::kDir, 0555)
              .ino;
      std::vector<SafetensorsEntry> entries;
      json tensors = json::object();
      const std::vector<TensorShard>& shards = p.shards(g);
      for (const TensorShard& s : shards) {
        const TensorInfo& t = model.tensor(s.tensor);
        entries.push_back({s.local_name, t.dtype, s.local_shape, 0, 0});
        tensors[s.local_name] = RankJsonTensor(t, s);
      }
      ASSIGN_OR_RETURN(
          SafetensorsHeader header,
          SafetensorsHeader::Build(std::move(entries),
                                   {{"scalai.rank", absl::StrCat(rank)},
                                    {"scalai.config", config.ToString()},
                                    {"scalai.step", absl::StrCat(step.step)}}));
      Node& file =
          tree->Add(rank_dir, "model.safetensors", NodeKind::kFile, 0644);
      file.text = header.Serialize();
      file.size = header.file_size();
      file.view = view_index;
      file.group = g;
      add_text(rank_dir, "rank.json",
               json{{"rank", rank},
                    {"tp_rank", c.tp_rank},
                    {"pp_rank", c.pp_rank},
                    {"dp_rank", c.dp_rank},
                    {"config", config.ToString()},
                    {"tensors", tensors}}
                       .dump(2, ' ', false, json::error_handler_t::replace) +
                   "\n");
      const uint64_t tensor_dir =
          tree->Add(rank_dir, "tensors", NodeKind::kDir, 0555).ino;
      for (size_t k = 0; k < shards.size(); ++k) {
        Node& t =
            tree->Add(tensor_dir, shards[k].local_name, NodeKind::kFile, 0444);
        t.size = shards[k].bytes;
        t.view = view_index;
        t.group = g;
        t.shard = static_cast<int>(k);
      }
      const uint64_t extra_dir =
          tree->Add(rank_dir, "extra", NodeKind::kDir, 0555).ino;
      RETURN_IF_ERROR(
          tree->AddExtraFiles(store, step, rank, extra_dir, extra_blobs));
    }
    tree->step_nodes_[step.step] = {first_node, tree->nodes_.size()};
    tree->views_.push_back(std::move(view));
    tree->tensor_starts_.push_back(std::move(starts));
  }
  Node& job_node = tree->nodes_[*tree->IndexOf(job_ino)];
  // The store's path is the user's and may hold any bytes.
  job_node.text =
      job.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  job_node.size = static_cast<int64_t>(job_node.text.size());
  tree->SortChildren();
  RETURN_IF_ERROR(tree->NumberSamples());
  tree->counts_ = std::make_shared<Counts>(tree->nodes_.size());
  return tree;
}

absl::Status Tree::AddExtraFiles(const Store& store, const StepRecord& step,
                                 int rank, uint64_t extra_dir,
                                 std::map<std::string, int>& blobs) {
  ASSIGN_OR_RETURN(std::vector<ExtraFile> files,
                   step.ExtraFilesSeenBy(config_, rank));
  // Directories made so far, by their path below extra/.
  std::map<std::string, uint64_t> dirs = {{"", extra_dir}};
  for (const ExtraFile& f : files) {
    uint64_t parent = extra_dir;
    std::string at;
    std::vector<std::string> parts = absl::StrSplit(f.path, '/');
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      at = absl::StrCat(at, parts[i], "/");
      auto [it, added] = dirs.try_emplace(at, 0);
      if (added) it->second = Add(parent, parts[i], NodeKind::kDir, 0555).ino;
      parent = it->second;
    }
    auto [blob, added] = blobs.try_emplace(f.blob, extras_.size());
    if (added) {
      extras_.push_back(std::make_unique<ExtraBlob>());
      extras_.back()->path = store.BlobPath(f.blob);
      extras_.back()->name = f.blob;
      extras_.back()->record = store.Blob(f.blob);
    }
    Node& file = Add(parent, parts.back(), NodeKind::kFile, 0444);
    file.size = f.size;
    file.extra = blob->second;
  }
  return absl::OkStatus();
}

absl::Status Tree::AddDatasets(const Store& store,
                               const std::vector<StepRecord>& steps,
                               uint64_t data_dir, json& job) {
  auto add_text = [&](uint64_t parent, std::string name, const json& j) {
    Node& n = Add(parent, std::move(name), NodeKind::kFile, 0444);
    n.text = j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
    n.size = static_cast<int64_t>(n.text.size());
  };
  ASSIGN_OR_RETURN(auto records, store.Datasets());
  const std::map<std::string, std::string> withheld = store.withheld_datasets();
  for (const auto& [name, record] : records) {
    if (withheld.contains(name)) continue;  // `status` says why
    ASSIGN_OR_RETURN(std::shared_ptr<const DatasetSource> source,
                     DatasetSource::Open(store, name, record));
    // docs/reference.md: where the newest committed step left off.
    int64_t position = 0;
    if (!steps.empty()) {
      const StepRecord& newest = steps.back();
      const int64_t b = record.global_batch;
      position = newest.consumed_samples.value_or(
          newest.step > INT64_MAX / b ? INT64_MAX / b * b : newest.step * b);
    }
    ASSIGN_OR_RETURN(std::unique_ptr<DatasetView> view,
                     DatasetView::Create(source, config_.dp(), position));
    const int index = static_cast<int>(datasets_.size());
    const DatasetOrder& order = view->order();
    const uint64_t dir = Add(data_dir, name, NodeKind::kDir, 0555).ino;
    json summary = {{"format", record.format},
                    {"samples", record.samples},
                    {"seed", record.seed},
                    {"epochs", record.epochs},
                    {"global_batch", record.global_batch},
                    {"position", view->start()},
                    {"positions", order.total_positions()},
                    {"batches_per_epoch", order.batches_per_epoch()},
                    {"dropped_per_epoch", order.dropped_per_epoch()},
                    {"dp", config_.dp()}};
    if (!record.token_dtype.empty()) {
      summary["token_dtype"] = record.token_dtype;
    }
    add_text(dir, "dataset.json", summary);
    summary["name"] = name;
    job["datasets"].push_back(summary);
    Dataset dataset;
    for (int d = 0; d < config_.dp(); ++d) {
      const int64_t samples = view->RankSamples(d);
      const uint64_t rank_dir =
          Add(dir, absl::StrFormat("rank-%05d", d), NodeKind::kDir, 0555).ino;
      add_text(rank_dir, "rank.json",
               {{"dp_rank", d},
                {"dp", config_.dp()},
                {"samples", samples},
                {"first_position",
                 samples > 0 ? view->RankPosition(d, 0) : view->start()}});
      Node& ids = Add(rank_dir, "sample-ids.u64", NodeKind::kFile, 0444);
      ids.size = 8 * samples;
      ids.data = DataFile::kSampleIds;
      Node& samples_dir = Add(rank_dir, "samples", NodeKind::kDir, 0555);
      samples_dir.data = DataFile::kSamplesDir;
      dataset.samples_dirs.push_back(samples_dir.ino);
      if (source->jsonl()) {
        Add(rank_dir, "samples.jsonl", NodeKind::kFile, 0444).data =
            DataFile::kStream;
      }
      for (size_t i = nodes_.size(); i-- > 0 && nodes_[i].parent == rank_dir;) {
        nodes_[i].dataset = index;
        nodes_[i].dp_rank = d;
      }
    }
    dataset.view = std::move(view);
    datasets_.push_back(std::move(dataset));
  }
  return absl::OkStatus();
}

absl::Status Tree::NumberSamples() {
  const uint64_t limit = (uint64_t{1} << kIndexBits) - nodes_.size();
  uint64_t base = 0;
  for (Dataset& d : datasets_) {
    d.ino_base = base;
    base += d.view->order().total_positions() - d.view->start();
    if (base >= limit) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "dataset ", d.view->source().name(), ": more positions than the ",
          "mount can number (2^", kIndexBits, " for all datasets)"));
    }
  }
  return absl::OkStatus();
}

uint64_t Tree::SampleIno(const Node& samples_dir, int64_t k) const {
  const Dataset& d = datasets_[samples_dir.dataset];
  const int64_t position = d.view->RankPosition(samples_dir.dp_rank, k);
  return InoOf(nodes_.size() + d.ino_base + (position - d.view->start()));
}

absl::StatusOr<const Node*> Tree::LookupSample(const Node& samples_dir,
                                               absl::string_view name,
                                               bool count) const {
  // One name per file: decimal, no sign, no leading zeros.
  int64_t k = -1;
  auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), k);
  if (ec != std::errc() || end != name.data() + name.size() || k < 0 ||
      (name.size() > 1 && name[0] == '0')) {
    return nullptr;
  }
  const DatasetView& view = *datasets_[samples_dir.dataset].view;
  if (k >= view.RankSamples(samples_dir.dp_rank)) return nullptr;
  const uint64_t ino = SampleIno(samples_dir, k);
  {
    std::lock_guard<std::mutex> lock(counts_->samples_mu);
    auto it = counts_->samples.find(ino);
    if (it != counts_->samples.end()) {
      if (count) {
        ++it->second.lookups;
        counts_->total_lookups.fetch_add(1);
      }
      return it->second.node.get();
    }
  }
  // Sized outside the lock: a Megatron sample's size is read from its .idx.
  ASSIGN_OR_RETURN(int64_t bytes, view.SampleBytes(samples_dir.dp_rank, k));
  auto node = std::make_unique<Node>();
  node->ino = ino;
  node->parent = samples_dir.ino;
  node->name = std::string(name);
  node->kind = NodeKind::kFile;
  node->mode = 0444;
  node->size = bytes;
  node->data = DataFile::kSample;
  node->dataset = samples_dir.dataset;
  node->dp_rank = samples_dir.dp_rank;
  node->sample = k;
  std::lock_guard<std::mutex> lock(counts_->samples_mu);
  Counts::Sample& entry = counts_->samples[ino];
  if (entry.node == nullptr) entry.node = std::move(node);
  if (count) {
    ++entry.lookups;
    counts_->total_lookups.fetch_add(1);
  }
  return entry.node.get();
}

absl::StatusOr<std::unique_ptr<Tree>> Tree::Rebuild(const Store& store,
                                                    const Tree& same) {
  return Rebuild(store, same, same.remote_);
}

absl::StatusOr<std::unique_ptr<Tree>> Tree::Rebuild(const Store& store,
                                                    const Tree& same,
                                                    const RemoteBytes* remote) {
  ASSIGN_OR_RETURN(std::unique_ptr<Tree> tree,
                   Build(store, same.config_, same.generation_, remote));
  if (tree->nodes_.size() != same.nodes_.size()) {
    return absl::InternalError(absl::StrCat(
        "the tree of generation ", same.generation_, " rebuilt has ",
        tree->nodes_.size(), " nodes, not ", same.nodes_.size()));
  }
  tree->counts_ = same.counts_;
  return tree;
}

uint64_t Tree::InoOf(uint64_t index) const {
  return index == 0 ? kRootIno : (generation_ << kIndexBits) | index;
}

std::optional<size_t> Tree::IndexOf(uint64_t ino) const {
  if (ino == kRootIno) return 0;
  const uint64_t index = ino & ((uint64_t{1} << kIndexBits) - 1);
  if (GenerationOf(ino) != generation_ || index == 0 ||
      index >= nodes_.size()) {
    return std::nullopt;
  }
  return index;
}

void Tree::CountLookup(uint64_t ino) const {
  std::optional<size_t> i = IndexOf(ino);
  if (i) {
    counts_->lookups[*i].fetch_add(1);
    counts_->total_lookups.fetch_add(1);
    return;
  }
  std::lock_guard<std::mutex> lock(counts_->samples_mu);
  auto it = counts_->samples.find(ino);
  if (it == counts_->samples.end()) return;
  ++it->second.lookups;
  counts_->total_lookups.fetch_add(1);
}

void Tree::Forget(uint64_t ino, uint64_t n) const {
  std::optional<size_t> i = IndexOf(ino);
  if (i) {
    // The kernel never forgets more than it was given; clamp all the same.
    std::atomic<uint64_t>& count = counts_->lookups[*i];
    uint64_t have = count.load();
    while (!count.compare_exchange_weak(have, have - std::min(have, n))) {
    }
    counts_->total_lookups.fetch_sub(std::min(have, n));
    return;
  }
  std::lock_guard<std::mutex> lock(counts_->samples_mu);
  auto it = counts_->samples.find(ino);
  if (it == counts_->samples.end()) return;
  const uint64_t dropped = std::min(it->second.lookups, n);
  it->second.lookups -= dropped;
  counts_->total_lookups.fetch_sub(dropped);
  if (it->second.lookups == 0 && it->second.opens == 0)
    counts_->samples.erase(it);
}

void Tree::CountOpen(uint64_t ino, int delta) const {
  std::optional<size_t> i = IndexOf(ino);
  if (i) {
    counts_->opens[*i].fetch_add(delta);
    return;
  }
  std::lock_guard<std::mutex> lock(counts_->samples_mu);
  auto it = counts_->samples.find(ino);
  if (it == counts_->samples.end()) return;
  it->second.opens += delta;
  if (it->second.lookups == 0 && it->second.opens == 0)
    counts_->samples.erase(it);
}

std::vector<NodeRef> Tree::UnopenedReferencesDeepestFirst() const {
  std::vector<NodeRef> out;
  {
    std::lock_guard<std::mutex> lock(counts_->samples_mu);
    for (const auto& [ino, sample] : counts_->samples) {
      if (sample.lookups > 0 && sample.opens == 0) {
        out.push_back({sample.node->parent, ino, sample.node->name});
      }
    }
  }
  // A child is always added after its parent: reverse order puts it first.
  for (size_t i = nodes_.size(); i-- > 1;) {
    if (counts_->lookups[i].load() > 0 && counts_->opens[i].load() == 0) {
      out.push_back({nodes_[i].parent, nodes_[i].ino, nodes_[i].name});
    }
  }
  return out;
}

bool Tree::StepOpen(int64_t step) const {
  auto it = step_nodes_.find(step);
  if (it == step_nodes_.end()) return false;
  for (size_t i = it->second.first; i < it->second.second; ++i) {
    if (counts_->opens[i].load() > 0) return true;
  }
  return false;
}

uint64_t Tree::lookups(uint64_t ino) const {
  std::optional<size_t> i = IndexOf(ino);
  if (i) return counts_->lookups[*i].load();
  std::lock_guard<std::mutex> lock(counts_->samples_mu);
  auto it = counts_->samples.find(ino);
  return it == counts_->samples.end() ? 0 : it->second.lookups;
}

const Node* Tree::Get(uint64_t ino) const {
  std::optional<size_t> i = IndexOf(ino);
  if (i) return &nodes_[*i];
  std::lock_guard<std::mutex> lock(counts_->samples_mu);
  auto it = counts_->samples.find(ino);
  return it == counts_->samples.end() ? nullptr : it->second.node.get();
}

absl::StatusOr<const Node*> Tree::Lookup(uint64_t parent,
                                         absl::string_view name) const {
  const Node* dir = Get(parent);
  if (dir == nullptr || dir->kind != NodeKind::kDir) return nullptr;
  if (dir->data == DataFile::kSamplesDir)
    return LookupSample(*dir, name, /*count=*/false);
  auto it = std::lower_bound(
      dir->children.begin(), dir->children.end(), name,
      [&](uint64_t ino, absl::string_view n) { return Get(ino)->name < n; });
  if (it == dir->children.end() || Get(*it)->name != name) return nullptr;
  return Get(*it);
}

absl::StatusOr<const Node*> Tree::Enter(uint64_t parent,
                                        absl::string_view name) const {
  const Node* dir = Get(parent);
  if (dir != nullptr && dir->data == DataFile::kSamplesDir)
    return LookupSample(*dir, name, /*count=*/true);
  ASSIGN_OR_RETURN(const Node* n, Lookup(parent, name));
  if (n != nullptr) CountLookup(n->ino);
  return n;
}

int64_t Tree::EntryCount(const Node& dir) const {
  if (dir.data == DataFile::kSamplesDir)
    return datasets_[dir.dataset].view->RankSamples(dir.dp_rank);
  return static_cast<int64_t>(dir.children.size());
}

DirEntry Tree::EntryAt(const Node& dir, int64_t i) const {
  if (dir.data == DataFile::kSamplesDir)
    return {absl::StrCat(i), SampleIno(dir, i), nullptr};
  const Node* child = Get(dir.children[i]);
  return {child->name, child->ino, child};
}

int64_t Tree::SizeOf(const Node& node) const {
  if (node.data == DataFile::kStream)
    return datasets_[node.dataset].view->StreamBytes(node.dp_rank);
  return node.size;
}

absl::StatusOr<int64_t> Tree::Read(const Node& node, int64_t offset,
                                   int64_t length, char* out) const {
  if (node.kind != NodeKind::kFile)
    return absl::InvalidArgumentError("not a file");
  const int64_t size = SizeOf(node);
  if (offset >= size || length <= 0) return 0;
  length = std::min(length, size - offset);
  if (node.data != DataFile::kNone) {
    const DatasetView& data = *datasets_[node.dataset].view;
    switch (node.data) {
      case DataFile::kSampleIds:
        data.ReadSampleIds(node.dp_rank, offset, length, out);
        break;
      case DataFile::kSample:
        RETURN_IF_ERROR(
            data.ReadSample(node.dp_rank, node.sample, offset, length, out));
        break;
      default:
        RETURN_IF_ERROR(data.ReadStream(node.dp_rank, offset, length, out));
    }
    return length;
  }
  if (node.extra >= 0) {
    RETURN_IF_ERROR(ExtraReader(node.extra).Read(out, length, offset));
    return length;
  }
  if (node.view < 0) {
    std::memcpy(out, node.text.data() + offset, length);
    return length;
  }
  const StepView& view = *views_[node.view];
  const int64_t header =
      std::min(length, std::max<int64_t>(0, HeaderSize(node) - offset));
  if (header > 0) std::memcpy(out, node.text.data() + offset, header);
  char* next = out + header;
  // One look at each blob for the whole request, however many tensors it
  // spans.
  UnchangedBlobs unchanged;
  RETURN_IF_ERROR(
      ForEachTensorPart(
          node, offset, length,
          [&](int shard, int64_t within, int64_t n) -> absl::StatusOr<bool> {
            RETURN_IF_ERROR(
                view.ReadTensor(node.group, shard, within, n, next, unchanged));
            next += n;
            return true;
          })
          .status());
  return length;
}

const BlobReader& Tree::ExtraReader(int extra) const {
  // Opened at the first read: a job's many steps and ranks may name far
  // more extra files than a process may map, and few are ever read.
  ExtraBlob& blob = *extras_[extra];
  std::call_once(blob.once, [&blob] {
    blob.reader = BlobReader::Open(blob.path, blob.name, blob.record);
  });
  return *blob.reader;
}

int64_t Tree::HeaderSize(const Node& node) const {
  return node.shard >= 0 ? 0 : static_cast<int64_t>(node.text.size());
}

absl::StatusOr<bool> Tree::ForEachTensorPart(
    const Node& node, int64_t offset, int64_t length,
    const std::function<absl::StatusOr<bool>(int, int64_t, int64_t)>& part)
    const {
  if (node.shard >= 0) return part(node.shard, offset, length);
  // model.safetensors: the header, then each tensor of the group in turn.
  const int64_t header = HeaderSize(node);
  int64_t done = std::min(length, std::max<int64_t>(0, header - offset));
  const StepView& view = *views_[node.view];
  const std::vector<int64_t>& starts = tensor_starts_[node.view][node.group];
  const std::vector<TensorShard>& shards = view.placement().shards(node.group);
  while (done < length) {
    const int64_t data_pos = offset + done - header;
    size_t k = std::upper_bound(starts.begin(), starts.end(), data_pos) -
               starts.begin() - 1;
    // Skip empty tensors that share a start with the next one.
    while (k < shards.size() && data_pos >= starts[k] + shards[k].bytes) ++k;
    const int64_t within = data_pos - starts[k];
    const int64_t n = std::min(length - done, shards[k].bytes - within);
    ASSIGN_OR_RETURN(bool go_on, part(static_cast<int>(k), within, n));
    if (!go_on) return false;
    done += n;
  }
  return true;
}

}  // namespace scalai
