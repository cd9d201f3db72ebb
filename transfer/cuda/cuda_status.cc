#include "transfer/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace scalai {

absl::Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(call, ": ", cudaGetErrorString(error), " (",
                   cudaGetErrorName(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status NcclStatus(ncclResult_t result, const char* call) {
  if (result == ncclSuccess || result == ncclInProgress) {
    return absl::OkStatus();
  }
  const std::string message =
      absl::StrCat(call, ": ", ncclGetErrorString(result));
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace scalai
