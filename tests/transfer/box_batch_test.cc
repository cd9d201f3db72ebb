// BoxBatch flattens boxes into runs that the host loop and the CUDA kernel
// walk with the same arithmetic (RunOffsets): for random tensors and boxes
// of 0 to 10 dims and element sizes 1 to 16, a batch of copies and fills
// writes exactly what CopyBox and ZeroBox write, and nothing else.
#include "transfer/box_batch.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/transfer/random_boxes.h"
#include "transfer/box_copy.h"

namespace scalai {
namespace {

class BoxBatchProperty : public ::testing::TestWithParam<int> {};

TEST_P(BoxBatchProperty, WritesWhatCopyBoxAndZeroBoxWrite) {
  std::mt19937_64 rng(GetParam());
  const int elem = std::vector<int>{1, 2, 4, 8, 16, 3}[rng() % 6];
  const int boxes = 1 + static_cast<int>(rng() % 6);
  std::vector<RandomBox> drawn;
  std::vector<std::vector<std::byte>> src, want, got;
  for (int i = 0; i < boxes; ++i) {
    drawn.push_back(DrawRandomBox(rng));
    const RandomBox& b = drawn.back();
    src.emplace_back(Elements(b.src_shape) * elem);
    for (std::byte& x : src.back()) x = static_cast<std::byte>(rng());
    want.emplace_back(Elements(b.dst_shape) * elem);
    for (std::byte& x : want.back()) x = static_cast<std::byte>(rng() | 1);
    got.push_back(want.back());
  }
  BoxBatch batch;
  int64_t written = 0;
  for (int i = 0; i < boxes; ++i) {
    const RandomBox& b = drawn[i];
    SCOPED_TRACE(absl::StrCat("box ", i, " [", absl::StrJoin(b.box, ","),
                              "] of [", absl::StrJoin(b.src_shape, ","),
                              "] to [", absl::StrJoin(b.dst_shape, ","), "], ",
                              elem, "-byte elements"));
    if (i % 3 == 2) {  // a fill
      ZeroBox(want[i].data(), b.dst_shape, b.dst_origin, b.box, elem);
      ASSERT_TRUE(
          batch.AddZero(got[i].data(), b.dst_shape, b.dst_origin, b.box, elem)
              .ok());
    } else {
      CopyBox(src[i].data(), b.src_shape, b.src_origin, want[i].data(),
              b.dst_shape, b.dst_origin, b.box, elem);
      ASSERT_TRUE(batch
                      .AddCopy(src[i].data(), b.src_shape, b.src_origin,
                               got[i].data(), b.dst_shape, b.dst_origin, b.box,
                               elem)
                      .ok());
    }
    written += Elements(b.box) * elem;
  }
  EXPECT_EQ(batch.bytes(), written);
  for (const BoxRuns& r : batch.boxes()) {
    EXPECT_LE(r.dims, kMaxRunDims);
    EXPECT_EQ(r.run_bytes % r.align, 0);
  }
  CopyBatchOnHost(batch);
  for (int i = 0; i < boxes; ++i) EXPECT_EQ(got[i], want[i]) << "box " << i;
}

INSTANTIATE_TEST_SUITE_P(RandomBoxes, BoxBatchProperty,
                         ::testing::Range(1, 501));

TEST(BoxBatch, MergesDimsContiguousInBothTensors) {
  // Rows 2..5 of an [8, 6] tensor into a [4, 6] one: one run of 4 rows.
  std::vector<std::byte> src(8 * 6 * 2), dst(4 * 6 * 2);
  BoxBatch batch;
  ASSERT_TRUE(batch
                  .AddCopy(src.data(), {8, 6}, {2, 0}, dst.data(), {4, 6},
                           {0, 0}, {4, 6}, 2)
                  .ok());
  ASSERT_EQ(batch.boxes().size(), 1u);
  EXPECT_EQ(batch.boxes()[0].runs, 1);
  EXPECT_EQ(batch.boxes()[0].run_bytes, 4 * 6 * 2);
  // A column band: one run per row, the row dims of a [2, 3, 8] tensor
  // merged into one of extent 6.
  batch.clear();
  std::vector<std::byte> wide(2 * 3 * 8 * 4), narrow(2 * 3 * 4 * 4);
  ASSERT_TRUE(batch
                  .AddCopy(wide.data(), {2, 3, 8}, {0, 0, 4}, narrow.data(),
                           {2, 3, 4}, {0, 0, 0}, {2, 3, 4}, 4)
                  .ok());
  ASSERT_EQ(batch.boxes().size(), 1u);
  EXPECT_EQ(batch.boxes()[0].dims, 1);
  EXPECT_EQ(batch.boxes()[0].runs, 6);
  EXPECT_EQ(batch.boxes()[0].run_bytes, 16);
}

TEST(BoxBatch, RefusesABoxOutsideItsTensorNamingTheDim) {
  std::vector<std::byte> src(16), dst(16);
  BoxBatch batch;
  absl::Status status = batch.AddCopy(src.data(), {4, 4}, {2, 0}, dst.data(),
                                      {4, 4}, {0, 0}, {3, 4}, 1);
  EXPECT_THAT(
      std::string(status.message()),
      ::testing::HasSubstr(
          "box [3,4] at [2,0] leaves the source tensor [4,4] in dim 0"));
  EXPECT_TRUE(batch.empty());
}

}  // namespace
}  // namespace scalai
