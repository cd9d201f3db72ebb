#include "ptc/pickle.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

using Kind = PickleValue::Kind;

// torch's storage classes and dtype attributes, by the DType they hold.
struct TorchType {
  DType dtype;
  const char* storage;
  const char* dtype_name;  // torch.<name>, as torch pickles a dtype
};
constexpr TorchType kTorchTypes[] = {
    {DType::kF64, "DoubleStorage", "float64"},
    {DType::kF32, "FloatStorage", "float32"},
    {DType::kF16, "HalfStorage", "float16"},
    {DType::kBF16, "BFloat16Storage", "bfloat16"},
    {DType::kI64, "LongStorage", "int64"},
    {DType::kI32, "IntStorage", "int32"},
    {DType::kI16, "ShortStorage", "int16"},
    {DType::kI8, "CharStorage", "int8"},
    {DType::kU8, "ByteStorage", "uint8"},
    {DType::kBool, "BoolStorage", "bool"},
};

// The dtype attributes torch also answers to under older names.
constexpr const char* kTorchDTypeAliases[][2] = {
    {"float", "float32"}, {"double", "float64"}, {"half", "float16"},
    {"long", "int64"},    {"int", "int32"},      {"short", "int16"},
};

// The callables a checkpoint may name, each built here as data.
constexpr const char* kCallables[] = {
    "collections.OrderedDict",
    "argparse.Namespace",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.core.numeric._frombuffer",
    "numpy._core.numeric._frombuffer",
    "numpy.ndarray",
    "numpy.dtype",
    "_codecs.encode",
};

// The global `module.name` as a value, or an error naming it.
absl::StatusOr<PickleRef> ResolveGlobal(const std::string& module,
                                        const std::string& name) {
  const std::string full = module + "." + name;
  auto global = PickleValue::Make(Kind::kGlobal);
  global->text = full;
  for (const char* c : kCallables) {
    if (full == c) return global;
  }
  if (module == "torch") {
    for (const TorchType& t : kTorchTypes) {
      if (name == t.storage) return global;
      if (name == t.dtype_name) {
        auto dtype = PickleValue::Make(Kind::kTorchDType);
        dtype->text = t.dtype_name;
        return dtype;
      }
    }
    for (const auto& alias : kTorchDTypeAliases) {
      if (name == alias[0]) {
        auto dtype = PickleValue::Make(Kind::kTorchDType);
        dtype->text = alias[1];
        return dtype;
      }
    }
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "the pickle names the global ", full,
      ", which a checkpoint may not use (allowed: dicts, lists, numbers, "
      "strings, argparse.Namespace, torch tensors and dtypes, numpy arrays); "
      "nothing was run"));
}

// Bounds on what a pickle may build. Every walk over a value (the writer,
// ForEachTensor, and destruction itself, one call per level) recurses with
// its nesting and visits every path to each value, and a pickle can nest a
// list a million deep in 2 MB, make a value contain itself through the memo,
// or share a value so that its paths double at each level. Checkpoints nest a
// few levels and share a few tensors.
constexpr int kMaxNesting = 200;
constexpr int64_t kMaxPaths = int64_t{1} << 24;

// The values `v` holds, in order; i past the last gives null.
const PickleValue* NthChild(const PickleValue& v, size_t i) {
  if (i < v.items.size()) return v.items[i].get();
  i -= v.items.size();
  if (i / 2 >= v.entries.size()) return nullptr;
  const auto& entry = v.entries[i / 2];
  return i % 2 == 0 ? entry.first.get() : entry.second.get();
}

// Checks the values reachable from `roots` against the bounds above, with an
// explicit stack: a value nested deeper than kMaxNesting, one that contains
// itself, or one reached by more than kMaxPaths paths is an error.
absl::Status CheckBounds(const std::vector<const PickleValue*>& roots) {
  struct Facts {
    bool open = true;  // on the current path: reaching it again is a cycle
    int height = 1;
    int64_t paths = 1;  // the value and every path below it
  };
  std::unordered_map<const PickleValue*, Facts> facts;
  struct Frame {
    const PickleValue* value;
    size_t next = 0;
  };
  std::vector<Frame> path;
  for (const PickleValue* root : roots) {
    if (root == nullptr || !facts.try_emplace(root).second) continue;
    path.push_back({root});
    while (!path.empty()) {
      Frame& top = path.back();
      if (const PickleValue* child = NthChild(*top.value, top.next++)) {
        auto [it, fresh] = facts.try_emplace(child);
        if (!fresh && it->second.open) {
          return absl::InvalidArgumentError(
              "a value contains itself (a cycle through the memo)");
        }
        if (path.size() + (fresh ? 1 : it->second.height) > kMaxNesting) {
          return absl::InvalidArgumentError(
              absl::StrCat("values nested deeper than ", kMaxNesting));
        }
        if (fresh) path.push_back({child});
        continue;
      }
      Facts& mine = facts[top.value];
      for (size_t i = 0; const PickleValue* child = NthChild(*top.value, i);
           ++i) {
        const Facts& below = facts[child];
        mine.height = std::max(mine.height, below.height + 1);
        mine.paths += below.paths;
        if (mine.paths > kMaxPaths) {
          return absl::InvalidArgumentError(absl::StrCat(
              "shared values reached by more than ", kMaxPaths,
              " paths (one value referenced over and over, at every level)"));
        }
      }
      mine.open = false;
      path.pop_back();
    }
  }
  return absl::OkStatus();
}

// Empties the containers in `all` and every container they reach, so that
// freeing them recurses no deeper than one level and cycles are broken. The
// list holds a reference to each value until all are emptied.
void Dismantle(std::vector<PickleRef> all) {
  std::unordered_set<const PickleValue*> seen;
  for (size_t i = 0; i < all.size(); ++i) {
    PickleValue& v = *all[i];
    for (PickleRef& child : v.items) {
      if (child != nullptr && seen.insert(child.get()).second) {
        all.push_back(child);
      }
    }
    for (auto& [key, value] : v.entries) {
      for (PickleRef* child : {&key, &value}) {
        if (*child != nullptr && seen.insert(child->get()).second) {
          all.push_back(*child);
        }
      }
    }
  }
  for (PickleRef& v : all) {
    v->items.clear();
    v->entries.clear();
  }
}

class Reader {
 public:
  explicit Reader(absl::string_view bytes) : in_(bytes) {}

  // The pickle's value, within the bounds above. Everything the pickle
  // built is checked, not only what the result reaches: a cycle dropped from
  // the stack and the memo would leak, and a deep chain would still be freed
  // recursively. On any error, all of it is dismantled before it is freed.
  absl::StatusOr<PickleRef> Run() {
    absl::StatusOr<PickleRef> result = Parse();
    if (result.ok()) {
      std::vector<const PickleValue*> roots;
      for (const PickleRef& v : pushed_) roots.push_back(v.get());
      if (absl::Status bounded = CheckBounds(roots); !bounded.ok()) {
        result = absl::InvalidArgumentError(
            absl::StrCat("the pickle's values: ", bounded.message()));
      }
    }
    if (!result.ok()) {
      stack_.clear();
      memo_.clear();
      storages_.clear();
      Dismantle(std::move(pushed_));
    }
    return result;
  }

 private:
  absl::StatusOr<PickleRef> Parse() {
    while (true) {
      if (at_ >= in_.size()) return Error("the pickle ends before STOP");
      const size_t op_at = at_;
      const uint8_t op = static_cast<uint8_t>(in_[at_++]);
      absl::Status s = Step(op);
      if (stopped_) {
        if (stack_.size() != 1 || !marks_.empty())
          return Error("STOP leaves a malformed stack");
        return stack_.back();
      }
      if (!s.ok()) {
        return absl::Status(
            s.code(), absl::StrFormat("pickle byte %d (opcode 0x%02x): %s",
                                      op_at, op, s.message()));
      }
    }
  }

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(what);
  }

  absl::StatusOr<absl::string_view> Take(uint64_t n) {
    if (n > in_.size() - at_) {
      return Error(
          absl::StrCat("wants ", n, " bytes; ", in_.size() - at_, " are left"));
    }
    absl::string_view out = in_.substr(at_, n);
    at_ += n;
    return out;
  }
  absl::StatusOr<uint64_t> Unsigned(int n) {
    ASSIGN_OR_RETURN(absl::string_view b, Take(n));
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = v << 8 | static_cast<uint8_t>(b[i]);
    return v;
  }
  absl::StatusOr<std::string> Line() {
    const size_t end = in_.find('\n', at_);
    if (end == absl::string_view::npos) return Error("a line without its end");
    std::string line(in_.substr(at_, end - at_));
    at_ = end + 1;
    return line;
  }

  absl::StatusOr<PickleRef> Pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back()))
      return Error("pops an empty stack");
    PickleRef v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  absl::StatusOr<PickleRef> Top() {
    if (stack_.empty()) return Error("reads an empty stack");
    return stack_.back();
  }
  // The items above the last mark, which is removed.
  absl::StatusOr<std::vector<PickleRef>> PopMark() {
    if (marks_.empty()) return Error("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PickleRef> items(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return items;
  }
  // Every value reaches the stack before anything can hold it, so pushed_
  // holds everything the pickle built, whatever it later drops.
  void Push(PickleRef v) {
    pushed_.push_back(v);
    stack_.push_back(std::move(v));
  }

  absl::Status Append(PickleValue& list, std::vector<PickleRef> items) {
    if (list.kind != Kind::kList)
      return Error(
          absl::StrCat("appends to a ", PickleValue::KindName(list.kind)));
    for (PickleRef& i : items) list.items.push_back(std::move(i));
    return absl::OkStatus();
  }
  absl::Status SetItems(PickleValue& dict, std::vector<PickleRef> kv) {
    if (dict.kind != Kind::kDict)
      return Error(
          absl::StrCat("sets items of a ", PickleValue::KindName(dict.kind)));
    if (kv.size() % 2 != 0) return Error("an odd number of keys and values");
    for (size_t i = 0; i < kv.size(); i += 2)
      dict.entries.emplace_back(std::move(kv[i]), std::move(kv[i + 1]));
    return absl::OkStatus();
  }

  absl::Status Memo(uint64_t key) {
    ASSIGN_OR_RETURN(PickleRef top, Top());
    memo_[key] = std::move(top);
    return absl::OkStatus();
  }
  absl::Status Get(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return Error(absl::StrCat("memo ", key, " unset"));
    Push(it->second);
    return absl::OkStatus();
  }

  static absl::StatusOr<std::vector<int64_t>> Ints(const PickleValue& v,
                                                   absl::string_view what) {
    if (v.kind != Kind::kTuple && v.kind != Kind::kList)
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is a ", PickleValue::KindName(v.kind)));
    std::vector<int64_t> out;
    for (const PickleRef& i : v.items) {
      if (i->kind != Kind::kInt)
        return absl::InvalidArgumentError(
            absl::StrCat(what, " holds a ", PickleValue::KindName(i->kind)));
      out.push_back(i->integer);
    }
    return out;
  }

  // The persistent id torch writes for a storage: ("storage", type, key,
  // location, numel).
  absl::StatusOr<PickleRef> PersistentLoad(const PickleValue& pid) {
    if (pid.kind != Kind::kTuple || pid.items.size() != 5 ||
        pid.items[0]->kind != Kind::kString ||
        pid.items[0]->text != "storage" ||
        pid.items[1]->kind != Kind::kGlobal ||
        pid.items[2]->kind != Kind::kString ||
        pid.items[3]->kind != Kind::kString ||
        pid.items[4]->kind != Kind::kInt) {
      return Error(
          "a persistent id that is not (\"storage\", type, key, location, "
          "numel)");
    }
    const std::string& type = pid.items[1]->text;
    if (type.rfind("torch.", 0) != 0)
      return Error(absl::StrCat("a storage of type ", type));
    ASSIGN_OR_RETURN(DType dtype, DTypeOfTorchStorage(type.substr(6)));
    const std::string& key = pid.items[2]->text;
    if (auto it = storages_.find(key); it != storages_.end()) {
      if (it->second->tensor.dtype != dtype)
        return Error(absl::StrCat("storage ", key, " has two dtypes"));
      return it->second;
    }
    if (pid.items[4]->integer < 0) return Error("a storage of negative size");
    auto storage = PickleValue::Make(Kind::kStorage);
    storage->tensor.storage_key = key;
    storage->tensor.dtype = dtype;
    storage->tensor.location = pid.items[3]->text;
    storage->tensor.storage_elements = pid.items[4]->integer;
    storages_[key] = storage;
    return storage;
  }

  absl::StatusOr<PickleRef> Reduce(const PickleValue& f,
                                   const PickleValue& args) {
    if (f.kind != Kind::kGlobal)
      return Error(absl::StrCat("calls a ", PickleValue::KindName(f.kind)));
    if (args.kind != Kind::kTuple)
      return Error(absl::StrCat("calls ", f.text, " with a ",
                                PickleValue::KindName(args.kind)));
    const std::vector<PickleRef>& a = args.items;
    const std::string& name = f.text;
    if (name == "collections.OrderedDict") {
      auto dict = PickleValue::Make(Kind::kDict);
      dict->ordered_dict = true;
      if (a.size() == 1 && a[0]->kind == Kind::kList) {
        for (const PickleRef& pair : a[0]->items) {
          if ((pair->kind != Kind::kTuple && pair->kind != Kind::kList) ||
              pair->items.size() != 2)
            return Error("OrderedDict of something other than pairs");
          dict->entries.emplace_back(pair->items[0], pair->items[1]);
        }
      } else if (!a.empty()) {
        return Error("OrderedDict with arguments");
      }
      return dict;
    }
    if (name == "torch._utils._rebuild_tensor_v2") {
      if (a.size() < 6 || a.size() > 7 || a[0]->kind != Kind::kStorage ||
          a[1]->kind != Kind::kInt || a[4]->kind != Kind::kBool)
        return Error("_rebuild_tensor_v2 with other arguments than torch's");
      auto t = PickleValue::Make(Kind::kTensor);
      t->tensor = a[0]->tensor;
      t->tensor.offset = a[1]->integer;
      ASSIGN_OR_RETURN(t->tensor.shape, Ints(*a[2], "a tensor's size"));
      ASSIGN_OR_RETURN(t->tensor.stride, Ints(*a[3], "a tensor's stride"));
      t->tensor.requires_grad = a[4]->boolean;
      const PickleTensor& v = t->tensor;
      if (v.shape.size() != v.stride.size())
        return Error("a tensor's size and stride differ in length");
      // The view must lie inside its storage.
      int64_t last = v.offset;
      if (v.offset < 0) return Error("a tensor at a negative offset");
      bool empty = false;
      for (size_t d = 0; d < v.shape.size(); ++d) {
        if (v.shape[d] < 0 || v.stride[d] < 0)
          return Error("a tensor of negative size or stride");
        if (v.shape[d] == 0) empty = true;
        if (v.shape[d] > 0) last += (v.shape[d] - 1) * v.stride[d];
      }
      if (!empty && last >= v.storage_elements) {
        return absl::DataLossError(
            absl::StrCat("a tensor of shape [", absl::StrJoin(v.shape, ","),
                         "] reaches element ", last, " of storage ",
                         v.storage_key, ", which holds ", v.storage_elements));
      }
      return t;
    }
    if (name == "torch._utils._rebuild_parameter") {
      if (a.size() != 3 || a[0]->kind != Kind::kTensor ||
          a[1]->kind != Kind::kBool)
        return Error("_rebuild_parameter with other arguments than torch's");
      auto t = PickleValue::Make(Kind::kTensor);
      t->tensor = a[0]->tensor;
      t->tensor.parameter = true;
      t->tensor.requires_grad = a[1]->boolean;
      return t;
    }
    if (name.ends_with("multiarray._reconstruct")) {
      if (a.size() != 3 || a[0]->kind != Kind::kGlobal ||
          a[0]->text != "numpy.ndarray")
        return Error("numpy _reconstruct of something other than ndarray");
      return PickleValue::Make(Kind::kArray);
    }
    if (name.ends_with("numeric._frombuffer")) {
      // Protocol 5's form of an array: (bytes, dtype, shape, order).
      if (a.size() != 4 || a[0]->kind != Kind::kBytes ||
          a[1]->kind != Kind::kNumpyDType || a[3]->kind != Kind::kString)
        return Error("numpy _frombuffer of other arguments than numpy's");
      auto array = PickleValue::Make(Kind::kArray);
      ASSIGN_OR_RETURN(array->array.shape, Ints(*a[2], "an array's shape"));
      if (a[3]->text != "C" && array->array.shape.size() > 1)
        return Error("a Fortran-ordered numpy array");
      array->array.descr = a[1]->text;
      array->array.data = a[0]->text;
      return array;
    }
    if (name == "numpy.dtype") {
      if (a.empty() || a[0]->kind != Kind::kString)
        return Error("numpy.dtype without a type string");
      auto d = PickleValue::Make(Kind::kNumpyDType);
      d->text = a[0]->text;
      return d;
    }
    if (name.ends_with("multiarray.scalar")) {
      if (a.size() != 2 || a[0]->kind != Kind::kNumpyDType ||
          a[1]->kind != Kind::kBytes)
        return Error("numpy scalar of other arguments than a dtype and bytes");
      auto s = PickleValue::Make(Kind::kArray);
      s->array.descr = a[0]->text;
      s->array.data = a[1]->text;
      return s;
    }
    if (name == "_codecs.encode") {
      if (a.size() != 2 || a[0]->kind != Kind::kString ||
          a[1]->kind != Kind::kString || a[1]->text != "latin1")
        return Error("_codecs.encode of other than (text, \"latin1\")");
      ASSIGN_OR_RETURN(std::string bytes, Latin1(a[0]->text));
      auto b = PickleValue::Make(Kind::kBytes);
      b->text = std::move(bytes);
      return b;
    }
    return Error(absl::StrCat("calls ", name, ", which builds no value here"));
  }

  // The bytes of text whose code points are all below 256 (how protocol 2
  // carries bytes: UTF-8 of their latin-1 reading).
  absl::StatusOr<std::string> Latin1(const std::string& utf8) {
    std::string out;
    for (size_t i = 0; i < utf8.size(); ++i) {
      const auto c = static_cast<uint8_t>(utf8[i]);
      if (c < 0x80) {
        out.push_back(static_cast<char>(c));
      } else if ((c & 0xe0) == 0xc0 && i + 1 < utf8.size() && c <= 0xc3) {
        out.push_back(static_cast<char>(
            ((c & 0x1f) << 6) | (static_cast<uint8_t>(utf8[++i]) & 0x3f)));
      } else {
        return Error("latin-1 bytes with a code point above 255");
      }
    }
    return out;
  }

  absl::Status Build(PickleValue& obj, const PickleValue& state) {
    if (obj.kind == Kind::kNamespace) {
      if (state.kind != Kind::kDict) return Error("a Namespace's state");
      for (const auto& [k, v] : state.entries) obj.entries.emplace_back(k, v);
      return absl::OkStatus();
    }
    if (obj.kind == Kind::kNumpyDType) {
      // (version, byte order, ...): the order joins the type string.
      if (state.kind != Kind::kTuple || state.items.size() < 2 ||
          state.items[1]->kind != Kind::kString)
        return Error("a numpy dtype's state");
      const std::string& order = state.items[1]->text;
      if ((order == "<" || order == ">") && !obj.text.empty() &&
          std::strchr("<>|=", obj.text[0]) == nullptr) {
        obj.text = order + obj.text;
      }
      return absl::OkStatus();
    }
    if (obj.kind == Kind::kArray) {
      // (version, shape, dtype, is_fortran, bytes).
      if (state.kind != Kind::kTuple || state.items.size() != 5 ||
          state.items[2]->kind != Kind::kNumpyDType ||
          state.items[3]->kind != Kind::kBool)
        return Error("a numpy array's state");
      if (state.items[4]->kind != Kind::kBytes)
        return Error("a numpy array of Python objects");
      ASSIGN_OR_RETURN(obj.array.shape,
                       Ints(*state.items[1], "an array's shape"));
      if (state.items[3]->boolean && obj.array.shape.size() > 1)
        return Error("a Fortran-ordered numpy array");
      obj.array.descr = state.items[2]->text;
      obj.array.data = state.items[4]->text;
      return absl::OkStatus();
    }
    return Error(
        absl::StrCat("sets the state of a ", PickleValue::KindName(obj.kind)));
  }

  absl::Status Step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        ASSIGN_OR_RETURN(uint64_t v, Unsigned(1));
        if (v < 2 || v > 5)
          return Error(absl::StrCat("protocol ", v, " (2 to 5 are read)"));
        return absl::OkStatus();
      }
      case 0x95:  // FRAME: the whole pickle is in memory already
        return Unsigned(8).status();
      case '.':  // STOP
        stopped_ = true;
        return absl::OkStatus();
      case '(':  // MARK
        marks_.push_back(stack_.size());
        return absl::OkStatus();
      case '0':  // POP
        if (!marks_.empty() && marks_.back() == stack_.size()) {
          marks_.pop_back();
          return absl::OkStatus();
        }
        return Pop().status();
      case '1':  // POP_MARK
        return PopMark().status();
      case '2': {  // DUP
        ASSIGN_OR_RETURN(PickleRef top, Top());
        Push(top);
        return absl::OkStatus();
      }
      case 'N':
        Push(PickleValue::None());
        return absl::OkStatus();
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        auto b = PickleValue::Make(Kind::kBool);
        b->boolean = op == 0x88;
        Push(b);
        return absl::OkStatus();
      }
      case 'K': {  // BININT1
        ASSIGN_OR_RETURN(uint64_t v, Unsigned(1));
        Push(PickleValue::Int(static_cast<int64_t>(v)));
        return absl::OkStatus();
      }
      case 'M': {  // BININT2
        ASSIGN_OR_RETURN(uint64_t v, Unsigned(2));
        Push(PickleValue::Int(static_cast<int64_t>(v)));
        return absl::OkStatus();
      }
      case 'J': {  // BININT
        ASSIGN_OR_RETURN(uint64_t v, Unsigned(4));
        Push(PickleValue::Int(static_cast<int32_t>(static_cast<uint32_t>(v))));
        return absl::OkStatus();
      }
      case 0x8a:
      case 0x8b: {  // LONG1, LONG4
        ASSIGN_OR_RETURN(uint64_t n, Unsigned(op == 0x8a ? 1 : 4));
        if (n > 8) return Error("an integer wider than 64 bits");
        ASSIGN_OR_RETURN(absl::string_view b, Take(n));
        uint64_t v = 0;
        for (int i = static_cast<int>(n) - 1; i >= 0; --i)
          v = v << 8 | static_cast<uint8_t>(b[i]);
        if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80))
          v |= ~uint64_t{0} << (8 * n);  // sign-extend
        Push(PickleValue::Int(static_cast<int64_t>(v)));
        return absl::OkStatus();
      }
      case 'I': {  // INT (text): also True and False of protocol 0
        ASSIGN_OR_RETURN(std::string line, Line());
        if (line == "01" || line == "00") {
          auto b = PickleValue::Make(Kind::kBool);
          b->boolean = line == "01";
          Push(b);
          return absl::OkStatus();
        }
        int64_t v = 0;
        if (!absl::SimpleAtoi(line, &v)) return Error("a malformed INT");
        Push(PickleValue::Int(v));
        return absl::OkStatus();
      }
      case 'G': {  // BINFLOAT, big-endian
        ASSIGN_OR_RETURN(absl::string_view b, Take(8));
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i)
          bits = bits << 8 | static_cast<uint8_t>(b[i]);
        double d;
        std::memcpy(&d, &bits, 8);
        Push(PickleValue::Float(d));
        return absl::OkStatus();
      }
      case 'X':
      case 0x8c:
      case 0x8d: {  // BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
        ASSIGN_OR_RETURN(uint64_t n, Unsigned(op == 'X'    ? 4
                                              : op == 0x8c ? 1
                                                           : 8));
        ASSIGN_OR_RETURN(absl::string_view s, Take(n));
        Push(PickleValue::String(std::string(s)));
        return absl::OkStatus();
      }
      case 'B':
      case 'C':
      case 0x8e:
      case 0x96: {  // BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
        const int width = op == 'B' ? 4 : op == 'C' ? 1 : 8;
        ASSIGN_OR_RETURN(uint64_t n, Unsigned(width));
        ASSIGN_OR_RETURN(absl::string_view s, Take(n));
        auto b = PickleValue::Make(Kind::kBytes);
        b->text = std::string(s);
        Push(b);
        return absl::OkStatus();
      }
      case ']':
        Push(PickleValue::Make(Kind::kList));
        return absl::OkStatus();
      case '}':
        Push(PickleValue::Make(Kind::kDict));
        return absl::OkStatus();
      case ')':
        Push(PickleValue::Make(Kind::kTuple));
        return absl::OkStatus();
      case 'l':
      case 't': {  // LIST, TUPLE
        ASSIGN_OR_RETURN(std::vector<PickleRef> items, PopMark());
        auto v = PickleValue::Make(op == 'l' ? Kind::kList : Kind::kTuple);
        v->items = std::move(items);
        Push(v);
        return absl::OkStatus();
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const size_t n = op - 0x84;
        auto v = PickleValue::Make(Kind::kTuple);
        v->items.resize(n);
        for (size_t i = n; i-- > 0;) {
          ASSIGN_OR_RETURN(v->items[i], Pop());
        }
        Push(v);
        return absl::OkStatus();
      }
      case 'd': {  // DICT
        ASSIGN_OR_RETURN(std::vector<PickleRef> kv, PopMark());
        auto d = PickleValue::Make(Kind::kDict);
        RETURN_IF_ERROR(SetItems(*d, std::move(kv)));
        Push(d);
        return absl::OkStatus();
      }
      case 'a': {  // APPEND
        ASSIGN_OR_RETURN(PickleRef v, Pop());
        ASSIGN_OR_RETURN(PickleRef list, Top());
        return Append(*list, {v});
      }
      case 'e': {  // APPENDS
        ASSIGN_OR_RETURN(std::vector<PickleRef> items, PopMark());
        ASSIGN_OR_RETURN(PickleRef list, Top());
        return Append(*list, std::move(items));
      }
      case 's': {  // SETITEM
        ASSIGN_OR_RETURN(PickleRef v, Pop());
        ASSIGN_OR_RETURN(PickleRef k, Pop());
        ASSIGN_OR_RETURN(PickleRef dict, Top());
        return SetItems(*dict, {k, v});
      }
      case 'u': {  // SETITEMS
        ASSIGN_OR_RETURN(std::vector<PickleRef> kv, PopMark());
        ASSIGN_OR_RETURN(PickleRef dict, Top());
        return SetItems(*dict, std::move(kv));
      }
      case 'c': {  // GLOBAL
        ASSIGN_OR_RETURN(std::string module, Line());
        ASSIGN_OR_RETURN(std::string name, Line());
        ASSIGN_OR_RETURN(PickleRef g, ResolveGlobal(module, name));
        Push(g);
        return absl::OkStatus();
      }
      case 0x93: {  // STACK_GLOBAL
        ASSIGN_OR_RETURN(PickleRef name, Pop());
        ASSIGN_OR_RETURN(PickleRef module, Pop());
        if (module->kind != Kind::kString || name->kind != Kind::kString)
          return Error("STACK_GLOBAL of other than strings");
        ASSIGN_OR_RETURN(PickleRef g, ResolveGlobal(module->text, name->text));
        Push(g);
        return absl::OkStatus();
      }
      case 'R': {  // REDUCE
        ASSIGN_OR_RETURN(PickleRef args, Pop());
        ASSIGN_OR_RETURN(PickleRef f, Pop());
        ASSIGN_OR_RETURN(PickleRef v, Reduce(*f, *args));
        Push(v);
        return absl::OkStatus();
      }
      case 0x81:
      case 0x92: {                                        // NEWOBJ, NEWOBJ_EX
        if (op == 0x92) RETURN_IF_ERROR(Pop().status());  // kwargs
        ASSIGN_OR_RETURN(PickleRef args, Pop());
        ASSIGN_OR_RETURN(PickleRef cls, Pop());
        if (cls->kind != Kind::kGlobal || cls->text != "argparse.Namespace")
          return Error("makes an object other than argparse.Namespace");
        Push(PickleValue::Make(Kind::kNamespace));
        return absl::OkStatus();
      }
      case 'b': {  // BUILD
        ASSIGN_OR_RETURN(PickleRef state, Pop());
        ASSIGN_OR_RETURN(PickleRef obj, Top());
        return Build(*obj, *state);
      }
      case 'Q': {  // BINPERSID
        ASSIGN_OR_RETURN(PickleRef pid, Pop());
        ASSIGN_OR_RETURN(PickleRef storage, PersistentLoad(*pid));
        Push(storage);
        return absl::OkStatus();
      }
      case 'q': {  // BINPUT
        ASSIGN_OR_RETURN(uint64_t k, Unsigned(1));
        return Memo(k);
      }
      case 'r': {  // LONG_BINPUT
        ASSIGN_OR_RETURN(uint64_t k, Unsigned(4));
        return Memo(k);
      }
      case 0x94:  // MEMOIZE
        return Memo(memo_.size());
      case 'p': {  // PUT
        ASSIGN_OR_RETURN(std::string line, Line());
        uint64_t k = 0;
        if (!absl::SimpleAtoi(line, &k)) return Error("a malformed PUT");
        return Memo(k);
      }
      case 'h': {  // BINGET
        ASSIGN_OR_RETURN(uint64_t k, Unsigned(1));
        return Get(k);
      }
      case 'j': {  // LONG_BINGET
        ASSIGN_OR_RETURN(uint64_t k, Unsigned(4));
        return Get(k);
      }
      case 'g': {  // GET
        ASSIGN_OR_RETURN(std::string line, Line());
        uint64_t k = 0;
        if (!absl::SimpleAtoi(line, &k)) return Error("a malformed GET");
        return Get(k);
      }
      default:
        return Error(
            "an opcode this reader does not accept (it builds only "
            "plain data)");
    }
  }

  absl::string_view in_;
  size_t at_ = 0;
  bool stopped_ = false;
  std::vector<PickleRef> stack_;
  std::vector<PickleRef> pushed_;  // with repeats, one per push
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PickleRef> memo_;
  std::map<std::string, PickleRef> storages_;
};

class Writer {
 public:
  absl::StatusOr<std::string> Run(const PickleValue& v) {
    out_ += "\x80\x03";
    RETURN_IF_ERROR(Write(v, 0));
    out_ += '.';
    return std::move(out_);
  }

 private:
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_ += static_cast<char>(v >> (8 * i));
  }
  void Str(absl::string_view s) {
    out_ += 'X';
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  void Global(absl::string_view module, absl::string_view name) {
    absl::StrAppend(&out_, "c", module, "\n", name, "\n");
  }
  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v >= 0 && v < 65536) {
      out_ += 'M';
      out_ += static_cast<char>(v);
      out_ += static_cast<char>(v >> 8);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      U32(static_cast<uint32_t>(v));
    } else {
      out_ += "\x8a\x08";
      for (int i = 0; i < 8; ++i) out_ += static_cast<char>(v >> (8 * i));
    }
  }
  void Ints(const Shape& v) {
    out_ += '(';
    for (int64_t i : v) Int(i);
    out_ += 't';
  }
  void EmptyOrderedDict() {
    Global("collections", "OrderedDict");
    out_ += ")R";
  }

  absl::Status Items(const std::vector<std::pair<PickleRef, PickleRef>>& e,
                     int depth) {
    for (size_t i = 0; i < e.size(); i += 1000) {
      out_ += '(';
      for (size_t j = i; j < std::min(e.size(), i + 1000); ++j) {
        RETURN_IF_ERROR(Write(*e[j].first, depth + 1));
        RETURN_IF_ERROR(Write(*e[j].second, depth + 1));
      }
      out_ += 'u';
    }
    return absl::OkStatus();
  }

  absl::Status Storage(const PickleTensor& t) {
    ASSIGN_OR_RETURN(std::string type, TorchStorageName(t.dtype));
    out_ += '(';
    Str("storage");
    Global("torch", type);
    Str(t.storage_key);
    Str(t.location);
    Int(t.storage_elements);
    out_ += "tQ";
    return absl::OkStatus();
  }

  absl::Status Write(const PickleValue& v, int depth) {
    if (depth > 1000) {
      return absl::InvalidArgumentError(
          "a value nested deeper than 1000 (a cycle?)");
    }
    switch (v.kind) {
      case Kind::kNone:
        out_ += 'N';
        return absl::OkStatus();
      case Kind::kBool:
        out_ += v.boolean ? "\x88" : "\x89";
        return absl::OkStatus();
      case Kind::kInt:
        Int(v.integer);
        return absl::OkStatus();
      case Kind::kFloat: {
        uint64_t bits;
        std::memcpy(&bits, &v.number, 8);
        out_ += 'G';
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>(bits >> (8 * i));
        return absl::OkStatus();
      }
      case Kind::kString:
        Str(v.text);
        return absl::OkStatus();
      case Kind::kBytes:
        out_ += 'B';
        U32(static_cast<uint32_t>(v.text.size()));
        out_ += v.text;
        return absl::OkStatus();
      case Kind::kList:
        out_ += "](";
        for (const PickleRef& i : v.items)
          RETURN_IF_ERROR(Write(*i, depth + 1));
        out_ += 'e';
        return absl::OkStatus();
      case Kind::kTuple:
        out_ += '(';
        for (const PickleRef& i : v.items)
          RETURN_IF_ERROR(Write(*i, depth + 1));
        out_ += 't';
        return absl::OkStatus();
      case Kind::kDict:
        if (v.ordered_dict) {
          EmptyOrderedDict();
        } else {
          out_ += '}';
        }
        return Items(v.entries, depth);
      case Kind::kNamespace:
        Global("argparse", "Namespace");
        out_ += ")\x81}";
        RETURN_IF_ERROR(Items(v.entries, depth));
        out_ += 'b';
        return absl::OkStatus();
      case Kind::kTorchDType:
        Global("torch", v.text);
        return absl::OkStatus();
      case Kind::kNumpyDType: {
        // numpy.dtype("u4", False, True) with its byte order as state.
        std::string descr = v.text, order = "|";
        if (!descr.empty() && std::strchr("<>|=", descr[0]) != nullptr) {
          order = descr.substr(0, 1);
          descr = descr.substr(1);
        }
        Global("numpy", "dtype");
        Str(descr);
        out_ += "\x89\x88\x87R(";
        Int(3);
        Str(order);
        out_ += "NNN";
        Int(-1);
        Int(-1);
        Int(0);
        out_ += "tb";
        return absl::OkStatus();
      }
      case Kind::kArray: {
        PickleValue dtype;
        dtype.kind = Kind::kNumpyDType;
        dtype.text = v.array.descr;
        if (v.array.shape.empty() && !v.array.data.empty()) {
          Global("numpy.core.multiarray", "scalar");
          RETURN_IF_ERROR(Write(dtype, depth + 1));
          out_ += 'B';
          U32(static_cast<uint32_t>(v.array.data.size()));
          out_ += v.array.data;
          out_ += "\x86R";
          return absl::OkStatus();
        }
        Global("numpy.core.multiarray", "_reconstruct");
        Global("numpy", "ndarray");
        Int(0);
        out_ += "\x85";
        out_ +=
            "C\x01"
            "b";
        out_ += "\x87R(";
        Int(1);
        Ints(v.array.shape);
        RETURN_IF_ERROR(Write(dtype, depth + 1));
        out_ += "\x89";
        out_ += 'B';
        U32(static_cast<uint32_t>(v.array.data.size()));
        out_ += v.array.data;
        out_ += "tb";
        return absl::OkStatus();
      }
      case Kind::kStorage:
        return Storage(v.tensor);
      case Kind::kTensor: {
        const PickleTensor& t = v.tensor;
        if (t.parameter) Global("torch._utils", "_rebuild_parameter");
        if (t.parameter) out_ += '(';
        Global("torch._utils", "_rebuild_tensor_v2");
        out_ += '(';
        RETURN_IF_ERROR(Storage(t));
        Int(t.offset);
        Ints(t.shape);
        Ints(t.stride);
        out_ += t.requires_grad && !t.parameter ? "\x88" : "\x89";
        EmptyOrderedDict();
        out_ += "tR";
        if (t.parameter) {
          out_ += t.requires_grad ? "\x88" : "\x89";
          EmptyOrderedDict();
          out_ += "tR";
        }
        return absl::OkStatus();
      }
      case Kind::kGlobal: {
        const size_t dot = v.text.rfind('.');
        Global(v.text.substr(0, dot), v.text.substr(dot + 1));
        return absl::OkStatus();
      }
    }
    return absl::InternalError("an unknown kind of value");
  }

  std::string out_;
};

}  // namespace

int64_t PickleTensor::elements() const {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

bool PickleTensor::contiguous() const {
  int64_t expect = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && stride[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

PickleRef PickleValue::Make(Kind kind) {
  auto v = std::make_shared<PickleValue>();
  v->kind = kind;
  return v;
}
PickleRef PickleValue::None() { return Make(Kind::kNone); }
PickleRef PickleValue::Int(int64_t i) {
  auto v = Make(Kind::kInt);
  v->integer = i;
  return v;
}
PickleRef PickleValue::Float(double f) {
  auto v = Make(Kind::kFloat);
  v->number = f;
  return v;
}
PickleRef PickleValue::String(std::string s) {
  auto v = Make(Kind::kString);
  v->text = std::move(s);
  return v;
}

const PickleValue* PickleValue::Find(absl::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::kString && k->text == key) return v.get();
  }
  return nullptr;
}
PickleValue* PickleValue::Find(absl::string_view key) {
  return const_cast<PickleValue*>(std::as_const(*this).Find(key));
}

void PickleValue::Set(absl::string_view key, PickleRef value) {
  for (auto& [k, v] : entries) {
    if (k->kind == Kind::kString && k->text == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(String(std::string(key)), std::move(value));
}

bool PickleValue::Erase(absl::string_view key) {
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    if (it->first->kind == Kind::kString && it->first->text == key) {
      entries.erase(it);
      return true;
    }
  }
  return false;
}

absl::string_view PickleValue::KindName(Kind kind) {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "argparse.Namespace";
    case Kind::kTorchDType:
      return "torch.dtype";
    case Kind::kNumpyDType:
      return "numpy.dtype";
    case Kind::kTensor:
      return "tensor";
    case Kind::kStorage:
      return "storage";
    case Kind::kArray:
      return "numpy.ndarray";
    case Kind::kGlobal:
      return "global";
  }
  return "value";
}

namespace {

absl::Status VisitTensors(PickleValue& v, int depth,
                          const std::function<void(PickleValue&)>& fn) {
  if (depth > 200) {
    return absl::InvalidArgumentError(
        "values nested deeper than 200 (a cycle?)");
  }
  if (v.kind == Kind::kTensor || v.kind == Kind::kStorage) {
    fn(v);
    return absl::OkStatus();
  }
  for (const PickleRef& i : v.items)
    RETURN_IF_ERROR(VisitTensors(*i, depth + 1, fn));
  for (const auto& [k, i] : v.entries) {
    RETURN_IF_ERROR(VisitTensors(*k, depth + 1, fn));
    RETURN_IF_ERROR(VisitTensors(*i, depth + 1, fn));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ForEachTensor(PickleValue& value,
                           const std::function<void(PickleValue&)>& fn) {
  return VisitTensors(value, 0, fn);
}

absl::StatusOr<PickleRef> Unpickle(absl::string_view bytes) {
  return Reader(bytes).Run();
}

absl::StatusOr<std::string> Pickle(const PickleValue& value) {
  return Writer().Run(value);
}

absl::StatusOr<std::string> TorchStorageName(DType dtype) {
  for (const TorchType& t : kTorchTypes) {
    if (t.dtype == dtype) return std::string(t.storage);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("torch has no storage for ", DTypeName(dtype)));
}

absl::StatusOr<DType> DTypeOfTorchStorage(absl::string_view name) {
  for (const TorchType& t : kTorchTypes) {
    if (name == t.storage) return t.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "a storage of type torch.", name, ", which has no safetensors dtype"));
}

}  // namespace scalai
