#include "ptc/model.h"

#include "absl/strings/str_cat.h"
#include "ptc/checked_math.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::StatusOr<int64_t> TensorBytes(const Shape& shape, DType dtype) {
  ASSIGN_OR_RETURN(int64_t elems, NumElements(shape));
  return CheckedMul(elems, DTypeSize(dtype));
}

absl::Status Model::Add(TensorInfo tensor) {
  if (index_.contains(tensor.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor.name, " appears twice"));
  }
  auto bytes = TensorBytes(tensor.shape, tensor.dtype);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor.name, " ", ShapeToString(tensor.shape),
                     ": ", bytes.status().message()));
  }
  ASSIGN_OR_RETURN(total_bytes_, CheckedAdd(total_bytes_, *bytes));
  index_.emplace(tensor.name, size());
  tensors_.push_back(std::move(tensor));
  return absl::OkStatus();
}

int Model::IndexOf(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

const TensorInfo* Model::Find(absl::string_view name) const {
  int i = IndexOf(name);
  return i < 0 ? nullptr : &tensors_[i];
}

}  // namespace scalai
