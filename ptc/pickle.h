// Python pickles (protocols 2 to 5) as PyTorch and Megatron-LM write them in
// `torch.save` files, read without running anything. Unpickling a file runs
// whatever callables it names, so the reader knows a fixed list of globals
// and builds each as plain data: dicts (`collections.OrderedDict` too),
// lists, tuples, numbers, strings, bytes, `argparse.Namespace`, torch dtypes,
// tensors (`torch._utils._rebuild_tensor_v2`, `_rebuild_parameter`, their
// storages as persistent ids) and numpy arrays and dtypes (the RNG state).
// Any other global is refused, naming it, before anything is built.
//
//   ASSIGN_OR_RETURN(PickleRef root, Unpickle(data_pkl));
//   const PickleValue* model = root->Find("model");
//   for (const auto& [key, value] : model->entries) ...  // value->tensor
//   std::string again = Pickle(*root);  // torch.load reads it
#ifndef SCALAI_PTC_PICKLE_H_
#define SCALAI_PTC_PICKLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ptc/box.h"
#include "ptc/dtype.h"

namespace scalai {

// A tensor of a torch.save file: a strided view of a storage, which the
// archive holds as the record "data/KEY".
struct PickleTensor {
  std::string storage_key;
  DType dtype = DType::kF32;
  int64_t storage_elements = 0;
  std::string location = "cpu";
  int64_t offset = 0;  // elements into the storage
  Shape shape;
  Shape stride;  // elements
  bool requires_grad = false;
  bool parameter = false;  // an nn.Parameter (torch._utils._rebuild_parameter)

  int64_t elements() const;
  bool contiguous() const;
};

// A numpy array (or scalar, with an empty shape): its dtype as numpy
// describes it ("<u4") and its bytes in C order.
struct PickleArray {
  std::string descr;
  Shape shape;
  std::string data;
};

struct PickleValue;
using PickleRef = std::shared_ptr<PickleValue>;

struct PickleValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kBytes,
    kList,
    kTuple,
    kDict,
    kNamespace,   // argparse.Namespace: entries are its attributes
    kTorchDType,  // text: "bfloat16"
    kNumpyDType,  // text: "<u4"
    kTensor,
    kStorage,  // a bare storage (the first argument of a tensor's rebuild)
    kArray,
    kGlobal,  // a global the reader knows, by name ("collections.OrderedDict")
  };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string text;              // kString, kBytes, kTorchDType, kNumpyDType
  std::vector<PickleRef> items;  // kList, kTuple
  std::vector<std::pair<PickleRef, PickleRef>> entries;  // kDict, kNamespace
  bool ordered_dict = false;  // a collections.OrderedDict
  PickleTensor tensor;        // kTensor; kStorage (its storage fields only)
  PickleArray array;

  static PickleRef None();
  static PickleRef Int(int64_t v);
  static PickleRef Float(double v);
  static PickleRef String(std::string v);
  static PickleRef Make(Kind kind);

  // The value of a dict's or namespace's string key, or null.
  const PickleValue* Find(absl::string_view key) const;
  PickleValue* Find(absl::string_view key);
  // Sets a string key's value, keeping the key's place if present.
  void Set(absl::string_view key, PickleRef value);
  // Removes a string key; false when it was not there.
  bool Erase(absl::string_view key);
  // Python's spelling of the kind, for errors: "dict", "tensor", ...
  static absl::string_view KindName(Kind kind);
};

// Calls `fn` on every tensor and storage below `value`, depth first; values
// nested deeper than 200 are an error (a cycle in a value built by code;
// Unpickle refuses them).
absl::Status ForEachTensor(PickleValue& value,
                           const std::function<void(PickleValue&)>& fn);

// Parses a pickle; errors name the byte offset and what was wrong there,
// and a global not on the list by its module and name. Values nested deeper
// than 200, values that contain themselves, and values shared so often that
// more than 2^24 paths lead to them are refused, so that every walk over
// what it returns (and freeing it) is bounded.
absl::StatusOr<PickleRef> Unpickle(absl::string_view bytes);

// Writes `value` as a protocol 3 pickle in torch.save's form: tensors as
// persistent ids ("storage", torch.<Type>Storage, key, location, numel).
// Values nested deeper than 1000 are an error (a cycle).
absl::StatusOr<std::string> Pickle(const PickleValue& value);

// torch's storage class name for a dtype ("BFloat16Storage"), and back.
absl::StatusOr<std::string> TorchStorageName(DType dtype);
absl::StatusOr<DType> DTypeOfTorchStorage(absl::string_view name);

}  // namespace scalai

#endif  // SCALAI_PTC_PICKLE_H_
