#include "transfer/copy_bytes.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace scalai {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Every distance from the source to the destination within a page near the
// slow one (and the usual ones), every source alignment that matters, and
// lengths on both sides of the vector loop's thresholds: the bytes copied are
// the source's, and not one byte around them changes.
TEST(CopyBytesTest, CopiesExactlyAtEveryDistance) {
  constexpr size_t kBuffer = 1 << 20;
  std::unique_ptr<uint8_t, FreeDeleter> src(
      static_cast<uint8_t*>(std::aligned_alloc(4096, kBuffer)));
  std::unique_ptr<uint8_t, FreeDeleter> dst(
      static_cast<uint8_t*>(std::aligned_alloc(4096, kBuffer)));
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < kBuffer; ++i) src.get()[i] = rng() & 0xff;
  const std::vector<size_t> lengths = {0,    1,    15,    63,    64,    65,
                                       127,  2047, 2048,  2049,  2111,  4096,
                                       4109, 8191, 65536, 70001, 300007};
  const std::vector<size_t> source_offsets = {0, 7, 64, 4090};
  int copies = 0;
  for (size_t so : source_offsets) {
    for (int ahead = -70; ahead <= 70; ++ahead) {
      const size_t dof = (so + 4096 + ahead) % 4096 + 4096;
      for (size_t n : lengths) {
        uint8_t* d = dst.get() + dof;
        const uint8_t* s = src.get() + so;
        std::fill(dst.get(), dst.get() + dof + n + 256, uint8_t{0xA5});
        CopyBytes(d, s, n);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(d[i], s[i])
              << "byte " << i << " of " << n << ", source +" << so
              << ", destination " << ahead << " bytes past it";
        }
        for (size_t i = dof - 64; i < dof; ++i) ASSERT_EQ(dst.get()[i], 0xA5);
        for (size_t i = dof + n; i < dof + n + 256; ++i) {
          ASSERT_EQ(dst.get()[i], 0xA5)
              << "byte " << i - dof << " past a copy of " << n;
        }
        ++copies;
      }
    }
  }
  EXPECT_EQ(copies, 4 * 141 * 17);
}

}  // namespace
}  // namespace scalai
