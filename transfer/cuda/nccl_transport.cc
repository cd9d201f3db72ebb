#include "transfer/cuda/nccl_transport.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ptc/status_macros.h"
#include "transfer/cuda/cuda_status.h"

namespace scalai {

absl::Status NcclTransport::Exchange(int rank,
                                     const std::vector<Outgoing>& sends,
                                     const std::vector<Incoming>& receives) {
  int world = 0;
  RETURN_IF_ERROR(NCCL_CALL(ncclCommCount(comm_, &world)));
  int self = -1;
  RETURN_IF_ERROR(NCCL_CALL(ncclCommUserRank(comm_, &self)));
  if (self != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " exchanges over the communicator of rank ", self));
  }
  std::vector<int> peers;
  for (const Outgoing& m : sends) peers.push_back(m.peer);
  for (const Incoming& m : receives) peers.push_back(m.peer);
  for (int peer : peers) {
    if (peer < 0 || peer >= world) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, " exchanges with rank ", peer,
                       " of a world of ", world));
    }
  }
  RETURN_IF_ERROR(NCCL_CALL(ncclGroupStart()));
  absl::Status posted;
  for (const Outgoing& m : sends) {
    posted.Update(NCCL_CALL(
        ncclSend(m.data, m.bytes, ncclUint8, m.peer, comm_, stream_)));
  }
  for (const Incoming& m : receives) {
    posted.Update(NCCL_CALL(
        ncclRecv(m.data, m.bytes, ncclUint8, m.peer, comm_, stream_)));
  }
  posted.Update(NCCL_CALL(ncclGroupEnd()));
  RETURN_IF_ERROR(posted);
  // Wait for the round, watching the communicator, so that a peer that
  // never posts its side ends in an error and not a hang.
  const absl::Time deadline = absl::Now() + timeout_;
  for (absl::Duration pause = absl::Microseconds(20);;
       pause = std::min(pause * 2, absl::Milliseconds(10))) {
    const cudaError_t done = cudaStreamQuery(stream_);
    if (done == cudaSuccess) return absl::OkStatus();
    if (done != cudaErrorNotReady) {
      return CudaStatus(done, "cudaStreamQuery (after a round's exchange)");
    }
    ncclResult_t async = ncclSuccess;
    RETURN_IF_ERROR(NCCL_CALL(ncclCommGetAsyncError(comm_, &async)));
    if (async != ncclSuccess && async != ncclInProgress) {
      return NcclStatus(async, "ncclCommGetAsyncError (a round's exchange)");
    }
    if (absl::Now() > deadline) {
      ncclCommAbort(comm_);
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", rank, " waited ", absl::FormatDuration(timeout_),
          " for a round with ranks ", absl::StrJoin(peers, ","),
          "; the communicator is aborted"));
    }
    std::this_thread::sleep_for(absl::ToChronoMicroseconds(pause));
  }
}

}  // namespace scalai
