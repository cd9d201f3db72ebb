// Random tensors and boxes for the box copy engines' tests (host and GPU):
// 0 to 10 dims, mostly small, sometimes spanning a dim whole so that dims
// merge, at most 2^16 elements per tensor.
#ifndef SCALAI_TESTS_TRANSFER_RANDOM_BOXES_H_
#define SCALAI_TESTS_TRANSFER_RANDOM_BOXES_H_

#include <random>

#include "ptc/box.h"

namespace scalai {

struct RandomBox {
  Shape src_shape, src_origin, dst_shape, dst_origin, box;
};

inline RandomBox DrawRandomBox(std::mt19937_64& rng) {
  const int rank = static_cast<int>(rng() % 11);
  RandomBox b;
  int64_t src_elems = 1, dst_elems = 1;
  for (int d = 0; d < rank; ++d) {
    // Mostly small dims, so that 10 of them stay small; sometimes the box
    // spans a dim whole, so that dims merge.
    const int64_t limit = rank > 4 ? 3 : 9;
    int64_t extent = 1 + static_cast<int64_t>(rng() % limit);
    const bool whole = rng() % 3 == 0;
    int64_t src = whole ? extent : extent + static_cast<int64_t>(rng() % 3);
    int64_t dst = whole ? extent : extent + static_cast<int64_t>(rng() % 3);
    if (src_elems * src > (1 << 16) || dst_elems * dst > (1 << 16)) {
      extent = src = dst = 1;
    }
    src_elems *= src;
    dst_elems *= dst;
    b.box.push_back(extent);
    b.src_shape.push_back(src);
    b.dst_shape.push_back(dst);
    b.src_origin.push_back(static_cast<int64_t>(rng() % (src - extent + 1)));
    b.dst_origin.push_back(static_cast<int64_t>(rng() % (dst - extent + 1)));
  }
  return b;
}

inline int64_t Elements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

}  // namespace scalai

#endif  // SCALAI_TESTS_TRANSFER_RANDOM_BOXES_H_
