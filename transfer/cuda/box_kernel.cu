#include <cuda_runtime.h>

#include "transfer/cuda/box_kernel.h"

namespace scalai {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

// Copies `bytes` contiguous bytes (a multiple of sizeof(Word)) from src to
// dst, or writes zeros when src is null, with the threads [lane, stride).
template <typename Word>
__device__ void CopyWords(const std::byte* src, std::byte* dst, int64_t bytes,
                          int lane, int stride) {
  const int64_t words = bytes / static_cast<int64_t>(sizeof(Word));
  Word* to = reinterpret_cast<Word*>(dst);
  if (src == nullptr) {
    const Word zero{};
    for (int64_t i = lane; i < words; i += stride) to[i] = zero;
    return;
  }
  const Word* from = reinterpret_cast<const Word*>(src);
  for (int64_t i = lane; i < words; i += stride) to[i] = from[i];
}

__device__ void CopyAligned(int align, const std::byte* src, std::byte* dst,
                            int64_t bytes, int lane, int stride) {
  switch (align) {
    case 16:
      CopyWords<uint4>(src, dst, bytes, lane, stride);
      break;
    case 8:
      CopyWords<uint2>(src, dst, bytes, lane, stride);
      break;
    case 4:
      CopyWords<uint32_t>(src, dst, bytes, lane, stride);
      break;
    case 2:
      CopyWords<uint16_t>(src, dst, bytes, lane, stride);
      break;
    default:
      CopyWords<uint8_t>(src, dst, bytes, lane, stride);
      break;
  }
}

__global__ void BoxKernel(const BoxRuns* boxes, const BoxWork* work, int count,
                          int64_t units) {
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    // The box of this unit: the last whose first unit is at or before it.
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (work[mid].unit_begin <= unit) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const BoxRuns& r = boxes[lo];
    const BoxWork& w = work[lo];
    const int64_t k = unit - w.unit_begin;
    int64_t s = 0, t = 0;
    if (w.parts_per_run > 1) {
      // One part of a long run, by the whole block.
      const int64_t run = k / w.parts_per_run;
      const int64_t begin = (k % w.parts_per_run) * kUnitBytes;
      const int64_t end =
          begin + kUnitBytes < r.run_bytes ? begin + kUnitBytes : r.run_bytes;
      RunOffsets(r, run, s, t);
      CopyAligned(r.align, r.src == nullptr ? nullptr : r.src + s + begin,
                  r.dst + t + begin, end - begin, threadIdx.x, blockDim.x);
      continue;
    }
    // Whole runs, one per warp at a time.
    const int64_t first = k * w.runs_per_unit;
    const int64_t last =
        first + w.runs_per_unit < r.runs ? first + w.runs_per_unit : r.runs;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    for (int64_t run = first + warp; run < last; run += blockDim.x / kWarp) {
      RunOffsets(r, run, s, t);
      CopyAligned(r.align, r.src == nullptr ? nullptr : r.src + s, r.dst + t,
                  r.run_bytes, lane, kWarp);
    }
  }
}

}  // namespace

cudaError_t LaunchBoxKernel(const BoxRuns* boxes, const BoxWork* work,
                            int count, int64_t units, int blocks,
                            cudaStream_t stream) {
  if (count == 0 || units == 0) return cudaSuccess;
  BoxKernel<<<blocks, kThreads, 0, stream>>>(boxes, work, count, units);
  return cudaGetLastError();
}

}  // namespace scalai
