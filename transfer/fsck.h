// Verifies a store: every blob against its recorded size and XXH3 checksum,
// every catalog record against the blobs and the layout. Returns the problems
// found, each naming the blob or step at fault; empty means healthy.
//
//   ASSIGN_OR_RETURN(std::vector<std::string> problems,
//                    CheckStore(*store, progress_fn));
#ifndef SCALAI_TRANSFER_FSCK_H_
#define SCALAI_TRANSFER_FSCK_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transfer/parallel.h"
#include "transfer/store.h"

namespace scalai {

absl::StatusOr<std::vector<std::string>> CheckStore(const Store& store,
                                                    ProgressFn progress);

// XXH3 of a whole file, read sequentially.
absl::StatusOr<uint64_t> HashFile(const std::string& path, Progress* progress);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_FSCK_H_
