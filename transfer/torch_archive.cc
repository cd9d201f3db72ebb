#include "transfer/torch_archive.h"

#include <zip.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

void Put16(std::string& out, uint32_t v) {
  out += static_cast<char>(v & 0xff);
  out += static_cast<char>((v >> 8) & 0xff);
}
void Put32(std::string& out, uint32_t v) {
  Put16(out, v & 0xffff);
  Put16(out, v >> 16);
}
void Put64(std::string& out, uint64_t v) {
  Put32(out, static_cast<uint32_t>(v));
  Put32(out, static_cast<uint32_t>(v >> 32));
}

constexpr uint32_t kMax32 = 0xffffffff;

// The error for a file libzip cannot open; `e` is finished here.
absl::Status NotAZip(const std::string& label, zip_error_t& e) {
  std::string why = zip_error_strerror(&e);
  zip_error_fini(&e);
  return absl::InvalidArgumentError(
      absl::StrCat(label, ": not a readable torch.save zip (", why, ")"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TorchArchive>> TorchArchive::Open(
    const std::string& path, std::string label) {
  int error = 0;
  zip* z = zip_open(path.c_str(), ZIP_RDONLY | ZIP_CHECKCONS, &error);
  if (z == nullptr) {
    zip_error_t e;
    zip_error_init_with_code(&e, error);
    return NotAZip(label, e);
  }
  return Adopt(std::unique_ptr<TorchArchive>(new TorchArchive(z, label)));
}

absl::StatusOr<std::unique_ptr<TorchArchive>> TorchArchive::FromBytes(
    std::string bytes, std::string label) {
  // The archive reads from the string it owns, so the source's bytes stay
  // where they are for as long as it lives.
  auto owned = std::make_unique<std::string>(std::move(bytes));
  zip_error_t e;
  zip_error_init(&e);
  zip_source_t* source =
      zip_source_buffer_create(owned->data(), owned->size(), 0, &e);
  if (source == nullptr) return NotAZip(label, e);
  zip* z = zip_open_from_source(source, ZIP_RDONLY | ZIP_CHECKCONS, &e);
  if (z == nullptr) {
    zip_source_free(source);
    return NotAZip(label, e);
  }
  zip_error_fini(&e);
  std::unique_ptr<TorchArchive> archive(new TorchArchive(z, label));
  archive->bytes_ = std::move(owned);
  return Adopt(std::move(archive));
}

absl::StatusOr<std::unique_ptr<TorchArchive>> TorchArchive::Adopt(
    std::unique_ptr<TorchArchive> archive) {
  zip* z = archive->zip_;
  // torch names every record NAME/...; NAME is the first record's directory.
  const zip_int64_t entries = zip_get_num_entries(z, 0);
  if (entries <= 0) return archive->Error("is an empty zip");
  const char* first = zip_get_name(z, 0, 0);
  const std::string name = first == nullptr ? "" : first;
  const size_t slash = name.find('/');
  if (slash == std::string::npos || slash == 0)
    return archive->Error("has no NAME/data.pkl (not a torch.save file)");
  archive->prefix_ = name.substr(0, slash);
  return archive;
}

TorchArchive::~TorchArchive() { zip_discard(zip_); }

absl::Status TorchArchive::Error(const std::string& what) const {
  return absl::InvalidArgumentError(absl::StrCat(label_, ": ", what));
}

absl::StatusOr<std::string> TorchArchive::ReadRecord(const std::string& name,
                                                     int64_t limit) {
  const std::string full = prefix_ + "/" + name;
  const zip_int64_t index = zip_name_locate(zip_, full.c_str(), 0);
  if (index < 0) return Error(absl::StrCat("has no record ", full));
  zip_stat_t st;
  if (zip_stat_index(zip_, index, 0, &st) != 0 || !(st.valid & ZIP_STAT_SIZE))
    return Error(absl::StrCat("record ", full, " has no size"));
  if (static_cast<int64_t>(st.size) > limit) {
    return Error(absl::StrCat("record ", full, " holds ", st.size,
                              " bytes, more than ", limit));
  }
  std::string out(st.size, '\0');
  RETURN_IF_ERROR(ReadInto(full, index, st.size, out.data()));
  return out;
}

absl::Status TorchArchive::ReadInto(const std::string& full, int64_t index,
                                    uint64_t size, char* out) {
  zip_file_t* f = zip_fopen_index(zip_, index, 0);
  if (f == nullptr) {
    return Error(absl::StrCat("record ", full, ": ",
                              zip_error_strerror(zip_get_error(zip_))));
  }
  zip_int64_t done = 0;
  while (done < static_cast<zip_int64_t>(size)) {
    const zip_int64_t n = zip_fread(f, out + done, size - done);
    if (n <= 0) break;
    done += n;
  }
  // A read to the end checks the record's CRC; reading once more reports a
  // mismatch or a record shorter than its header says.
  char probe;
  const zip_int64_t extra = zip_fread(f, &probe, 1);
  std::string why;
  if (done != static_cast<zip_int64_t>(size) || extra != 0) {
    why = zip_error_strerror(zip_file_get_error(f));
  }
  zip_fclose(f);
  if (!why.empty()) {
    return absl::DataLossError(absl::StrCat(
        label_, ": record ", full, " cannot be read whole (", why, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> TorchArchive::ReadStorage(const std::string& key,
                                                      int64_t bytes) {
  std::string out(bytes, '\0');
  RETURN_IF_ERROR(ReadStorageInto(key, bytes, out.data()));
  return out;
}

absl::Status TorchArchive::ReadStorageInto(const std::string& key,
                                           int64_t bytes, char* out) {
  const std::string full = prefix_ + "/data/" + key;
  const zip_int64_t index = zip_name_locate(zip_, full.c_str(), 0);
  if (index < 0) return Error(absl::StrCat("has no record ", full));
  zip_stat_t st;
  if (zip_stat_index(zip_, index, 0, &st) != 0)
    return Error(absl::StrCat("record ", full, " has no size"));
  if (static_cast<int64_t>(st.size) != bytes) {
    return absl::DataLossError(
        absl::StrCat(label_, ": storage ", key, " holds ", st.size,
                     " bytes; its tensors' header says ", bytes));
  }
  return ReadInto(full, index, st.size, out);
}

uint32_t Crc32(uint32_t crc, const void* data, int64_t bytes) {
  const auto* at = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    const uInt n = static_cast<uInt>(std::min<int64_t>(bytes, 1 << 30));
    crc = static_cast<uint32_t>(crc32(crc, at, n));
    at += n;
    bytes -= n;
  }
  return crc;
}

absl::Status TorchArchiveWriter::Put(const std::string& bytes) {
  RETURN_IF_ERROR(write_(bytes.data(), bytes.size()));
  position_ += bytes.size();
  return absl::OkStatus();
}

absl::Status TorchArchiveWriter::Begin(const std::string& name, int64_t bytes) {
  if (open_) return absl::InternalError("a record begun before the last ended");
  Record r{prefix_ + "/" + name, static_cast<uint64_t>(bytes), position_, 0};
  const bool zip64 = r.size >= kMax32;
  // The data starts at a multiple of 64: an extra field of padding (id
  // "FB", as torch writes it) fills the gap, after the ZIP64 sizes if any.
  const uint64_t fixed = 30 + r.name.size() + (zip64 ? 20 : 0) + 4;
  const uint64_t pad = (64 - (position_ + fixed) % 64) % 64;
  std::string h;
  Put32(h, 0x04034b50);
  Put16(h, zip64 ? 45 : 20);  // version needed
  Put16(h, 0);                // flags
  Put16(h, 0);                // stored
  Put16(h, 0);                // time
  Put16(h, 0x21);             // date: 1980-01-01
  Put32(h, 0);                // CRC-32, patched by End
  Put32(h, zip64 ? kMax32 : static_cast<uint32_t>(r.size));
  Put32(h, zip64 ? kMax32 : static_cast<uint32_t>(r.size));
  Put16(h, static_cast<uint32_t>(r.name.size()));
  Put16(h, static_cast<uint32_t>((zip64 ? 20 : 0) + 4 + pad));
  h += r.name;
  if (zip64) {
    Put16(h, 0x0001);
    Put16(h, 16);
    Put64(h, r.size);
    Put64(h, r.size);
  }
  Put16(h, 0x4246);
  Put16(h, static_cast<uint32_t>(pad));
  h.append(pad, 'Z');
  RETURN_IF_ERROR(Put(h));
  records_.push_back(std::move(r));
  open_ = true;
  return absl::OkStatus();
}

absl::Status TorchArchiveWriter::End(uint32_t crc) {
  if (!open_) return absl::InternalError("a record ended that was not begun");
  open_ = false;
  Record& r = records_.back();
  r.crc = crc;
  position_ += r.size;  // the caller wrote the data
  std::string c;
  Put32(c, crc);
  return patch_(static_cast<int64_t>(r.offset) + 14, c.data(), c.size());
}

absl::Status TorchArchiveWriter::Add(const std::string& name,
                                     const std::string& bytes) {
  RETURN_IF_ERROR(Begin(name, bytes.size()));
  RETURN_IF_ERROR(write_(bytes.data(), bytes.size()));
  return End(Crc32(0, bytes.data(), bytes.size()));
}

absl::Status TorchArchiveWriter::Finish() {
  bool versioned = false;
  for (const Record& r : records_)
    versioned = versioned || r.name == prefix_ + "/version";
  if (!versioned) RETURN_IF_ERROR(Add("version", "3\n"));
  const uint64_t central_at = position_;
  std::string central;
  for (const Record& r : records_) {
    const bool big = r.size >= kMax32, far = r.offset >= kMax32;
    std::string extra;
    if (big || far) {
      Put16(extra, 0x0001);
      Put16(extra, (big ? 16 : 0) + (far ? 8 : 0));
      if (big) {
        Put64(extra, r.size);
        Put64(extra, r.size);
      }
      if (far) Put64(extra, r.offset);
    }
    Put32(central, 0x02014b50);
    Put16(central, big || far ? 45 : 20);  // made by
    Put16(central, big || far ? 45 : 20);  // needed
    Put16(central, 0);
    Put16(central, 0);
    Put16(central, 0);
    Put16(central, 0x21);
    Put32(central, r.crc);
    Put32(central, big ? kMax32 : static_cast<uint32_t>(r.size));
    Put32(central, big ? kMax32 : static_cast<uint32_t>(r.size));
    Put16(central, static_cast<uint32_t>(r.name.size()));
    Put16(central, static_cast<uint32_t>(extra.size()));
    Put16(central, 0);  // comment
    Put16(central, 0);  // disk
    Put16(central, 0);  // internal attributes
    Put32(central, 0);  // external attributes
    Put32(central, far ? kMax32 : static_cast<uint32_t>(r.offset));
    central += r.name;
    central += extra;
  }
  RETURN_IF_ERROR(Put(central));
  const uint64_t count = records_.size();
  const bool zip64 =
      count >= 0xffff || central.size() >= kMax32 || central_at >= kMax32;
  std::string end;
  if (zip64) {
    const uint64_t record_at = position_;
    Put32(end, 0x06064b50);
    Put64(end, 44);
    Put16(end, 45);
    Put16(end, 45);
    Put32(end, 0);
    Put32(end, 0);
    Put64(end, count);
    Put64(end, count);
    Put64(end, central.size());
    Put64(end, central_at);
    Put32(end, 0x07064b50);  // the locator
    Put32(end, 0);
    Put64(end, record_at);
    Put32(end, 1);
  }
  Put32(end, 0x06054b50);
  Put16(end, 0);
  Put16(end, 0);
  Put16(end, zip64 ? 0xffff : static_cast<uint32_t>(count));
  Put16(end, zip64 ? 0xffff : static_cast<uint32_t>(count));
  Put32(end, zip64 ? kMax32 : static_cast<uint32_t>(central.size()));
  Put32(end, zip64 ? kMax32 : static_cast<uint32_t>(central_at));
  Put16(end, 0);
  return Put(end);
}

absl::StatusOr<std::string> TorchArchiveBytes(
    const std::string& prefix,
    const std::vector<std::pair<std::string, std::string>>& records) {
  std::string out;
  TorchArchiveWriter writer(
      prefix,
      [&](const void* data, int64_t n) {
        out.append(static_cast<const char*>(data), n);
        return absl::OkStatus();
      },
      [&](int64_t at, const void* data, int64_t n) {
        std::memcpy(out.data() + at, data, n);
        return absl::OkStatus();
      });
  for (const auto& [name, bytes] : records)
    RETURN_IF_ERROR(writer.Add(name, bytes));
  RETURN_IF_ERROR(writer.Finish());
  return out;
}

}  // namespace scalai
