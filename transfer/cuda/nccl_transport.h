// The live reshard's transport between GPUs: each round's messages posted as
// ncclSend/ncclRecv inside one ncclGroupStart/ncclGroupEnd on the stream of
// the rank's CudaMemory, so that a round's packing, exchange and unpacking
// run in stream order. NCCL matches a send with its receive by peer and
// order, and cannot see a size mismatch; the schedule derives both sides
// from the same plan (host-tested: every send meets a receive of its size).
// A round that does not finish within `timeout` aborts the communicator
// and fails naming the peers, rather than hanging on a lost rank.
//
//   ncclComm_t comm;  // over the ranks of A ∪ B, rank = the plan's rank
//   RETURN_IF_ERROR(NCCL_CALL(ncclCommInitRank(&comm, world, id, rank)));
//   NcclTransport transport(comm, memory->stream());
//   RETURN_IF_ERROR(RunLiveReshard(schedule, rank, a, b, transport, *memory));
#ifndef SCALAI_TRANSFER_CUDA_NCCL_TRANSPORT_H_
#define SCALAI_TRANSFER_CUDA_NCCL_TRANSPORT_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/time/time.h"
#include "transfer/live_reshard.h"

namespace scalai {

class NcclTransport : public LiveTransport {
 public:
  NcclTransport(ncclComm_t comm, cudaStream_t stream,
                absl::Duration timeout = absl::Minutes(5))
      : comm_(comm), stream_(stream), timeout_(timeout) {}
  absl::Status Exchange(int rank, const std::vector<Outgoing>& sends,
                        const std::vector<Incoming>& receives) override;

 private:
  ncclComm_t comm_;
  cudaStream_t stream_;
  absl::Duration timeout_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_CUDA_NCCL_TRANSPORT_H_
