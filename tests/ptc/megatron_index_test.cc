#include "ptc/megatron_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

namespace scalai {
namespace {

using ::testing::HasSubstr;

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// An .idx as Megatron writes it: sequences of `lengths` tokens laid end to
// end in the .bin, one document per sequence.
std::string Idx(const std::vector<int32_t>& lengths, int dtype = 8,
                uint64_t version = 1) {
  std::string out("MMIDIDX\0\0", 9);
  Put<uint64_t>(out, version);
  Put<uint8_t>(out, static_cast<uint8_t>(dtype));
  Put<uint64_t>(out, lengths.size());
  Put<uint64_t>(out, lengths.size() + 1);
  for (int32_t n : lengths) Put<int32_t>(out, n);
  int64_t at = 0;
  for (int32_t n : lengths) {
    Put<int64_t>(out, at);
    at += int64_t{n} * MegatronItemBytes(dtype);
  }
  for (size_t d = 0; d <= lengths.size(); ++d) Put<int64_t>(out, d);
  return out;
}

absl::Status Check(const std::string& idx, int64_t bin_size) {
  auto parsed = MegatronIndex::Parse(idx, idx.size());
  if (!parsed.ok()) return parsed.status();
  return parsed->CheckEntries(idx, bin_size);
}

TEST(MegatronIndexTest, ReadsTheTables) {
  const std::string idx = Idx({3, 0, 5}, /*dtype=*/4);
  auto parsed = MegatronIndex::Parse(idx, idx.size());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->sequences(), 3);
  EXPECT_EQ(parsed->documents(), 4);
  EXPECT_EQ(parsed->item_bytes(), 4);
  EXPECT_EQ(parsed->sequence_bytes(idx, 0), 12);
  EXPECT_EQ(parsed->sequence_bytes(idx, 2), 20);
  EXPECT_EQ(parsed->pointer(idx, 2), 12);
  EXPECT_TRUE(parsed->CheckEntries(idx, 32).ok());
  // Multimodal datasets append a mode byte per sequence.
  EXPECT_TRUE(MegatronIndex::Parse(idx + "abc", idx.size() + 3).ok());
}

TEST(MegatronIndexTest, EveryDtypeCodeHasItsSize) {
  const int expected[] = {0, 1, 1, 2, 4, 8, 8, 4, 2, 0};
  for (int code = 0; code <= 9; ++code)
    EXPECT_EQ(MegatronItemBytes(code), expected[code]) << code;
}

TEST(MegatronIndexTest, RefusesMalformedHeaders) {
  EXPECT_THAT(Check("", 10).message(), HasSubstr("empty file"));
  EXPECT_THAT(Check("MMIDIDX", 10).message(), HasSubstr("too short"));
  std::string bad = Idx({1});
  bad[0] = 'X';
  EXPECT_THAT(Check(bad, 10).message(), HasSubstr("bad magic"));
  EXPECT_THAT(Check(Idx({1}, 8, 2), 10).message(),
              HasSubstr("version 2 is not supported"));
  EXPECT_THAT(Check(Idx({1}, 9), 10).message(),
              HasSubstr("unknown dtype code 9"));
  EXPECT_THAT(Check(Idx({}), 10).message(), HasSubstr("no sequences"));
  // Counts larger than the file, and a file longer than its tables.
  std::string huge = Idx({1});
  const uint64_t many = uint64_t{1} << 62;
  std::memcpy(huge.data() + 18, &many, 8);
  EXPECT_THAT(Check(huge, 10).message(), HasSubstr("more than the file"));
  EXPECT_THAT(Check(Idx({1}) + std::string(5, '\0'), 10).message(),
              HasSubstr("tables end at byte"));
  EXPECT_THAT(Check(Idx({1, 2}).substr(0, 40), 10).message(),
              HasSubstr("more than the file"));
}

TEST(MegatronIndexTest, RefusesEntriesOutsideTheBin) {
  // Sequences of 3 and 5 uint16 tokens need 16 bytes of .bin.
  const std::string idx = Idx({3, 5});
  EXPECT_TRUE(Check(idx, 16).ok());
  EXPECT_THAT(Check(idx, 15).message(), HasSubstr("past the end of the .bin"));
  EXPECT_THAT(Check(idx, 0).message(), HasSubstr("the .bin is empty"));
  std::string far = idx;
  const int64_t pointer = int64_t{1} << 62;
  std::memcpy(far.data() + MegatronIndex::kHeaderBytes + 8 + 8, &pointer, 8);
  EXPECT_THAT(Check(far, 16).message(), HasSubstr("sequence 1 (pointer"));
  std::string negative = idx;
  const int32_t minus = -1;
  std::memcpy(negative.data() + MegatronIndex::kHeaderBytes, &minus, 4);
  EXPECT_THAT(Check(negative, 16).message(), HasSubstr("negative length"));
  std::string docs = idx;
  const int64_t past = 3;
  std::memcpy(docs.data() + docs.size() - 8, &past, 8);
  EXPECT_THAT(Check(docs, 16).message(), HasSubstr("document start 2 is 3"));
}

}  // namespace
}  // namespace scalai
