#include "tests/fuzz/parser_targets.h"

#include <stdlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ptc/box.h"
#include "ptc/dtype.h"
#include "ptc/layout.h"
#include "ptc/megatron_index.h"
#include "ptc/model_spec.h"
#include "ptc/parallel_config.h"
#include "ptc/pickle.h"
#include "ptc/safetensors.h"
#include "transfer/cluster_file.h"

namespace scalai {
namespace {

FuzzResult Refused() { return {}; }
FuzzResult Fine() { return {.parsed = true, .broken = std::nullopt}; }
FuzzResult Broke(std::string why) {
  return {.parsed = true, .broken = std::move(why)};
}

// --- `echo ... > MOUNT/config`, `--config`, `plan`.

FuzzResult RunParallelConfig(absl::string_view bytes) {
  auto config = ParallelConfig::Parse(bytes);
  if (!config.ok()) return Refused();
  const std::string text = config->ToString();
  auto again = ParallelConfig::Parse(text);
  if (!again.ok()) {
    return Broke(absl::StrCat("its own text \"", text,
                              "\" is refused: ", again.status().ToString()));
  }
  if (!(*again == *config)) {
    return Broke(absl::StrCat("\"", text, "\" reads back as \"",
                              again->ToString(), "\""));
  }
  if (config->world_size() < 1 ||
      config->world_size() > ParallelConfig::kMaxWorldSize) {
    return Broke(absl::StrCat("world size ", config->world_size(), " passed"));
  }
  return Fine();
}

std::vector<std::string> ParallelConfigSeeds() {
  return {"tp=2,pp=4,dp=8",
          "tp=1,pp=1,dp=1",
          "tp=2,pp=2,dp=4,fsdp=2",
          "tp=2,pp=1,dp=2,distopt=1",
          "tp=1,pp=3,dp=1,stages=2:1:1",
          "tp=2,pp=1,dp=2,hosts=h0+h1",
          " tp=4,pp=2,dp=4\n"};
}

// --- `--model` of `synth` and `plan`.

FuzzResult RunModelSpec(absl::string_view bytes) {
  auto spec = ModelSpec::Parse(bytes);
  if (!spec.ok()) return Refused();
  if (spec->layers < 0 || spec->hidden < 0 || spec->heads < 0 ||
      spec->vocab < 0 || spec->groups < 0 || spec->ffn < 0) {
    return Broke("a negative size passed");
  }
  return Fine();
}

std::vector<std::string> ModelSpecSeeds() {
  return {"layers=2,hidden=64,heads=4,vocab=1000",
          "layers=4,hidden=128,heads=8,groups=2,ffn=512,vocab=50257,bias=1",
          "layers=1,hidden=32,heads=2,vocab=100,optimizer=adam,"
          "gated_linear_unit=1"};
}

// --- Layout files (`--layout FILE`).

FuzzResult RunLayout(absl::string_view bytes) {
  auto layout = Layout::FromJson(bytes, "fuzz");
  if (!layout.ok()) return Refused();
  // Names as checkpoints spell them; classifying one may refuse it.
  for (absl::string_view name :
       {"decoder.layers.3.self_attention.linear_qkv.weight",
        "embedding.word_embeddings.weight", "model.layers.10.mlp.up_proj.bias",
        "lm_head.weight", "", "x"}) {
    auto rule = layout->Classify(name);
    if (rule.ok() && rule->rule == nullptr) {
      return Broke(absl::StrCat("\"", name, "\" classified without a rule"));
    }
  }
  auto again = Layout::FromJson(layout->ToJson().dump(), "again");
  if (!again.ok()) {
    return Broke(
        absl::StrCat("its own JSON is refused: ", again.status().ToString()));
  }
  return Fine();
}

std::vector<std::string> LayoutSeeds() {
  // The presets, as JSON.
  std::vector<std::string> seeds;
  for (const std::string& name : Layout::PresetNames()) {
    auto layout = Layout::Load(name);
    if (layout.ok()) seeds.push_back(layout->ToJson().dump(2));
  }
  return seeds;
}

// --- safetensors files (import, saves through the mount).

FuzzResult RunSafetensors(absl::string_view bytes) {
  const auto size = static_cast<int64_t>(bytes.size());
  auto header = SafetensorsHeader::Parse(bytes, size);
  if (!header.ok()) return Refused();
  if (header->data_start() + header->data_bytes() != size) {
    return Broke(
        absl::StrCat("data ends at ", header->file_size(), " of ", size));
  }
  // No holes, no overlaps, each tensor exactly its elements' bytes.
  int64_t at = 0;
  for (const SafetensorsEntry& e : header->tensors()) {
    auto elements = NumElements(e.shape);
    if (!elements.ok()) return Broke(absl::StrCat(e.name, ": shape overflows"));
    if (e.data_begin != at ||
        e.data_end - e.data_begin != *elements * DTypeSize(e.dtype)) {
      return Broke(absl::StrCat(e.name, ": bytes [", e.data_begin, ", ",
                                e.data_end, ") after ", at, " for ", *elements,
                                " elements"));
    }
    at = e.data_end;
  }
  if (at != header->data_bytes()) {
    return Broke(
        absl::StrCat("tensors end at ", at, " of ", header->data_bytes()));
  }
  // What Scalai writes of it reads back the same.
  const std::string head = header->Serialize();
  auto again = SafetensorsHeader::Parse(
      head, static_cast<int64_t>(head.size()) + header->data_bytes());
  if (!again.ok()) {
    return Broke(
        absl::StrCat("its own header is refused: ", again.status().ToString()));
  }
  if (again->tensors() != header->tensors() ||
      again->metadata() != header->metadata()) {
    return Broke("its own header reads back different");
  }
  return Fine();
}

std::string SafetensorsFile(const std::string& json, int64_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + std::string(data_bytes, '\x5a');
}

std::vector<std::string> SafetensorsSeeds() {
  return {SafetensorsFile(
              R"({"__metadata__":{"format":"pt"},)"
              R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
              R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})",
              22),
          SafetensorsFile(
              R"({"s":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
              R"("e":{"dtype":"U8","shape":[0,4],"data_offsets":[8,8]}})",
              8)};
}

// --- Pickles of torch.save files (Megatron's .pt checkpoints).

FuzzResult RunPickle(absl::string_view bytes) {
  auto root = Unpickle(bytes);
  if (!root.ok()) return Refused();
  // Unpickle's nesting bound is within ForEachTensor's: every value it
  // returns can be walked.
  if (absl::Status visited = ForEachTensor(**root, [](PickleValue&) {});
      !visited.ok()) {
    return Broke(absl::StrCat("ForEachTensor refuses what Unpickle returned: ",
                              visited.ToString()));
  }
  auto once = Pickle(**root);
  if (!once.ok()) return Refused();  // a cycle, refused by the writer
  auto read = Unpickle(*once);
  if (!read.ok()) {
    return Broke(absl::StrCat("what the writer wrote is refused: ",
                              read.status().ToString()));
  }
  auto twice = Pickle(**read);
  if (!twice.ok() || *twice != *once) {
    return Broke("what the writer wrote reads back different");
  }
  return Fine();
}

std::vector<std::string> PickleSeeds() {
  using Kind = PickleValue::Kind;
  auto root = PickleValue::Make(Kind::kDict);
  auto args = PickleValue::Make(Kind::kNamespace);
  args->Set("tensor_model_parallel_size", PickleValue::Int(2));
  auto dtype = PickleValue::Make(Kind::kTorchDType);
  dtype->text = "bfloat16";
  args->Set("params_dtype", dtype);
  root->Set("args", args);
  root->Set("iteration", PickleValue::Int(1000));
  auto model = PickleValue::Make(Kind::kDict);
  model->ordered_dict = true;
  auto tensor = PickleValue::Make(Kind::kTensor);
  tensor->tensor.storage_key = "0";
  tensor->tensor.dtype = DType::kBF16;
  tensor->tensor.shape = {4, 3};
  tensor->tensor.stride = RowMajorStrides(tensor->tensor.shape);
  tensor->tensor.storage_elements = 12;
  model->Set("decoder.layers.0.mlp.linear_fc1.weight", tensor);
  root->Set("model", model);
  auto rng = PickleValue::Make(Kind::kList);
  auto tuple = PickleValue::Make(Kind::kTuple);
  auto array = PickleValue::Make(Kind::kArray);
  array->array.descr = "<u4";
  array->array.shape = {2};
  array->array.data = std::string(8, '\x07');
  auto bytes = PickleValue::Make(Kind::kBytes);
  bytes->text = std::string("\0\xff", 2);
  tuple->items = {PickleValue::String("MT19937"), array, PickleValue::None(),
                  PickleValue::Float(0.5), bytes};
  rng->items = {tuple};
  root->Set("rng_state", rng);
  auto pickled = Pickle(*root);
  return {pickled.ok() ? *pickled : std::string()};
}

// --- Megatron indexed datasets (.idx beside a .bin).

FuzzResult RunMegatronIndex(absl::string_view bytes) {
  const auto size = static_cast<int64_t>(bytes.size());
  auto index = MegatronIndex::Parse(bytes, size);
  if (!index.ok()) return Refused();
  if (index->document_starts_at() + 8 * index->documents() > size) {
    return Broke(absl::StrCat("tables end past the file's ", size, " bytes"));
  }
  // A .bin of the size the last sequence implies, and one byte shorter.
  int64_t bin = 0;
  for (int64_t i = 0; i < index->sequences(); ++i) {
    const int64_t end =
        index->pointer(bytes, i) + index->sequence_bytes(bytes, i);
    if (end > bin && index->pointer(bytes, i) >= 0 &&
        index->sequence_bytes(bytes, i) >= 0) {
      bin = end;
    }
  }
  for (int64_t bin_size : {bin, bin - 1, int64_t{1}}) {
    if (bin_size < 0) continue;
    absl::Status checked = index->CheckEntries(bytes, bin_size);
    if (!checked.ok()) continue;
    for (int64_t i = 0; i < index->sequences(); ++i) {
      const int64_t at = index->pointer(bytes, i);
      const int64_t n = index->sequence_bytes(bytes, i);
      if (at < 0 || n < 0 || at + n > bin_size) {
        return Broke(absl::StrCat("sequence ", i, " at ", at, " (", n,
                                  " bytes) passed against a .bin of ",
                                  bin_size));
      }
    }
  }
  return Fine();
}

std::vector<std::string> MegatronIndexSeeds() {
  std::string idx("MMIDIDX\0\0", 9);
  auto put = [&idx](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i)
      idx.push_back(static_cast<char>(v >> (8 * i)));
  };
  put(1, 8);  // version
  put(4, 1);  // int32 tokens
  put(3, 8);  // sequences
  put(3, 8);  // documents
  for (uint64_t length : {5, 2, 7}) put(length, 4);
  for (uint64_t pointer : {0, 20, 28}) put(pointer, 8);
  for (uint64_t start : {0, 1, 3}) put(start, 8);
  return {idx};
}

// --- The cluster file of `mount --cluster FILE`.

// A directory with the files the seeds name, so that mutants get past
// reading them; made once per process and removed at exit.
const std::string& ClusterFileDir() {
  static const std::string* const kDir = [] {
    std::string pattern = "/tmp/scalai-fuzz-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) return new std::string("/");
    auto* dir = new std::string(pattern);
    const std::pair<const char*, const char*> kFiles[] = {
        {"token", "0123456789abcdef0123\n"},
        {"c.pem", "-----BEGIN CERTIFICATE-----\n"},
        {"k.pem", "-----BEGIN PRIVATE KEY-----\n"},
        {"ca.pem", "-----BEGIN CERTIFICATE-----\n"}};
    for (const auto& [name, text] : kFiles) {
      std::ofstream(*dir + "/" + name) << text;
    }
    static const std::string* const kRemove = dir;
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(*kRemove, ignored);
    });
    return dir;
  }();
  return *kDir;
}

FuzzResult RunClusterFile(absl::string_view bytes) {
  auto cluster = ClusterFile::Parse(bytes, ClusterFileDir());
  if (!cluster.ok()) return Refused();
  for (const ClusterHost& host : cluster->hosts) {
    if (!IsHostName(host.name))
      return Broke(absl::StrCat("host \"", host.name, "\""));
    if (!cluster->FindHost(host.name).ok()) {
      return Broke(absl::StrCat("host \"", host.name, "\" is not found"));
    }
  }
  return Fine();
}

std::vector<std::string> ClusterFileSeeds() {
  return {R"({"job": "gpt", "etcd": ["http://10.0.0.1:2379"],
  "token_file": "token", "hosts": [{"name": "h0", "address": "10.0.0.2:7000"},
  {"name": "h1", "address": "10.0.0.3:7000"}]})",
          R"({"job": "j", "etcd": ["https://e:2379"], "token_file": "token",
  "tls": {"cert": "c.pem", "key": "k.pem", "ca": "ca.pem"},
  "hosts": [{"name": "a", "address": "a:1"}]})"};
}

}  // namespace

const std::vector<FuzzTarget>& FuzzTargets() {
  static const auto* const kTargets = new std::vector<FuzzTarget>{
      {"parallel_config", RunParallelConfig, ParallelConfigSeeds},
      {"model_spec", RunModelSpec, ModelSpecSeeds},
      {"layout", RunLayout, LayoutSeeds},
      {"safetensors", RunSafetensors, SafetensorsSeeds},
      {"pickle", RunPickle, PickleSeeds},
      {"megatron_index", RunMegatronIndex, MegatronIndexSeeds},
      {"cluster_file", RunClusterFile, ClusterFileSeeds},
  };
  return *kTargets;
}

const FuzzTarget* FindFuzzTarget(absl::string_view name) {
  for (const FuzzTarget& t : FuzzTargets()) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

}  // namespace scalai
