// A Box is an axis-aligned N-d region of a tensor: an origin and a shape, in
// element coordinates. Every tensor shard, copy and view is described by boxes.
//
//   Box a({0, 0}, {4, 8}), b({2, 4}, {4, 8});
//   Box overlap = Intersect(a, b);              // origin {2,4}, shape {2,4}
//   ASSIGN_OR_RETURN(int64_t n, overlap.NumElements());  // 8
#ifndef SCALAI_PTC_BOX_H_
#define SCALAI_PTC_BOX_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace scalai {

using Shape = std::vector<int64_t>;

// Product of the extents, overflow-checked. An empty shape (a scalar) has one
// element.
absl::StatusOr<int64_t> NumElements(const Shape& shape);

// "[4, 8]".
std::string ShapeToString(const Shape& shape);

class Box {
 public:
  Box() = default;
  Box(Shape origin, Shape shape);

  // The box covering a whole tensor of `shape`.
  static Box Full(const Shape& shape);

  int rank() const { return static_cast<int>(origin_.size()); }
  const Shape& origin() const { return origin_; }
  const Shape& shape() const { return shape_; }
  int64_t begin(int dim) const { return origin_[dim]; }
  int64_t end(int dim) const { return origin_[dim] + shape_[dim]; }

  bool empty() const;
  absl::StatusOr<int64_t> NumElements() const {
    return scalai::NumElements(shape_);
  }

  // True when every element of `other` lies in this box.
  bool Contains(const Box& other) const;

  std::string ToString() const;

  friend bool operator==(const Box&, const Box&) = default;

 private:
  Shape origin_;
  Shape shape_;
};

// The common part of two boxes of the same rank; empty() when they are
// disjoint.
Box Intersect(const Box& a, const Box& b);

// Row-major strides, in elements, of a tensor of `shape`.
Shape RowMajorStrides(const Shape& shape);

}  // namespace scalai

#endif  // SCALAI_PTC_BOX_H_
