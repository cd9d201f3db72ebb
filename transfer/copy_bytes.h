// CopyBytes is memcpy for the bulk copies of tensor bytes, which land at
// whatever offset a checkpoint's layout gives them: glibc's memcpy (its
// `rep movsb` range, about 2 KiB to half a MiB) runs at a tenth to a
// thirtieth of its speed on this project's test machines (AMD EPYC) when the
// destination lies 1 to 31 bytes past the source modulo a 4 KiB page, and
// the safetensors header of a stored shard put every tensor of the
// benchmarks' step 16 or 24 bytes past its place in the blob. Those copies
// take a plain vector loop instead; every other copy is memcpy's.
//
//   CopyBytes(reply + at, blob + offset, n);  // no overlap, as memcpy
#ifndef SCALAI_TRANSFER_COPY_BYTES_H_
#define SCALAI_TRANSFER_COPY_BYTES_H_

#include <cstddef>

namespace scalai {

void CopyBytes(void* dst, const void* src, size_t n);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_COPY_BYTES_H_
