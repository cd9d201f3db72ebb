#include "ptc/box.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace scalai {
namespace {

TEST(Box, IntersectOverlapping) {
  Box a({0, 0}, {4, 8}), b({2, 4}, {4, 8});
  EXPECT_EQ(Intersect(a, b), Box({2, 4}, {2, 4}));
  EXPECT_EQ(*Intersect(a, b).NumElements(), 8);
}

TEST(Box, IntersectDisjointIsEmpty) {
  EXPECT_TRUE(Intersect(Box({0}, {4}), Box({4}, {4})).empty());
  EXPECT_TRUE(Intersect(Box({0, 0}, {4, 4}), Box({0, 9}, {4, 4})).empty());
}

TEST(Box, ContainsAndPrints) {
  Box full = Box::Full({4, 8});
  EXPECT_TRUE(full.Contains(Box({1, 2}, {3, 6})));
  EXPECT_FALSE(full.Contains(Box({1, 2}, {4, 6})));
  EXPECT_EQ(Box({1, 2}, {3, 3}).ToString(), "[1:4, 2:5]");
}

TEST(Box, NumElementsDetectsOverflowAndNegatives) {
  EXPECT_EQ(*NumElements({}), 1);  // a scalar
  EXPECT_EQ(*NumElements({3, 0, 5}), 0);
  EXPECT_FALSE(NumElements({int64_t{1} << 40, int64_t{1} << 40}).ok());
  EXPECT_FALSE(NumElements({4, -1}).ok());
}

TEST(Box, RowMajorStrides) {
  EXPECT_EQ(RowMajorStrides({2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(RowMajorStrides({}), Shape{});
}

}  // namespace
}  // namespace scalai
