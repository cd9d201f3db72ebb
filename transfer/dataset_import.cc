#include "transfer/dataset_import.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "ptc/dataset_order.h"
#include "ptc/excerpt.h"
#include "ptc/megatron_index.h"
#include "ptc/status_macros.h"
#include "ptc/utf8.h"
#include "transfer/dataset_source.h"

namespace scalai {
namespace {

absl::Status UserError(absl::string_view label, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", why));
}

// The file's absolute path, size and mtime; a user error when it is not a
// regular, non-empty file.
absl::StatusOr<FileStamp> Stamp(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr)
    return UserError(path, std::strerror(errno));
  struct stat st;
  if (stat(resolved, &st) != 0) return UserError(path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return UserError(path, "not a regular file");
  if (st.st_size == 0) return UserError(path, "empty file");
  return FileStamp{
      resolved, st.st_size,
      int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec};
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 200 || name[0] == '.') return false;
  for (char c : name) {
    if (!isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' &&
        c != '.') {
      return false;
    }
  }
  return true;
}

// Appends uint64 entries to the index file, hashing what it writes.
class IndexWriter {
 public:
  IndexWriter(int fd, std::string path)
      : fd_(fd), path_(std::move(path)), state_(XXH3_createState()) {
    XXH3_64bits_reset(state_);
  }
  ~IndexWriter() { XXH3_freeState(state_); }
  absl::Status Add(uint64_t v) {
    buffer_.push_back(v);
    return buffer_.size() == kEntries ? Flush() : absl::OkStatus();
  }
  absl::Status Flush() {
    const int64_t bytes = static_cast<int64_t>(buffer_.size()) * 8;
    XXH3_64bits_update(state_, buffer_.data(), bytes);
    RETURN_IF_ERROR(WriteAll(fd_, buffer_.data(), bytes, path_));
    size_ += bytes;
    buffer_.clear();
    return absl::OkStatus();
  }
  int64_t size() const { return size_; }
  uint64_t digest() const { return XXH3_64bits_digest(state_); }

 private:
  static constexpr size_t kEntries = 1 << 17;
  int fd_;
  std::string path_;
  XXH3_state_t* state_;
  std::vector<uint64_t> buffer_;
  int64_t size_ = 0;
};

// Hashes the source files' bytes in order, each after its size, for the
// record's content_xxh3.
class ContentHasher {
 public:
  ContentHasher() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  ~ContentHasher() { XXH3_freeState(state_); }
  ContentHasher(const ContentHasher&) = delete;
  ContentHasher& operator=(const ContentHasher&) = delete;
  void File(int64_t size) { XXH3_64bits_update(state_, &size, sizeof(size)); }
  void Bytes(const void* data, int64_t n) {
    XXH3_64bits_update(state_, data, static_cast<size_t>(n));
  }
  uint64_t digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

// Indexes one JSONL file: every line a JSON value; blank lines are refused,
// since they would be empty samples. Writes each line's start and, at the
// end, one past the last line's newline (as if the file ended with one).
absl::StatusOr<int64_t> IndexJsonl(const FileStamp& stamp, IndexWriter& index,
                                   ContentHasher& content, Progress& progress) {
  ASSIGN_OR_RETURN(MappedFile map, MappedFile::Open(stamp.path));
  const char* data = reinterpret_cast<const char*>(map.data());
  const int64_t size = map.size();
  content.File(size);
  content.Bytes(data, size);
  int64_t at = 0;
  int64_t lines = 0;
  int64_t reported = 0;
  while (at < size) {
    const char* nl =
        static_cast<const char*>(std::memchr(data + at, '\n', size - at));
    const int64_t end = nl == nullptr ? size : nl - data;
    ++lines;
    absl::string_view line(data + at, end - at);
    if (line.empty() || line == "\r") {
      return UserError(stamp.path,
                       absl::StrCat("line ", lines, " is empty (JSONL has ",
                                    "one sample a line)"));
    }
    if (!nlohmann::json::accept(line)) {
      return UserError(stamp.path,
                       absl::StrCat("line ", lines, " is not valid JSON"));
    }
    RETURN_IF_ERROR(index.Add(at));
    at = end + 1;
    if (at - reported >= (16 << 20)) {
      progress.Add(at - reported);
      reported = at;
    }
  }
  progress.Add(size - reported);
  RETURN_IF_ERROR(index.Add(at == size ? size : size + 1));
  return lines;
}

// The .idx and .bin of each Megatron pair named by `files`, in order.
absl::StatusOr<std::vector<std::string>> MegatronPrefixes(
    const std::vector<std::string>& files) {
  std::vector<std::string> prefixes;
  std::set<std::string> seen;
  for (const std::string& f : files) {
    std::string prefix = f;
    if (absl::EndsWith(f, ".idx") || absl::EndsWith(f, ".bin"))
      prefix = f.substr(0, f.size() - 4);
    if (seen.insert(prefix).second) prefixes.push_back(prefix);
  }
  return prefixes;
}

}  // namespace

absl::StatusOr<AddedDataset> AddDataset(Store& store,
                                        const DatasetImportOptions& o) {
  if (!ValidName(o.name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset name '", Excerpt(o.name),
        "': use letters, digits, '_', '-' and '.',", " not starting with '.'"));
  }
  ASSIGN_OR_RETURN(auto existing, store.Datasets());
  std::string replaced_index;
  const auto it = existing.find(o.name);
  const bool replacing = it != existing.end();
  if (replacing) {
    if (!o.replace) {
      return absl::AlreadyExistsError(
          absl::StrCat("dataset ", o.name, " already exists in ", store.dir(),
                       " (--replace registers it again)"));
    }
    replaced_index = it->second.index;
  }
  if (o.format != "jsonl" && o.format != "megatron") {
    return absl::InvalidArgumentError(absl::StrCat(
        "format '", Excerpt(o.format), "': expected jsonl or megatron"));
  }
  if (o.files.empty())
    return absl::InvalidArgumentError("no source files given");
  for (const std::string& f : o.files) {
    // The record keeps the paths, in JSON.
    if (!IsUtf8(f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "\"", Excerpt(f), "\": a dataset file's path must be UTF-8"));
    }
  }

  DatasetRecord record;
  record.format = o.format;
  record.global_batch = o.global_batch;
  record.seed = o.seed;
  record.epochs = o.epochs;
  std::vector<std::string> paths = o.files;
  if (o.format == "megatron") {
    ASSIGN_OR_RETURN(std::vector<std::string> prefixes,
                     MegatronPrefixes(o.files));
    paths.clear();
    for (const std::string& p : prefixes) {
      paths.push_back(p + ".idx");
      paths.push_back(p + ".bin");
    }
  }
  std::vector<FileStamp> stamps;
  int64_t total = 0;
  for (const std::string& p : paths) {
    ASSIGN_OR_RETURN(FileStamp s, Stamp(p));
    total += s.size;
    stamps.push_back(std::move(s));
  }
  Progress progress(total, o.progress);
  ContentHasher content;

  bool committed = false;
  std::string index_path;
  absl::Cleanup remove_index = [&] {
    if (!committed && !index_path.empty()) unlink(index_path.c_str());
  };
  if (o.format == "jsonl") {
    if (mkdir(store.dataset_dir().c_str(), 0700) != 0 && errno != EEXIST)
      return ErrnoError(errno, "create", store.dataset_dir());
    record.index = Store::NewBlobName();
    record.index.replace(record.index.size() - 5, 5, ".lines");
    index_path = store.dataset_dir() + "/" + record.index;
    ASSIGN_OR_RETURN(UniqueFd fd,
                     OpenFile(index_path, O_WRONLY | O_CREAT | O_EXCL, 0600));
    IndexWriter index(fd.get(), index_path);
    for (const FileStamp& s : stamps) {
      ASSIGN_OR_RETURN(int64_t lines, IndexJsonl(s, index, content, progress));
      record.parts.push_back({lines, {s}});
      record.samples += lines;
    }
    RETURN_IF_ERROR(index.Flush());
    if (fsync(fd.get()) != 0) return ErrnoError(errno, "fsync", index_path);
    record.index_size = index.size();
    record.index_xxh3 = index.digest();
    RETURN_IF_ERROR(SyncDir(store.dataset_dir()));
  } else {
    for (size_t i = 0; i < stamps.size(); i += 2) {
      const FileStamp& idx_stamp = stamps[i];
      const FileStamp& bin_stamp = stamps[i + 1];
      ASSIGN_OR_RETURN(MappedFile idx, MappedFile::Open(idx_stamp.path));
      absl::string_view bytes(reinterpret_cast<const char*>(idx.data()),
                              idx.size());
      auto header = MegatronIndex::Parse(bytes, idx.size());
      if (!header.ok())
        return UserError(idx_stamp.path, header.status().message());
      if (absl::Status s = header->CheckEntries(bytes, bin_stamp.size); !s.ok())
        return UserError(idx_stamp.path, s.message());
      // One dataset's samples are all of one width: a job reads them as
      // one array type.
      const std::string dtype = MegatronDTypeName(header->dtype_code());
      if (i == 0) {
        record.token_dtype = dtype;
      } else if (dtype != record.token_dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dataset ", o.name, ": ", stamps[0].path, " holds ",
            record.token_dtype, " tokens but ", idx_stamp.path, " holds ",
            dtype, " (one dataset has one token dtype)"));
      }
      content.File(idx.size());
      content.Bytes(idx.data(), idx.size());
      content.File(bin_stamp.size);
      RETURN_IF_ERROR(
          ReadChunks(bin_stamp.path, [&](const char* data, int64_t n) {
            content.Bytes(data, n);
            return absl::OkStatus();
          }));
      progress.Add(idx_stamp.size + bin_stamp.size);
      record.parts.push_back({header->sequences(), {idx_stamp, bin_stamp}});
      record.samples += header->sequences();
    }
  }
  record.content_xxh3 = content.digest();
  // A file written while it was read has changed under the index.
  for (const DatasetRecord::Part& part : record.parts) {
    for (const FileStamp& s : part.files) {
      if (absl::Status st = CheckStamp(s, o.name); !st.ok())
        return UserError(s.path, "changed while it was indexed");
    }
  }
  auto order = DatasetOrder::Create(record.samples, record.global_batch,
                                    record.seed, record.epochs);
  if (!order.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("dataset ", o.name, ": ", order.status().message()));
  if (store.current_config()) {
    if (absl::Status s = order->CheckDp(store.current_config()->dp());
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset ", o.name, ": ", s.message(), " (the store's config is ",
          store.current_config()->ToString(), ")"));
    }
  }
  // The views start at the newest step's position, which must fall on a
  // global batch of this dataset too.
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store.Steps());
  if (!steps.empty() && steps.back().consumed_samples &&
      *steps.back().consumed_samples % record.global_batch != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset ", o.name, ": the newest step ", steps.back().step,
        " consumed ", *steps.back().consumed_samples,
        " samples, not a multiple of the global batch ", record.global_batch));
  }
  Catalog::Batch batch;
  batch.Put(Table::kDatasets, o.name, Store::EncodeDataset(record));
  RETURN_IF_ERROR(store.catalog().Commit(batch));
  committed = true;
  if (!replaced_index.empty()) {
    // Committed already: an index left behind by a failure here is an
    // orphan, removed when the store is next opened for writing.
    if (unlink((store.dataset_dir() + "/" + replaced_index).c_str()) == 0) {
      (void)SyncDir(store.dataset_dir());
    }
  }
  return AddedDataset{std::move(record), replacing};
}

}  // namespace scalai
