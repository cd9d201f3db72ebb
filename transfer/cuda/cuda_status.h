// CUDA and NCCL results as absl::Status, naming the call that failed, so
// that an error from the GPU backend says which call and why:
//   "cudaMalloc(&data, 1073741824): out of memory (cudaErrorMemoryAllocation)"
//
//   RETURN_IF_ERROR(CUDA_CALL(cudaStreamSynchronize(stream)));
//   RETURN_IF_ERROR(NCCL_CALL(ncclGroupEnd()));
#ifndef SCALAI_TRANSFER_CUDA_CUDA_STATUS_H_
#define SCALAI_TRANSFER_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"

namespace scalai {

absl::Status CudaStatus(cudaError_t error, const char* call);
absl::Status NcclStatus(ncclResult_t result, const char* call);

}  // namespace scalai

#define CUDA_CALL(expr) ::scalai::CudaStatus((expr), #expr)
#define NCCL_CALL(expr) ::scalai::NcclStatus((expr), #expr)

#endif  // SCALAI_TRANSFER_CUDA_CUDA_STATUS_H_
