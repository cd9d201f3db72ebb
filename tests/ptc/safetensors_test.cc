#include "ptc/safetensors.h"

#include <cstdint>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace scalai {
namespace {

using ::testing::HasSubstr;

// A file: the 8-byte length of `json`, `json`, then `data_bytes` bytes.
std::string FileWith(const std::string& json, int64_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + std::string(data_bytes, 'x');
}

absl::StatusOr<SafetensorsHeader> ParseFile(const std::string& file) {
  return SafetensorsHeader::Parse(file, static_cast<int64_t>(file.size()));
}

TEST(Safetensors, ParsesAValidHeader) {
  std::string file = FileWith(
      R"({"__metadata__": {"format": "pt"},
          "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [16, 28]},
          "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
          "s": {"dtype": "I64", "shape": [], "data_offsets": [28, 36]},
          "z": {"dtype": "U8", "shape": [0, 5], "data_offsets": [36, 36]}})",
      36);
  auto h = ParseFile(file);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors().size(), 4u);
  EXPECT_EQ(h->tensors()[0].name, "a");  // data order
  EXPECT_EQ(h->Find("b")->shape, (Shape{2, 3}));
  EXPECT_EQ(h->metadata().at("format"), "pt");
  EXPECT_EQ(h->data_bytes(), 36);
}

TEST(Safetensors, RoundTripsWhatItWrites) {
  auto built = SafetensorsHeader::Build(
      {{"layer.weight", DType::kBF16, {3, 5}, 0, 0},
       {"a\"quoted\\name", DType::kF8E4M3, {7}, 0, 0},
       {"scalar", DType::kF64, {}, 0, 0}},
      {{"scalai.rank", "3"}, {"scalai.config", "tp=2,pp=1,dp=1"}});
  ASSERT_TRUE(built.ok()) << built.status();
  std::string head = built->Serialize();
  EXPECT_EQ(static_cast<int64_t>(head.size()), built->data_start());
  EXPECT_EQ(head.size() % 8, 0u);
  std::string file = head + std::string(built->data_bytes(), '\1');
  auto parsed = ParseFile(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->tensors(), built->tensors());
  EXPECT_EQ(parsed->metadata(), built->metadata());
  EXPECT_EQ(parsed->data_bytes(), 30 + 7 + 8);
  EXPECT_EQ(parsed->Serialize(), head);
}

TEST(Safetensors, BuildRefusesDuplicateNames) {
  auto built = SafetensorsHeader::Build(
      {{"w", DType::kF32, {1}, 0, 0}, {"w", DType::kF32, {1}, 0, 0}}, {});
  ASSERT_FALSE(built.ok());
  EXPECT_THAT(std::string(built.status().message()),
              HasSubstr("\"w\" appears twice"));
}

struct Malformed {
  const char* what;
  std::string file;
  const char* message;
};

class SafetensorsRefuses : public ::testing::TestWithParam<Malformed> {};

TEST_P(SafetensorsRefuses, WithAClearError) {
  auto h = ParseFile(GetParam().file);
  ASSERT_FALSE(h.ok()) << GetParam().what;
  EXPECT_THAT(std::string(h.status().message()), HasSubstr(GetParam().message))
      << GetParam().what;
}

std::string LengthOnly(uint64_t n, int64_t total) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + std::string(total - 8, ' ');
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SafetensorsRefuses,
    ::testing::Values(
        Malformed{"short file", "abc",
                  "too short for the 8-byte header length"},
        Malformed{"length past the file", LengthOnly(1000, 100),
                  "runs past the end of the file"},
        Malformed{"huge length", LengthOnly(uint64_t{1} << 40, 100),
                  "exceeds the limit"},
        Malformed{"invalid JSON", FileWith(R"({"a": {"dtype": )", 0),
                  "not valid JSON"},
        Malformed{"not an object", FileWith("[1, 2]", 0), "not a JSON object"},
        Malformed{
            "unknown dtype",
            FileWith(
                R"({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}})",
                16),
            "unknown dtype \"F128\""},
        Malformed{
            "dtype not a string",
            FileWith(
                R"({"a": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}})",
                4),
            "\"dtype\" missing or not a string"},
        Malformed{
            "negative extent",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})",
                4),
            "non-negative integers"},
        Malformed{
            "shape x dtype != bytes",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})",
                12),
            "[2, 2] of F32 is 16 bytes but data_offsets [0, 12] hold 12"},
        Malformed{
            "overlap",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                               "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                12),
            "overlap tensor \"a\""},
        Malformed{
            "hole",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                               "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                12),
            "leaving a hole after byte 4"},
        Malformed{
            "hole at the start",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                8),
            "leaving a hole after byte 0"},
        Malformed{
            "offset past the data",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                8),
            "past the data section of 8 bytes"},
        Malformed{
            "trailing bytes",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                9),
            "5 bytes after the last tensor"},
        Malformed{
            "reversed offsets",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}})",
                4),
            "end before they begin"},
        Malformed{
            "offsets not a pair",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})",
                4),
            "\"data_offsets\" must be [begin, end]"},
        Malformed{
            "duplicate names",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                               "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                8),
            "tensor \"a\" appears twice"},
        Malformed{
            "unknown key",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}})",
                4),
            "unknown key \"x\""},
        Malformed{"metadata not strings",
                  FileWith(R"({"__metadata__": {"step": 100}})", 0),
                  "__metadata__ \"step\" is not a string"},
        Malformed{
            "overflowing shape",
            FileWith(
                R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})",
                4),
            "overflow"}),
    [](const ::testing::TestParamInfo<Malformed>& info) {
      std::string name;
      for (char c : std::string(info.param.what))
        name += std::isalnum(c) ? c : '_';
      return name;
    });

TEST(Safetensors, ReadsAHeaderFromAFile) {
  auto built = *SafetensorsHeader::Build({{"w", DType::kI32, {3}, 0, 0}}, {});
  std::string path = ::testing::TempDir() + "/w.safetensors";
  std::ofstream(path, std::ios::binary)
      << built.Serialize() << std::string(12, '\0');
  auto h = ReadSafetensorsHeader(path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors(), built.tensors());
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << built.Serialize() << "xx";
  auto truncated = ReadSafetensorsHeader(path);
  ASSERT_FALSE(truncated.ok());
  EXPECT_THAT(std::string(truncated.status().message()), HasSubstr(path));
}

}  // namespace
}  // namespace scalai
