#include "ptc/dtype.h"

#include <array>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace scalai {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  int size;
};

constexpr std::array<DTypeInfo, 15> kDTypes = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU64, "U64", 8},
    {DType::kU32, "U32", 4},
    {DType::kU16, "U16", 2},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};

const DTypeInfo& Info(DType dtype) {
  return kDTypes[static_cast<size_t>(dtype)];
}

}  // namespace

int DTypeSize(DType dtype) { return Info(dtype).size; }

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype \"", name, "\""));
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  std::string upper = absl::AsciiStrToUpper(name);
  struct Alias {
    absl::string_view alias;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"FLOAT64", DType::kF64},     {"DOUBLE", DType::kF64},
      {"FP64", DType::kF64},        {"FLOAT32", DType::kF32},
      {"FLOAT", DType::kF32},       {"FP32", DType::kF32},
      {"FLOAT16", DType::kF16},     {"HALF", DType::kF16},
      {"FP16", DType::kF16},        {"BFLOAT16", DType::kBF16},
      {"INT64", DType::kI64},       {"INT32", DType::kI32},
      {"INT16", DType::kI16},       {"INT8", DType::kI8},
      {"UINT8", DType::kU8},        {"FP8_E4M3", DType::kF8E4M3},
      {"FP8_E5M2", DType::kF8E5M2},
  };
  for (const Alias& a : kAliases) {
    if (a.alias == upper) return a.dtype;
  }
  auto exact = ParseSafetensorsDType(upper);
  if (exact.ok()) return exact;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype \"", name,
      "\" (expected one of F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 "
      "U64 U32 U16 U8 BOOL)"));
}

}  // namespace scalai
