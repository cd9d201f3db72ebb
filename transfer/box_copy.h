// Strided N-d box copies between row-major tensors in memory: the inner loop
// of every reshard. Trailing dimensions that both boxes span fully merge into
// one memcpy, so a split along dim 0 is a single copy.
//
//   CopyBox(src, src_shape, {2, 0}, dst, dst_shape, {0, 0}, {4, 8}, /*elem_bytes=*/2);
//   ZeroBox(dst, dst_shape, {4, 0}, {2, 8}, 2);
#ifndef SCALAI_TRANSFER_BOX_COPY_H_
#define SCALAI_TRANSFER_BOX_COPY_H_

#include <cstddef>

#include "ptc/box.h"

namespace scalai {

// Copies the box of `box_shape` at `src_origin` of tensor `src` (of
// `src_shape`) to `dst_origin` of tensor `dst`. Boxes must lie inside their
// tensors.
void CopyBox(const std::byte* src, const Shape& src_shape,
             const Shape& src_origin, std::byte* dst, const Shape& dst_shape,
             const Shape& dst_origin, const Shape& box_shape, int elem_bytes);

// Writes zeros to the box of `box_shape` at `dst_origin` of tensor `dst`.
void ZeroBox(std::byte* dst, const Shape& dst_shape, const Shape& dst_origin,
             const Shape& box_shape, int elem_bytes);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_BOX_COPY_H_
