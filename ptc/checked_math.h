// Overflow-checked integer arithmetic for sizes, offsets and element counts.
// Tensor sizes come from untrusted files, so every product is checked.
//
//   ASSIGN_OR_RETURN(int64_t bytes, CheckedMul(elems, elem_bytes));
#ifndef SCALAI_PTC_CHECKED_MATH_H_
#define SCALAI_PTC_CHECKED_MATH_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace scalai {

inline absl::StatusOr<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) {
    return absl::OutOfRangeError(
        absl::StrCat("integer overflow: ", a, " * ", b));
  }
  return out;
}

inline absl::StatusOr<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) {
    return absl::OutOfRangeError(
        absl::StrCat("integer overflow: ", a, " + ", b));
  }
  return out;
}

}  // namespace scalai

#endif  // SCALAI_PTC_CHECKED_MATH_H_
