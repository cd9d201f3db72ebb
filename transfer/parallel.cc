#include "transfer/parallel.h"

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <vector>

namespace scalai {

void Progress::Add(int64_t bytes) {
  int64_t now = done_.fetch_add(bytes) + bytes;
  if (!fn_) return;
  std::lock_guard<std::mutex> lock(mu_);
  fn_(now, total_);
}

absl::Status ParallelFor(size_t n, int threads,
                         const std::function<absl::Status(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  absl::Status first_error;  // guarded by mu
  auto worker = [&] {
    for (size_t i; !failed.load() && (i = next.fetch_add(1)) < n;) {
      absl::Status s = fn(i);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s;
        failed = true;
      }
    }
  };
  const int count = static_cast<int>(std::min<size_t>(std::max(threads, 1), n));
  std::vector<std::thread> pool;
  for (int t = 1; t < count; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  return first_error;
}

int IoThreads() {
  return std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 2,
                    8);
}

}  // namespace scalai
