#include "transfer/torch_archive.h"

#include <zip.h>
#include <zlib.h>

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

}  // namespace

absl::StatusOr<std::unique_ptr<TorchArchive>> TorchArchive::Open(
    const std::string& path, std::string label) {
  int error = 0;
  zip* z = zip_open(path.c_str(), ZIP_RDONLY | ZIP_CHECKCONS, &error);
  if (z == nullptr) {
    zip_error_t e;
    zip_error_init_with_code(&e, error);
    std::string why = zip_error_strerror(&e);
    zip_error_fini(&e);
    return absl::InvalidArgumentError(
        absl::StrCat(label, ": not a readable torch.save zip (", why, ")"));
  }
  std::unique_ptr<TorchArchive> archive(new TorchArchive(z, std::move(label)));
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
  zip_file_t* f = zip_fopen_index(zip_, index, 0);
  if (f == nullptr) {
    return Error(absl::StrCat("record ", full, ": ",
                              zip_error_strerror(zip_get_error(zip_))));
  }
  std::string out(st.size, '\0');
  zip_int64_t done = 0;
  while (done < static_cast<zip_int64_t>(st.size)) {
    const zip_int64_t n = zip_fread(f, out.data() + done, st.size - done);
    if (n <= 0) break;
    done += n;
  }
  // A read to the end checks the record's CRC; reading once more reports a
  // mismatch or a record shorter than its header says.
  char probe;
  const zip_int64_t extra = zip_fread(f, &probe, 1);
  std::string why;
  if (done != static_cast<zip_int64_t>(st.size) || extra != 0) {
    why = zip_error_strerror(zip_file_get_error(f));
  }
  zip_fclose(f);
  if (!why.empty()) {
    return absl::DataLossError(absl::StrCat(
        label_, ": record ", full, " cannot be read whole (", why, ")"));
  }
  return out;
}

absl::StatusOr<std::string> TorchArchive::ReadStorage(const std::string& key,
                                                      int64_t bytes) {
  const std::string name = "data/" + key;
  const std::string full = prefix_ + "/" + name;
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
  return ReadRecord(name, bytes);
}

void TorchArchiveWriter::Add(const std::string& name, std::string bytes) {
  records_.emplace_back(prefix_ + "/" + name, std::move(bytes));
}

absl::StatusOr<std::string> TorchArchiveWriter::Finish() {
  bool versioned = false;
  for (const auto& [name, bytes] : records_)
    versioned = versioned || name == prefix_ + "/version";
  if (!versioned) Add("version", "3\n");
  std::string out, central;
  for (const auto& [name, bytes] : records_) {
    const uint32_t crc = crc32(crc32(0, nullptr, 0),
                               reinterpret_cast<const Bytef*>(bytes.data()),
                               static_cast<uInt>(bytes.size()));
    const uint64_t offset = out.size();
    // The data starts at a multiple of 64: an extra field of padding
    // (id "FB", as torch writes it) fills the gap.
    const uint64_t header_end = offset + 30 + name.size() + 4;
    const uint64_t pad = (64 - header_end % 64) % 64;
    Put32(out, 0x04034b50);
    Put16(out, 20);  // version needed
    Put16(out, 0);   // flags
    Put16(out, 0);   // stored
    Put16(out, 0);   // time
    Put16(out, 0);   // date
    Put32(out, crc);
    Put32(out, static_cast<uint32_t>(bytes.size()));
    Put32(out, static_cast<uint32_t>(bytes.size()));
    Put16(out, static_cast<uint32_t>(name.size()));
    Put16(out, static_cast<uint32_t>(4 + pad));
    out += name;
    Put16(out, 0x4246);
    Put16(out, static_cast<uint32_t>(pad));
    out.append(pad, 'Z');
    out += bytes;

    Put32(central, 0x02014b50);
    Put16(central, 20);  // made by
    Put16(central, 20);  // needed
    Put16(central, 0);
    Put16(central, 0);
    Put16(central, 0);
    Put16(central, 0);
    Put32(central, crc);
    Put32(central, static_cast<uint32_t>(bytes.size()));
    Put32(central, static_cast<uint32_t>(bytes.size()));
    Put16(central, static_cast<uint32_t>(name.size()));
    Put16(central, 0);  // extra
    Put16(central, 0);  // comment
    Put16(central, 0);  // disk
    Put16(central, 0);  // internal attributes
    Put32(central, 0);  // external attributes
    Put32(central, static_cast<uint32_t>(offset));
    central += name;
    if (out.size() >= (uint64_t{1} << 32)) break;
  }
  const uint64_t central_at = out.size();
  if (central_at + central.size() >= (uint64_t{1} << 32) ||
      records_.size() >= 0xffff) {
    return absl::InvalidArgumentError(
        "a torch archive of 4 GiB or more, or of 65535 records, needs ZIP64, "
        "which this writer does not write");
  }
  out += central;
  Put32(out, 0x06054b50);
  Put16(out, 0);
  Put16(out, 0);
  Put16(out, static_cast<uint32_t>(records_.size()));
  Put16(out, static_cast<uint32_t>(records_.size()));
  Put32(out, static_cast<uint32_t>(central.size()));
  Put32(out, static_cast<uint32_t>(central_at));
  Put16(out, 0);
  return out;
}

}  // namespace scalai
