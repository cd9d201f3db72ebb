#include "transfer/dataset_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/mapping_guard.h"

namespace scalai {
namespace {

absl::Status PreadAll(int fd, char* out, int64_t length, int64_t offset,
                      const std::string& path) {
  while (length > 0) {
    const ssize_t n = pread(fd, out, length, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "read", path);
    }
    if (n == 0) {
      return absl::DataLossError(
          absl::StrCat(path, " ends before byte ", offset + length));
    }
    out += n;
    length -= n;
    offset += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckStamp(const FileStamp& stamp, const std::string& dataset) {
  struct stat st;
  if (stat(stamp.path.c_str(), &st) != 0) {
    return absl::DataLossError(
        absl::StrCat("dataset ", dataset, ": source file ", stamp.path,
                     " is gone (", std::strerror(errno), ")"));
  }
  const int64_t mtime_ns =
      int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  if (st.st_size != stamp.size || mtime_ns != stamp.mtime_ns) {
    return absl::DataLossError(absl::StrCat(
        "dataset ", dataset, ": source file ", stamp.path,
        " changed since it was registered (size ", stamp.size, " -> ",
        st.st_size, ", mtime ", stamp.mtime_ns, " -> ", mtime_ns,
        " ns); register it again with scalai dataset add --replace"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MappedFile> OpenLineIndex(const Store& store,
                                         const DatasetRecord& record,
                                         const std::string& dataset) {
  auto refused = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(
        "dataset ", dataset, ": its line index ", record.index, " ", what,
        " (scalai dataset add --replace indexes its files again)"));
  };
  absl::StatusOr<MappedFile> index =
      MappedFile::Open(store.dataset_dir() + "/" + record.index);
  if (!index.ok()) {
    return refused(
        absl::StrCat("cannot be read (", index.status().message(), ")"));
  }
  if (index->size() != record.index_size) {
    return refused(absl::StrCat("has ", index->size(),
                                " bytes, the record says ", record.index_size));
  }
  // Hashed whole at each open (8 bytes a sample: 80 MB for ten million
  // samples, a few hundredths of a second when cached).
  uint64_t sum = 0;
  if (!ReadMapped([&] { sum = HashChunk(index->data(), index->size()); })) {
    return refused("was cut short while read");
  }
  if (sum != record.index_xxh3) return refused("does not match its checksum");
  return index;
}

absl::StatusOr<std::unique_ptr<DatasetSource>> DatasetSource::Open(
    const Store& store, const std::string& name, const DatasetRecord& record) {
  std::unique_ptr<DatasetSource> source(new DatasetSource());
  source->name_ = name;
  source->record_ = record;
  if (source->jsonl()) {
    ASSIGN_OR_RETURN(source->index_, OpenLineIndex(store, record, name));
  }
  int64_t first = 0;
  int64_t index_first = 0;
  for (const DatasetRecord::Part& r : source->record_.parts) {
    Part part;
    part.record = &r;
    part.first = first;
    part.index_first = index_first;
    first += r.samples;
    index_first += r.samples + 1;
    part.opened = [&]() -> absl::Status {
      for (const FileStamp& f : r.files) {
        RETURN_IF_ERROR(CheckStamp(f, name));
        ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(f.path, O_RDONLY));
        part.fds.push_back(std::move(fd));
      }
      if (!source->jsonl()) {
        char head[MegatronIndex::kHeaderBytes];
        RETURN_IF_ERROR(PreadAll(part.fds[0].get(), head, sizeof(head), 0,
                                 r.files[0].path));
        ASSIGN_OR_RETURN(
            part.megatron,
            MegatronIndex::Parse(absl::string_view(head, sizeof(head)),
                                 r.files[0].size));
      }
      return absl::OkStatus();
    }();
    source->parts_.push_back(std::move(part));
  }
  if (source->jsonl() &&
      index_first * 8 != static_cast<int64_t>(source->index_.size())) {
    return absl::DataLossError(absl::StrCat(
        "dataset ", name, ": its line index does not match its parts"));
  }
  return source;
}

const DatasetSource::Part& DatasetSource::PartOf(int64_t id) const {
  auto it =
      std::upper_bound(parts_.begin(), parts_.end(), id,
                       [](int64_t i, const Part& p) { return i < p.first; });
  return *(it - 1);
}

absl::Status DatasetSource::Locate(const Part& part, int64_t id, int64_t* begin,
                                   int64_t* end) const {
  RETURN_IF_ERROR(part.opened);
  const int64_t local = id - part.first;
  if (jsonl()) {
    // Entry j is line j's first byte; entry j + 1 is one past its newline.
    uint64_t at[2];
    std::memcpy(at, index_.data() + 8 * (part.index_first + local), sizeof(at));
    *begin = static_cast<int64_t>(at[0]);
    *end = static_cast<int64_t>(at[1]) - 1;
    return absl::OkStatus();
  }
  const MegatronIndex& idx = part.megatron;
  const std::string& path = part.record->files[0].path;
  int32_t length = 0;
  int64_t pointer = 0;
  RETURN_IF_ERROR(PreadAll(part.fds[0].get(), reinterpret_cast<char*>(&length),
                           4, idx.lengths_at() + 4 * local, path));
  RETURN_IF_ERROR(PreadAll(part.fds[0].get(), reinterpret_cast<char*>(&pointer),
                           8, idx.pointers_at() + 8 * local, path));
  *begin = pointer;
  *end = pointer + int64_t{length} * idx.item_bytes();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> DatasetSource::SampleBytes(int64_t id) const {
  int64_t begin = 0;
  int64_t end = 0;
  RETURN_IF_ERROR(Locate(PartOf(id), id, &begin, &end));
  return end - begin;
}

absl::Status DatasetSource::CheckUnchanged(const Part& part) const {
  for (const FileStamp& f : part.record->files)
    RETURN_IF_ERROR(CheckStamp(f, name_));
  return absl::OkStatus();
}

absl::Status DatasetSource::ReadSample(int64_t id, int64_t offset,
                                       int64_t length, char* out) const {
  const Part& part = PartOf(id);
  RETURN_IF_ERROR(CheckUnchanged(part));
  int64_t begin = 0;
  int64_t end = 0;
  RETURN_IF_ERROR(Locate(part, id, &begin, &end));
  if (offset < 0 || length < 0 || offset + length > end - begin) {
    return absl::OutOfRangeError(
        absl::StrCat("bytes ", offset, "+", length, " of sample ", id,
                     " of dataset ", name_, " (", end - begin, " bytes)"));
  }
  const int data = jsonl() ? 0 : 1;
  return PreadAll(part.fds[data].get(), out, length, begin + offset,
                  part.record->files[data].path);
}

}  // namespace scalai
