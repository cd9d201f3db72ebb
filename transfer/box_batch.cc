#include "transfer/box_batch.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transfer/copy_bytes.h"

namespace scalai {
namespace {

absl::Status CheckInside(const char* which, const Shape& shape,
                         const Shape& origin, const Shape& box) {
  if (shape.size() != box.size() || origin.size() != box.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a box of ", box.size(), " dims does not fit the ", which,
        " tensor of ", shape.size(), " dims (origin of ", origin.size(), ")"));
  }
  for (size_t d = 0; d < box.size(); ++d) {
    if (origin[d] < 0 || box[d] < 0 || origin[d] + box[d] > shape[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat("box [", absl::StrJoin(box, ","), "] at [",
                       absl::StrJoin(origin, ","), "] leaves the ", which,
                       " tensor [", absl::StrJoin(shape, ","), "] in dim ", d));
    }
  }
  return absl::OkStatus();
}

int AlignOf(uint64_t v) {
  int align = 16;
  while (align > 1 && v % align != 0) align /= 2;
  return align;
}

// A box described by outer dims (extent, strides in bytes) over runs of
// run_bytes, at byte offsets src_base/dst_base of src/dst.
struct Flat {
  std::vector<int64_t> extent, src_stride, dst_stride;
  int64_t run_bytes = 0;
};

Flat Flatten(const Shape& src_shape, const Shape& src_origin,
             const Shape& dst_shape, const Shape& dst_origin, const Shape& box,
             int elem_bytes, int64_t& src_base, int64_t& dst_base) {
  const int rank = static_cast<int>(box.size());
  const Shape src_strides = RowMajorStrides(src_shape);
  const Shape dst_strides = RowMajorStrides(dst_shape);
  src_base = dst_base = 0;
  for (int d = 0; d < rank; ++d) {
    src_base += src_origin[d] * src_strides[d] * elem_bytes;
    dst_base += dst_origin[d] * dst_strides[d] * elem_bytes;
  }
  // Trailing dims the box spans fully in both tensors form one run, and so
  // does the dim where that stops.
  int inner = rank;
  int64_t run_elems = 1;
  while (inner > 0) {
    const int d = --inner;
    run_elems *= box[d];
    if (box[d] != src_shape[d] || box[d] != dst_shape[d]) break;
  }
  Flat f;
  f.run_bytes = run_elems * elem_bytes;
  for (int d = 0; d < inner; ++d) {
    if (box[d] == 1) continue;  // indexes nothing
    const int64_t s = src_strides[d] * elem_bytes;
    const int64_t t = dst_strides[d] * elem_bytes;
    // A dim that steps exactly over the previous one's extent merges.
    if (!f.extent.empty() && f.src_stride.back() == s * box[d] &&
        f.dst_stride.back() == t * box[d]) {
      f.extent.back() *= box[d];
      f.src_stride.back() = s;
      f.dst_stride.back() = t;
      continue;
    }
    f.extent.push_back(box[d]);
    f.src_stride.push_back(s);
    f.dst_stride.push_back(t);
  }
  return f;
}

}  // namespace

absl::Status BoxBatch::AddCopy(const std::byte* src, const Shape& src_shape,
                               const Shape& src_origin, std::byte* dst,
                               const Shape& dst_shape, const Shape& dst_origin,
                               const Shape& box_shape, int elem_bytes) {
  if (src != nullptr) {
    absl::Status inside =
        CheckInside("source", src_shape, src_origin, box_shape);
    if (!inside.ok()) return inside;
  }
  absl::Status inside =
      CheckInside("destination", dst_shape, dst_origin, box_shape);
  if (!inside.ok()) return inside;
  if (elem_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("element size ", elem_bytes, " is not positive"));
  }
  for (int64_t e : box_shape) {
    if (e == 0) return absl::OkStatus();
  }
  int64_t src_base = 0, dst_base = 0;
  const Flat f = Flatten(src != nullptr ? src_shape : dst_shape,
                         src != nullptr ? src_origin : dst_origin, dst_shape,
                         dst_origin, box_shape, elem_bytes, src_base, dst_base);
  if (src == nullptr) src_base = 0;
  // Dims beyond what an engine indexes are walked here, one entry each.
  const int outer = static_cast<int>(f.extent.size());
  const int walked = outer > kMaxRunDims ? outer - kMaxRunDims : 0;
  std::vector<int64_t> idx(walked, 0);
  for (;;) {
    BoxRuns r;
    int64_t s = src_base, t = dst_base;
    for (int d = 0; d < walked; ++d) {
      s += idx[d] * f.src_stride[d];
      t += idx[d] * f.dst_stride[d];
    }
    r.src = src != nullptr ? src + s : nullptr;
    r.dst = dst + t;
    r.run_bytes = f.run_bytes;
    r.dims = outer - walked;
    r.runs = 1;
    uint64_t bits =
        reinterpret_cast<uintptr_t>(r.dst) | static_cast<uint64_t>(r.run_bytes);
    if (r.src != nullptr) bits |= reinterpret_cast<uintptr_t>(r.src);
    for (int d = 0; d < r.dims; ++d) {
      r.extent[d] = f.extent[walked + d];
      r.src_stride[d] = r.src != nullptr ? f.src_stride[walked + d] : 0;
      r.dst_stride[d] = f.dst_stride[walked + d];
      r.runs *= r.extent[d];
      bits |= static_cast<uint64_t>(r.src_stride[d]) |
              static_cast<uint64_t>(r.dst_stride[d]);
    }
    r.align = AlignOf(bits);
    bytes_ += r.runs * r.run_bytes;
    boxes_.push_back(r);
    int d = walked - 1;
    while (d >= 0 && ++idx[d] == f.extent[d]) idx[d--] = 0;
    if (d < 0) break;
  }
  return absl::OkStatus();
}

absl::Status BoxBatch::AddZero(std::byte* dst, const Shape& dst_shape,
                               const Shape& dst_origin, const Shape& box_shape,
                               int elem_bytes) {
  return AddCopy(nullptr, dst_shape, dst_origin, dst, dst_shape, dst_origin,
                 box_shape, elem_bytes);
}

void CopyBatchOnHost(const BoxBatch& batch) {
  for (const BoxRuns& r : batch.boxes()) {
    for (int64_t i = 0; i < r.runs; ++i) {
      int64_t s = 0, t = 0;
      RunOffsets(r, i, s, t);
      if (r.src == nullptr) {
        std::memset(r.dst + t, 0, r.run_bytes);
      } else {
        CopyBytes(r.dst + t, r.src + s, r.run_bytes);
      }
    }
  }
}

}  // namespace scalai
