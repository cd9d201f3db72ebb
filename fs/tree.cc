#include "fs/tree.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"

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

absl::StatusOr<std::unique_ptr<Tree>> Tree::Build(const Store& store,
                                                  const ParallelConfig& config,
                                                  uint64_t generation) {
  std::unique_ptr<Tree> tree(new Tree());
  tree->config_ = config;
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
  add_text(kRootIno, "config", config.ToString() + "\n").mode = 0644;
  add_text(kRootIno, "status", "").live = true;
  json job = {
      {"store", store.dir()},        {"layout", store.layout().ToJson()},
      {"config", config.ToString()}, {"world_size", config.world_size()},
      {"steps", json::array()},      {"datasets", json::array()}};
  if (store.model() != nullptr) job["model"] = ModelSummary(store);
  for (const StepRecord& s : steps) job["steps"].push_back(s.step);
  add_text(kRootIno, "job.json", job.dump(2) + "\n");
  const uint64_t ckpt = tree->Add(kRootIno, "ckpt", NodeKind::kDir, 0555).ino;
  tree->Add(kRootIno, "data", NodeKind::kDir, 0555);
  if (!steps.empty()) {
    Node& latest = tree->Add(ckpt, "latest", NodeKind::kSymlink, 0777);
    latest.text = StepName(steps.back().step);
    latest.size = static_cast<int64_t>(latest.text.size());
  }
  for (const StepRecord& step : steps) {
    ASSIGN_OR_RETURN(std::unique_ptr<StepView> view,
                     StepView::Create(store, step, config));
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
        Shape offset(t.shape.size(), 0);
        for (const ShardPiece& piece : s.pieces) {
          if (!piece.zero_fill) {
            offset = piece.global.origin();
            break;
          }
        }
        tensors[s.local_name] = {{"dtype", DTypeName(t.dtype)},
                                 {"shape", s.local_shape},
                                 {"global_shape", t.shape},
                                 {"global_offset", offset}};
      }
      ASSIGN_OR_RETURN(
          SafetensorsHeader header,
          SafetensorsHeader::Build(std::move(entries),
                                   {{"scalai.rank", absl::StrCat(rank)},
                                    {"scalai.config", config.ToString()},
                                    {"scalai.step", absl::StrCat(step.step)}}));
      Node& file =
          tree->Add(rank_dir, "model.safetensors", NodeKind::kFile, 0444);
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
                       .dump(2) +
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
      tree->Add(rank_dir, "extra", NodeKind::kDir, 0555);
    }
    tree->views_.push_back(std::move(view));
    tree->tensor_starts_.push_back(std::move(starts));
  }
  tree->SortChildren();
  tree->counts_ = std::make_shared<Counts>(tree->nodes_.size());
  return tree;
}

absl::StatusOr<std::unique_ptr<Tree>> Tree::Rebuild(const Store& store,
                                                    const Tree& same) {
  ASSIGN_OR_RETURN(std::unique_ptr<Tree> tree,
                   Build(store, same.config_, same.generation_));
  if (tree->nodes_.size() != same.nodes_.size()) {
    return absl::InternalError(absl::StrCat(
        "the tree of generation ", same.generation_, " rebuilt has ",
        tree->nodes_.size(), " nodes, not ", same.nodes_.size()));
  }
  tree->counts_ = same.counts_;
  return tree;
}

uint64_t Tree::InoOf(size_t index) const {
  return index == 0 ? kRootIno : (generation_ << 32) | index;
}

std::optional<size_t> Tree::IndexOf(uint64_t ino) const {
  if (ino == kRootIno) return 0;
  const size_t index = ino & 0xffffffffu;
  if ((ino >> 32) != generation_ || index == 0 || index >= nodes_.size()) {
    return std::nullopt;
  }
  return index;
}

void Tree::CountLookup(uint64_t ino) const {
  std::optional<size_t> i = IndexOf(ino);
  if (!i) return;
  counts_->lookups[*i].fetch_add(1);
  counts_->total_lookups.fetch_add(1);
}

void Tree::Forget(uint64_t ino, uint64_t n) const {
  std::optional<size_t> i = IndexOf(ino);
  if (!i) return;
  // The kernel never forgets more than it was given; clamp all the same.
  std::atomic<uint64_t>& count = counts_->lookups[*i];
  uint64_t have = count.load();
  while (!count.compare_exchange_weak(have, have - std::min(have, n))) {
  }
  counts_->total_lookups.fetch_sub(std::min(have, n));
}

void Tree::CountOpen(uint64_t ino, int delta) const {
  std::optional<size_t> i = IndexOf(ino);
  if (i) counts_->opens[*i].fetch_add(delta);
}

std::vector<const Node*> Tree::UnopenedReferencesDeepestFirst() const {
  // A child is always added after its parent: reverse order puts it first.
  std::vector<const Node*> out;
  for (size_t i = nodes_.size(); i-- > 1;) {
    if (counts_->lookups[i].load() > 0 && counts_->opens[i].load() == 0) {
      out.push_back(&nodes_[i]);
    }
  }
  return out;
}

uint64_t Tree::lookups(uint64_t ino) const {
  std::optional<size_t> i = IndexOf(ino);
  return i ? counts_->lookups[*i].load() : 0;
}

const Node* Tree::Get(uint64_t ino) const {
  std::optional<size_t> i = IndexOf(ino);
  return i ? &nodes_[*i] : nullptr;
}

const Node* Tree::Lookup(uint64_t parent, absl::string_view name) const {
  const Node* dir = Get(parent);
  if (dir == nullptr || dir->kind != NodeKind::kDir) return nullptr;
  auto it = std::lower_bound(
      dir->children.begin(), dir->children.end(), name,
      [&](uint64_t ino, absl::string_view n) { return Get(ino)->name < n; });
  if (it == dir->children.end() || Get(*it)->name != name) return nullptr;
  return Get(*it);
}

absl::StatusOr<int64_t> Tree::Read(const Node& node, int64_t offset,
                                   int64_t length, char* out) const {
  if (node.kind != NodeKind::kFile)
    return absl::InvalidArgumentError("not a file");
  if (offset >= node.size || length <= 0) return 0;
  length = std::min(length, node.size - offset);
  if (node.view < 0) {
    std::memcpy(out, node.text.data() + offset, length);
    return length;
  }
  const StepView& view = *views_[node.view];
  if (node.shard >= 0) {
    RETURN_IF_ERROR(
        view.ReadTensor(node.group, node.shard, offset, length, out));
    return length;
  }
  // model.safetensors: the header, then each tensor of the group in turn.
  int64_t done = 0;
  const int64_t header = static_cast<int64_t>(node.text.size());
  if (offset < header) {
    done = std::min(length, header - offset);
    std::memcpy(out, node.text.data() + offset, done);
  }
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
    RETURN_IF_ERROR(view.ReadTensor(node.group, static_cast<int>(k), within, n,
                                    out + done));
    done += n;
  }
  return length;
}

}  // namespace scalai
