#include "transfer/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/dataset_order.h"
#include "ptc/excerpt.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "xxhash.h"

namespace scalai {
namespace {

using nlohmann::json;

absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("catalog record ", what, " is damaged"));
}

absl::StatusOr<json> ParseRecord(const std::string& text,
                                 absl::string_view what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corrupt(what);
  return j;
}

constexpr char kServedAt[] = "SERVED_AT";
// Marks the error of an open refused because another process holds the
// store (Store::HeldByAnother).
constexpr char kHeldPayload[] = "scalai/store-held";

// Whether the process holding the store is a mount server whose mount is
// gone: `umount` returns when the kernel lets go of the mount point, a beat
// before the server has exited and released the store.
bool HolderIsLeaving(const std::string& dir) {
  std::ifstream in(dir + "/" + kServedAt);
  std::string mountpoint;
  if (!std::getline(in, mountpoint) || mountpoint.empty()) return false;
  return MountedDevice(mountpoint).empty();
}

// The store's writer lock, held for as long as the descriptor stays open.
absl::StatusOr<UniqueFd> Lock(const std::string& dir) {
  const std::string path = dir + "/LOCK";
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoError(errno, "open", path);
  // A server on its way out is waited for (10 s at most); any other holder
  // is an error at once.
  for (int tries = 0;; ++tries) {
    if (flock(fd.get(), LOCK_EX | LOCK_NB) == 0) return fd;
    if (errno != EWOULDBLOCK) return ErrnoError(errno, "lock", dir + "/LOCK");
    if (tries >= 500 || !HolderIsLeaving(dir)) {
      absl::Status held = absl::FailedPreconditionError(
          absl::StrCat("store ", dir, " is in use by another scalai process"));
      held.SetPayload(kHeldPayload, absl::Cord());
      return held;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

std::string Store::NewBlobName() {
  static thread_local std::mt19937_64 rng(
      std::random_device{}() ^ (static_cast<uint64_t>(getpid()) << 32));
  return absl::StrFormat("%016x%016x.blob", rng(), rng());
}

absl::StatusOr<std::unique_ptr<Store>> Store::Create(const std::string& dir,
                                                     const Layout& layout) {
  if (mkdir(dir.c_str(), 0700) != 0) {
    if (errno != EEXIST) return ErrnoError(errno, "create store", dir);
    ASSIGN_OR_RETURN(std::vector<std::string> entries, ListDir(dir));
    if (!entries.empty()) {
      return absl::AlreadyExistsError(
          absl::StrCat("store ", dir, ": directory exists and is not empty"));
    }
    if (chmod(dir.c_str(), 0700) != 0) return ErrnoError(errno, "chmod", dir);
  }
  if (mkdir((dir + "/blobs").c_str(), 0700) != 0) {
    return ErrnoError(errno, "create", dir + "/blobs");
  }
  std::unique_ptr<Store> store(new Store());
  store->dir_ = dir;
  ASSIGN_OR_RETURN(store->lock_, Lock(dir));
  ASSIGN_OR_RETURN(store->catalog_,
                   Catalog::Open(dir + "/catalog", Catalog::Mode::kCreate));
  Catalog::Batch batch;
  batch.Put(Table::kMeta, "layout", layout.ToJson().dump());
  RETURN_IF_ERROR(store->catalog_->Commit(batch));
  RETURN_IF_ERROR(SyncDir(dir));
  store->layout_ = layout;
  return store;
}

absl::Status Store::NoteServedAt(const std::string& mountpoint) const {
  char resolved[PATH_MAX];
  const std::string path =
      realpath(mountpoint.c_str(), resolved) != nullptr ? resolved : mountpoint;
  const std::string file = dir_ + "/" + kServedAt;
  const std::string tmp = file + ".tmp";
  {
    ASSIGN_OR_RETURN(UniqueFd fd,
                     OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600));
    const std::string text = path + "\n";
    RETURN_IF_ERROR(WriteAll(fd.get(), text.data(), text.size(), tmp));
  }
  if (rename(tmp.c_str(), file.c_str()) != 0)
    return ErrnoError(errno, "rename", tmp);
  return absl::OkStatus();
}

bool Store::HeldByAnother(const absl::Status& status) {
  return status.GetPayload(kHeldPayload).has_value();
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& dir,
                                                   Access access) {
  struct stat st;
  if (stat((dir + "/catalog").c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat(dir, " is not a scalai store (scalai init makes one)"));
  }
  std::unique_ptr<Store> store(new Store());
  store->dir_ = dir;
  const bool writer = access != Access::kReadOnly;
  if (writer) {
    ASSIGN_OR_RETURN(store->lock_, Lock(dir));
  }
  ASSIGN_OR_RETURN(
      store->catalog_,
      Catalog::Open(dir + "/catalog", writer ? Catalog::Mode::kReadWrite
                                             : Catalog::Mode::kReadOnly));
  RETURN_IF_ERROR(store->Load());
  if (writer) {
    // One scan of the blob records serves both.
    ASSIGN_OR_RETURN(auto blobs, store->Blobs());
    RETURN_IF_ERROR(
        store->RemoveOrphans(blobs, /*even_all=*/access == Access::kRepair));
    RETURN_IF_ERROR(store->AddChunkSums(std::move(blobs)));
  }
  return store;
}

absl::Status Store::Load() {
  ASSIGN_OR_RETURN(std::optional<std::string> layout,
                   catalog_->Get(Table::kMeta, "layout"));
  if (!layout) return Corrupt("layout");
  ASSIGN_OR_RETURN(layout_, Layout::FromJson(*layout, "stored layout"));
  ASSIGN_OR_RETURN(std::optional<std::string> model,
                   catalog_->Get(Table::kMeta, "model"));
  if (model) {
    json j = json::parse(*model, nullptr, false);
    if (j.is_discarded() || !j.is_array()) return Corrupt("model");
    Model m;
    for (const json& t : j) {
      if (!t.is_array() || t.size() != 3 || !t[0].is_string() ||
          !t[1].is_string() || !t[2].is_array()) {
        return Corrupt("model");
      }
      auto dtype = ParseSafetensorsDType(t[1].get<std::string>());
      if (!dtype.ok()) return Corrupt("model");
      RETURN_IF_ERROR(
          m.Add({t[0].get<std::string>(), *dtype, t[2].get<Shape>()}));
    }
    model_ = std::make_shared<const Model>(std::move(m));
  }
  ASSIGN_OR_RETURN(std::optional<std::string> config,
                   catalog_->Get(Table::kMeta, "config"));
  if (config) {
    auto parsed = ParallelConfig::Parse(*config);
    if (!parsed.ok()) return Corrupt("config");
    config_ = *parsed;
  }
  return absl::OkStatus();
}

absl::Status Store::RemoveOrphans(
    const std::map<std::string, BlobRecord>& blobs, bool even_all) {
  ASSIGN_OR_RETURN(std::vector<std::string> files, ListDir(blob_dir()));
  if (blobs.empty() && !files.empty() && !even_all) {
    // Every blob would go. A catalog damaged past what RocksDB detects
    // (a log cut at a record's length) opens like this, so nothing is
    // removed on its word.
    return absl::FailedPreconditionError(absl::StrCat(
        blob_dir(), " holds ", files.size(),
        " blob files but the catalog names none: the catalog may be damaged, "
        "so nothing was removed (if they are left by an interrupted first "
        "import, scalai fsck --repair ",
        dir_, " removes them)"));
  }
  for (const std::string& name : files) {
    if (blobs.contains(name)) continue;
    if (unlink(BlobPath(name).c_str()) != 0 && errno != ENOENT) {
      return ErrnoError(errno, "remove orphaned blob", BlobPath(name));
    }
    ++orphans_removed_;
  }
  if (orphans_removed_ > 0) RETURN_IF_ERROR(SyncDir(blob_dir()));
  // Dataset indexes of a registration that never committed.
  struct stat st;
  if (stat(dataset_dir().c_str(), &st) != 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(auto datasets, Datasets());
  std::set<std::string> named;
  for (const auto& [name, d] : datasets) named.insert(d.index);
  ASSIGN_OR_RETURN(files, ListDir(dataset_dir()));
  for (const std::string& name : files) {
    if (named.contains(name)) continue;
    const std::string path = dataset_dir() + "/" + name;
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError(errno, "remove orphaned dataset index", path);
    }
    ++orphans_removed_;
  }
  return absl::OkStatus();
}

absl::Status Store::SetCurrentConfig(const ParallelConfig& config) {
  if (model_ != nullptr) {
    auto placement = Placement::Create(layout_, model_, config);
    if (!placement.ok()) return placement.status();
  }
  ASSIGN_OR_RETURN(auto datasets, Datasets());
  for (const auto& [name, d] : datasets) {
    ASSIGN_OR_RETURN(
        DatasetOrder order,
        DatasetOrder::Create(d.samples, d.global_batch, d.seed, d.epochs));
    if (absl::Status s = order.CheckDp(config.dp()); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset ", name, ": ", s.message()));
    }
  }
  if (config_ == config) return absl::OkStatus();
  Catalog::Batch batch;
  batch.Put(Table::kMeta, "config", config.ToString());
  RETURN_IF_ERROR(catalog_->Commit(batch));
  config_ = config;
  return absl::OkStatus();
}

absl::Status Store::CheckPosition(int64_t consumed_samples) const {
  ASSIGN_OR_RETURN(auto datasets, Datasets());
  for (const auto& [name, d] : datasets) {
    if (d.global_batch > 0 && consumed_samples % d.global_batch != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("consumed samples ", consumed_samples,
                       " is not a multiple of the global batch ",
                       d.global_batch, " of dataset ", Excerpt(name)));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<ShardRecord> DecodeShard(const json& j,
                                        const std::string& what) {
  ShardRecord shard;
  if (!j.is_object() || !j.contains("blobs") || !j["blobs"].is_array() ||
      !j.contains("tensors") || !j["tensors"].is_array()) {
    return Corrupt(what);
  }
  for (const json& b : j["blobs"]) {
    if (!b.is_string()) return Corrupt(what);
    shard.blobs.push_back(b.get<std::string>());
  }
  for (const json& t : j["tensors"]) {
    if (!t.is_array() || t.size() != 2 || !t[0].is_number_integer() ||
        !t[1].is_number_integer()) {
      return Corrupt(what);
    }
    ShardRecord::Location loc{t[0].get<int>(), t[1].get<int64_t>()};
    if (loc.blob < 0 || loc.blob >= static_cast<int>(shard.blobs.size()) ||
        loc.offset < 0) {
      return Corrupt(what);
    }
    shard.tensors.push_back(loc);
  }
  return shard;
}

json ShardJson(const ShardRecord& shard) {
  json tensors = json::array();
  for (const ShardRecord::Location& loc : shard.tensors)
    tensors.push_back({loc.blob, loc.offset});
  return json{{"blobs", shard.blobs}, {"tensors", tensors}};
}

// The groups list of a step record ("held"): distinct, each below `groups`.
absl::StatusOr<std::vector<int>> DecodeHeld(const json& j, int groups,
                                            const std::string& what) {
  std::vector<int> held;
  if (!j.is_array()) return Corrupt(what);
  for (const json& g : j) {
    if (!g.is_number_integer()) return Corrupt(what);
    const int group = g.get<int>();
    if (group < 0 || group >= groups ||
        (!held.empty() && group <= held.back())) {
      return Corrupt(what);
    }
    held.push_back(group);
  }
  return held;
}

}  // namespace

namespace {

// A step record as the catalog keeps it under `key`.
absl::StatusOr<StepRecord> DecodeStep(const std::string& key,
                                      const std::string& value) {
  std::string what = absl::StrCat("step ", StepFromKey(key));
  ASSIGN_OR_RETURN(json j, ParseRecord(value, what));
  if (!j.contains("config") || !j["config"].is_string() ||
      !j.contains("groups") || !j["groups"].is_number_integer() ||
      !j.contains("bytes")) {
    return Corrupt(what);
  }
  StepRecord step;
  step.step = StepFromKey(key);
  step.config = j["config"].get<std::string>();
  step.groups = j["groups"].get<int>();
  step.bytes = j["bytes"].get<int64_t>();
  if (step.groups < 0) return Corrupt(what);
  if (j.contains("held")) {
    ASSIGN_OR_RETURN(step.held, DecodeHeld(j["held"], step.groups, what));
  }
  if (j.contains("retained")) {
    if (!j["retained"].is_array()) return Corrupt(what);
    for (const json& r : j["retained"]) {
      RetainedShards kept;
      if (!r.is_object() || !r.contains("config") || !r["config"].is_string() ||
          !r.contains("groups") || !r["groups"].is_object()) {
        return Corrupt(what);
      }
      kept.config = r["config"].get<std::string>();
      for (const auto& [group, shard] : r["groups"].items()) {
        int g = -1;
        if (!absl::SimpleAtoi(group, &g) || g < 0) return Corrupt(what);
        ASSIGN_OR_RETURN(kept.groups[g], DecodeShard(shard, what));
      }
      step.retained.push_back(std::move(kept));
    }
  }
  if (j.contains("consumed_samples")) {
    if (!j["consumed_samples"].is_number_integer()) return Corrupt(what);
    step.consumed_samples = j["consumed_samples"].get<int64_t>();
  }
  if (j.contains("extra")) {
    try {
      step.extra_config = j.at("extra_config").get<std::string>();
      for (const auto& [rank, files] : j.at("extra").items()) {
        std::vector<ExtraFile>& mine = step.extra[std::stoi(rank)];
        for (const json& f : files) {
          mine.push_back({f.at("path").get<std::string>(),
                          f.at("blob").get<std::string>(),
                          f.at("size").get<int64_t>()});
        }
      }
    } catch (const std::exception&) {
      return Corrupt(what);
    }
  }
  return step;
}

}  // namespace

absl::StatusOr<std::vector<StepRecord>> Store::Steps() const {
  ASSIGN_OR_RETURN(auto records, catalog_->Scan(Table::kSteps));
  std::vector<StepRecord> steps;
  for (const auto& [key, value] : records) {
    ASSIGN_OR_RETURN(StepRecord step, DecodeStep(key, value));
    steps.push_back(std::move(step));
  }
  return steps;
}

absl::StatusOr<std::optional<StepRecord>> Store::FindStep(int64_t step) const {
  // One record, not a scan: a peer asks for a step at every call.
  const std::string key = StepKey(step);
  ASSIGN_OR_RETURN(std::optional<std::string> value,
                   catalog_->Get(Table::kSteps, key));
  if (!value) return std::nullopt;
  return DecodeStep(key, *value);
}

absl::StatusOr<StepRecord> Store::ResolveStep(
    std::optional<int64_t> step) const {
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, Steps());
  if (steps.empty())
    return absl::NotFoundError(absl::StrCat("store ", dir_, " has no steps"));
  if (!step) return steps.back();
  for (const StepRecord& s : steps) {
    if (s.step == *step) return s;
  }
  return absl::NotFoundError(
      absl::StrCat("store ", dir_, " has no step ", *step));
}

bool StepRecord::holds(int group) const {
  return !held || std::binary_search(held->begin(), held->end(), group);
}

absl::StatusOr<ShardRecord> Store::Shard(int64_t step, int group) const {
  std::string what = absl::StrCat("step ", step, " group ", group);
  ASSIGN_OR_RETURN(std::optional<std::string> value,
                   catalog_->Get(Table::kShards, ShardKey(step, group)));
  if (!value)
    return absl::DataLossError(
        absl::StrCat("catalog record ", what, " is missing"));
  ASSIGN_OR_RETURN(json j, ParseRecord(*value, what));
  return DecodeShard(j, what);
}

namespace {

absl::StatusOr<BlobRecord> DecodeBlob(const std::string& name,
                                      const std::string& value) {
  const std::string what = absl::StrCat("blob ", name);
  ASSIGN_OR_RETURN(json j, ParseRecord(value, what));
  BlobRecord b;
  if (!j.contains("size") || !j["size"].is_number_integer() ||
      (j.contains("step") && !j["step"].is_number_integer())) {
    return Corrupt(what);
  }
  b.size = j["size"].get<int64_t>();
  b.step = j.value("step", int64_t{0});
  if (b.size < 0) return Corrupt(what);
  if (j.contains("chunks") && j["chunks"].is_string()) {
    auto chunks = DecodeChunkSums(j["chunks"].get<std::string>());
    if (!chunks.ok() ||
        static_cast<int64_t>(chunks->size()) != ChunkCount(b.size)) {
      return Corrupt(what);
    }
    b.chunks = *std::move(chunks);
  } else if (j.contains("xxh3") && j["xxh3"].is_string()) {
    uint64_t whole = 0;
    if (!absl::SimpleHexAtoi(j["xxh3"].get<std::string>(), &whole))
      return Corrupt(what);
    b.whole_xxh3 = whole;
  } else {
    return Corrupt(what);
  }
  return b;
}

}  // namespace

absl::StatusOr<std::map<std::string, BlobRecord>> Store::Blobs() const {
  ASSIGN_OR_RETURN(auto records, catalog_->Scan(Table::kBlobs));
  std::map<std::string, BlobRecord> blobs;
  for (const auto& [key, value] : records) {
    ASSIGN_OR_RETURN(blobs[key], DecodeBlob(key, value));
  }
  return blobs;
}

absl::StatusOr<BlobRecord> Store::Blob(const std::string& name) const {
  ASSIGN_OR_RETURN(std::optional<std::string> value,
                   catalog_->Get(Table::kBlobs, name));
  if (!value) {
    return absl::DataLossError(
        absl::StrCat("blob ", name, " is not recorded in the catalog"));
  }
  return DecodeBlob(name, *value);
}

absl::Status Store::AddChunkSums(std::map<std::string, BlobRecord> blobs) {
  Catalog::Batch batch;
  for (auto& [name, record] : blobs) {
    if (!record.whole_xxh3) continue;
    // One read gives both: the whole-blob sum says the bytes are still the
    // ones recorded, and only then are their chunk sums worth recording.
    XXH3_state_t* whole = XXH3_createState();
    absl::Cleanup free_whole = [whole] { XXH3_freeState(whole); };
    XXH3_64bits_reset(whole);
    ChunkHasher chunks;
    absl::Status read =
        ReadChunks(BlobPath(name), [&](const char* d, int64_t n) {
          XXH3_64bits_update(whole, d, n);
          chunks.Update(d, n);
          return absl::OkStatus();
        });
    if (!read.ok() || chunks.bytes() != record.size ||
        XXH3_64bits_digest(whole) != *record.whole_xxh3) {
      ++blobs_not_upgraded_;
      continue;
    }
    record.chunks = chunks.Finish();
    record.whole_xxh3.reset();
    batch.Put(Table::kBlobs, name, EncodeBlob(record));
    ++blobs_upgraded_;
  }
  if (blobs_upgraded_ == 0) return absl::OkStatus();
  return catalog_->Commit(batch);
}

namespace {

// Every blob that `step`'s records name.
absl::Status AddBlobsOf(const Store& store, const StepRecord& step,
                        std::set<std::string>& uses) {
  for (int g = 0; g < step.groups; ++g) {
    if (!step.holds(g)) continue;
    ASSIGN_OR_RETURN(ShardRecord shard, store.Shard(step.step, g));
    uses.insert(shard.blobs.begin(), shard.blobs.end());
  }
  for (const RetainedShards& kept : step.retained) {
    for (const auto& [g, shard] : kept.groups)
      uses.insert(shard.blobs.begin(), shard.blobs.end());
  }
  for (const std::string& blob : step.ExtraBlobs()) uses.insert(blob);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::set<std::string>> Store::BlobsInUse() const {
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, Steps());
  std::set<std::string> uses;
  for (const StepRecord& s : steps) RETURN_IF_ERROR(AddBlobsOf(*this, s, uses));
  ASSIGN_OR_RETURN(std::vector<PendingStep> pending, PendingSteps());
  for (const PendingStep& p : pending) {
    for (std::string& blob : p.Blobs()) uses.insert(std::move(blob));
  }
  return uses;
}

std::vector<std::string> PendingStep::Blobs() const {
  std::vector<std::string> blobs = record.ExtraBlobs();
  blobs.insert(blobs.end(), duplicates.begin(), duplicates.end());
  for (const auto& [g, shard] : shards)
    blobs.insert(blobs.end(), shard.blobs.begin(), shard.blobs.end());
  return blobs;
}

namespace {
// The part of a pending step that this host's workers saved, and the copies
// of other hosts' shards it keeps with it.
constexpr absl::string_view kPendingPrefix = "pending/";
constexpr absl::string_view kCopiesPrefix = "pending-copies/";
constexpr absl::string_view kRemovedPrefix = "removed-pending/";
}  // namespace

std::string Store::PendingKey(int64_t step) {
  return absl::StrCat(kPendingPrefix, StepKey(step));
}

std::string Store::PendingCopiesKey(int64_t step) {
  return absl::StrCat(kCopiesPrefix, StepKey(step));
}

std::string Store::PendingRemovedKey(int64_t step) {
  return absl::StrCat(kRemovedPrefix, StepKey(step));
}

std::string Store::EncodePending(const PendingStep& pending) {
  json j = json::parse(EncodeStep(pending.record));
  json shards = json::object();
  for (const auto& [g, shard] : pending.shards)
    shards[std::to_string(g)] = ShardJson(shard);
  j["pending_shards"] = shards;
  return j.dump();
}

namespace {

// One part of a pending step as the catalog keeps it under `key`, whose
// prefix is `prefix`.
absl::StatusOr<PendingStep> DecodePending(absl::string_view prefix,
                                          absl::string_view key,
                                          const std::string& value) {
  const std::string step_key(key.substr(prefix.size()));
  PendingStep p;
  ASSIGN_OR_RETURN(p.record, DecodeStep(step_key, value));
  const std::string what = absl::StrCat("pending step ", p.record.step);
  ASSIGN_OR_RETURN(json j, ParseRecord(value, what));
  if (!j.contains("pending_shards") || !j["pending_shards"].is_object() ||
      !p.record.held) {
    return Corrupt(what);
  }
  for (const auto& [group, shard] : j["pending_shards"].items()) {
    int g = -1;
    if (!absl::SimpleAtoi(group, &g) || !p.record.holds(g)) {
      return Corrupt(what);
    }
    ASSIGN_OR_RETURN(p.shards[g], DecodeShard(shard, what));
  }
  if (p.shards.size() != p.record.held->size()) return Corrupt(what);
  return p;
}

// The two parts of a pending step as one (either may be missing).
absl::StatusOr<std::optional<PendingStep>> MergePending(
    std::optional<PendingStep> saved, std::optional<PendingStep> copies) {
  if (!copies) return saved;
  copies->saved = false;
  copies->copied = copies->record.held.value_or(std::vector<int>());
  if (!saved) return copies;
  if (saved->record.config != copies->record.config) {
    return absl::DataLossError(absl::StrCat(
        "pending step ", saved->record.step, " was saved under ",
        saved->record.config, " and copied under ", copies->record.config));
  }
  for (auto& [g, shard] : copies->shards) {
    if (saved->shards.contains(g)) {
      saved->duplicates.insert(saved->duplicates.end(), shard.blobs.begin(),
                               shard.blobs.end());
      continue;
    }
    saved->copied.push_back(g);
    saved->record.held->push_back(g);
    saved->shards.emplace(g, std::move(shard));
  }
  std::sort(saved->record.held->begin(), saved->record.held->end());
  return saved;
}

}  // namespace

absl::StatusOr<std::vector<PendingStep>> Store::PendingSteps() const {
  std::map<int64_t, std::optional<PendingStep>> saved, copies;
  for (auto [prefix, parts] :
       {std::pair{kPendingPrefix, &saved}, std::pair{kCopiesPrefix, &copies}}) {
    ASSIGN_OR_RETURN(auto records, catalog_->Scan(Table::kMeta, prefix));
    for (const auto& [key, value] : records) {
      ASSIGN_OR_RETURN(PendingStep p, DecodePending(prefix, key, value));
      const int64_t step = p.record.step;
      (*parts)[step] = std::move(p);
    }
  }
  std::set<std::string> removed;
  ASSIGN_OR_RETURN(auto marks, catalog_->Scan(Table::kMeta, kRemovedPrefix));
  for (const auto& [key, value] : marks) removed.insert(key);
  std::set<int64_t> steps;
  for (const auto& [step, part] : saved) steps.insert(step);
  for (const auto& [step, part] : copies) steps.insert(step);
  std::vector<PendingStep> out;
  for (int64_t step : steps) {
    ASSIGN_OR_RETURN(
        std::optional<PendingStep> p,
        MergePending(std::move(saved[step]), std::move(copies[step])));
    if (!p) continue;
    p->removed = removed.contains(PendingRemovedKey(step));
    out.push_back(*std::move(p));
  }
  return out;
}

absl::StatusOr<std::optional<PendingStep>> Store::FindPending(
    int64_t step) const {
  std::optional<PendingStep> parts[2];
  const std::pair<absl::string_view, std::string> keys[2] = {
      {kPendingPrefix, PendingKey(step)},
      {kCopiesPrefix, PendingCopiesKey(step)}};
  for (int i = 0; i < 2; ++i) {
    ASSIGN_OR_RETURN(std::optional<std::string> value,
                     catalog_->Get(Table::kMeta, keys[i].second));
    if (!value) continue;
    ASSIGN_OR_RETURN(parts[i],
                     DecodePending(keys[i].first, keys[i].second, *value));
  }
  ASSIGN_OR_RETURN(std::optional<PendingStep> p,
                   MergePending(std::move(parts[0]), std::move(parts[1])));
  if (p) {
    ASSIGN_OR_RETURN(std::optional<std::string> removed,
                     catalog_->Get(Table::kMeta, PendingRemovedKey(step)));
    p->removed = removed.has_value();
  }
  return p;
}

absl::Status Store::CommitAgreedStep(
    const StepRecord& agreed, const std::map<std::string, BlobRecord>& copied) {
  ASSIGN_OR_RETURN(std::optional<StepRecord> existing, FindStep(agreed.step));
  if (existing) {
    // Recorded already: what is still pending of it (a copy that came
    // late) is not part of it, and goes.
    if (existing->config == agreed.config) return DiscardPending(agreed.step);
    return absl::AlreadyExistsError(
        absl::StrCat("step ", agreed.step, " is already recorded under ",
                     existing->config, ", not ", agreed.config));
  }
  ASSIGN_OR_RETURN(std::optional<PendingStep> pending,
                   FindPending(agreed.step));
  StepRecord record = agreed;
  record.held = std::vector<int>();
  record.retained.clear();
  Catalog::Batch batch;
  for (const auto& [name, blob] : copied)
    batch.Put(Table::kBlobs, name, EncodeBlob(blob));
  if (pending) {
    const PendingStep& p = *pending;
    if (p.record.config != agreed.config || p.record.groups != agreed.groups) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", agreed.step, " was saved here under ", p.record.config,
          ", the cluster committed it under ", agreed.config));
    }
    record.held = p.record.held;
    for (const auto& [rank, files] : p.record.extra) record.extra[rank] = files;
    for (const auto& [g, shard] : p.shards)
      batch.Put(Table::kShards, ShardKey(agreed.step, g), EncodeShard(shard));
    batch.Delete(Table::kMeta, PendingKey(agreed.step));
    batch.Delete(Table::kMeta, PendingCopiesKey(agreed.step));
    batch.Delete(Table::kMeta, PendingRemovedKey(agreed.step));
  }
  record.extra_config = record.extra.empty() ? "" : agreed.config;
  batch.Put(Table::kSteps, StepKey(agreed.step), EncodeStep(record));
  if (!pending) return catalog_->Commit(batch);
  const std::set<std::string> duplicates(pending->duplicates.begin(),
                                         pending->duplicates.end());
  return CommitFreeing(batch, duplicates, {}).status();
}

absl::Status Store::DiscardPending(int64_t step) {
  ASSIGN_OR_RETURN(std::optional<PendingStep> pending, FindPending(step));
  if (!pending) return absl::OkStatus();
  Catalog::Batch batch;
  batch.Delete(Table::kMeta, PendingKey(step));
  batch.Delete(Table::kMeta, PendingCopiesKey(step));
  batch.Delete(Table::kMeta, PendingRemovedKey(step));
  const std::vector<std::string> blobs = pending->Blobs();
  // A pending step's blobs are its own: nothing else names them.
  return CommitFreeing(batch, {blobs.begin(), blobs.end()}, {}).status();
}

absl::Status Store::MarkPendingRemoved(int64_t step) {
  ASSIGN_OR_RETURN(std::optional<std::string> saved,
                   catalog_->Get(Table::kMeta, PendingKey(step)));
  if (!saved) return absl::OkStatus();
  Catalog::Batch batch;
  batch.Put(Table::kMeta, PendingRemovedKey(step), "");
  return catalog_->Commit(batch);
}

absl::Status Store::AddPendingCopies(
    int64_t step, const std::string& config, int groups,
    const std::map<int, ShardRecord>& shards,
    const std::map<std::string, BlobRecord>& blobs) {
  const std::string key = PendingCopiesKey(step);
  ASSIGN_OR_RETURN(std::optional<std::string> value,
                   catalog_->Get(Table::kMeta, key));
  PendingStep copies;
  if (value) {
    ASSIGN_OR_RETURN(copies, DecodePending(kCopiesPrefix, key, *value));
  } else {
    copies.record.step = step;
    copies.record.config = config;
    copies.record.groups = groups;
    copies.record.held.emplace();
  }
  // A group copied here already keeps its first copy; the second's blobs
  // are not recorded, and go.
  std::set<std::string> added, unused;
  for (const auto& [g, shard] : shards) {
    std::set<std::string>& into =
        copies.shards.emplace(g, shard).second ? added : unused;
    into.insert(shard.blobs.begin(), shard.blobs.end());
    if (&into == &added) copies.record.held->push_back(g);
  }
  std::sort(copies.record.held->begin(), copies.record.held->end());
  Catalog::Batch batch;
  for (const auto& [name, blob] : blobs) {
    if (added.contains(name)) batch.Put(Table::kBlobs, name, EncodeBlob(blob));
  }
  batch.Put(Table::kMeta, key, EncodePending(copies));
  RETURN_IF_ERROR(catalog_->Commit(batch));
  for (const std::string& name : unused) unlink(BlobPath(name).c_str());
  return absl::OkStatus();
}

absl::Status Store::DropPendingGroup(int64_t step, int group) {
  Catalog::Batch batch;
  std::set<std::string> dropped;
  for (auto [prefix, key] :
       {std::pair{kPendingPrefix, PendingKey(step)},
        std::pair{kCopiesPrefix, PendingCopiesKey(step)}}) {
    ASSIGN_OR_RETURN(std::optional<std::string> value,
                     catalog_->Get(Table::kMeta, key));
    if (!value) continue;
    ASSIGN_OR_RETURN(PendingStep part, DecodePending(prefix, key, *value));
    auto shard = part.shards.find(group);
    if (shard == part.shards.end()) continue;
    dropped.insert(shard->second.blobs.begin(), shard->second.blobs.end());
    part.shards.erase(shard);
    std::erase(*part.record.held, group);
    batch.Put(Table::kMeta, key, EncodePending(part));
  }
  // The blobs of the other groups and of the extra files stay.
  ASSIGN_OR_RETURN(std::optional<PendingStep> now, FindPending(step));
  std::set<std::string> kept;
  if (now) {
    for (const auto& [g, shard] : now->shards) {
      if (g != group) kept.insert(shard.blobs.begin(), shard.blobs.end());
    }
    for (const std::string& blob : now->record.ExtraBlobs()) kept.insert(blob);
  }
  return CommitFreeing(batch, dropped, kept).status();
}

absl::StatusOr<int> Store::CommitFreeing(Catalog::Batch& batch,
                                         const std::set<std::string>& dropped,
                                         const std::set<std::string>& kept) {
  std::vector<std::string> freed;
  for (const std::string& blob : dropped) {
    if (kept.contains(blob)) continue;
    batch.Delete(Table::kBlobs, blob);
    freed.push_back(blob);
  }
  RETURN_IF_ERROR(catalog_->Commit(batch));
  // A crash here leaves orphans, which the next writable open removes.
  int removed = 0;
  for (const std::string& blob : freed)
    removed += unlink(BlobPath(blob).c_str()) == 0 ? 1 : 0;
  if (removed > 0) RETURN_IF_ERROR(SyncDir(blob_dir()));
  return removed;
}

absl::Status Store::DeleteStep(int64_t step) {
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, Steps());
  std::set<std::string> mine, others;
  Catalog::Batch batch;
  bool found = false;
  for (const StepRecord& s : steps) {
    RETURN_IF_ERROR(AddBlobsOf(*this, s, s.step == step ? mine : others));
    if (s.step != step) continue;
    found = true;
    batch.Delete(Table::kSteps, StepKey(step));
    for (int g = 0; g < s.groups; ++g) {
      if (s.holds(g)) batch.Delete(Table::kShards, ShardKey(step, g));
    }
  }
  if (!found) return absl::NotFoundError(absl::StrCat("no step ", step));
  return CommitFreeing(batch, mine, others).status();
}

absl::StatusOr<int> Store::ReleaseRetained() {
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, Steps());
  // The retained shards' blobs go, but for those a step still names.
  std::set<std::string> retained, kept;
  Catalog::Batch batch;
  bool any = false;
  for (StepRecord& s : steps) {
    for (const RetainedShards& r : s.retained) {
      for (const auto& [g, shard] : r.groups)
        retained.insert(shard.blobs.begin(), shard.blobs.end());
    }
    if (!s.retained.empty()) {
      any = true;
      s.retained.clear();
      batch.Put(Table::kSteps, StepKey(s.step), EncodeStep(s));
    }
    RETURN_IF_ERROR(AddBlobsOf(*this, s, kept));
  }
  if (!any) return 0;
  return CommitFreeing(batch, retained, kept);
}

absl::StatusOr<std::map<std::string, DatasetRecord>> Store::Datasets() const {
  ASSIGN_OR_RETURN(auto records, catalog_->Scan(Table::kDatasets));
  std::map<std::string, DatasetRecord> datasets;
  for (const auto& [key, value] : records) {
    std::string what = absl::StrCat("dataset ", key);
    ASSIGN_OR_RETURN(json j, ParseRecord(value, what));
    DatasetRecord d;
    try {
      d.format = j.at("format").get<std::string>();
      d.token_dtype = j.value("token_dtype", std::string());
      d.samples = j.at("samples").get<int64_t>();
      d.global_batch = j.at("global_batch").get<int64_t>();
      d.seed = j.at("seed").get<uint64_t>();
      d.epochs = j.at("epochs").get<int64_t>();
      d.index = j.at("index").get<std::string>();
      d.index_size = j.at("index_size").get<int64_t>();
      d.index_xxh3 =
          std::stoull(j.at("index_xxh3").get<std::string>(), nullptr, 16);
      if (j.contains("content_xxh3")) {
        d.content_xxh3 =
            std::stoull(j.at("content_xxh3").get<std::string>(), nullptr, 16);
      }
      for (const json& p : j.at("parts")) {
        DatasetRecord::Part part;
        part.samples = p.at("samples").get<int64_t>();
        for (const json& f : p.at("files")) {
          part.files.push_back({f.at("path").get<std::string>(),
                                f.at("size").get<int64_t>(),
                                f.at("mtime_ns").get<int64_t>()});
        }
        d.parts.push_back(std::move(part));
      }
    } catch (const std::exception&) {
      return Corrupt(what);
    }
    datasets[key] = std::move(d);
  }
  return datasets;
}

void Store::WithholdDataset(const std::string& name, std::string reason) {
  std::lock_guard<std::mutex> lock(withheld_mu_);
  withheld_[name] = std::move(reason);
}

std::map<std::string, std::string> Store::withheld_datasets() const {
  std::lock_guard<std::mutex> lock(withheld_mu_);
  return withheld_;
}

std::string Store::EncodeDataset(const DatasetRecord& d) {
  json parts = json::array();
  for (const DatasetRecord::Part& p : d.parts) {
    json files = json::array();
    for (const FileStamp& f : p.files) {
      files.push_back(
          {{"path", f.path}, {"size", f.size}, {"mtime_ns", f.mtime_ns}});
    }
    parts.push_back({{"samples", p.samples}, {"files", files}});
  }
  json j = {{"format", d.format},
            {"samples", d.samples},
            {"global_batch", d.global_batch},
            {"seed", d.seed},
            {"epochs", d.epochs},
            {"index", d.index},
            {"index_size", d.index_size},
            {"index_xxh3", absl::StrFormat("%016x", d.index_xxh3)},
            {"parts", parts}};
  if (!d.token_dtype.empty()) j["token_dtype"] = d.token_dtype;
  if (d.content_xxh3)
    j["content_xxh3"] = absl::StrFormat("%016x", *d.content_xxh3);
  return j.dump();
}

absl::StatusOr<std::shared_ptr<const Placement>> Store::StepPlacement(
    const StepRecord& step) const {
  if (model_ == nullptr) return Corrupt("model");
  if (step.full())
    return std::make_shared<const Placement>(Placement::CreateFull(model_));
  auto config = ParallelConfig::Parse(step.config);
  if (!config.ok()) return Corrupt(absl::StrCat("step ", step.step));
  ASSIGN_OR_RETURN(Placement p, Placement::Create(layout_, model_, *config));
  return std::make_shared<const Placement>(std::move(p));
}

std::string Store::EncodeModel(const Model& model) {
  json j = json::array();
  for (const TensorInfo& t : model.tensors()) {
    j.push_back({t.name, std::string(DTypeName(t.dtype)), t.shape});
  }
  return j.dump();
}

std::string Store::EncodeStep(const StepRecord& step) {
  json j = {
      {"config", step.config}, {"groups", step.groups}, {"bytes", step.bytes}};
  if (step.consumed_samples) j["consumed_samples"] = *step.consumed_samples;
  if (step.held) j["held"] = *step.held;
  if (!step.retained.empty()) {
    json retained = json::array();
    for (const RetainedShards& kept : step.retained) {
      json groups = json::object();
      for (const auto& [g, shard] : kept.groups)
        groups[std::to_string(g)] = ShardJson(shard);
      retained.push_back({{"config", kept.config}, {"groups", groups}});
    }
    j["retained"] = retained;
  }
  if (!step.extra.empty()) {
    json extra = json::object();
    for (const auto& [rank, files] : step.extra) {
      json list = json::array();
      for (const ExtraFile& f : files) {
        list.push_back({{"path", f.path}, {"blob", f.blob}, {"size", f.size}});
      }
      extra[std::to_string(rank)] = list;
    }
    j["extra_config"] = step.extra_config;
    j["extra"] = extra;
  }
  return j.dump();
}

absl::StatusOr<std::vector<ExtraFile>> StepRecord::ExtraFilesSeenBy(
    const ParallelConfig& config, int rank) const {
  if (extra.empty()) return std::vector<ExtraFile>();
  auto saved = ParallelConfig::Parse(extra_config);
  if (!saved.ok()) return Corrupt(absl::StrCat("step ", step));
  std::set<int> ranks;
  for (const auto& [r, files] : extra) ranks.insert(r);
  std::optional<int> source = ExtraSourceRank(*saved, ranks, config, rank);
  if (!source) return std::vector<ExtraFile>();
  return extra.at(*source);
}

std::vector<std::string> StepRecord::ExtraBlobs() const {
  std::vector<std::string> blobs;
  for (const auto& [rank, files] : extra) {
    for (const ExtraFile& f : files) blobs.push_back(f.blob);
  }
  return blobs;
}

std::string Store::EncodeShard(const ShardRecord& shard) {
  return ShardJson(shard).dump();
}

std::string Store::EncodeBlob(const BlobRecord& blob) {
  json j = {{"size", blob.size}, {"step", blob.step}};
  if (blob.whole_xxh3) {
    j["xxh3"] = absl::StrFormat("%016x", *blob.whole_xxh3);
  } else {
    j["chunks"] = EncodeChunkSums(blob.chunks);
  }
  return j.dump();
}

}  // namespace scalai
