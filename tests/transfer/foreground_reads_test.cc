// Background work gives way to reads: Yield waits while a read is in flight
// or came just before, until reads pause or for a bounded time, and not at
// all without them. A fake clock makes every wait exact.
#include "transfer/foreground_reads.h"

#include <atomic>
#include <memory>
#include <thread>

#include "gtest/gtest.h"

namespace scalai {
namespace {

constexpr int64_t kMs = 1'000'000;

// A clock whose time moves only when someone sleeps; `on_sleep` runs after
// each sleep (a reader that reads again).
struct FakeClock {
  std::atomic<int64_t> now{1000 * kMs};
  std::atomic<int> sleeps{0};
  std::function<void()> on_sleep;

  ForegroundReads::Clock clock() {
    return {[this] { return now.load(); },
            [this](int64_t nanos) {
              EXPECT_GT(nanos, 0);
              now += nanos;
              ++sleeps;
              if (on_sleep) on_sleep();
            }};
  }
};

// A read answered at once.
void ReadOnce(ForegroundReads& reads) { ForegroundReads::Reading read(&reads); }

TEST(ForegroundReadsTest, WithoutReadsNothingWaits) {
  FakeClock fake;
  ForegroundReads reads(fake.clock());
  reads.Yield();
  // Reads that do not count (null) change nothing.
  { ForegroundReads::Reading not_counted(nullptr); }
  reads.Yield();
  EXPECT_EQ(fake.sleeps, 0);
  EXPECT_EQ(reads.waited_nanos(), 0);
}

TEST(ForegroundReadsTest, WaitsUntilReadsPause) {
  FakeClock fake;
  ForegroundReads reads(fake.clock());
  ReadOnce(reads);
  fake.now += 4 * kMs;
  reads.Yield();
  EXPECT_EQ(reads.waited_nanos(), ForegroundReads::kQuietNanos - 4 * kMs);
  // Quiet since: the next piece goes at once.
  reads.Yield();
  EXPECT_EQ(fake.sleeps, 1);
}

TEST(ForegroundReadsTest, ReadsLongAgoDoNotCount) {
  FakeClock fake;
  ForegroundReads reads(fake.clock());
  ReadOnce(reads);
  fake.now += ForegroundReads::kQuietNanos;
  reads.Yield();
  EXPECT_EQ(fake.sleeps, 0);
}

TEST(ForegroundReadsTest, AReadDuringTheWaitExtendsIt) {
  FakeClock fake;
  ForegroundReads reads(fake.clock());
  int reads_left = 1;
  fake.on_sleep = [&] {
    if (reads_left-- > 0) ReadOnce(reads);
  };
  ReadOnce(reads);
  fake.now += 7 * kMs;
  reads.Yield();
  // 3 ms until quiet, a read then, and the quiet time again.
  EXPECT_EQ(reads.waited_nanos(), 3 * kMs + ForegroundReads::kQuietNanos);
  EXPECT_EQ(fake.sleeps, 2);
}

TEST(ForegroundReadsTest, AReadInFlightHoldsTheWaitUntilItEnds) {
  FakeClock fake;
  ForegroundReads reads(fake.clock());
  auto slow = std::make_unique<ForegroundReads::Reading>(&reads);
  fake.now += 50 * kMs;  // arrived long ago, still being answered
  fake.on_sleep = [&] {
    if (fake.now == 1055 * kMs) slow.reset();
  };
  reads.Yield();
  // Answered after 5 ms, then quiet for the quiet time.
  EXPECT_EQ(reads.waited_nanos(), 5 * kMs + ForegroundReads::kQuietNanos);
}

TEST(ForegroundReadsTest, AReaderThatNeverPausesHoldsEachCallBoundedly) {
  static_assert(ForegroundReads::kMaxWaitNanos > ForegroundReads::kQuietNanos);
  FakeClock fake;
  ForegroundReads reads(fake.clock());
  ForegroundReads::Reading endless(&reads);
  for (int i = 0; i < 5; ++i) reads.Yield();
  EXPECT_EQ(reads.waited_nanos(), 5 * ForegroundReads::kMaxWaitNanos);
}

TEST(ForegroundReadsTest, TheSteadyClockWaitsAndReturns) {
  ForegroundReads reads;
  std::atomic<bool> stop{false}, reading{false};
  std::thread reader([&] {
    while (!stop) {
      ReadOnce(reads);
      reading = true;
    }
  });
  while (!reading) std::this_thread::yield();
  // Each call returns; one finds the reader within its last 10 ms and waits
  // (a loaded machine may keep the reader off a core for a while).
  for (int i = 0; i < 1000 && reads.waited_nanos() == 0; ++i) reads.Yield();
  stop = true;
  reader.join();
  EXPECT_GT(reads.waited_nanos(), 0);
}

}  // namespace
}  // namespace scalai
