#include "ptc/box.h"

#include <algorithm>
#include <cassert>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ptc/checked_math.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::StatusOr<int64_t> NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) {
    if (extent < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative extent in shape ", ShapeToString(shape)));
    }
    ASSIGN_OR_RETURN(n, CheckedMul(n, extent));
  }
  return n;
}

std::string ShapeToString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

Box::Box(Shape origin, Shape shape)
    : origin_(std::move(origin)), shape_(std::move(shape)) {
  assert(origin_.size() == shape_.size());
}

Box Box::Full(const Shape& shape) { return Box(Shape(shape.size(), 0), shape); }

bool Box::empty() const {
  return std::any_of(shape_.begin(), shape_.end(),
                     [](int64_t e) { return e <= 0; });
}

bool Box::Contains(const Box& other) const {
  if (other.rank() != rank()) return false;
  for (int d = 0; d < rank(); ++d) {
    if (other.begin(d) < begin(d) || other.end(d) > end(d)) return false;
  }
  return true;
}

std::string Box::ToString() const {
  std::vector<std::string> ranges;
  for (int d = 0; d < rank(); ++d) {
    ranges.push_back(absl::StrCat(begin(d), ":", end(d)));
  }
  return absl::StrCat("[", absl::StrJoin(ranges, ", "), "]");
}

Box Intersect(const Box& a, const Box& b) {
  assert(a.rank() == b.rank());
  Shape origin(a.rank()), shape(a.rank());
  for (int d = 0; d < a.rank(); ++d) {
    origin[d] = std::max(a.begin(d), b.begin(d));
    shape[d] = std::max<int64_t>(0, std::min(a.end(d), b.end(d)) - origin[d]);
  }
  return Box(std::move(origin), std::move(shape));
}

Shape RowMajorStrides(const Shape& shape) {
  Shape strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * shape[d + 1];
  }
  return strides;
}

}  // namespace scalai
