#include "fs/save_area.h"

#include <charconv>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ptc/excerpt.h"
#include "ptc/status_macros.h"
#include "ptc/utf8.h"

namespace scalai {
namespace {

constexpr absl::string_view kShardFile = "model.safetensors";
constexpr absl::string_view kExtraDir = "extra";

// The number in `prefix` + zero-padded digits, exactly as the mount names
// it; nullopt for any other name.
std::optional<int64_t> Numbered(absl::string_view name,
                                absl::string_view prefix, size_t digits) {
  if (!absl::StartsWith(name, prefix) || name.size() != prefix.size() + digits)
    return std::nullopt;
  int64_t n = -1;
  const char* begin = name.data() + prefix.size();
  auto [end, ec] = std::from_chars(begin, name.data() + name.size(), n);
  if (ec != std::errc() || end != name.data() + name.size() || n < 0)
    return std::nullopt;
  return n;
}

// Names saved go into the catalog's JSON records (extra/ paths).
absl::Status CheckName(absl::string_view name) {
  if (IsUtf8(name)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "\"", Excerpt(name), "\": names saved under ckpt/ must be UTF-8"));
}

}  // namespace

uint64_t SaveArea::AddNode(SaveNode node) {
  node.ino = next_ino_++;
  const uint64_t ino = node.ino;
  if (node.parent != 0 && nodes_.contains(node.parent))
    nodes_[node.parent].children[node.name] = ino;
  nodes_[ino].node = std::move(node);
  return ino;
}

void SaveArea::RemoveTree(uint64_t ino) {
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return;
  // Each child takes itself out of this map: walk a copy.
  std::vector<uint64_t> children;
  for (const auto& [name, child] : it->second.children)
    children.push_back(child);
  for (uint64_t child : children) RemoveTree(child);
  it = nodes_.find(ino);
  auto parent = nodes_.find(it->second.node.parent);
  if (parent != nodes_.end())
    parent->second.children.erase(it->second.node.name);
  nodes_.erase(it);
}

absl::StatusOr<SaveNode> SaveArea::MkdirStep(absl::string_view name,
                                             const ParallelConfig& config) {
  std::optional<int64_t> step = Numbered(name, "step-", 8);
  if (!step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ckpt/", Excerpt(name), ": a step directory is named step-NNNNNNNN"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (removed_.contains(*step)) {
    return absl::UnavailableError(absl::StrCat(
        "step ", *step,
        " was removed here and is being withdrawn from the cluster: it can "
        "be saved again once etcd has recorded that"));
  }
  if (steps_.contains(*step)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "step ", *step,
        steps_.at(*step).committed ? " is committed" : " is being saved"));
  }
  StepWriter::Options options;
  if (ranks_of_host_) {
    ASSIGN_OR_RETURN(options.ranks, ranks_of_host_(config));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<StepWriter> writer,
                   StepWriter::Create(store_, *step, config, options));
  SaveNode dir_node;
  dir_node.name = std::string(name);
  dir_node.dir = true;
  dir_node.step = *step;
  const uint64_t dir = AddNode(std::move(dir_node));
  steps_[*step] = Step{std::move(writer), dir};
  return nodes_[dir].node;
}

absl::StatusOr<SaveNode> SaveArea::Mkdir(uint64_t parent,
                                         absl::string_view name) {
  RETURN_IF_ERROR(CheckName(name));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(parent);
  if (it == nodes_.end()) return absl::NotFoundError("no such directory");
  const SaveNode& p = it->second.node;
  if (it->second.children.contains(std::string(name)))
    return absl::AlreadyExistsError(absl::StrCat(Excerpt(name), " exists"));
  const Step& step = steps_.at(p.step);
  if (step.committed) {
    return absl::AlreadyExistsError(
        absl::StrCat("step ", p.step, " is committed: its directories exist"));
  }
  if (p.rank >= 0) {
    if (!p.extra && name != kExtraDir) {
      return absl::PermissionDeniedError(absl::StrCat(
          "a rank directory holds model.safetensors and extra/ only, not ",
          Excerpt(name)));
    }
    SaveNode dir = p;
    dir.parent = parent;
    dir.name = std::string(name);
    dir.extra_path = p.extra ? absl::StrCat(p.extra_path, name, "/") : "";
    dir.extra = true;
    const uint64_t ino = AddNode(std::move(dir));
    return nodes_[ino].node;
  }
  std::optional<int64_t> rank = Numbered(name, "rank-", 5);
  const ParallelConfig& config = step.writer->config();
  if (!rank || *rank >= config.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", p.step, ": ", Excerpt(name), " is not a rank of ",
                     config.ToString(), " (rank-00000 to rank-",
                     absl::StrFormat("%05d", config.world_size() - 1), ")"));
  }
  RETURN_IF_ERROR(step.writer->CheckRank(static_cast<int>(*rank)));
  SaveNode dir;
  dir.parent = parent;
  dir.name = std::string(name);
  dir.dir = true;
  dir.step = p.step;
  dir.rank = static_cast<int>(*rank);
  step.writer->Join(dir.rank);
  const uint64_t ino = AddNode(std::move(dir));
  return nodes_[ino].node;
}

absl::StatusOr<std::pair<SaveNode, std::shared_ptr<ShardFile>>>
SaveArea::Create(uint64_t parent, absl::string_view name) {
  RETURN_IF_ERROR(CheckName(name));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(parent);
  if (it == nodes_.end()) return absl::NotFoundError("no such directory");
  const SaveNode p = it->second.node;
  if (p.rank < 0 || (!p.extra && name != kShardFile)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "only rank-RRRRR/model.safetensors and files under rank-RRRRR/extra/ "
        "can be saved, not ",
        Excerpt(name)));
  }
  const std::string extra_path = absl::StrCat(p.extra_path, name);
  const Step& step = steps_.at(p.step);
  std::shared_ptr<ShardFile> file;
  if (step.committed && p.extra) {
    return StepWriter::LateExtra(p.step, p.rank, extra_path);
  } else if (step.committed) {
    ASSIGN_OR_RETURN(file, ShardFile::Scratch(store_.blob_dir(),
                                              step.writer->ShardLimit(p.rank)));
  } else if (p.extra) {
    ASSIGN_OR_RETURN(file, step.writer->OpenExtra(p.rank, extra_path));
  } else {
    ASSIGN_OR_RETURN(file, step.writer->Open(p.rank));
  }
  uint64_t ino;
  auto existing = it->second.children.find(std::string(name));
  if (existing != it->second.children.end()) {
    if (nodes_.at(existing->second).node.dir)
      return absl::AlreadyExistsError(absl::StrCat(name, " is a directory"));
    ino = existing->second;
  } else {
    SaveNode n;
    n.parent = parent;
    n.name = std::string(name);
    n.step = p.step;
    n.rank = p.rank;
    n.extra = p.extra;
    if (p.extra) n.extra_path = extra_path;
    ino = AddNode(std::move(n));
  }
  if (!step.committed) nodes_[ino].file = file;
  SaveNode node = nodes_[ino].node;
  node.committed = step.committed;
  return std::make_pair(node, file);
}

absl::StatusOr<std::shared_ptr<ShardFile>> SaveArea::Rewrite(uint64_t ino) {
  std::optional<SaveNode> n = Get(ino);
  if (!n || n->dir) return absl::NotFoundError("no such file");
  ASSIGN_OR_RETURN(auto created, Create(n->parent, n->name));
  return created.second;
}

std::shared_ptr<ShardFile> SaveArea::FileOf(uint64_t ino) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(ino);
  return it == nodes_.end() ? nullptr : it->second.file;
}

std::optional<SaveNode> SaveArea::Get(uint64_t ino) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return std::nullopt;
  SaveNode n = it->second.node;
  if (it->second.file != nullptr) n.size = it->second.file->size();
  auto step = steps_.find(n.step);
  n.committed = step != steps_.end() && step->second.committed;
  return n;
}

std::optional<SaveNode> SaveArea::Lookup(uint64_t parent,
                                         absl::string_view name) const {
  uint64_t ino = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(parent);
    if (it == nodes_.end()) return std::nullopt;
    auto child = it->second.children.find(std::string(name));
    if (child == it->second.children.end()) return std::nullopt;
    ino = child->second;
  }
  return Get(ino);
}

std::optional<SaveNode> SaveArea::LookupStep(absl::string_view name) const {
  std::optional<int64_t> step = Numbered(name, "step-", 8);
  if (!step) return std::nullopt;
  uint64_t dir = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = steps_.find(*step);
    // A committed step is still found here: until the server has switched
    // to a tree that shows it, this is where a walk finds it.
    if (it == steps_.end()) return std::nullopt;
    dir = it->second.dir;
  }
  return Get(dir);
}

std::vector<SaveNode> SaveArea::Children(uint64_t dir) const {
  std::vector<uint64_t> inos;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(dir);
    if (it == nodes_.end()) return {};
    for (const auto& [name, ino] : it->second.children) inos.push_back(ino);
  }
  std::vector<SaveNode> out;
  for (uint64_t ino : inos) {
    if (std::optional<SaveNode> n = Get(ino)) out.push_back(*n);
  }
  return out;
}

std::vector<SaveNode> SaveArea::Steps() const {
  std::vector<uint64_t> dirs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [step, s] : steps_) {
      if (!s.committed) dirs.push_back(s.dir);
    }
  }
  std::vector<SaveNode> out;
  for (uint64_t ino : dirs) {
    if (std::optional<SaveNode> n = Get(ino)) out.push_back(*n);
  }
  return out;
}

absl::Status SaveArea::Unlink(uint64_t parent, absl::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(parent);
  if (it == nodes_.end()) return absl::NotFoundError("no such directory");
  auto child = it->second.children.find(std::string(name));
  if (child == it->second.children.end())
    return absl::NotFoundError(absl::StrCat(name, " does not exist"));
  const Node& n = nodes_.at(child->second);
  if (n.node.dir) return absl::FailedPreconditionError("a directory");
  const Step& step = steps_.at(n.node.step);
  if (step.committed) {
    return absl::PermissionDeniedError(
        absl::StrCat("step ", n.node.step, " is committed"));
  }
  if (n.node.extra) {
    step.writer->ForgetExtra(n.node.rank, n.node.extra_path);
  } else {
    step.writer->Forget(n.node.rank);
  }
  RemoveTree(child->second);
  return absl::OkStatus();
}

absl::Status SaveArea::Rmdir(uint64_t parent, absl::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t ino = 0;
  if (parent == 0) {
    std::optional<int64_t> step = Numbered(name, "step-", 8);
    if (!step || !steps_.contains(*step) || steps_.at(*step).committed)
      return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    ino = steps_.at(*step).dir;
  } else {
    auto it = nodes_.find(parent);
    if (it == nodes_.end()) return absl::NotFoundError("no such directory");
    auto child = it->second.children.find(std::string(name));
    if (child == it->second.children.end())
      return absl::NotFoundError(absl::StrCat(name, " does not exist"));
    ino = child->second;
  }
  const Node& n = nodes_.at(ino);
  if (!n.node.dir) return absl::FailedPreconditionError("not a directory");
  if (!n.children.empty())
    return absl::FailedPreconditionError("directory not empty");
  if (steps_.at(n.node.step).committed) {
    return absl::PermissionDeniedError(
        absl::StrCat("step ", n.node.step, " is committed"));
  }
  if (n.node.rank < 0) {
    if (ranks_of_host_) {
      // Durable first: a host mounted again before the cluster withdrew
      // the step must not let its pending part vote.
      RETURN_IF_ERROR(store_.MarkPendingRemoved(n.node.step));
      removed_.insert_or_assign(n.node.step,
                                steps_.at(n.node.step).writer->config());
    }
    steps_.erase(n.node.step);  // its writer removes its blobs
  } else if (!n.node.extra) {
    steps_.at(n.node.step).writer->Leave(n.node.rank);
  }
  RemoveTree(ino);
  return absl::OkStatus();
}

std::vector<SaveArea::Removed> SaveArea::RemovedSteps() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Removed> out;
  for (const auto& [step, config] : removed_) out.push_back({step, config});
  return out;
}

void SaveArea::ReleaseRemoved(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  removed_.erase(step);
}

void SaveArea::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  nodes_.clear();
  steps_.clear();
  removed_.clear();
}

absl::StatusOr<bool> SaveArea::Close(uint64_t ino,
                                     const std::shared_ptr<ShardFile>& file) {
  std::shared_ptr<StepWriter> writer;
  int rank = -1;
  bool extra = false;
  std::string extra_path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(ino);
    if (it == nodes_.end()) {
      return absl::FailedPreconditionError(
          "the file was removed before it was closed");
    }
    auto step = steps_.find(it->second.node.step);
    if (step == steps_.end())
      return absl::FailedPreconditionError("its step is gone");
    const SaveNode& n = it->second.node;
    if (step->second.committed && n.extra) {
      return StepWriter::LateExtra(n.step, n.rank, n.extra_path);
    }
    if (step->second.committed) {
      return absl::AbortedError(
          absl::StrCat("step ", step->first, " committed before this close"));
    }
    writer = step->second.writer;
    rank = it->second.node.rank;
    extra = it->second.node.extra;
    extra_path = it->second.node.extra_path;
  }
  // Checked without mu_: a 2 GiB shard must not hold up the other ranks.
  if (extra) {
    RETURN_IF_ERROR(writer->CloseExtra(rank, extra_path, file));
  } else {
    RETURN_IF_ERROR(writer->Close(rank, file));
  }
  return writer->complete();
}

absl::Status SaveArea::SaveAsHost(RanksOfHost ranks) {
  // Parts whose step directory was removed before this mount began still
  // wait for the cluster to withdraw their steps.
  std::map<int64_t, ParallelConfig> removed;
  if (ranks) {
    ASSIGN_OR_RETURN(std::vector<PendingStep> pending, store_.PendingSteps());
    for (const PendingStep& p : pending) {
      if (!p.removed) continue;
      ASSIGN_OR_RETURN(ParallelConfig config,
                       ParallelConfig::Parse(p.record.config));
      removed.emplace(p.record.step, std::move(config));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  ranks_of_host_ = std::move(ranks);
  removed_.merge(removed);
  return absl::OkStatus();
}

absl::Status SaveArea::Commit(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = steps_.find(step);
  if (it == steps_.end() || it->second.committed) return absl::OkStatus();
  RETURN_IF_ERROR(it->second.writer->Commit());
  if (!it->second.writer->pending()) MarkCommittedLocked(it);
  return absl::OkStatus();
}

void SaveArea::Committed(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = steps_.find(step);
  if (it != steps_.end() && !it->second.committed) MarkCommittedLocked(it);
}

void SaveArea::Discard(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = steps_.find(step);
  if (it == steps_.end()) return;
  RemoveTree(it->second.dir);
  steps_.erase(it);
}

void SaveArea::MarkCommittedLocked(std::map<int64_t, Step>::iterator it) {
  // The step's nodes stay until the next commit, for walks in flight; the
  // tree shows the step from now on.
  for (auto old = steps_.begin(); old != steps_.end();) {
    if (old->second.committed) {
      RemoveTree(old->second.dir);
      old = steps_.erase(old);
    } else {
      ++old;
    }
  }
  it->second.committed = true;
  it->second.writer.reset();
}

std::vector<std::pair<int64_t, std::vector<int>>> SaveArea::Pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int64_t, std::vector<int>>> out;
  for (const auto& [step, s] : steps_) {
    if (!s.committed) out.emplace_back(step, s.writer->missing());
  }
  return out;
}

}  // namespace scalai
