// Runs independent jobs on a few threads, stopping at the first error; and a
// thread-safe progress counter that reports to a callback.
//
//   RETURN_IF_ERROR(ParallelFor(n, threads, [&](size_t i) { return Copy(i); }));
//   Progress progress(total_bytes, on_progress);
//   progress.Add(n);
#ifndef SCALAI_TRANSFER_PARALLEL_H_
#define SCALAI_TRANSFER_PARALLEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "absl/status/status.h"

namespace scalai {

// Called with (bytes done, bytes total); may be empty.
using ProgressFn = std::function<void(int64_t, int64_t)>;

class Progress {
 public:
  Progress(int64_t total, ProgressFn fn) : total_(total), fn_(std::move(fn)) {}
  void Add(int64_t bytes);
  int64_t done() const { return done_.load(); }

 private:
  const int64_t total_;
  std::atomic<int64_t> done_{0};
  std::mutex mu_;  // serializes calls to fn_
  ProgressFn fn_;
};

// Runs fn(0..n-1) on up to `threads` threads; returns the first error, after
// which no new index starts.
absl::Status ParallelFor(size_t n, int threads,
                         const std::function<absl::Status(size_t)>& fn);

// Threads worth using for I/O-bound copies on this machine.
int IoThreads();

}  // namespace scalai

#endif  // SCALAI_TRANSFER_PARALLEL_H_
