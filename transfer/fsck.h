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

// Reads the blob at `path` once and says what is wrong with it against
// `record` (its first chunk that does not match), or nothing.
absl::StatusOr<std::optional<std::string>> CheckBlob(const std::string& path,
                                                     const BlobRecord& record,
                                                     Progress* progress);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_FSCK_H_
