// The CUDA kernel behind DeviceBoxCopier (device_box_copy.h), declared in
// plain C++ so that only box_kernel.cu is compiled by nvcc. A launch walks
// every box of a batch: the work is cut into units of kUnitBytes, a long
// run into several units, short runs grouped into one, and each thread
// block takes units by grid stride.
#ifndef SCALAI_TRANSFER_CUDA_BOX_KERNEL_H_
#define SCALAI_TRANSFER_CUDA_BOX_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "transfer/box_runs.h"

namespace scalai {

inline constexpr int64_t kUnitBytes = 64 << 10;

// How one box's runs are cut into units: units [unit_begin, next box's
// unit_begin); a unit is one part of a run when parts_per_run > 1, else
// runs_per_unit whole runs.
struct BoxWork {
  int64_t unit_begin = 0;
  int64_t parts_per_run = 1;
  int64_t runs_per_unit = 1;
};

// Enqueues the copy of `count` boxes (device arrays) on `stream`, in
// `blocks` blocks; `units` is the total over the boxes.
cudaError_t LaunchBoxKernel(const BoxRuns* boxes, const BoxWork* work,
                            int count, int64_t units, int blocks,
                            cudaStream_t stream);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CUDA_BOX_KERNEL_H_
