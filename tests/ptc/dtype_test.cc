#include "ptc/dtype.h"

#include "gtest/gtest.h"

namespace scalai {
namespace {

TEST(DType, SafetensorsNamesRoundTrip) {
  for (DType t :
       {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3,
        DType::kF8E5M2, DType::kI64, DType::kI32, DType::kI16, DType::kI8,
        DType::kU64, DType::kU32, DType::kU16, DType::kU8, DType::kBool}) {
    auto parsed = ParseSafetensorsDType(DTypeName(t));
    ASSERT_TRUE(parsed.ok()) << DTypeName(t);
    EXPECT_EQ(*parsed, t);
  }
}

TEST(DType, Sizes) {
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeSize(DType::kF8E5M2), 1);
  EXPECT_EQ(DTypeSize(DType::kF64), 8);
  EXPECT_EQ(DTypeSize(DType::kBool), 1);
}

TEST(DType, CommandLineAliases) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
  EXPECT_EQ(*ParseDType("fp16"), DType::kF16);
  EXPECT_EQ(*ParseDType("F8_E4M3"), DType::kF8E4M3);
}

TEST(DType, UnknownNamesAreRefused) {
  EXPECT_FALSE(
      ParseSafetensorsDType("bf16").ok());  // the header wants exact names
  EXPECT_FALSE(ParseSafetensorsDType("F128").ok());
  auto s = ParseDType("complex64");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("complex64"), absl::string_view::npos);
}

}  // namespace
}  // namespace scalai
