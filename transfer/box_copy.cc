#include "transfer/box_copy.h"

#include <cstring>

#include "transfer/copy_bytes.h"

namespace scalai {
namespace {

// Walks the box row by row, where a "row" is the largest contiguous run in
// both tensors, and calls `run(src_offset, dst_offset, bytes)`.
template <typename Run>
void ForEachRun(const Shape& src_shape, const Shape& src_origin,
                const Shape& dst_shape, const Shape& dst_origin,
                const Shape& box_shape, int elem_bytes, Run run) {
  const int rank = static_cast<int>(box_shape.size());
  for (int64_t extent : box_shape) {
    if (extent == 0) return;
  }
  // Merge trailing dims that the box spans fully in both tensors.
  int inner = rank;  // dims [inner, rank) form one contiguous run
  int64_t run_elems = 1;
  while (inner > 0) {
    int d = inner - 1;
    run_elems *= box_shape[d];
    --inner;
    if (box_shape[d] != src_shape[d] || box_shape[d] != dst_shape[d]) break;
  }
  const Shape src_strides = RowMajorStrides(src_shape);
  const Shape dst_strides = RowMajorStrides(dst_shape);
  Shape idx(inner, 0);
  const int64_t run_bytes = run_elems * elem_bytes;
  while (true) {
    int64_t s = 0, t = 0;
    for (int d = 0; d < inner; ++d) {
      s += (src_origin[d] + idx[d]) * src_strides[d];
      t += (dst_origin[d] + idx[d]) * dst_strides[d];
    }
    if (inner < rank) {
      s += src_origin[inner] * src_strides[inner];
      t += dst_origin[inner] * dst_strides[inner];
    }
    run(s * elem_bytes, t * elem_bytes, run_bytes);
    int d = inner - 1;
    while (d >= 0 && ++idx[d] == box_shape[d]) idx[d--] = 0;
    if (d < 0) return;
  }
}

}  // namespace

void CopyBox(const std::byte* src, const Shape& src_shape,
             const Shape& src_origin, std::byte* dst, const Shape& dst_shape,
             const Shape& dst_origin, const Shape& box_shape, int elem_bytes) {
  ForEachRun(
      src_shape, src_origin, dst_shape, dst_origin, box_shape, elem_bytes,
      [&](int64_t s, int64_t t, int64_t n) { CopyBytes(dst + t, src + s, n); });
}

void ZeroBox(std::byte* dst, const Shape& dst_shape, const Shape& dst_origin,
             const Shape& box_shape, int elem_bytes) {
  ForEachRun(
      dst_shape, dst_origin, dst_shape, dst_origin, box_shape, elem_bytes,
      [&](int64_t, int64_t t, int64_t n) { std::memset(dst + t, 0, n); });
}

}  // namespace scalai
