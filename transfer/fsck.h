// Verifies a store: every blob against its recorded size and chunk sums,
// every catalog record against the blobs and the layout. Returns the problems
// found, each naming the blob or step at fault; empty means healthy.
//
//   ASSIGN_OR_RETURN(std::vector<std::string> problems,
//                    CheckStore(*store, progress_fn));
#ifndef SCALAI_TRANSFER_FSCK_H_
#define SCALAI_TRANSFER_FSCK_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transfer/parallel.h"
#include "transfer/store.h"

namespace scalai {

absl::StatusOr<std::vector<std::string>> CheckStore(const Store& store,
                                                    ProgressFn progress);

// CheckStore while another process (a mount) holds the store and may change
// it: the store is opened with `open_store` (for reading), and checked as
// its catalog stood at that open. A blob or dataset index whose file was
// not there to be read was, if a catalog opened after the check no longer
// names it, retired by the writer meanwhile, and is no problem; if it still
// names it, the file is lost (a writer removes a file only once the commit
// that drops its record is durable).
struct CheckBesideWriter {
  std::vector<std::string> problems;
  size_t blobs = 0;    // blobs checked
  size_t retired = 0;  // of them, retired by the writer during the check
};
absl::StatusOr<CheckBesideWriter> CheckStoreBesideWriter(
    const StoreOpener& open_store, ProgressFn progress);

// Reads the blob at `path` once and says what is wrong with it against
// `record` (its first chunk that does not match), or nothing.
absl::StatusOr<std::optional<std::string>> CheckBlob(const std::string& path,
                                                     const BlobRecord& record,
                                                     Progress* progress);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_FSCK_H_
