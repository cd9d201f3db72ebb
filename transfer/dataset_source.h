// A DatasetSource reads the samples of a registered dataset from its source
// files, in place: sample i of a JSONL dataset is line i without its
// newline, found through the line index the store keeps; sample i of a
// Megatron dataset is sequence i's tokens, found through the .idx. Files are
// read with pread, never mapped, so that a file truncated under a reader
// gives an error instead of SIGBUS, and before any bytes are served the
// files are checked against their registered size and mtime: a changed file
// is reported (DataLoss, naming it), never served.
//
//   ASSIGN_OR_RETURN(auto source, DatasetSource::Open(store, "web", record));
//   ASSIGN_OR_RETURN(int64_t n, source->SampleBytes(id));
//   RETURN_IF_ERROR(source->ReadSample(id, 0, n, buffer));
#ifndef SCALAI_TRANSFER_DATASET_SOURCE_H_
#define SCALAI_TRANSFER_DATASET_SOURCE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/megatron_index.h"
#include "transfer/files.h"
#include "transfer/store.h"

namespace scalai {

class DatasetSource {
 public:
  // Opening never fails for a changed or missing source file: the dataset
  // stays visible and its reads report the file.
  static absl::StatusOr<std::unique_ptr<DatasetSource>> Open(
      const Store& store, const std::string& name, const DatasetRecord& record);

  const std::string& name() const { return name_; }
  const DatasetRecord& record() const { return record_; }
  int64_t samples() const { return record_.samples; }
  bool jsonl() const { return record_.format == "jsonl"; }

  absl::StatusOr<int64_t> SampleBytes(int64_t id) const;
  // Reads bytes [offset, offset + length) of sample `id`, all within it.
  absl::Status ReadSample(int64_t id, int64_t offset, int64_t length,
                          char* out) const;

 private:
  struct Part {
    const DatasetRecord::Part* record = nullptr;
    int64_t first = 0;          // the dataset's id of the part's sample 0
    int64_t index_first = 0;    // jsonl: the part's first index entry
    std::vector<UniqueFd> fds;  // as record->files
    MegatronIndex megatron;
    absl::Status opened;  // why the part cannot be read, if it cannot
  };
  DatasetSource() = default;
  const Part& PartOf(int64_t id) const;
  // Where sample `id` lies in the data file of its part: [begin, end).
  absl::Status Locate(const Part& part, int64_t id, int64_t* begin,
                      int64_t* end) const;
  absl::Status CheckUnchanged(const Part& part) const;

  std::string name_;
  DatasetRecord record_;
  std::vector<Part> parts_;
  MappedFile index_;  // jsonl: the store's own line index, never changed
};

// Bytes of a file stamp's file as it is now, compared with the stamp; a
// DataLoss error naming the file and dataset when they differ.
absl::Status CheckStamp(const FileStamp& stamp, const std::string& dataset);

// A jsonl dataset's line index, the store's own file, mapped and checked
// against the size and XXH3 its record gives: a damaged index would cut the
// source into the wrong lines, and serve them as samples. A missing,
// short or damaged one is a DataLoss error naming the dataset and the file,
// and the command that indexes the files again.
absl::StatusOr<MappedFile> OpenLineIndex(const Store& store,
                                         const DatasetRecord& record,
                                         const std::string& dataset);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_DATASET_SOURCE_H_
