// Reads through a file mapping fault (SIGBUS) when the file was cut short
// under it: a blob truncated by someone else while the mount serves it.
// ReadMapped runs the code that reads the mapping and turns that fault into
// a false return for the caller to report as damage, instead of the signal
// ending the process and every worker's mount with it.
//
//   if (!ReadMapped([&] { std::memcpy(out, map + offset, n); })) {
//     return absl::DataLossError("... was truncated while in use");
//   }
#ifndef SCALAI_TRANSFER_MAPPING_GUARD_H_
#define SCALAI_TRANSFER_MAPPING_GUARD_H_

#include "absl/functional/function_ref.h"

namespace scalai {

// Runs `read`; returns false if it faulted on a mapping. `read` is left
// where it faulted, so it must only copy or hash bytes: no allocation, no
// locks, nothing to undo. Nests; thread-safe.
bool ReadMapped(absl::FunctionRef<void()> read);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_MAPPING_GUARD_H_
