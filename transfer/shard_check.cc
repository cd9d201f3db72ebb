#include "transfer/shard_check.h"

#include <map>

#include "absl/strings/str_cat.h"

namespace scalai {
namespace {

absl::Status UserError(absl::string_view label, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", why));
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> MatchShardHeader(
    const Model& model, const std::vector<TensorShard>& shards,
    const SafetensorsHeader& header, absl::string_view label,
    absl::string_view where) {
  std::map<absl::string_view, const SafetensorsEntry*> entries;
  for (const SafetensorsEntry& e : header.tensors()) entries[e.name] = &e;
  std::vector<int64_t> offsets;
  for (const TensorShard& s : shards) {
    auto it = entries.find(s.local_name);
    if (it == entries.end()) {
      return UserError(label, absl::StrCat("tensor ", s.local_name,
                                           " is missing (the layout",
                                           " places it on ", where, ")"));
    }
    const SafetensorsEntry& e = *it->second;
    const TensorInfo& t = model.tensor(s.tensor);
    if (e.dtype != t.dtype) {
      return UserError(label, absl::StrCat("tensor ", s.local_name, " is ",
                                           DTypeName(e.dtype), ", expected ",
                                           DTypeName(t.dtype)));
    }
    if (e.shape != s.local_shape) {
      return UserError(label,
                       absl::StrCat("tensor ", s.local_name, ": expected ",
                                    ShapeToString(s.local_shape), " on ", where,
                                    ", got ", ShapeToString(e.shape)));
    }
    offsets.push_back(header.data_start() + e.data_begin);
    entries.erase(it);
  }
  if (!entries.empty()) {
    return UserError(label,
                     absl::StrCat("tensor ", entries.begin()->first,
                                  " is not one the layout places on ", where));
  }
  return offsets;
}

}  // namespace scalai
