// Element types of tensors, named as the safetensors format names them.
//
//   ASSIGN_OR_RETURN(DType t, ParseDType("BF16"));
//   int64_t bytes = DTypeSize(t) * elems;   // 2 * elems
//   absl::string_view name = DTypeName(t);  // "BF16"
#ifndef SCALAI_PTC_DTYPE_H_
#define SCALAI_PTC_DTYPE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace scalai {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
};

// Bytes per element.
int DTypeSize(DType dtype);

// The safetensors name: "F32", "BF16", "F8_E4M3", "BOOL", ...
absl::string_view DTypeName(DType dtype);

// Accepts safetensors names exactly ("BF16") and, for command lines, the
// lower-case names PyTorch users type ("bf16", "float32", "fp16").
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Parses a safetensors header's dtype field: the exact names only.
absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name);

}  // namespace scalai

#endif  // SCALAI_PTC_DTYPE_H_
