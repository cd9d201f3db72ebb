#include "transfer/box_copy.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace scalai {
namespace {

// Element-by-element reference of CopyBox.
void NaiveCopy(const std::vector<std::byte>& src, const Shape& src_shape,
               const Shape& src_origin, std::vector<std::byte>& dst,
               const Shape& dst_shape, const Shape& dst_origin,
               const Shape& box, int elem) {
  const int64_t n = *NumElements(box);
  const Shape ss = RowMajorStrides(src_shape), ds = RowMajorStrides(dst_shape);
  for (int64_t e = 0; e < n; ++e) {
    int64_t rest = e, s = 0, d = 0;
    for (int k = static_cast<int>(box.size()) - 1; k >= 0; --k) {
      int64_t i = rest % box[k];
      rest /= box[k];
      s += (src_origin[k] + i) * ss[k];
      d += (dst_origin[k] + i) * ds[k];
    }
    std::memcpy(&dst[d * elem], &src[s * elem], elem);
  }
}

TEST(BoxCopy, MatchesElementwiseCopyOnRandomBoxes) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 2000; ++trial) {
    const int rank = static_cast<int>(rng() % 4);
    const int elem = 1 << (rng() % 4);
    Shape src_shape(rank), dst_shape(rank), box(rank), so(rank), doff(rank);
    for (int d = 0; d < rank; ++d) {
      box[d] = rng() % 5;
      src_shape[d] = box[d] + rng() % 3;
      dst_shape[d] = box[d] + rng() % 3;
      so[d] = src_shape[d] == box[d] ? 0 : rng() % (src_shape[d] - box[d] + 1);
      doff[d] =
          dst_shape[d] == box[d] ? 0 : rng() % (dst_shape[d] - box[d] + 1);
    }
    std::vector<std::byte> src(*NumElements(src_shape) * elem),
        a(*NumElements(dst_shape) * elem), b;
    for (auto& x : src) x = static_cast<std::byte>(rng());
    for (auto& x : a) x = static_cast<std::byte>(rng());
    b = a;
    CopyBox(src.data(), src_shape, so, a.data(), dst_shape, doff, box, elem);
    NaiveCopy(src, src_shape, so, b, dst_shape, doff, box, elem);
    ASSERT_EQ(a, b) << "trial " << trial;
    std::vector<std::byte> zeros(*NumElements(box) * elem, std::byte{0});
    ZeroBox(a.data(), dst_shape, doff, box, elem);
    NaiveCopy(zeros, box, Shape(rank, 0), b, dst_shape, doff, box, elem);
    ASSERT_EQ(a, b) << "zero trial " << trial;
  }
}

}  // namespace
}  // namespace scalai
