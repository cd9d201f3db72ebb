// The shared buffers of chunks read past the page cache: a chunk is loaded
// once while a buffer holds it, however many threads ask for it at once;
// the least recently used buffer is the one reused; a failed load keeps
// nothing; more askers than buffers wait their turn.
#include "transfer/chunk_buffers.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace scalai {
namespace {

constexpr int64_t kBytes = 2 * ChunkBuffers::kAlignment;

// What chunk `key` holds: each byte tells its owner, chunk and place.
char ByteOf(ChunkBuffers::Key key, int64_t at) {
  return static_cast<char>(key.owner * 31 + key.chunk * 7 + at);
}

class Counted {
 public:
  absl::Status Load(ChunkBuffers::Key key, char* buffer) {
    ++calls_;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer) % ChunkBuffers::kAlignment,
              0u);
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    for (int64_t i = 0; i < kBytes; ++i) buffer[i] = ByteOf(key, i);
    return absl::OkStatus();
  }
  int calls() const { return calls_; }
  void set_delay(std::chrono::milliseconds d) { delay_ = d; }

 private:
  std::atomic<int> calls_{0};
  std::chrono::milliseconds delay_{0};
};

// Copies [from, from + n) of `key` and checks the bytes.
void ExpectCopy(ChunkBuffers& buffers, Counted& loader, ChunkBuffers::Key key,
                int64_t from, int64_t n) {
  std::string out(n, '\0');
  ASSERT_TRUE(buffers
                  .Copy(
                      key,
                      [&](char* buffer) { return loader.Load(key, buffer); },
                      from, n, out.data())
                  .ok());
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], ByteOf(key, from + i)) << "byte " << from + i;
  }
}

TEST(ChunkBuffers, LoadsAChunkOnceWhileABufferHoldsIt) {
  ChunkBuffers buffers(4, kBytes);
  Counted loader;
  for (int round = 0; round < 3; ++round) {
    for (int64_t c = 0; c < 4; ++c) {
      ExpectCopy(buffers, loader, {1, c}, round * 100, 1000);
    }
  }
  EXPECT_EQ(loader.calls(), 4);
  EXPECT_EQ(buffers.loads(), 4);
  // Another owner's chunk of the same number is another chunk.
  ExpectCopy(buffers, loader, {2, 0}, 0, kBytes);
  EXPECT_EQ(loader.calls(), 5);
}

TEST(ChunkBuffers, ReusesTheLeastRecentlyUsedBuffer) {
  ChunkBuffers buffers(2, kBytes);
  Counted loader;
  ExpectCopy(buffers, loader, {1, 0}, 0, 10);  // A
  ExpectCopy(buffers, loader, {1, 1}, 0, 10);  // B
  ExpectCopy(buffers, loader, {1, 0}, 5, 10);  // A again: B is the oldest
  ExpectCopy(buffers, loader, {1, 2}, 0, 10);  // C takes B's buffer
  EXPECT_EQ(loader.calls(), 3);
  ExpectCopy(buffers, loader, {1, 0}, 0, 10);  // A stayed
  EXPECT_EQ(loader.calls(), 3);
  ExpectCopy(buffers, loader, {1, 1}, 0, 10);  // B is read again
  EXPECT_EQ(loader.calls(), 4);
}

TEST(ChunkBuffers, AFailedLoadKeepsNothing) {
  ChunkBuffers buffers(2, kBytes);
  std::string out(10, 'x');
  absl::Status s = buffers.Copy(
      {1, 0},
      [](char* buffer) {
        std::memset(buffer, 'b', kBytes);
        return absl::DataLossError("chunk 0 does not match");
      },
      0, 10, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(out, std::string(10, 'x'));  // nothing handed out
  Counted loader;
  ExpectCopy(buffers, loader, {1, 0}, 0, 10);  // read again, not the bad bytes
  EXPECT_EQ(loader.calls(), 1);
}

TEST(ChunkBuffers, ThreadsAskingForOneChunkAtOnceLoadItOnce) {
  ChunkBuffers buffers(4, kBytes);
  Counted loader;
  loader.set_delay(std::chrono::milliseconds(50));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      ExpectCopy(buffers, loader, {7, 3}, t * 512, 512);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(loader.calls(), 1);
}

TEST(ChunkBuffers, MoreAskersThanBuffersWaitTheirTurn) {
  ChunkBuffers buffers(2, kBytes);
  Counted loader;
  loader.set_delay(std::chrono::milliseconds(5));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int64_t c = 0; c < 20; ++c) {
        ExpectCopy(buffers, loader, {static_cast<uint64_t>(t), c}, c, 100);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(loader.calls(), 8 * 20);
}

}  // namespace
}  // namespace scalai
