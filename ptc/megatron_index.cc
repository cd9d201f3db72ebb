#include "ptc/megatron_index.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace scalai {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};

template <typename T>
T Load(const char* at) {
  T v;
  std::memcpy(&v, at, sizeof(T));  // unaligned, little-endian host
  return v;
}

}  // namespace

const char* MegatronDTypeName(int dtype_code) {
  // Megatron's DType enum, in order from code 1.
  static const char* const kNames[] = {"uint8", "int8",    "int16",   "int32",
                                       "int64", "float64", "float32", "uint16"};
  return dtype_code >= 1 && dtype_code <= 8 ? kNames[dtype_code - 1] : "";
}

int MegatronItemBytes(int dtype_code) {
  // Megatron's DType enum: uint8, int8, int16, int32, int64, float64,
  // float32, uint16.
  switch (dtype_code) {
    case 1:
    case 2:
      return 1;
    case 3:
    case 8:
      return 2;
    case 4:
    case 7:
      return 4;
    case 5:
    case 6:
      return 8;
    default:
      return 0;
  }
}

absl::StatusOr<MegatronIndex> MegatronIndex::Parse(absl::string_view head,
                                                   int64_t file_size) {
  if (file_size == 0) return absl::InvalidArgumentError("empty file");
  if (file_size < kHeaderBytes ||
      head.size() < static_cast<size_t>(kHeaderBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("too short for an MMIDIDX header (", file_size, " bytes, ",
                     "the header alone takes ", kHeaderBytes, ")"));
  }
  if (std::memcmp(head.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(
        "bad magic: not a Megatron MMIDIDX index");
  }
  const uint64_t version = Load<uint64_t>(head.data() + 9);
  if (version != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MMIDIDX version ", version, " is not supported (only version 1)"));
  }
  MegatronIndex idx;
  idx.dtype_code_ = static_cast<uint8_t>(head[17]);
  idx.item_bytes_ = MegatronItemBytes(idx.dtype_code_);
  if (idx.item_bytes_ == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown dtype code ", idx.dtype_code_, " (expected 1 to 8)"));
  }
  const uint64_t sequences = Load<uint64_t>(head.data() + 18);
  const uint64_t documents = Load<uint64_t>(head.data() + 26);
  const uint64_t room = static_cast<uint64_t>(file_size - kHeaderBytes);
  // Checked one at a time, so that nothing below can overflow.
  if (sequences > room / 12 || documents > (room - 12 * sequences) / 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the header counts ", sequences, " sequences and ", documents,
        " documents, more than the file's ", file_size, " bytes hold"));
  }
  idx.sequences_ = static_cast<int64_t>(sequences);
  idx.documents_ = static_cast<int64_t>(documents);
  const int64_t tables_end = idx.document_starts_at() + 8 * idx.documents_;
  // Multimodal datasets append one mode byte per sequence.
  if (file_size != tables_end && file_size != tables_end + idx.sequences_) {
    return absl::InvalidArgumentError(
        absl::StrCat("the header's tables end at byte ", tables_end,
                     " but the file has ", file_size, " bytes"));
  }
  if (idx.sequences_ == 0) return absl::InvalidArgumentError("no sequences");
  return idx;
}

int64_t MegatronIndex::sequence_bytes(absl::string_view idx, int64_t i) const {
  return int64_t{Load<int32_t>(idx.data() + lengths_at() + 4 * i)} *
         item_bytes_;
}

int64_t MegatronIndex::pointer(absl::string_view idx, int64_t i) const {
  return Load<int64_t>(idx.data() + pointers_at() + 8 * i);
}

absl::Status MegatronIndex::CheckEntries(absl::string_view idx,
                                         int64_t bin_size) const {
  if (bin_size == 0) return absl::InvalidArgumentError("the .bin is empty");
  for (int64_t i = 0; i < sequences_; ++i) {
    const int32_t length = Load<int32_t>(idx.data() + lengths_at() + 4 * i);
    const int64_t at = pointer(idx, i);
    if (length < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, " has a negative length ", length));
    }
    // at <= bin_size first, so at + bytes cannot overflow.
    if (at < 0 || at > bin_size || sequence_bytes(idx, i) > bin_size - at) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", i, " (pointer ", at, ", ", sequence_bytes(idx, i),
          " bytes) lies past the end of the .bin (", bin_size,
          " bytes): truncated .bin or bad pointers"));
    }
  }
  int64_t previous = 0;
  for (int64_t d = 0; d < documents_; ++d) {
    const int64_t start =
        Load<int64_t>(idx.data() + document_starts_at() + 8 * d);
    if (start < previous || start > sequences_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "document start ", d, " is ", start, ": expected ascending values ",
          "within [0, ", sequences_, "]"));
    }
    previous = start;
  }
  return absl::OkStatus();
}

}  // namespace scalai
