// A Model is the list of a job's global (unsharded) tensors: names, dtypes and
// shapes, in a fixed order that every placement and plan indexes by position.
//
//   Model model;
//   RETURN_IF_ERROR(model.Add({"output_layer.weight", DType::kBF16, {50304, 4096}}));
//   const TensorInfo* t = model.Find("output_layer.weight");
#ifndef SCALAI_PTC_MODEL_H_
#define SCALAI_PTC_MODEL_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ptc/box.h"
#include "ptc/dtype.h"

namespace scalai {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

class Model {
 public:
  // Appends a tensor; refuses a duplicate name or a negative or overflowing
  // shape.
  absl::Status Add(TensorInfo tensor);

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  int size() const { return static_cast<int>(tensors_.size()); }
  const TensorInfo& tensor(int index) const { return tensors_[index]; }

  // The tensor's index, or -1.
  int IndexOf(absl::string_view name) const;
  const TensorInfo* Find(absl::string_view name) const;

  // Bytes of all tensors together.
  int64_t total_bytes() const { return total_bytes_; }

 private:
  std::vector<TensorInfo> tensors_;
  absl::flat_hash_map<std::string, int> index_;
  int64_t total_bytes_ = 0;
};

// Bytes of one tensor of `shape` and `dtype`, overflow-checked.
absl::StatusOr<int64_t> TensorBytes(const Shape& shape, DType dtype);

}  // namespace scalai

#endif  // SCALAI_PTC_MODEL_H_
