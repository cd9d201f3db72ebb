// A MegatronIndex is the header of a Megatron-LM indexed dataset's `.idx`
// file (MMIDIDX, version 1): the token dtype and where the per-sequence
// tables lie. The file holds, little-endian and unpadded:
//   magic "MMIDIDX\0\0", uint64 version, uint8 dtype code,
//   uint64 sequences, uint64 documents,
//   int32 lengths[sequences] (tokens), int64 pointers[sequences] (bytes
//   into the .bin), int64 document_starts[documents],
//   and optionally int8 modes[sequences] (multimodal datasets).
// Sample i of the dataset is sequence i: lengths[i] tokens at pointers[i].
//
//   ASSIGN_OR_RETURN(MegatronIndex idx, MegatronIndex::Parse(bytes, size));
//   RETURN_IF_ERROR(idx.CheckEntries(bytes, bin_size));
//   int64_t at = idx.pointer(bytes, i), n = idx.sequence_bytes(bytes, i);
#ifndef SCALAI_PTC_MEGATRON_INDEX_H_
#define SCALAI_PTC_MEGATRON_INDEX_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace scalai {

class MegatronIndex {
 public:
  static constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

  // Reads the header from the first bytes of an .idx file of `file_size`
  // bytes and checks that the tables fit it exactly. Errors say what is
  // wrong, without the file's name (the caller adds it).
  static absl::StatusOr<MegatronIndex> Parse(absl::string_view head,
                                             int64_t file_size);

  int dtype_code() const { return dtype_code_; }
  int item_bytes() const { return item_bytes_; }
  int64_t sequences() const { return sequences_; }
  int64_t documents() const { return documents_; }
  // Byte offsets of the tables in the .idx file.
  int64_t lengths_at() const { return kHeaderBytes; }
  int64_t pointers_at() const { return lengths_at() + 4 * sequences_; }
  int64_t document_starts_at() const { return pointers_at() + 8 * sequences_; }

  // Checks every table entry of the whole .idx `idx` against a .bin of
  // `bin_size` bytes: lengths not negative, every sequence inside the .bin,
  // document starts ascending within [0, sequences].
  absl::Status CheckEntries(absl::string_view idx, int64_t bin_size) const;

  // Entry i of the tables, read from the whole .idx `idx`.
  int64_t sequence_bytes(absl::string_view idx, int64_t i) const;
  int64_t pointer(absl::string_view idx, int64_t i) const;

 private:
  int dtype_code_ = 0;
  int item_bytes_ = 0;
  int64_t sequences_ = 0;
  int64_t documents_ = 0;
};

// Bytes per token of a Megatron dtype code, or 0 for an unknown code.
int MegatronItemBytes(int dtype_code);
// The numpy name of a Megatron dtype code ("uint16", "int32", ...), or "" for
// an unknown code.
const char* MegatronDTypeName(int dtype_code);

}  // namespace scalai

#endif  // SCALAI_PTC_MEGATRON_INDEX_H_
