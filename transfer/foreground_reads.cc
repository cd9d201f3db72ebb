#include "transfer/foreground_reads.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace scalai {

ForegroundReads::Clock ForegroundReads::SteadyClock() {
  return {[] {
            return std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                .count();
          },
          [](int64_t nanos) {
            std::this_thread::sleep_for(std::chrono::nanoseconds(nanos));
          }};
}

ForegroundReads::Reading::Reading(ForegroundReads* reads) : reads_(reads) {
  if (reads_ == nullptr) return;
  reads_->in_flight_.fetch_add(1);
  reads_->last_read_.store(reads_->clock_.now_nanos(),
                           std::memory_order_relaxed);
}

ForegroundReads::Reading::~Reading() {
  if (reads_ == nullptr) return;
  reads_->last_read_.store(reads_->clock_.now_nanos(),
                           std::memory_order_relaxed);
  reads_->in_flight_.fetch_sub(1);
}

void ForegroundReads::Yield() const {
  const int64_t start = clock_.now_nanos();
  const int64_t give_up_at = start + kMaxWaitNanos;
  int64_t now = start;
  while (now < give_up_at) {
    int64_t until = now + kPollNanos;  // while a read is in flight
    if (in_flight_.load() == 0) {
      until = last_read_.load(std::memory_order_relaxed) + kQuietNanos;
      if (now >= until) break;
    }
    clock_.sleep_nanos(std::min(until, give_up_at) - now);
    now = clock_.now_nanos();
  }
  if (now > start) waited_.fetch_add(now - start, std::memory_order_relaxed);
}

}  // namespace scalai
