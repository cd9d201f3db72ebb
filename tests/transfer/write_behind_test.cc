#include "transfer/write_behind.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transfer/files.h"

namespace scalai {
namespace {

constexpr int64_t kSpan = WriteBehind::kSpanBytes;
constexpr int64_t kWindow = WriteBehind::kWindowBytes;

// Whatever the sizes of the writes, the spans started tile the whole spans
// written so far, and the spans dropped tile everything a window behind.
TEST(WriteBehind, SpansTileTheFileBehindTheFrontier) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    WriteBehind behind;
    int64_t frontier = 0, started = 0, dropped = 0;
    for (int write = 0; write < 100; ++write) {
      frontier += static_cast<int64_t>(rng() % (3 * kSpan));
      const WriteBehind::Spans s = behind.Advance(frontier);
      if (s.start_to > s.start_from) {
        EXPECT_EQ(s.start_from, started);
        started = s.start_to;
      }
      if (s.drop_to > s.drop_from) {
        EXPECT_EQ(s.drop_from, dropped);
        dropped = s.drop_to;
      }
      EXPECT_EQ(started, frontier / kSpan * kSpan);
      EXPECT_EQ(dropped, std::max<int64_t>(0, started - kWindow));
    }
  }
}

TEST(WriteBehind, NothingIsDueBeforeAWholeSpan) {
  WriteBehind behind;
  const WriteBehind::Spans s = behind.Advance(kSpan - 1);
  EXPECT_EQ(s.start_to, s.start_from);
  EXPECT_EQ(s.drop_to, s.drop_from);
}

TEST(WriteBehind, KeepOnlyStartsWriteback) {
  WriteBehind behind(WriteBehind::Pages::kKeep);
  const WriteBehind::Spans s = behind.Advance(10 * kSpan);
  EXPECT_EQ(s.start_from, 0);
  EXPECT_EQ(s.start_to, 10 * kSpan);
  EXPECT_EQ(s.drop_to, s.drop_from);
}

TEST(WriteBehind, ResetStartsOverForAnEmptiedFile) {
  WriteBehind behind;
  behind.Advance(5 * kSpan);
  behind.Reset();
  const WriteBehind::Spans s = behind.Advance(kSpan);
  EXPECT_EQ(s.start_from, 0);
  EXPECT_EQ(s.start_to, kSpan);
}

// On a real file: the bytes are all there, and the pages a window behind
// the end have left the page cache.
TEST(WriteBehind, StreamsARealFileAndDropsItsOldPages) {
  const std::string path = testing::TempDir() + "/write_behind_test.bin";
  unlink(path.c_str());
  auto fd = OpenFile(path, O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const int64_t chunk = 1 << 20, total = 5 * kSpan + 12345;
  std::vector<char> data(chunk);
  WriteBehind behind;
  for (int64_t at = 0; at < total; at += chunk) {
    const int64_t n = std::min(chunk, total - at);
    for (int64_t i = 0; i < n; ++i) data[i] = static_cast<char>((at + i) * 31);
    ASSERT_TRUE(WriteAll(fd->get(), data.data(), n, path).ok());
    ASSERT_TRUE(
        WriteBehind::Apply(fd->get(), behind.Advance(at + n), path).ok());
  }
  ASSERT_EQ(fdatasync(fd->get()), 0);

  void* map = mmap(nullptr, total, PROT_READ, MAP_SHARED, fd->get(), 0);
  ASSERT_NE(map, MAP_FAILED);
  struct statfs fs;
  ASSERT_EQ(fstatfs(fd->get(), &fs), 0);
  if (fs.f_type != TMPFS_MAGIC) {  // tmpfs pages are the file: never dropped
    const int64_t page = sysconf(_SC_PAGESIZE);
    std::vector<unsigned char> resident((total + page - 1) / page);
    ASSERT_EQ(mincore(map, total, resident.data()), 0);
    const int64_t dropped_pages = (5 * kSpan - kWindow) / page;
    int64_t still = 0;
    for (int64_t p = 0; p < dropped_pages; ++p) still += resident[p] & 1;
    EXPECT_EQ(still, 0) << "pages a window behind the end are still cached";
  }
  const char* bytes = static_cast<const char*>(map);
  int64_t wrong = 0;
  for (int64_t i = 0; i < total; ++i) {
    wrong += bytes[i] != static_cast<char>(i * 31);
  }
  EXPECT_EQ(wrong, 0);
  munmap(map, total);
  unlink(path.c_str());
}

}  // namespace
}  // namespace scalai
