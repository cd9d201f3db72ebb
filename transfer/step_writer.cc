#include "transfer/step_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ptc/excerpt.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "transfer/shard_check.h"

namespace scalai {
namespace {

std::string Label(int rank) {
  return absl::StrFormat("rank-%05d/model.safetensors", rank);
}

}  // namespace

absl::StatusOr<std::shared_ptr<ShardFile>> ShardFile::Scratch(
    const std::string& dir, int64_t max_bytes) {
  std::shared_ptr<ShardFile> file(new ShardFile());
  file->path_ = dir + "/(scratch)";
  file->label_ = "model.safetensors";
  file->max_bytes_ = max_bytes;
  ASSIGN_OR_RETURN(file->fd_, OpenFile(dir, O_RDWR | O_TMPFILE, 0600));
  return file;
}

ShardFile::~ShardFile() = default;

int64_t ShardFile::SizeLimit(int64_t tensor_bytes) {
  return 8 + SafetensorsHeader::kMaxHeaderBytes + tensor_bytes;
}

absl::Status ShardFile::Write(const char* data, int64_t size, int64_t offset) {
  if (offset < 0 || size > max_bytes_ || offset > max_bytes_ - size) {
    return absl::OutOfRangeError(absl::StrCat(
        label_, ": a write ending at byte ", offset + size,
        " passes the largest valid size of this file, ", max_bytes_,
        " bytes (a shard: its tensors and the largest header; an extra/ "
        "file: ",
        StepWriter::kMaxExtraBytes, ")"));
  }
  RETURN_IF_ERROR(BeginChange());
  absl::Cleanup end = [this] { EndChange(); };
  int64_t done = 0;
  while (done < size) {
    const ssize_t n =
        pwrite(fd_.get(), data + done, size - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write", path_);
    }
    done += n;
  }
  WriteBehind::Spans due;
  {
    std::lock_guard<std::mutex> lock(mu_);
    size_ = std::max(size_, offset + size);
    const bool in_order = offset == stream_.bytes();
    for (int64_t c = offset / kBlobChunkBytes;
         size > 0 && c <= (offset + size - 1) / kBlobChunkBytes; ++c) {
      read_back_.erase(c);
      if (!in_order) rewritten_.insert(c);
    }
    if (in_order) {
      stream_.Update(data, size);
      due = behind_.Advance(stream_.bytes());
    }
  }
  absl::Status streamed = WriteBehind::Apply(fd_.get(), due, path_);
  if (!streamed.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (write_error_.ok()) write_error_ = streamed;
  }
  return streamed;
}

absl::Status ShardFile::BeginChange() {
  std::lock_guard<std::mutex> lock(mu_);
  if (sealed_) {
    return absl::FailedPreconditionError(
        absl::StrCat(label_,
                     " belongs to a committed step: its bytes never "
                     "change"));
  }
  ++changing_;
  return absl::OkStatus();
}

void ShardFile::EndChange() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--changing_ == 0) unchanging_.notify_all();
}

void ShardFile::Seal() {
  std::unique_lock<std::mutex> lock(mu_);
  sealed_ = true;
  unchanging_.wait(lock, [this] { return changing_ == 0; });
}

void ShardFile::Unseal() {
  std::lock_guard<std::mutex> lock(mu_);
  sealed_ = false;
}

absl::Status ShardFile::Truncate() {
  RETURN_IF_ERROR(BeginChange());
  absl::Cleanup end = [this] { EndChange(); };
  if (ftruncate(fd_.get(), 0) != 0) return ErrnoError(errno, "truncate", path_);
  std::lock_guard<std::mutex> lock(mu_);
  size_ = 0;
  stream_.Reset();
  rewritten_.clear();
  read_back_.clear();
  behind_.Reset();
  write_error_ = absl::OkStatus();  // the bytes it was about are gone
  return absl::OkStatus();
}

absl::Status ShardFile::Sync() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!write_error_.ok()) return write_error_;
  }
  if (fdatasync(fd_.get()) != 0) return ErrnoError(errno, "fsync", path_);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ShardFile::Read(char* out, int64_t size,
                                        int64_t offset) const {
  int64_t done = 0;
  while (done < size) {
    const ssize_t n = pread(fd_.get(), out + done, size - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "read", path_);
    }
    if (n == 0) break;
    done += n;
  }
  return done;
}

RangeReader ShardFile::Reader() const {
  return [this](char* out, int64_t size, int64_t offset) {
    return Read(out, size, offset);
  };
}

int64_t ShardFile::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_;
}

absl::StatusOr<std::vector<uint64_t>> ShardFile::ChunkSums() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> streamed = stream_.Finish();
  std::vector<uint64_t> sums(ChunkCount(size_));
  std::vector<char> buf;
  for (int64_t c = 0; c < static_cast<int64_t>(sums.size()); ++c) {
    const int64_t begin = c * kBlobChunkBytes;
    const int64_t bytes = std::min(kBlobChunkBytes, size_ - begin);
    // The stream's sum holds when it hashed exactly this chunk's bytes and
    // nothing rewrote them since.
    if (begin + bytes <= stream_.bytes() &&
        (bytes == kBlobChunkBytes || begin + bytes == stream_.bytes()) &&
        !rewritten_.contains(c)) {
      sums[c] = streamed[c];
      continue;
    }
    if (auto it = read_back_.find(c); it != read_back_.end()) {
      sums[c] = it->second;
      continue;
    }
    buf.resize(kBlobChunkBytes);
    ASSIGN_OR_RETURN(int64_t got, Read(buf.data(), bytes, begin));
    if (got != bytes)
      return absl::DataLossError(absl::StrCat(path_, " shrank"));
    sums[c] = read_back_[c] = HashChunk(buf.data(), bytes);
  }
  return sums;
}

StepWriter::StepWriter(Store& store, int64_t step,
                       std::shared_ptr<const Placement> placement,
                       std::optional<std::set<int>> ranks)
    : store_(store),
      step_(step),
      placement_(std::move(placement)),
      ranks_(std::move(ranks)) {
  valid_.resize(placement_->config().world_size());
}

StepWriter::~StepWriter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (committed_) return;
  for (const std::string& blob : blobs_) unlink(store_.BlobPath(blob).c_str());
}

absl::StatusOr<std::unique_ptr<StepWriter>> StepWriter::Create(
    Store& store, int64_t step, const ParallelConfig& config, Options options) {
  if (store.model() == nullptr) {
    return absl::FailedPreconditionError(
        "the store does not know its model yet: import a first checkpoint");
  }
  ASSIGN_OR_RETURN(std::optional<StepRecord> existing, store.FindStep(step));
  if (existing) {
    return absl::AlreadyExistsError(
        absl::StrCat("step ", step, " is already committed"));
  }
  ASSIGN_OR_RETURN(Placement p,
                   Placement::Create(store.layout(), store.model(), config));
  std::optional<std::set<int>> ranks;
  if (options.ranks)
    ranks.emplace(options.ranks->begin(), options.ranks->end());
  return std::unique_ptr<StepWriter>(new StepWriter(
      store, step, std::make_shared<const Placement>(std::move(p)),
      std::move(ranks)));
}

absl::Status StepWriter::CheckRank(int rank) const {
  if (rank < 0 || rank >= config().world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not a rank of ", config().ToString()));
  }
  if (ranks_ && !ranks_->contains(rank)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", rank, " of ", config().ToString(),
        " runs on another host: it is saved through that host's mount"));
  }
  return absl::OkStatus();
}

bool StepWriter::Awaited(int rank) const {
  if (ranks_ && !ranks_->contains(rank)) return false;
  return config().SavesShard(rank) || joined_.contains(rank);
}

absl::StatusOr<std::shared_ptr<ShardFile>> StepWriter::Open(int rank) {
  RETURN_IF_ERROR(CheckRank(rank));  // before ShardLimit looks it up
  return NewFile(rank, Label(rank), ShardLimit(rank));
}

int64_t StepWriter::ShardLimit(int rank) const {
  return ShardFile::SizeLimit(
      placement_->group_bytes(config().ShardGroup(rank)));
}

absl::StatusOr<std::shared_ptr<ShardFile>> StepWriter::OpenExtra(
    int rank, const std::string& path) {
  return NewFile(rank, absl::StrFormat("rank-%05d/extra/%s", rank, path),
                 kMaxExtraBytes);
}

absl::StatusOr<std::shared_ptr<ShardFile>> StepWriter::NewFile(
    int rank, absl::string_view label, int64_t max_bytes) {
  RETURN_IF_ERROR(CheckRank(rank));
  std::shared_ptr<ShardFile> file(new ShardFile());
  file->blob_ = Store::NewBlobName();
  file->path_ = store_.BlobPath(file->blob_);
  file->label_ = std::string(label);
  file->max_bytes_ = max_bytes;
  {
    // Recorded first, so that the file is removed whatever happens next.
    std::lock_guard<std::mutex> lock(mu_);
    if (committed_) {
      return absl::FailedPreconditionError(absl::StrCat(
          label, ": step ", step_,
          ranks_ ? " is saved on this host, waiting for the other hosts"
                 : " is already committed"));
    }
    blobs_.insert(file->blob_);
  }
  ASSIGN_OR_RETURN(file->fd_,
                   OpenFile(file->path_, O_RDWR | O_CREAT | O_EXCL, 0600));
  return file;
}

absl::StatusOr<ShardFile::Checked> StepWriter::Check(int rank,
                                                     ShardFile& file) {
  const std::string label = Label(rank);
  const int64_t size = file.size();
  char first8[8];
  ASSIGN_OR_RETURN(int64_t got, file.Read(first8, 8, 0));
  if (got < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, ": ", size, " bytes: too short for a safetensors header"));
  }
  auto length =
      SafetensorsHeader::ParseLength(absl::string_view(first8, 8), size);
  if (!length.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": ", length.status().message()));
  std::string prefix(8 + *length, '\0');
  ASSIGN_OR_RETURN(got, file.Read(prefix.data(), prefix.size(), 0));
  // Parsed against the file's size: a shard cut short, or with bytes past
  // its last tensor, is refused here.
  auto header = SafetensorsHeader::Parse(prefix, size);
  if (!header.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": ", header.status().message()));
  const std::string where = config().DescribeRank(rank);
  ShardFile::Checked checked;
  ASSIGN_OR_RETURN(
      checked.offsets,
      MatchShardHeader(placement_->model(),
                       placement_->shards(config().ShardGroup(rank)), *header,
                       label, where));
  checked.data_start = header->data_start();
  checked.data_bytes = header->data_bytes();
  auto it = header->metadata().find("scalai.consumed_samples");
  if (it != header->metadata().end()) {
    // The position the data views start from once this step is the newest:
    // one no dataset can start from would make the store unmountable.
    int64_t n = 0;
    if (!absl::SimpleAtoi(it->second, &n) || n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": scalai.consumed_samples \"",
                       Excerpt(it->second), "\" is not a count of samples"));
    }
    if (absl::Status s = store_.CheckPosition(n); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(label, ": ", s.message()));
    }
    checked.consumed_samples = n;
  }
  return checked;
}

absl::Status StepWriter::Close(int rank,
                               const std::shared_ptr<ShardFile>& file) {
  ASSIGN_OR_RETURN(ShardFile::Checked checked, Check(rank, *file));
  std::shared_ptr<ShardFile> replica;
  int replica_rank = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int group = config().ShardGroup(rank);
    for (int r = 0; r < config().world_size(); ++r) {
      if (r != rank && valid_[r] != nullptr &&
          config().ShardGroup(r) == group) {
        replica = valid_[r];
        replica_rank = r;
        break;
      }
    }
  }
  if (replica != nullptr) {
    // Replicas must hold the same tensor bytes; their headers may differ
    // (scalai.rank), so the data after each header is compared.
    bool same = checked.data_bytes == replica->checked_.data_bytes;
    if (same) {
      ASSIGN_OR_RETURN(
          same, SameBytes(file->Reader(), checked.data_start, replica->Reader(),
                          replica->checked_.data_start, checked.data_bytes));
    }
    if (!same) {
      return absl::InvalidArgumentError(absl::StrCat(
          Label(rank), ": differs from its replica ", Label(replica_rank),
          " (a data-parallel copy must be identical)"));
    }
  }
  RETURN_IF_ERROR(file->ChunkSums().status());
  // A refused or replaced file keeps its blob until the step commits or
  // goes: another handle may still be writing to it.
  std::lock_guard<std::mutex> lock(mu_);
  file->checked_ = std::move(checked);
  valid_[rank] = file;
  return absl::OkStatus();
}

void StepWriter::Forget(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= static_cast<int>(valid_.size()) ||
      valid_[rank] == nullptr || committed_) {
    return;
  }
  valid_[rank] = nullptr;
}

absl::Status StepWriter::CloseExtra(int rank, const std::string& path,
                                    const std::shared_ptr<ShardFile>& file) {
  RETURN_IF_ERROR(file->ChunkSums().status());
  std::lock_guard<std::mutex> lock(mu_);
  if (committed_) return LateExtra(step_, rank, path);
  extra_[{rank, path}] = file;
  return absl::OkStatus();
}

absl::Status StepWriter::LateExtra(int64_t step, int rank,
                                   const std::string& path) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "rank-%05d/extra/%s: step %d is already committed (a rank writes its "
      "extra/ files before its model.safetensors, whose close may commit)",
      rank, path, step));
}

void StepWriter::ForgetExtra(int rank, const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!committed_) extra_.erase({rank, path});
}

void StepWriter::Join(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!config().SavesShard(rank)) joined_.insert(rank);
}

void StepWriter::Leave(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  joined_.erase(rank);
}

std::vector<int> StepWriter::missing() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (int r = 0; r < config().world_size(); ++r) {
    if (Awaited(r) && valid_[r] == nullptr) out.push_back(r);
  }
  return out;
}

bool StepWriter::complete() const { return missing().empty(); }

absl::Status StepWriter::CompareTiedCopies() const {
  const Placement& p = *placement_;
  auto rank_of = [&](int group) { return config().SaverOfGroup(group); };
  for (const Placement::TiedCopy& c : p.tied_copies()) {
    const int in_rank = rank_of(c.input_group);
    const int out_rank = rank_of(c.output_group);
    const ShardFile* in = valid_[in_rank].get();
    const ShardFile* out = valid_[out_rank].get();
    if (in == nullptr || out == nullptr) continue;
    ASSIGN_OR_RETURN(
        bool same,
        SameBytes(in->Reader(), in->checked_.offsets[c.input_shard],
                  out->Reader(), out->checked_.offsets[c.output_shard],
                  p.shards(c.input_group)[c.input_shard].bytes));
    if (!same) {
      return absl::InvalidArgumentError(absl::StrCat(
          Label(out_rank), ": ",
          p.shards(c.output_group)[c.output_shard].local_name, " differs from ",
          p.shards(c.input_group)[c.input_shard].local_name, " in ",
          Label(in_rank), " (tied embeddings must be equal)"));
    }
  }
  return absl::OkStatus();
}

absl::Status StepWriter::Commit() {
  std::lock_guard<std::mutex> lock(mu_);
  if (committed_) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::optional<StepRecord> existing, store_.FindStep(step_));
  if (existing) {
    return absl::AlreadyExistsError(
        absl::StrCat("step ", step_, " is already committed"));
  }
  const ParallelConfig& cfg = config();
  // Sealed before their sums are taken, so that what is recorded is what
  // stays; unsealed again if the commit fails.
  std::vector<ShardFile*> sealed;
  absl::Cleanup unseal = [&sealed] {
    for (ShardFile* f : sealed) f->Unseal();
  };
  // The file that stands for each group saved here: its saver's,
  // or on a cluster's host that does not run that rank, the first replica
  // saved here (the cluster compares it with the one saved elsewhere).
  std::map<int, int> saver;  // rank, by group
  for (int r = 0; r < cfg.world_size(); ++r) {
    if (cfg.SavesShard(r) && (!ranks_ || ranks_->contains(r)))
      saver[cfg.ShardGroup(r)] = r;
  }
  if (ranks_) {
    for (int r : *ranks_) {
      if (valid_[r] != nullptr) saver.emplace(cfg.ShardGroup(r), r);
    }
  }
  for (const auto& [group, r] : saver) {
    if (valid_[r] != nullptr) sealed.push_back(valid_[r].get());
  }
  for (const auto& [key, file] : extra_) sealed.push_back(file.get());
  for (ShardFile* f : sealed) f->Seal();
  RETURN_IF_ERROR(CompareTiedCopies());
  StepRecord record;
  record.step = step_;
  record.config = cfg.ToString();
  record.groups = placement_->num_groups();
  Catalog::Batch batch;
  std::set<std::string> used;
  std::map<int, ShardRecord> shards;  // by group
  for (const auto& [group, r] : saver) {
    if (valid_[r] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_, ": ", Label(r), " is not saved yet"));
    }
    ShardFile& file = *valid_[r];
    RETURN_IF_ERROR(file.Sync());
    ShardRecord shard;
    shard.blobs = {file.blob()};
    for (int64_t at : file.checked_.offsets) shard.tensors.push_back({0, at});
    shards[group] = std::move(shard);
    ASSIGN_OR_RETURN(std::vector<uint64_t> sums, file.ChunkSums());
    batch.Put(Table::kBlobs, file.blob(),
              Store::EncodeBlob({file.size(), std::move(sums), step_}));
    // Bytes the step counts once, where its saver saved them.
    if (cfg.SavesShard(r)) record.bytes += file.checked_.data_bytes;
    used.insert(file.blob());
    if (r == 0) record.consumed_samples = file.checked_.consumed_samples;
  }
  for (const auto& [key, file] : extra_) {
    RETURN_IF_ERROR(file->Sync());
    ASSIGN_OR_RETURN(std::vector<uint64_t> sums, file->ChunkSums());
    batch.Put(Table::kBlobs, file->blob(),
              Store::EncodeBlob({file->size(), std::move(sums), step_}));
    record.extra[key.first].push_back({key.second, file->blob(), file->size()});
    used.insert(file->blob());
  }
  if (!record.extra.empty()) record.extra_config = cfg.ToString();
  RETURN_IF_ERROR(SyncDir(store_.blob_dir()));
  if (ranks_) {
    PendingStep pending;
    record.held.emplace();
    for (const auto& [g, shard] : shards) record.held->push_back(g);
    pending.record = std::move(record);
    pending.shards = std::move(shards);
    batch.Put(Table::kMeta, Store::PendingKey(step_),
              Store::EncodePending(pending));
  } else {
    for (const auto& [g, shard] : shards) {
      batch.Put(Table::kShards, ShardKey(step_, g), Store::EncodeShard(shard));
    }
    batch.Put(Table::kSteps, StepKey(step_), Store::EncodeStep(record));
  }
  RETURN_IF_ERROR(store_.catalog().Commit(batch));
  committed_ = true;
  std::move(unseal).Cancel();
  // Replicas and earlier attempts are not part of the step.
  for (const std::string& blob : blobs_) {
    if (!used.contains(blob)) unlink(store_.BlobPath(blob).c_str());
  }
  return absl::OkStatus();
}

}  // namespace scalai
