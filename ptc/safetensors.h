// The safetensors header codec: an 8-byte little-endian header length, a JSON
// object of tensors {dtype, shape, data_offsets} and an optional
// "__metadata__" of strings, then the tensors' bytes with no holes or overlaps.
// Parsing is strict, because headers come from files Scalai did not write.
//
//   ASSIGN_OR_RETURN(auto h, SafetensorsHeader::Parse(prefix, file_size));
//   for (const SafetensorsEntry& e : h.tensors()) ...  // at data_start() + begin
//   std::string head = SafetensorsHeader::Build(entries, meta)->Serialize();
#ifndef SCALAI_PTC_SAFETENSORS_H_
#define SCALAI_PTC_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ptc/box.h"
#include "ptc/dtype.h"

namespace scalai {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  int64_t data_begin = 0;  // relative to the start of the data section
  int64_t data_end = 0;
  friend bool operator==(const SafetensorsEntry&,
                         const SafetensorsEntry&) = default;
};

class SafetensorsHeader {
 public:
  // The safetensors library's own bound on the JSON header.
  static constexpr int64_t kMaxHeaderBytes = 100 << 20;

  // The JSON length from the first 8 bytes of a file of `file_size` bytes,
  // checked against the file size and kMaxHeaderBytes.
  static absl::StatusOr<int64_t> ParseLength(absl::string_view first8,
                                             int64_t file_size);

  // Parses `prefix`, the file's first data_start() bytes (at least the 8-byte
  // length and the whole JSON), of a file of `file_size` bytes.
  static absl::StatusOr<SafetensorsHeader> Parse(absl::string_view prefix,
                                                 int64_t file_size);

  // A header for tensors laid out back to back in the given order.
  static absl::StatusOr<SafetensorsHeader> Build(
      std::vector<SafetensorsEntry> tensors,
      std::map<std::string, std::string> metadata);

  // Tensors in the order of their data.
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }
  // Offset of the data section in the file: 8 + JSON length.
  int64_t data_start() const { return data_start_; }
  int64_t data_bytes() const { return data_bytes_; }
  int64_t file_size() const { return data_start_ + data_bytes_; }
  const SafetensorsEntry* Find(absl::string_view name) const;

  // The 8-byte length and the JSON, padded with spaces so that the data
  // section starts 8-byte aligned; exactly data_start() bytes.
  std::string Serialize() const;

 private:
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
  int64_t data_start_ = 0;
  int64_t data_bytes_ = 0;
};

// Reads and parses the header of the safetensors file at `path`.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(
    const std::string& path);

}  // namespace scalai

#endif  // SCALAI_PTC_SAFETENSORS_H_
