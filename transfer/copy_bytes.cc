#include "transfer/copy_bytes.h"

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace scalai {
namespace {

// Below this memcpy moves bytes with vector registers whatever their
// distance; at and above it glibc may switch to `rep movsb`.
constexpr size_t kLoopFrom = 2048;

// How far the destination lies past the source within a page: the slow
// case is a few bytes ahead (docs/benchmarks.md, 2026-12-07, evening).
bool SlowDistance(const void* dst, const void* src) {
  const uintptr_t ahead =
      (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) &
      4095;
  return ahead != 0 && ahead < 64;
}

}  // namespace

void CopyBytes(void* dst, const void* src, size_t n) {
#if defined(__SSE2__)
  if (n >= kLoopFrom && SlowDistance(dst, src)) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    // 64 bytes a step, all four loads before the stores.
    for (; n >= 64; n -= 64, s += 64, d += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 48), e);
    }
    std::memcpy(d, s, n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace scalai
