// Chunk sums and verified reads (issue 16): the hasher agrees with hashing
// each chunk alone however the bytes are fed; a BlobReader hands out only
// bytes that match their chunk sums, whichever way it read them from the
// disk, and names the blob, step and chunk when they do not; a store's
// records without chunk sums get them at the next writable open when the
// bytes still match; a file saved with rewrites gets the sums of its final
// bytes.
#include "transfer/blob_checksum.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <random>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ptc/status_macros.h"
#include "tests/scratch_dir.h"
#include "transfer/blob_reader.h"
#include "transfer/chunk_hold.h"
#include "transfer/step_writer.h"
#include "transfer/store.h"
#include "xxhash.h"

// ReadAround's answers to a filesystem that does not take O_DIRECT as it
// promised, or a disk that fails: every preadv of this binary goes through
// the wrapper below (linked with --wrap=preadv64, tests/transfer/meson.build),
// which does as `g_preadv_fault` says to reads of descriptors opened with
// O_DIRECT.
enum class PreadvFault {
  kNone,
  kRefuseDirect,  // EINVAL, as a filesystem that takes O_DIRECT at open only
  kShortMidPage,  // the first kShortBytes only, the rest of the buffer wiped
  kFail,          // EIO
  kEndEarly,      // 0: the file ends here
};
std::atomic<PreadvFault> g_preadv_fault{PreadvFault::kNone};
std::atomic<int> g_direct_preadvs{0};  // preadv calls on O_DIRECT descriptors
constexpr ssize_t kShortBytes = 5000;  // a page and then some

extern "C" ssize_t __real_preadv64(int fd, const iovec* iov, int count,
                                   off_t offset);
extern "C" ssize_t __wrap_preadv64(int fd, const iovec* iov, int count,
                                   off_t offset) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_DIRECT) == 0) {
    return __real_preadv64(fd, iov, count, offset);
  }
  ++g_direct_preadvs;
  switch (g_preadv_fault.load()) {
    case PreadvFault::kNone:
      return __real_preadv64(fd, iov, count, offset);
    case PreadvFault::kRefuseDirect:
      errno = EINVAL;
      return -1;
    case PreadvFault::kFail:
      errno = EIO;
      return -1;
    case PreadvFault::kEndEarly:
      return 0;
    case PreadvFault::kShortMidPage:
      break;
  }
  const ssize_t n = __real_preadv64(fd, iov, count, offset);
  if (n <= kShortBytes) return n;
  // Bytes past the short count are not the file's: a reader that took
  // them would fail the chunk's check.
  ssize_t at = 0;
  for (int i = 0; i < count; ++i) {
    const ssize_t keep =
        std::clamp<ssize_t>(kShortBytes - at, 0, iov[i].iov_len);
    memset(static_cast<char*>(iov[i].iov_base) + keep, 0,
           iov[i].iov_len - keep);
    at += iov[i].iov_len;
  }
  return kShortBytes;
}

namespace scalai {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

std::vector<uint64_t> SumsOf(const std::string& bytes) {
  std::vector<uint64_t> sums;
  for (size_t at = 0; at < bytes.size(); at += kBlobChunkBytes) {
    sums.push_back(
        HashChunk(bytes.data() + at,
                  std::min<int64_t>(kBlobChunkBytes, bytes.size() - at)));
  }
  return sums;
}

TEST(ChunkHasher, AgreesWithEachChunkHashedAloneHoweverFed) {
  std::mt19937_64 rng(7);
  for (size_t size :
       {size_t{0}, size_t{1}, size_t(kBlobChunkBytes),
        size_t(kBlobChunkBytes) + 1, size_t(3.5 * kBlobChunkBytes)}) {
    const std::string bytes = RandomBytes(rng, size);
    ChunkHasher hasher;
    for (size_t at = 0; at < size;) {
      const size_t n = std::min<size_t>(size - at, 1 + rng() % (3 << 20));
      hasher.Update(bytes.data() + at, n);
      at += n;
    }
    EXPECT_EQ(hasher.bytes(), static_cast<int64_t>(size));
    EXPECT_EQ(hasher.Finish(), SumsOf(bytes)) << size;
    EXPECT_EQ(static_cast<int64_t>(hasher.Finish().size()), ChunkCount(size));
  }
}

TEST(ChunkSums, EncodeDecodeRoundTripAndRefuseDamage) {
  std::vector<uint64_t> sums = {0, 1, 0xdeadbeefcafef00dull};
  EXPECT_EQ(*DecodeChunkSums(EncodeChunkSums(sums)), sums);
  EXPECT_FALSE(DecodeChunkSums("0123").ok());
  EXPECT_FALSE(DecodeChunkSums("zz23456789abcdef").ok());
}

// Whether any page of the file at `path` is in the page cache.
bool AnyPageCached(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0);
  struct stat st;
  EXPECT_EQ(fstat(fd, &st), 0);
  void* map = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  EXPECT_NE(map, MAP_FAILED);
  const long page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> resident((st.st_size + page - 1) / page);
  EXPECT_EQ(mincore(map, st.st_size, resident.data()), 0);
  munmap(map, st.st_size);
  return std::any_of(resident.begin(), resident.end(),
                     [](unsigned char r) { return r & 1; });
}

// Written back and dropped from the page cache; false where the page cache
// cannot be dropped (a tmpfs), where these reads go through it anyway. A
// read through a mapping just before may have left the kernel's read-ahead
// in flight, whose pages count as cached only once read, after a drop:
// dropped again until none come back in two pauses running.
bool DropCache(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(fdatasync(fd), 0);
  int clean = 0;
  for (int attempt = 0; attempt < 40 && clean < 2; ++attempt) {
    if (clean == 0) {
      EXPECT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    clean = AnyPageCached(path) ? 0 : clean + 1;
  }
  close(fd);
  return clean == 2;
}

class BlobReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = Store::Create((dir_ / "store").string(),
                               *Layout::Load("megatron-core-gpt"));
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  void TearDown() override { store_.reset(); }

  // A blob file with `bytes` and its record (chunk sums, or the whole-blob
  // sum of an older store when `legacy`).
  std::string AddBlob(const std::string& bytes, bool legacy = false,
                      int64_t step = 7) {
    const std::string name = Store::NewBlobName();
    std::ofstream(store_->BlobPath(name), std::ios::binary) << bytes;
    BlobRecord record{static_cast<int64_t>(bytes.size()), SumsOf(bytes), step};
    if (legacy) {
      record.chunks.clear();
      record.whole_xxh3 = XXH3_64bits(bytes.data(), bytes.size());
    }
    Catalog::Batch batch;
    batch.Put(Table::kBlobs, name, Store::EncodeBlob(record));
    EXPECT_TRUE(store_->catalog().Commit(batch).ok());
    return name;
  }

  // Changes one byte in place, as a bit flip on disk would, and moves the
  // file's mtime on (the kernel's clock may not have ticked yet).
  void Flip(const std::string& name, int64_t offset) {
    const std::string path = store_->BlobPath(name);
    int fd = open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char c;
    ASSERT_EQ(pread(fd, &c, 1, offset), 1);
    c = static_cast<char>(c ^ 0x40);
    ASSERT_EQ(pwrite(fd, &c, 1, offset), 1);
    struct stat st;
    ASSERT_EQ(fstat(fd, &st), 0);
    timespec times[2] = {st.st_atim, st.st_mtim};
    times[1].tv_sec += 1;
    ASSERT_EQ(futimens(fd, times), 0);
    close(fd);
  }

  ScratchDir scratch_{"blob-reader"};  // first: it outlives the store
  const fs::path dir_ = scratch_.path();
  std::unique_ptr<Store> store_;
};

TEST_F(BlobReaderTest, ServesMatchingBytesAndNamesTheBadChunk) {
  std::mt19937_64 rng(1);
  const std::string bytes = RandomBytes(rng, 3 * kBlobChunkBytes + 100);
  const std::string name = AddBlob(bytes);
  auto blob = BlobReader::Open(*store_, name);
  std::string out(bytes.size(), '\0');
  ASSERT_TRUE(blob->Read(out.data(), out.size(), 0).ok());
  EXPECT_EQ(out, bytes);

  // A byte of chunk 2 changes after the chunk was verified: the change of
  // the file is seen and the chunk checked again.
  Flip(name, 2 * kBlobChunkBytes + 5);
  absl::Status s = blob->Verify(2 * kBlobChunkBytes, 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(name));
  EXPECT_THAT(s.message(), HasSubstr("step 7"));
  EXPECT_THAT(s.message(), HasSubstr("chunk 2"));
  // The other chunks are intact and still served.
  EXPECT_TRUE(blob->Read(out.data(), kBlobChunkBytes, 0).ok());
  EXPECT_TRUE(blob->Verify(3 * kBlobChunkBytes, 100).ok());
  // A reader opened afterwards refuses it too.
  auto again = BlobReader::Open(*store_, name);
  EXPECT_FALSE(again->Read(out.data(), 1, 2 * kBlobChunkBytes).ok());
  // Past the recorded end is refused, not read.
  EXPECT_FALSE(again->Verify(bytes.size() - 1, 2).ok());
}

// The two ways a cold chunk is read, each checked in the buffer it was
// read into: around the page cache into the process's ChunkHold, and, while
// a SharedPageCache lives (a materialization reading the same blobs beside
// the mount), with pread into a buffer.
enum class ColdPath { kHold, kSharedPageCache };

std::string PathName(ColdPath path) {
  return path == ColdPath::kHold ? "Hold" : "SharedPageCache";
}
void PrintTo(ColdPath path, std::ostream* os) { *os << PathName(path); }

class ColdReadTest : public BlobReaderTest,
                     public ::testing::WithParamInterface<ColdPath> {
 protected:
  void SetUp() override {
    BlobReaderTest::SetUp();
    if (GetParam() == ColdPath::kSharedPageCache) sharing_.emplace();
  }
  // After a read from a cold cache: whether it went the way asked for.
  void ExpectReadThroughThePageCache(const std::string& path,
                                     bool was_cold) const {
    if (!was_cold) return;  // a tmpfs: both ways go through the page cache
    EXPECT_EQ(AnyPageCached(path), GetParam() == ColdPath::kSharedPageCache);
  }

  std::optional<ChunkHold::SharedPageCache> sharing_;
};

INSTANTIATE_TEST_SUITE_P(BothPaths, ColdReadTest,
                         ::testing::Values(ColdPath::kHold,
                                           ColdPath::kSharedPageCache),
                         [](const auto& info) { return PathName(info.param); });

// Damage on the disk is caught in a chunk read from it, by a read and by a
// Verify alike.
TEST_P(ColdReadTest, ChunksReadFromTheDiskAreChecked) {
  std::mt19937_64 rng(9);
  const std::string bytes = RandomBytes(rng, 2 * kBlobChunkBytes + 5);
  const std::string name = AddBlob(bytes);
  const std::string path = store_->BlobPath(name);
  Flip(name, kBlobChunkBytes + 3);
  const bool cold = DropCache(path);
  auto blob = BlobReader::Open(*store_, name);
  std::string out(kBlobChunkBytes, '\0');
  // The damaged chunk first: a read of another would bring it in with the
  // kernel's read-ahead.
  absl::Status s = blob->Read(out.data(), 10, kBlobChunkBytes + 100);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("chunk 1"));
  ExpectReadThroughThePageCache(path, cold);
  ASSERT_TRUE(blob->Read(out.data(), kBlobChunkBytes, 0).ok());
  EXPECT_TRUE(out == bytes.substr(0, kBlobChunkBytes));

  DropCache(path);
  s = BlobReader::Open(*store_, name)->Verify(kBlobChunkBytes + 100, 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("chunk 1"));
}

// A read that needs a chunk from the disk is served from the buffer the
// chunk was checked in: through the page cache, whole chunks straight into
// the caller's buffer where it is aligned for the kernel's copy, and parts
// of chunks out of the thread's. Either way the bytes are the blob's, and a
// damaged chunk is refused before any of it is handed out.
TEST_P(ColdReadTest, ReadsFromTheDiskServeTheBytesTheyChecked) {
  std::mt19937_64 rng(11);
  const std::string bytes = RandomBytes(rng, 4 * kBlobChunkBytes + 999);
  const std::string name = AddBlob(bytes);
  const std::string path = store_->BlobPath(name);
  // Read into an aligned buffer, and into one 8 bytes past it.
  const IoBuffer buffer = NewIoBuffer(bytes.size() + 64);
  auto matches = [&](const char* out, int64_t offset, int64_t n) {
    return std::string_view(out, n) ==
           std::string_view(bytes).substr(offset, n);
  };
  // Aligned ranges (chunks copied whole), a range with parts of two chunks
  // around a whole one, the short last chunk, then random ranges; each from
  // a cold cache and a fresh reader, so that no chunk is verified yet.
  std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, 2 * kBlobChunkBytes},
      {kBlobChunkBytes - 10, 2 * kBlobChunkBytes + 20},
      {4 * kBlobChunkBytes, 999},
      {4 * kBlobChunkBytes - 1, 1000},
      {0, static_cast<int64_t>(bytes.size())}};
  for (int i = 0; i < 20; ++i) {
    const int64_t offset = rng() % bytes.size();
    ranges.emplace_back(offset, 1 + rng() % (bytes.size() - offset));
  }
  for (int64_t skew : {0, 8}) {
    char* const out = buffer.get() + skew;
    for (const auto& [offset, n] : ranges) {
      SCOPED_TRACE(absl::StrCat(offset, "+", n, ", skew ", skew));
      const bool cold = DropCache(path);
      auto blob = BlobReader::Open(*store_, name);
      std::fill(out, out + bytes.size(), '\0');
      ASSERT_TRUE(blob->Read(out, n, offset).ok());
      ASSERT_TRUE(matches(out, offset, n));
      ExpectReadThroughThePageCache(path, cold);
      // Read again, now verified: from the mapping, the same bytes.
      std::fill(out, out + bytes.size(), '\0');
      ASSERT_TRUE(blob->Read(out, n, offset).ok());
      ASSERT_TRUE(matches(out, offset, n));
    }
  }
  // Damage in a chunk read whole into the caller's buffer, and in one read
  // in part: both refused, naming the chunk.
  Flip(name, 2 * kBlobChunkBytes + 77);
  for (const auto& [offset, n] :
       {std::pair<int64_t, int64_t>{kBlobChunkBytes, 2 * kBlobChunkBytes},
        {2 * kBlobChunkBytes + 70, 10}}) {
    SCOPED_TRACE(absl::StrCat(offset, "+", n));
    DropCache(path);
    auto blob = BlobReader::Open(*store_, name);
    absl::Status s = blob->Read(buffer.get(), n, offset);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(s.message(), HasSubstr("chunk 2"));
    // The chunk before it is intact and still served.
    ASSERT_TRUE(
        blob->Read(buffer.get(), kBlobChunkBytes, kBlobChunkBytes).ok());
    EXPECT_TRUE(matches(buffer.get(), kBlobChunkBytes, kBlobChunkBytes));
  }
}

// A chunk the page cache lacks is read around it (O_DIRECT) into the
// process's ChunkHold, and the read that wants its other part copies that
// from the hold, not from the disk again: a mount's requests straddle
// chunks. Nothing held outlives a change of the file.
TEST_F(BlobReaderTest, ColdChunksAreReadAroundThePageCacheOnceForBothParts) {
  std::mt19937_64 rng(21);
  const std::string bytes = RandomBytes(rng, 3 * kBlobChunkBytes + 300);
  const std::string name = AddBlob(bytes);
  const std::string path = store_->BlobPath(name);
  if (!DropCache(path)) GTEST_SKIP() << "no page cache to drop under " << path;
  auto blob = BlobReader::Open(*store_, name);
  const int64_t half = kBlobChunkBytes / 2;
  std::string out(kBlobChunkBytes, '\0');
  // The second half of chunk 1 and the first of chunk 2.
  ASSERT_TRUE(
      blob->Read(out.data(), kBlobChunkBytes, kBlobChunkBytes + half).ok());
  EXPECT_TRUE(out == bytes.substr(kBlobChunkBytes + half, kBlobChunkBytes));
  EXPECT_FALSE(AnyPageCached(path)) << "read through the page cache";

  // The disk's copy of chunk 1 goes bad behind the reader's back, its time
  // kept: the first half of chunk 1 is still served, from the hold (a
  // read from the disk would get the bad byte: the chunk is verified, and
  // not checked again while the file looks unchanged).
  struct stat before;
  ASSERT_EQ(stat(path.c_str(), &before), 0);
  Flip(name, kBlobChunkBytes + 10);
  const timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  ASSERT_TRUE(DropCache(path));
  ASSERT_TRUE(blob->Read(out.data(), half, kBlobChunkBytes).ok());
  EXPECT_TRUE(out.compare(0, half, bytes, kBlobChunkBytes, half) == 0);

  // Chunk 2's second half is still held, but the file has changed (a new
  // time): it is read from the disk again and checked, and the damage put
  // into it now is found.
  Flip(name, 2 * kBlobChunkBytes + half + 10);
  ASSERT_TRUE(DropCache(path));
  absl::Status s = blob->Read(out.data(), half, 2 * kBlobChunkBytes + half);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("chunk 2"));
}

class ReadAroundFaultTest : public BlobReaderTest {
 protected:
  void TearDown() override {
    g_preadv_fault = PreadvFault::kNone;
    BlobReaderTest::TearDown();
  }

  // A cold blob of ten chunks and a reader of it; false where the page
  // cache cannot be dropped (reads never go around it there).
  bool ColdBlob() {
    std::mt19937_64 rng(31);
    bytes_ = RandomBytes(rng, 10 * kBlobChunkBytes + 300);
    name_ = AddBlob(bytes_);
    path_ = store_->BlobPath(name_);
    if (!DropCache(path_)) return false;
    blob_ = BlobReader::Open(*store_, name_);
    return true;
  }
  // Reads [offset, offset + n) and says whether it got the blob's bytes.
  absl::Status ReadAndCompare(int64_t offset, int64_t n) {
    std::string out(n, '\0');
    RETURN_IF_ERROR(blob_->Read(out.data(), n, offset));
    if (out.compare(0, n, bytes_, offset, n) != 0) {
      return absl::InternalError(absl::StrCat("wrong bytes at ", offset));
    }
    return absl::OkStatus();
  }

  std::string bytes_;
  std::string name_;
  std::string path_;
  std::shared_ptr<const BlobReader> blob_;
};

TEST_F(ReadAroundFaultTest, TheWrapperSeesTheReadsAroundThePageCache) {
  if (!ColdBlob()) GTEST_SKIP() << "no page cache to drop under " << path_;
  const int before = g_direct_preadvs;
  ASSERT_TRUE(ReadAndCompare(kBlobChunkBytes + 100, 1000).ok());
  EXPECT_GT(g_direct_preadvs, before) << "--wrap=preadv64 missed ReadAround";
}

// EINVAL from an O_DIRECT read: the rest comes through the page cache, and
// the blob's later reads never try O_DIRECT again.
TEST_F(ReadAroundFaultTest, ARefusedDirectReadFallsBackToThePageCache) {
  if (!ColdBlob()) GTEST_SKIP() << "no page cache to drop under " << path_;
  g_preadv_fault = PreadvFault::kRefuseDirect;
  const int before = g_direct_preadvs;
  absl::Status s = ReadAndCompare(kBlobChunkBytes + 100, kBlobChunkBytes);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(g_direct_preadvs, before + 1);
  EXPECT_TRUE(AnyPageCached(path_));
  ASSERT_TRUE(DropCache(path_));
  // Past the chunks read ahead with the first read, so not checked yet.
  s = ReadAndCompare(8 * kBlobChunkBytes, 2 * kBlobChunkBytes + 300);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(g_direct_preadvs, before + 1) << "O_DIRECT tried again";
}

// An O_DIRECT read that stops short in the middle of a page: the rest of
// the read through the page cache (O_DIRECT cannot start mid-page), and
// nothing past the short count taken.
TEST_F(ReadAroundFaultTest, AShortDirectReadIsFinishedThroughThePageCache) {
  if (!ColdBlob()) GTEST_SKIP() << "no page cache to drop under " << path_;
  g_preadv_fault = PreadvFault::kShortMidPage;
  const int before = g_direct_preadvs;
  absl::Status s = ReadAndCompare(kBlobChunkBytes - 64, kBlobChunkBytes);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(g_direct_preadvs, before + 1);
  // The chunks read ahead in the same read were checked, and are served.
  g_preadv_fault = PreadvFault::kFail;
  s = ReadAndCompare(2 * kBlobChunkBytes, kBlobChunkBytes);
  EXPECT_TRUE(s.ok()) << s;
}

// A failing disk, and a file shorter than its record: the read is refused,
// naming the blob, and nothing is served.
TEST_F(ReadAroundFaultTest, AFailedOrEarlyEndingDirectReadIsRefused) {
  if (!ColdBlob()) GTEST_SKIP() << "no page cache to drop under " << path_;
  g_preadv_fault = PreadvFault::kFail;
  absl::Status s = ReadAndCompare(kBlobChunkBytes + 100, 1000);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(path_));
  g_preadv_fault = PreadvFault::kEndEarly;
  s = ReadAndCompare(3 * kBlobChunkBytes + 100, 1000);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("ends at byte ", 3 * kBlobChunkBytes)));
  // The disk well again: the same bytes are served.
  g_preadv_fault = PreadvFault::kNone;
  s = ReadAndCompare(kBlobChunkBytes + 100, 1000);
  EXPECT_TRUE(s.ok()) << s;
  s = ReadAndCompare(3 * kBlobChunkBytes + 100, 1000);
  EXPECT_TRUE(s.ok()) << s;
}

// Eight threads read a cold blob at once in requests of 960 KiB that start
// 24 bytes in, as a mount's read-ahead does: each chunk's two parts are
// wanted by two threads at the same time, and every byte comes out right.
TEST_F(BlobReaderTest, ConcurrentRequestsThatStraddleColdChunksGetTheirBytes) {
  std::mt19937_64 rng(23);
  const std::string bytes = RandomBytes(rng, 12 * kBlobChunkBytes + 4000);
  const std::string name = AddBlob(bytes);
  const std::string path = store_->BlobPath(name);
  constexpr int64_t kRequest = 960 << 10;
  for (int round = 0; round < 3; ++round) {
    const bool cold = DropCache(path);
    auto blob = BlobReader::Open(*store_, name);
    std::string out(bytes.size(), '\0');
    std::atomic<int64_t> next{24};
    std::atomic<int> failed{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&] {
        for (;;) {
          const int64_t at = next.fetch_add(kRequest);
          if (at >= static_cast<int64_t>(bytes.size())) break;
          const int64_t n = std::min<int64_t>(kRequest, bytes.size() - at);
          if (!blob->Read(out.data() + at, n, at).ok()) ++failed;
        }
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(failed, 0);
    EXPECT_TRUE(out.compare(24, std::string::npos, bytes, 24) == 0)
        << "round " << round;
    if (cold) {
      EXPECT_FALSE(AnyPageCached(path)) << "round " << round;
    }
  }
}

// Eight threads want parts of one damaged cold chunk at once: one reads it
// into the hold and finds the damage, and those that waited for that fill
// are refused too, never handed the slot's bytes.
TEST_F(BlobReaderTest, ReadersWaitingOnADamagedChunkAreRefusedToo) {
  std::mt19937_64 rng(29);
  const std::string bytes = RandomBytes(rng, 4 * kBlobChunkBytes);
  const std::string name = AddBlob(bytes);
  const std::string path = store_->BlobPath(name);
  Flip(name, 2 * kBlobChunkBytes + 12345);
  constexpr int kThreads = 8;
  constexpr int64_t kSlice = kBlobChunkBytes / kThreads;
  for (int round = 0; round < 10; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    DropCache(path);
    auto blob = BlobReader::Open(*store_, name);
    std::atomic<int> ready{0};
    std::atomic<int> refused{0};
    std::atomic<int> served{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::string out(kSlice, '\0');
        ++ready;
        while (ready.load() < kThreads) std::this_thread::yield();
        absl::Status s =
            blob->Read(out.data(), kSlice, 2 * kBlobChunkBytes + t * kSlice);
        if (absl::IsDataLoss(s)) ++refused;
        if (s.ok()) ++served;
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(served, 0);
    EXPECT_EQ(refused, kThreads);
  }
}

// A chunk is read for its check with pread through the blob's name; once
// the name is gone (a step retired while a reader has it open) the mapping
// still serves the file, checked the same way.
TEST_F(BlobReaderTest, ChunksAreCheckedThroughTheMappingOnceTheNameIsGone) {
  std::mt19937_64 rng(3);
  const std::string bytes = RandomBytes(rng, 3 * kBlobChunkBytes + 7);
  const std::string name = AddBlob(bytes);
  auto blob = BlobReader::Open(*store_, name);
  const std::string path = store_->BlobPath(name);
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(unlink(path.c_str()), 0);
  // Chunk 1 is damaged after the name went, through a descriptor opened
  // before.
  char c = 0;
  ASSERT_EQ(pread(fd, &c, 1, kBlobChunkBytes + 9), 1);
  c = static_cast<char>(c ^ 0x10);
  ASSERT_EQ(pwrite(fd, &c, 1, kBlobChunkBytes + 9), 1);
  close(fd);
  std::string out(kBlobChunkBytes + 7, '\0');
  ASSERT_TRUE(blob->Read(out.data(), kBlobChunkBytes, 0).ok());
  EXPECT_TRUE(out.compare(0, kBlobChunkBytes, bytes, 0, kBlobChunkBytes) == 0);
  absl::Status s = blob->Read(out.data(), 10, kBlobChunkBytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("chunk 1"));
  ASSERT_TRUE(
      blob->Read(out.data(), kBlobChunkBytes + 7, 2 * kBlobChunkBytes).ok());
  EXPECT_TRUE(out == bytes.substr(2 * kBlobChunkBytes));
}

// Another file put in a blob's place (a copy restored over the store, a
// tool that writes beside and renames) is never read in its stead: a reader
// that has verified the blob's chunks serves them from the file it mapped,
// by every path, and opens no descriptor on the newcomer.
TEST_F(BlobReaderTest, AFilePutInTheBlobsPlaceIsNeverRead) {
  std::mt19937_64 rng(31);
  const std::string bytes = RandomBytes(rng, 3 * kBlobChunkBytes + 11);
  const std::string name = AddBlob(bytes);
  const std::string path = store_->BlobPath(name);
  auto blob = BlobReader::Open(*store_, name);
  std::string out(bytes.size(), '\0');
  ASSERT_TRUE(blob->Read(out.data(), out.size(), 0).ok());  // all verified
  const std::string other = RandomBytes(rng, bytes.size());
  std::ofstream(path + ".new", std::ios::binary) << other;
  ASSERT_EQ(rename((path + ".new").c_str(), path.c_str()), 0);

  EXPECT_FALSE(blob->OpenFd().ok());
  std::fill(out.begin(), out.end(), '\0');
  ASSERT_TRUE(blob->Read(out.data(), out.size(), 0).ok());
  EXPECT_TRUE(out == bytes);
  std::unique_ptr<char[]> buffer(new char[kBlobChunkBytes]);
  out.clear();
  ASSERT_TRUE(blob->ReadInto(0, bytes.size(), buffer.get(),
                             [&](const char* data, int64_t n) {
                               out.append(data, n);
                               return absl::OkStatus();
                             })
                  .ok());
  EXPECT_TRUE(out == bytes);
}

// The materializer's path: pread a chunk at a time, never the mapping.
TEST_F(BlobReaderTest, ReadIntoVerifiesWhatItHandsOut) {
  std::mt19937_64 rng(5);
  const std::string bytes = RandomBytes(rng, 4 * kBlobChunkBytes + 999);
  const std::string name = AddBlob(bytes);
  std::unique_ptr<char[]> buffer(new char[kBlobChunkBytes]);
  auto read_into = [&](const BlobReader& blob, int64_t offset, int64_t n,
                       std::string& out) {
    out.clear();
    return blob.ReadInto(offset, n, buffer.get(),
                         [&](const char* data, int64_t k) {
                           EXPECT_LE(k, kBlobChunkBytes);
                           out.append(data, k);
                           return absl::OkStatus();
                         });
  };
  auto blob = BlobReader::Open(*store_, name);
  std::string out;
  for (int i = 0; i < 30; ++i) {
    const int64_t offset = rng() % bytes.size();
    const int64_t n = rng() % (bytes.size() - offset + 1);
    ASSERT_TRUE(read_into(*blob, offset, n, out).ok());
    EXPECT_EQ(out, bytes.substr(offset, n));
  }
  Flip(name, 3 * kBlobChunkBytes + 1);
  auto fresh = BlobReader::Open(*store_, name);
  absl::Status s = read_into(*fresh, 0, bytes.size(), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("chunk 3"));
  // The chunks before it were handed out; nothing of chunk 3 was.
  EXPECT_EQ(out, bytes.substr(0, 3 * kBlobChunkBytes));
  EXPECT_FALSE(read_into(*fresh, bytes.size() - 5, 10, out).ok());
}

TEST_F(BlobReaderTest, TruncatedMissingAndUnrecordedBlobsFailEachRead) {
  std::mt19937_64 rng(2);
  const std::string bytes = RandomBytes(rng, 2 * kBlobChunkBytes);
  const std::string short_blob = AddBlob(bytes);
  auto blob = BlobReader::Open(*store_, short_blob);
  ASSERT_EQ(truncate(store_->BlobPath(short_blob).c_str(), kBlobChunkBytes), 0);
  std::string out(16, '\0');
  absl::Status s = blob->Read(out.data(), 16, kBlobChunkBytes + 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("has ", kBlobChunkBytes)));
  EXPECT_THAT(s.message(), HasSubstr(short_blob));

  const std::string gone = AddBlob(bytes);
  ASSERT_EQ(unlink(store_->BlobPath(gone).c_str()), 0);
  s = BlobReader::Open(*store_, gone)->Read(out.data(), 16, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(gone));
  EXPECT_THAT(s.message(), HasSubstr("cannot be opened"));

  s = BlobReader::Open(*store_, "unknown.blob")->Read(out.data(), 16, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("not recorded"));
}

TEST_F(BlobReaderTest, OlderRecordsGetChunkSumsAtTheNextWritableOpen) {
  std::mt19937_64 rng(3);
  const std::string good = RandomBytes(rng, 2 * kBlobChunkBytes + 3);
  const std::string bad = RandomBytes(rng, kBlobChunkBytes / 2);
  const std::string good_name = AddBlob(good, /*legacy=*/true);
  const std::string bad_name = AddBlob(bad, /*legacy=*/true);
  Flip(bad_name, 10);
  // Until then, an older record is verified as one chunk.
  std::string out(good.size(), '\0');
  EXPECT_TRUE(BlobReader::Open(*store_, good_name)
                  ->Read(out.data(), out.size(), 0)
                  .ok());
  EXPECT_EQ(out, good);

  const std::string dir = store_->dir();
  store_.reset();
  store_ = *Store::Open(dir);
  EXPECT_EQ(store_->blobs_upgraded(), 1);
  EXPECT_EQ(store_->blobs_not_upgraded(), 1);
  BlobRecord upgraded = *store_->Blob(good_name);
  EXPECT_FALSE(upgraded.whole_xxh3);
  EXPECT_EQ(upgraded.chunks, SumsOf(good));
  // The damaged one keeps its whole-blob sum, and reads of it fail.
  EXPECT_TRUE(store_->Blob(bad_name)->whole_xxh3);
  absl::Status s = BlobReader::Open(*store_, bad_name)->Read(out.data(), 1, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("chunk 0"));
  // Nothing more to do the next time.
  store_.reset();
  store_ = *Store::Open(dir);
  EXPECT_EQ(store_->blobs_upgraded(), 0);
}

// What the file holds now, read back through the ShardFile.
std::string Contents(ShardFile& f) {
  std::string out(f.size(), '\0');
  EXPECT_EQ(*f.Read(out.data(), out.size(), 0), f.size());
  return out;
}

TEST_F(BlobReaderTest, SavedFileSumsAreOfTheBytesAsClosed) {
  std::mt19937_64 rng(4);
  const std::string final_bytes = RandomBytes(rng, 5 * kBlobChunkBytes + 77);
  // A placeholder header, the data streamed, the real header written last.
  {
    auto f = *ShardFile::Scratch(store_->blob_dir(), 1 << 30);
    std::string placeholder(4096, '\0');
    ASSERT_TRUE(f->Write(placeholder.data(), placeholder.size(), 0).ok());
    ASSERT_TRUE(
        f->Write(final_bytes.data() + 4096, final_bytes.size() - 4096, 4096)
            .ok());
    ASSERT_TRUE(f->Write(final_bytes.data(), 4096, 0).ok());
    EXPECT_EQ(Contents(*f), final_bytes);
    EXPECT_EQ(*f->ChunkSums(), SumsOf(final_bytes));
  }
  // Random overlapping pieces, in any order, then a second pass.
  for (int round = 0; round < 3; ++round) {
    auto f = *ShardFile::Scratch(store_->blob_dir(), 1 << 30);
    const std::string junk = RandomBytes(rng, final_bytes.size());
    for (const std::string* src : {&junk, &final_bytes}) {
      for (int i = 0; i < 40; ++i) {
        const size_t at = rng() % final_bytes.size();
        const size_t n =
            std::min<size_t>(final_bytes.size() - at, 1 + rng() % (2 << 20));
        ASSERT_TRUE(f->Write(src->data() + at, n, at).ok());
      }
      ASSERT_TRUE(f->ChunkSums().ok());  // a close between the passes
    }
    // Whatever the pieces missed, written in order at the end.
    ASSERT_TRUE(f->Write(final_bytes.data(), final_bytes.size(), 0).ok());
    EXPECT_EQ(*f->ChunkSums(), SumsOf(final_bytes)) << "round " << round;
  }
  // Written, truncated, written again.
  {
    auto f = *ShardFile::Scratch(store_->blob_dir(), 1 << 30);
    std::string first = RandomBytes(rng, 3 * kBlobChunkBytes);
    ASSERT_TRUE(f->Write(first.data(), first.size(), 0).ok());
    ASSERT_TRUE(f->Truncate().ok());
    ASSERT_TRUE(f->Write(final_bytes.data(), final_bytes.size(), 0).ok());
    EXPECT_EQ(*f->ChunkSums(), SumsOf(final_bytes));
  }
}

// Issue 24: a write past the largest valid size fails at once and writes
// nothing, so no blob grows sparse to a terabyte.
TEST_F(BlobReaderTest, WritesPastTheLimitAreRefusedWritingNothing) {
  auto f = *ShardFile::Scratch(store_->blob_dir(), 1000);
  const std::string ten = "0123456789";
  ASSERT_TRUE(f->Write(ten.data(), ten.size(), 990).ok());
  absl::Status s = f->Write(ten.data(), ten.size(), int64_t{1} << 40);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("largest valid size"));
  EXPECT_EQ(f->Write(ten.data(), ten.size(), 991).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(f->size(), 1000);
  EXPECT_EQ(ShardFile::SizeLimit(5), 8 + (100 << 20) + 5);
}

}  // namespace
}  // namespace scalai
