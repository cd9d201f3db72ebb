// The restricted pickle reader and the writer: what the writer writes reads
// back the same (ints of every width, floats, text, bytes, containers,
// Namespace, OrderedDict, tensors, dtypes, numpy arrays); hostile or broken
// pickles are refused with the byte offset and the reason, never run.
#include "ptc/pickle.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace scalai {
namespace {

using Kind = PickleValue::Kind;
using ::testing::HasSubstr;

PickleRef Tensor(std::string key, DType dtype, Shape shape, int64_t offset,
                 int64_t storage_elements) {
  auto t = PickleValue::Make(Kind::kTensor);
  t->tensor.storage_key = std::move(key);
  t->tensor.dtype = dtype;
  t->tensor.stride = RowMajorStrides(shape);
  t->tensor.shape = std::move(shape);
  t->tensor.offset = offset;
  t->tensor.storage_elements = storage_elements;
  return t;
}

TEST(Pickle, WhatItWritesReadsBackTheSame) {
  auto root = PickleValue::Make(Kind::kDict);
  for (int64_t v : {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535},
                    int64_t{65536}, int64_t{-1}, int64_t{-2147483648LL},
                    int64_t{1} << 40, -(int64_t{1} << 62)}) {
    root->entries.emplace_back(PickleValue::Int(v),
                               PickleValue::Float(v / 3.0));
  }
  auto args = PickleValue::Make(Kind::kNamespace);
  args->Set("tensor_model_parallel_size", PickleValue::Int(4));
  auto dtype = PickleValue::Make(Kind::kTorchDType);
  dtype->text = "bfloat16";
  args->Set("params_dtype", dtype);
  args->Set("name", PickleValue::String("gpt \xc3\xa9"));
  root->Set("args", args);
  auto model = PickleValue::Make(Kind::kDict);
  model->ordered_dict = true;
  model->Set("a.weight", Tensor("0", DType::kBF16, {4, 3}, 0, 12));
  model->Set("b", Tensor("1", DType::kF32, {3}, 2, 6));
  root->Set("model", model);
  auto list = PickleValue::Make(Kind::kList);
  auto tuple = PickleValue::Make(Kind::kTuple);
  tuple->items = {PickleValue::None(), PickleValue::String("x")};
  auto bytes = PickleValue::Make(Kind::kBytes);
  bytes->text = std::string("\0\xff\x80", 3);
  auto array = PickleValue::Make(Kind::kArray);
  array->array.descr = "<u4";
  array->array.shape = {2};
  array->array.data = std::string(8, '\x07');
  list->items = {tuple, bytes, array};
  root->Set("rng", list);

  auto once = Pickle(*root);
  ASSERT_TRUE(once.ok()) << once.status();
  auto read = Unpickle(*once);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)->Find("model")->Find("b")->tensor.offset, 2);
  EXPECT_TRUE((*read)->Find("model")->ordered_dict);
  EXPECT_EQ((*read)->Find("args")->Find("params_dtype")->text, "bfloat16");
  EXPECT_EQ((*read)->Find("rng")->items[2]->array.data, std::string(8, '\x07'));
  EXPECT_EQ((*read)->entries[8].first->integer, -(int64_t{1} << 62));
  auto twice = Pickle(**read);
  ASSERT_TRUE(twice.ok());
  EXPECT_EQ(*twice, *once);
}

absl::Status Read(const std::string& bytes) { return Unpickle(bytes).status(); }

TEST(Pickle, RefusesWhatIsNotPlainData) {
  // os.system("true"): refused at the global, before any call.
  absl::Status s =
      Read(std::string("\x80\x02"
                       "cos\nsystem\nX\x04\0\0\0true\x85R.",
                       25));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("pickle byte 2 (opcode 0x63): the pickle "
                                     "names the global os.system"));
  // STACK_GLOBAL of builtins.eval.
  s =
      Read(std::string("\x80\x04\x8c\x08"
                       "builtins\x8c\x04"
                       "eval\x93.",
                       19));
  EXPECT_THAT(s.message(), HasSubstr("builtins.eval"));
  // INST and OBJ build objects of any class: not accepted at all.
  EXPECT_THAT(Read("(iposix\nsystem\n.").message(),
              HasSubstr("an opcode this reader does not accept"));
  EXPECT_THAT(Read("(o.").message(),
              HasSubstr("an opcode this reader does not accept"));
  // A call of something that is not a global.
  EXPECT_THAT(Read(std::string("\x80\x02N)R.", 6)).message(),
              HasSubstr("calls a None"));
}

TEST(Pickle, RefusesBrokenPickles) {
  EXPECT_THAT(Read(std::string("\x80\x02]", 3)).message(),
              HasSubstr("ends before STOP"));
  EXPECT_THAT(Read(std::string("\x80\x02h\x05.", 5)).message(),
              HasSubstr("memo 5 unset"));
  EXPECT_THAT(Read(std::string("\x80\x06N.", 4)).message(),
              HasSubstr("protocol 6"));
  EXPECT_THAT(Read(std::string("\x80\x02\x8a\x09"
                               "123456789.",
                               14))
                  .message(),
              HasSubstr("wider than 64 bits"));
  EXPECT_THAT(Read(std::string("\x80\x02X\xff\0\0\0ab.", 11)).message(),
              HasSubstr("wants 255 bytes"));
  EXPECT_THAT(Read(std::string("\x80\x02NN.", 5)).message(),
              HasSubstr("STOP leaves a malformed stack"));
}

// What a few bytes can build that no checkpoint holds, and that would crash
// or hang whoever walks or frees it: each is refused with its reason, and
// returns (freeing what was built without recursing once per level).
TEST(Pickle, RefusesValuesTooDeepCyclicOrSharedTooOften) {
  const int n = 100000;  // a list 100,000 deep: 200 KB
  std::string deep =
      "\x80\x02" + std::string(n, ']') + std::string(n - 1, 'a') + ".";
  EXPECT_THAT(Read(deep).message(), HasSubstr("nested deeper than 200"));
  // The same chain left in the memo while the pickle returns None.
  const std::string put0("q\0", 2), get0("h\0", 2);
  std::string hidden =
      "\x80\x02" + std::string(n, ']') + std::string(n - 1, 'a') + put0 + "0N.";
  EXPECT_THAT(Read(hidden).message(), HasSubstr("nested deeper than 200"));
  // A chain broken off by a bad opcode halfway: the error is the opcode's.
  std::string broken =
      "\x80\x02" + std::string(n, ']') + std::string(n / 2, 'a') + "\xff";
  EXPECT_THAT(Read(broken).message(), HasSubstr("opcode 0xff"));
  // 200 levels read; one more is refused.
  auto nested = [](int levels) {
    return "\x80\x02" + std::string(levels, ']') +
           std::string(levels - 1, 'a') + ".";
  };
  auto deepest = Unpickle(nested(200));
  ASSERT_TRUE(deepest.ok()) << deepest.status();
  // What the reader returns, every walk takes.
  EXPECT_TRUE(ForEachTensor(**deepest, [](PickleValue&) {}).ok());
  EXPECT_TRUE(Pickle(**deepest).ok());
  EXPECT_THAT(Read(nested(201)).message(), HasSubstr("nested deeper than 200"));
  // A list that holds itself: x = []; x.append(x).
  EXPECT_THAT(Read("\x80\x02]" + put0 + get0 + "a.").message(),
              HasSubstr("contains itself"));
  // d = {}; d[None] = d; then d is popped and its memo slot reused, so that
  // nothing the pickle returns reaches it (it leaked, found by libFuzzer).
  EXPECT_THAT(
      Read("\x80\x02}" + put0 + "N" + get0 + "s0N" + put0 + ".").message(),
      HasSubstr("contains itself"));
  // x = []; then 40 times x = [x, x]: 2^40 paths in 300 bytes.
  auto doubled = [&](int times) {
    std::string pickle = "\x80\x02]";
    for (int i = 0; i < times; ++i) pickle += put0 + "0](" + get0 + get0 + "e";
    return pickle + ".";
  };
  EXPECT_THAT(Read(doubled(40)).message(),
              HasSubstr("more than 16777216 paths"));
  // Twenty doublings are a million paths: read.
  EXPECT_TRUE(Unpickle(doubled(20)).ok()) << Read(doubled(20));
}

TEST(Pickle, RefusesATensorBeyondItsStorage) {
  auto t = Tensor("0", DType::kF32, {4, 3}, 1, 12);  // reaches element 12
  auto bytes = Pickle(*t);
  ASSERT_TRUE(bytes.ok());
  absl::Status s = Read(*bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(),
              HasSubstr("a tensor of shape [4,3] reaches element 12 of "
                        "storage 0, which holds 12"));
}

TEST(Pickle, WriterRefusesACycle) {
  auto list = PickleValue::Make(Kind::kList);
  list->items.push_back(list);
  EXPECT_THAT(std::string(Pickle(*list).status().message()),
              HasSubstr("nested deeper than 1000"));
  list->items.clear();  // lets the list go
}

}  // namespace
}  // namespace scalai
