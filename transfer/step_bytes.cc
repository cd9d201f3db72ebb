#include "transfer/step_bytes.h"

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::Status StepBytes::AddGroup(const Store& store, int64_t step, int g,
                                 const ShardRecord* record,
                                 const Placement& placement) {
  std::vector<Tensor> tensors;
  held_.push_back(record != nullptr);
  if (record == nullptr) {
    tensors_.emplace_back(placement.shards(g).size(),
                          Tensor{nullptr, nullptr, 0});
    return absl::OkStatus();
  }
  if (record->tensors.size() != placement.shards(g).size()) {
    return absl::DataLossError(
        absl::StrCat("catalog record of step ", step, " group ", g, " lists ",
                     record->tensors.size(), " tensors, the placement ",
                     placement.shards(g).size()));
  }
  for (const ShardRecord::Location& at : record->tensors) {
    const std::string& name = record->blobs[at.blob];
    auto it = blobs_.find(name);
    if (it == blobs_.end()) {
      it = blobs_.emplace(name, BlobReader::Open(store, name)).first;
    }
    const BlobReader& blob = *it->second;
    // A location past the blob's end fails each read (Verify), like any
    // other damage, rather than the whole step.
    tensors.push_back(
        {&blob, blob.data() != nullptr ? blob.data() + at.offset : nullptr,
         at.offset});
  }
  tensors_.push_back(std::move(tensors));
  return absl::OkStatus();
}

absl::StatusOr<StepBytes> StepBytes::Load(const Store& store,
                                          const StepRecord& step,
                                          const Placement& placement) {
  StepBytes out;
  for (int g = 0; g < step.groups; ++g) {
    if (!step.holds(g)) {
      RETURN_IF_ERROR(out.AddGroup(store, step.step, g, nullptr, placement));
      continue;
    }
    ASSIGN_OR_RETURN(ShardRecord record, store.Shard(step.step, g));
    RETURN_IF_ERROR(out.AddGroup(store, step.step, g, &record, placement));
  }
  return out;
}

std::set<std::string> StepBytes::MissingBlobs() const {
  std::set<std::string> missing;
  for (const auto& [name, blob] : blobs_) {
    if (blob->missing()) missing.insert(name);
  }
  return missing;
}

absl::StatusOr<StepBytes> StepBytes::LoadRetained(const Store& store,
                                                  int64_t step,
                                                  const RetainedShards& kept,
                                                  const Placement& placement) {
  StepBytes out;
  for (int g = 0; g < placement.num_groups(); ++g) {
    auto it = kept.groups.find(g);
    RETURN_IF_ERROR(out.AddGroup(
        store, step, g, it == kept.groups.end() ? nullptr : &it->second,
        placement));
  }
  return out;
}

}  // namespace scalai
