// ForegroundReads lets background work give the machine to the reads a job
// waits on. After a reconfiguration every worker loads its shard through the
// mount while the mount re-stores the step under the new config beside the
// reads (materialization); both want the same cores, memory and disk, and
// the job waits for the slowest reader while nobody waits for the
// materialization. On a 2-core VM, a materialization beside the reads made
// one reader of assembled shards take 1.7x as long as with none (4.22 s
// against 2.51 s for 1.93 GiB; 2.1x from a cold cache).
//
// The mount marks each read of a checkpoint file from its arrival to its
// reply; the materialization calls Yield before each piece it writes, which
// waits while a read is in flight or came in the last few milliseconds. A
// wait is bounded per call, so background work slows under readers that
// never pause but never stops.
//
//   ForegroundReads reads;                   // shared by readers and workers
//   {
//     ForegroundReads::Reading reading(&reads);  // a reader, per request
//     ...                                        // answer it
//   }
//   reads.Yield();                           // a worker, between pieces
#ifndef SCALAI_TRANSFER_FOREGROUND_READS_H_
#define SCALAI_TRANSFER_FOREGROUND_READS_H_

#include <atomic>
#include <cstdint>
#include <functional>

namespace scalai {

class ForegroundReads {
 public:
  // Reads this close together count as one reader still reading (a reader
  // asks for its next megabyte well within it, even between files).
  static constexpr int64_t kQuietNanos = 10'000'000;
  // The longest one Yield waits. A materialization's piece is at most 256
  // KiB, so under a reader that never pauses each of its writers still
  // moves about 12 MB/s.
  static constexpr int64_t kMaxWaitNanos = 20'000'000;

  // Where time comes from: a monotonic clock and a sleep (tests pass their
  // own, so that no test depends on the machine's speed).
  struct Clock {
    std::function<int64_t()> now_nanos;
    std::function<void(int64_t nanos)> sleep_nanos;
  };
  static Clock SteadyClock();

  ForegroundReads() : ForegroundReads(SteadyClock()) {}
  explicit ForegroundReads(Clock clock) : clock_(std::move(clock)) {}
  ForegroundReads(const ForegroundReads&) = delete;
  ForegroundReads& operator=(const ForegroundReads&) = delete;

  // A read a job waits on, from its arrival until it is answered (null:
  // a read that does not count).
  class Reading {
   public:
    explicit Reading(ForegroundReads* reads);
    ~Reading();
    Reading(const Reading&) = delete;
    Reading& operator=(const Reading&) = delete;

   private:
    ForegroundReads* reads_;
  };

  // Returns at once unless a read is in flight or ended within
  // kQuietNanos; then sleeps until neither holds, or kMaxWaitNanos in all.
  void Yield() const;

  // Time spent in Yield, all callers together.
  int64_t waited_nanos() const { return waited_.load(); }

 private:
  // How often a wait looks again while reads are in flight.
  static constexpr int64_t kPollNanos = 1'000'000;

  Clock clock_;
  std::atomic<int> in_flight_{0};
  // When the last read arrived or ended; far enough in the past to be quiet
  // at start.
  std::atomic<int64_t> last_read_{INT64_MIN / 2};
  mutable std::atomic<int64_t> waited_{0};
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_FOREGROUND_READS_H_
