#include "transfer/chunk_hold.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

namespace scalai {
namespace {

constexpr int64_t kSlotBytes = 4096;

ChunkHold::Key K(uint64_t blob, int64_t chunk) { return {blob, chunk}; }

TEST(ChunkHold, TheFirstFillsAndTheNextCopiesOnceFilled) {
  ChunkHold hold(4, kSlotBytes);
  ChunkHold::Pin first = hold.Acquire(K(1, 0), 100);
  ASSERT_TRUE(first);
  EXPECT_TRUE(first.must_fill());
  // Another read of the same chunk finds it, to wait for, not to fill.
  ChunkHold::Pin second = hold.Acquire(K(1, 0), 100);
  ASSERT_TRUE(second);
  EXPECT_FALSE(second.must_fill());
  std::atomic<bool> copied{false};
  std::string seen;
  std::thread waiter([&] {
    second.Wait();
    ASSERT_TRUE(second.status().ok());
    seen.assign(second.data(), 5);
    copied = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(copied) << "a waiter must not see the slot before it is filled";
  std::memcpy(first.data(), "bytes", 5);
  first.Filled(absl::OkStatus());
  waiter.join();
  EXPECT_EQ(seen, "bytes");
  // Another chunk, or the same chunk of another blob, is not this slot.
  EXPECT_FALSE(hold.Find(K(1, 1)));
  EXPECT_FALSE(hold.Find(K(2, 0)));
  // Once every byte has been copied out the slot is free: no one finds it.
  first.Served(60);
  EXPECT_TRUE(hold.Find(K(1, 0)));
  second.Served(40);
  EXPECT_FALSE(hold.Find(K(1, 0)));
}

TEST(ChunkHold, AFailedOrAbandonedFillIsToldToThoseWaitingAndTriedAgain) {
  ChunkHold hold(2, kSlotBytes);
  {
    ChunkHold::Pin filler = hold.Acquire(K(1, 3), 10);
    ChunkHold::Pin waiting = hold.Find(K(1, 3));
    ASSERT_TRUE(waiting);
    filler.Filled(absl::DataLossError("chunk 3 does not match"));
    waiting.Wait();
    EXPECT_TRUE(absl::IsDataLoss(waiting.status()));
  }
  // Whoever comes next fills it again.
  ChunkHold::Pin again = hold.Acquire(K(1, 3), 10);
  ASSERT_TRUE(again);
  EXPECT_TRUE(again.must_fill());
  ChunkHold::Pin waiting = hold.Find(K(1, 3));
  std::thread waiter([&] {
    waiting.Wait();
    EXPECT_FALSE(waiting.status().ok());
  });
  // The filler gives up without saying how it went (an early return):
  // the waiter is woken, not left hanging.
  again = ChunkHold::Pin();
  waiter.join();
  EXPECT_TRUE(hold.Acquire(K(1, 3), 10).must_fill());
}

TEST(ChunkHold, SlotsInUseAreNeverTakenAndTheOldestIdleOneIs) {
  ChunkHold hold(2, kSlotBytes);
  // Chunks filled and read in part only: they stay held, unpinned.
  for (int64_t chunk : {0, 1}) {
    ChunkHold::Pin pin = hold.Acquire(K(7, chunk), 100);
    ASSERT_TRUE(pin.must_fill());
    pin.Filled(absl::OkStatus());
    pin.Served(50);
  }
  EXPECT_TRUE(hold.Find(K(7, 0)));
  EXPECT_TRUE(hold.Find(K(7, 1)));
  // A third chunk takes the slot of the one least recently used: chunk 0
  // was looked at first above, so chunk 0's.
  {
    ChunkHold::Pin third = hold.Acquire(K(7, 2), 100);
    ASSERT_TRUE(third.must_fill());
    EXPECT_FALSE(hold.Find(K(7, 0)));
    EXPECT_TRUE(hold.Find(K(7, 1)));
    // Both slots pinned now (third, and the one Find just pinned): a
    // fourth chunk gets none, and its reader goes its own way.
    ChunkHold::Pin keep = hold.Find(K(7, 1));
    EXPECT_FALSE(hold.Acquire(K(7, 3), 100));
    third.Filled(absl::OkStatus());
  }
  // Chunks larger than a slot, and keys of no blob, are never held.
  EXPECT_FALSE(hold.Acquire(K(7, 4), kSlotBytes + 1));
  EXPECT_FALSE(hold.Acquire(K(0, 4), 10));
  EXPECT_NE(ChunkHold::NewBlobId(), ChunkHold::NewBlobId());
}

// Many threads fill and copy chunks of a few blobs at once: every copy sees
// the bytes its chunk was filled with, never another chunk's.
TEST(ChunkHold, ConcurrentReadersSeeTheirChunksBytes) {
  ChunkHold hold(3, kSlotBytes);
  std::atomic<int> wrong{0};
  std::atomic<int> fills{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        const int64_t chunk = (i + t) % 5;
        const char mark = static_cast<char>('a' + chunk);
        ChunkHold::Pin pin = hold.Acquire(K(9, chunk), 2);
        if (!pin) continue;  // all three slots pinned
        if (pin.must_fill()) {
          std::memset(pin.data(), mark, kSlotBytes);
          ++fills;
          pin.Filled(absl::OkStatus());
        } else {
          pin.Wait();
          if (!pin.status().ok()) continue;
        }
        for (int64_t b = 0; b < kSlotBytes; b += 512) {
          if (pin.data()[b] != mark) ++wrong;
        }
        pin.Served(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong, 0);
  EXPECT_GT(fills, 5);
}

}  // namespace
}  // namespace scalai
