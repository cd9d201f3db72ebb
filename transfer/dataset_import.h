// Registers a dataset in a store (`scalai dataset add`): checks every source
// file, indexes JSONL lines into the store, records the files' size and
// mtime, and commits one catalog record. Any error leaves the store as it
// was: no record, no index file.
//
//   DatasetImportOptions o{.name = "web", .format = "jsonl",
//                          .files = {"a.jsonl"}, .global_batch = 512};
//   ASSIGN_OR_RETURN(AddedDataset added, AddDataset(*store, o));
#ifndef SCALAI_TRANSFER_DATASET_IMPORT_H_
#define SCALAI_TRANSFER_DATASET_IMPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transfer/parallel.h"
#include "transfer/store.h"

namespace scalai {

struct DatasetImportOptions {
  std::string name;
  std::string format;  // "jsonl" or "megatron"
  // jsonl: the files, read in order. megatron: each an .idx, a .bin or their
  // common prefix (Megatron's data path); each pair once, in order.
  std::vector<std::string> files;
  int64_t global_batch = 0;
  uint64_t seed = 1234;  // Megatron's default
  int64_t epochs = 1;
  // Registers `name` again in place of the record it has (after its source
  // files changed, or to index them again): the new record replaces the
  // old in one commit, and the old line index goes once nothing names it.
  bool replace = false;
  ProgressFn progress;  // bytes of source files checked
};

struct AddedDataset {
  DatasetRecord record;
  bool replaced = false;  // it took the place of a record of its name
};
absl::StatusOr<AddedDataset> AddDataset(Store& store,
                                        const DatasetImportOptions& options);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_DATASET_IMPORT_H_
