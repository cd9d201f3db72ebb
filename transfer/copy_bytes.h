// CopyBytes is memcpy for the bulk copies of tensor bytes, which land at
// whatever offset a checkpoint's layout gives them: glibc's memcpy (its
// `rep movsb` range, about 2 KiB to half a MiB) runs at a tenth to a
// thirtieth of its speed on this project's test machines (AMD EPYC) when the
// destination lies 1 to 31 bytes past the source modulo a 4 KiB page, and
// the safetensors header of a stored shard put every tensor of the
// benchmarks' step 16 or 24 bytes past its place in the blob. Copies of
// 2 KiB or more whose destination is 1 to 63 bytes ahead (a margin past 31)
// take a plain vector loop instead, at 29-46 GB/s; every other copy is
// memcpy's (docs/benchmarks.md, 2026-12-07, evening).
//
//   CopyBytes(reply + at, blob + offset, n);  // no overlap, as memcpy
#ifndef SCALAI_TRANSFER_COPY_BYTES_H_
#define SCALAI_TRANSFER_COPY_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace scalai {

// The copy that takes the loop; CopyBytes decides.
void CopyBytesAhead(void* dst, const void* src, size_t n);

// Inline, so that the many short copies of a reshard (rows of a tensor
// split along dim 1) cost what memcpy costs.
inline void CopyBytes(void* dst, const void* src, size_t n) {
  // Below 2 KiB glibc copies with vector registers at any distance.
  constexpr size_t kLoopFrom = 2048;
  const uintptr_t ahead =
      (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) &
      4095;
  if (n >= kLoopFrom && ahead != 0 && ahead < 64) {
    CopyBytesAhead(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

}  // namespace scalai

#endif  // SCALAI_TRANSFER_COPY_BYTES_H_
