// A live reshard moves a job's state from config A to config B while it is
// still in memory (a GPU's), without the disk: every rank holds its A shard
// and fills its B shard, and the bytes that another rank holds cross over a
// transport (NCCL between GPUs; HostTransport, threads and queues, where
// there are none). A LiveSchedule, made from the same ReshardPlan as every
// other path, says for every pair of ranks which boxes one sends and the
// other receives, in one order both derive, so that the two sides of each
// message agree on its size; boxes a rank holds itself are copied locally.
// Messages are cut into rounds of at most Options::round_bytes per peer
// (the staging memory), each round one grouped exchange in which every send
// is posted before any receive waits, so no schedule can deadlock.
//
// The executor is written once: a LiveMemory says where the buffers are and
// copies boxes there (HostMemory; CudaMemory, one kernel per batch), a
// LiveTransport moves the messages (HostTransport; NcclTransport).
//
//   ASSIGN_OR_RETURN(LiveSchedule s, LiveSchedule::Create(plan));
//   HostTransport transport(s.world());
//   // On each rank's thread, with its A shard's tensors and room for B's
//   // (sized by s.DestinationBytes(rank)):
//   HostMemory memory;
//   RETURN_IF_ERROR(
//       RunLiveReshard(s, rank, a_tensors, b_tensors, transport, memory));
//
// With a GPU (transfer/cuda/), the same call takes device pointers,
// a CudaMemory and an NcclTransport over the ranks of A and B.
#ifndef SCALAI_TRANSFER_LIVE_RESHARD_H_
#define SCALAI_TRANSFER_LIVE_RESHARD_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ptc/reshard_plan.h"
#include "transfer/live_memory.h"

namespace scalai {

// One box of a destination shard, filled from a source shard's box of the
// same shape (or with zeros when !src.valid()), in the pieces' views.
struct LiveBox {
  ShardRef src;
  int src_piece = 0;
  Shape src_origin;
  ShardRef dst;
  int dst_piece = 0;
  Box dst_box;
  int64_t bytes = 0;
};

class LiveSchedule {
 public:
  struct Options {
    // The most one message carries: boxes larger are cut along their
    // outermost dimensions until they fit (down to single rows).
    int64_t round_bytes = 64 << 20;
    // Sends a rank's own bytes through the transport too, as messages to
    // itself, instead of copying them locally: exercises a transport's
    // whole path with a single rank (a GPU check on one device).
    bool local_through_transport = false;
  };
  static absl::StatusOr<LiveSchedule> Create(const ReshardPlan& plan,
                                             Options options);
  static absl::StatusOr<LiveSchedule> Create(const ReshardPlan& plan) {
    return Create(plan, Options());
  }

  const ReshardPlan& plan() const { return *plan_; }
  // Ranks of A or B: max of the two world sizes.
  int world() const { return world_; }
  int rounds() const { return rounds_; }
  // What `rank` fills without a message: its own A bytes and zeros.
  const std::vector<LiveBox>& local(int rank) const { return local_[rank]; }
  // The boxes of the message from `from` to `to` in round `round`, in the
  // order both pack and unpack them; empty when there is none.
  const std::vector<LiveBox>& message(int from, int to, int round) const;
  // The peers `rank` sends to, and receives from, in `round`.
  std::vector<int> SendsOf(int rank, int round) const;
  std::vector<int> ReceivesOf(int rank, int round) const;
  static int64_t Bytes(const std::vector<LiveBox>& boxes);
  // The bytes of each tensor of `rank`'s B shard (none for a rank not in B).
  std::vector<int64_t> DestinationBytes(int rank) const;
  // The staging `rank` needs: its largest round's sends and receives.
  int64_t StagingBytes(int rank) const;

 private:
  const ReshardPlan* plan_ = nullptr;
  int world_ = 0;
  int rounds_ = 0;
  std::vector<std::vector<LiveBox>> local_;  // by rank
  std::vector<std::vector<int>> senders_;    // by receiving rank
  // (from, to) -> rounds, each a message's boxes.
  std::map<std::pair<int, int>, std::vector<std::vector<LiveBox>>> messages_;
};

// How ranks exchange messages: one grouped exchange per round. An NCCL
// backend posts them as ncclSend/ncclRecv inside one group.
class LiveTransport {
 public:
  // Messages are in the rank's LiveMemory (device memory for NCCL).
  struct Outgoing {
    int peer;
    const std::byte* data;
    int64_t bytes;
  };
  struct Incoming {
    int peer;
    std::byte* data;
    int64_t bytes;  // what the schedule expects
  };
  virtual ~LiveTransport() = default;
  // Posts every send, then takes every receive; a message of another size
  // than expected is an error naming both ranks and sizes.
  virtual absl::Status Exchange(int rank, const std::vector<Outgoing>& sends,
                                const std::vector<Incoming>& receives) = 0;
};

// The host reference transport: ranks are threads, each pair of ranks a
// queue. A receive that waits past `timeout` fails naming what it waited
// for, so that a schedule that would deadlock fails instead of hanging.
// Messages are read from and written to each rank's memory through
// `memories` (by rank; empty when all are host memory), so ranks whose
// buffers are on a GPU can run over it too.
class HostTransport : public LiveTransport {
 public:
  explicit HostTransport(int world, absl::Duration timeout = absl::Seconds(60),
                         std::vector<LiveMemory*> memories = {})
      : world_(world), timeout_(timeout), memories_(std::move(memories)) {}
  absl::Status Exchange(int rank, const std::vector<Outgoing>& sends,
                        const std::vector<Incoming>& receives) override;
  // Messages sent and never received (0 once every send met its receive).
  int64_t unclaimed() const;

 private:
  LiveMemory& MemoryOf(int rank);

  const int world_;
  const absl::Duration timeout_;
  const std::vector<LiveMemory*> memories_;
  HostMemory host_;
  mutable std::mutex mu_;
  std::condition_variable arrived_;
  std::map<std::pair<int, int>, std::deque<std::vector<std::byte>>> queues_;
};

// Bytes a rank moved: copied locally (or zeroed), sent and received.
struct LiveTraffic {
  int64_t local_bytes = 0;
  int64_t sent_bytes = 0;
  int64_t received_bytes = 0;
};

// Runs `rank`'s part of the schedule: `a` points at its A shard's tensors
// in `memory` (in the order of its A group's shards; empty for a rank new
// in B), `b` at room for its B shard's (schedule.DestinationBytes(rank)),
// which it fills. Staging of schedule.StagingBytes(rank) is allocated from
// `memory`. Every rank of schedule.world() must run it at once, each on its
// own thread or process; all its copies are finished when it returns.
absl::StatusOr<LiveTraffic> RunLiveReshard(
    const LiveSchedule& schedule, int rank,
    const std::vector<const std::byte*>& a, const std::vector<std::byte*>& b,
    LiveTransport& transport, LiveMemory& memory);

// The same in host memory: `b` is sized and filled here.
absl::StatusOr<LiveTraffic> RunLiveReshard(
    const LiveSchedule& schedule, int rank,
    const std::vector<std::vector<std::byte>>& a,
    std::vector<std::vector<std::byte>>& b, LiveTransport& transport);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_LIVE_RESHARD_H_
