// One box copy flattened for a copy engine: a set of equal contiguous runs,
// each found from its index by a few multiply-adds. The same struct and the
// same address arithmetic serve the host loop and the CUDA kernel (this
// header compiles under nvcc and has no dependencies), so the host tests
// check the arithmetic the GPU runs.
//
//   BoxRuns r = ...;  // from BoxBatch
//   for (int64_t i = 0; i < r.runs; ++i) {
//     int64_t s, d;
//     RunOffsets(r, i, s, d);
//     memcpy(r.dst + d, r.src + s, r.run_bytes);
//   }
#ifndef SCALAI_TRANSFER_BOX_RUNS_H_
#define SCALAI_TRANSFER_BOX_RUNS_H_

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SCALAI_HOST_DEVICE __host__ __device__
#else
#define SCALAI_HOST_DEVICE
#endif

namespace scalai {

// Dimensions a box keeps after merging the trailing ones it spans fully;
// tensors of more dimensions than this are cut into boxes of fewer.
inline constexpr int kMaxRunDims = 8;

struct BoxRuns {
  const std::byte* src = nullptr;  // nullptr: the runs are filled with zeros
  std::byte* dst = nullptr;
  int64_t run_bytes = 0;  // bytes of one contiguous run
  int64_t runs = 0;       // product of extent[0..dims)
  int dims = 0;           // outer dimensions that index the runs
  int64_t extent[kMaxRunDims] = {};
  int64_t src_stride[kMaxRunDims] = {};  // bytes
  int64_t dst_stride[kMaxRunDims] = {};  // bytes
  // The largest power of two, up to 16, that divides both base addresses,
  // every stride and run_bytes: the widest word a copy may move.
  int align = 1;
};

// Byte offsets from src and dst of run `index` (0 <= index < runs), the
// outermost dimension varying slowest.
SCALAI_HOST_DEVICE inline void RunOffsets(const BoxRuns& r, int64_t index,
                                          int64_t& src_offset,
                                          int64_t& dst_offset) {
  src_offset = 0;
  dst_offset = 0;
  for (int d = r.dims - 1; d >= 0; --d) {
    const int64_t i = index % r.extent[d];
    index /= r.extent[d];
    src_offset += i * r.src_stride[d];
    dst_offset += i * r.dst_stride[d];
  }
}

}  // namespace scalai

#endif  // SCALAI_TRANSFER_BOX_RUNS_H_
