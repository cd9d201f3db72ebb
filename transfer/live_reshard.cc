#include "transfer/live_reshard.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/box_batch.h"

namespace scalai {
namespace {

// Cuts `box` along its outermost dimensions until every part carries at
// most `limit` bytes (a single element always goes whole).
void SplitToFit(const LiveBox& box, int64_t limit, std::vector<LiveBox>& out) {
  const Shape& shape = box.dst_box.shape();
  int dim = 0;
  while (dim < static_cast<int>(shape.size()) && shape[dim] == 1) ++dim;
  if (box.bytes <= limit || dim == static_cast<int>(shape.size())) {
    out.push_back(box);
    return;
  }
  const int64_t slice = box.bytes / shape[dim];  // bytes of one index of dim
  const int64_t step = std::max<int64_t>(1, limit / slice);
  for (int64_t at = 0; at < shape[dim]; at += step) {
    const int64_t n = std::min(step, shape[dim] - at);
    LiveBox part = box;
    Shape origin = box.dst_box.origin(), extent = shape;
    origin[dim] += at;
    extent[dim] = n;
    part.dst_box = Box(std::move(origin), std::move(extent));
    part.src_origin[dim] += at;
    part.bytes = slice * n;
    SplitToFit(part, limit, out);
  }
}

int ElemBytes(const Placement& p, ShardRef shard) {
  return DTypeSize(
      p.model().tensor(p.shards(shard.group)[shard.shard].tensor).dtype);
}

}  // namespace

absl::StatusOr<LiveSchedule> LiveSchedule::Create(const ReshardPlan& plan,
                                                  Options options) {
  if (options.round_bytes < 1) {
    return absl::InvalidArgumentError("round_bytes must be at least 1");
  }
  const Placement& from = plan.from();
  const Placement& to = plan.to();
  const ParallelConfig& cfrom = from.config();
  const ParallelConfig& cto = to.config();
  LiveSchedule s;
  s.plan_ = &plan;
  s.world_ = std::max(cfrom.world_size(), cto.world_size());
  s.local_.resize(s.world_);
  s.senders_.resize(s.world_);
  // The ranks of A that hold each source group.
  std::vector<std::vector<int>> holders(from.num_groups());
  for (int q = 0; q < cfrom.world_size(); ++q)
    holders[cfrom.ShardGroup(q)].push_back(q);
  // Each pair's boxes, in plan order, before they are cut into messages.
  std::map<std::pair<int, int>, std::vector<LiveBox>> streams;
  for (int r = 0; r < cto.world_size(); ++r) {
    const int g = cto.ShardGroup(r);
    const int own = r < cfrom.world_size() ? cfrom.ShardGroup(r) : -1;
    for (int k = 0; k < static_cast<int>(to.shards(g).size()); ++k) {
      const ShardRef dst{g, k};
      const int64_t elem = ElemBytes(to, dst);
      for (const CopyOp& op : plan.ops(g, k)) {
        ASSIGN_OR_RETURN(int64_t n, op.dst.NumElements());
        LiveBox box{op.src,       op.src_piece, op.src_origin, dst,
                    op.dst_piece, op.dst,       n * elem};
        if (!op.src.valid() ||
            (op.src.group == own && !options.local_through_transport)) {
          s.local_[r].push_back(std::move(box));
          continue;
        }
        if (op.src.group == own) {  // to itself, through the transport
          SplitToFit(box, options.round_bytes, streams[{r, r}]);
          continue;
        }
        // Another rank's bytes: spread the readers of a replicated group
        // over its holders.
        const std::vector<int>& from_ranks = holders[op.src.group];
        if (from_ranks.empty()) {
          return absl::InternalError(absl::StrCat(
              "no rank of ", cfrom.ToString(), " holds group ", op.src.group));
        }
        const int q = from_ranks[r % from_ranks.size()];
        SplitToFit(box, options.round_bytes, streams[{q, r}]);
      }
    }
  }
  for (auto& [pair, boxes] : streams) {
    std::vector<std::vector<LiveBox>>& rounds = s.messages_[pair];
    int64_t filled = options.round_bytes;  // starts a message at once
    for (LiveBox& box : boxes) {
      if (filled + box.bytes > options.round_bytes) {
        rounds.emplace_back();
        filled = 0;
      }
      filled += box.bytes;
      rounds.back().push_back(std::move(box));
    }
    s.rounds_ = std::max(s.rounds_, static_cast<int>(rounds.size()));
    s.senders_[pair.second].push_back(pair.first);
  }
  return s;
}

const std::vector<LiveBox>& LiveSchedule::message(int from, int to,
                                                  int round) const {
  static const std::vector<LiveBox> kNone;
  auto it = messages_.find({from, to});
  if (it == messages_.end() || round >= static_cast<int>(it->second.size()))
    return kNone;
  return it->second[round];
}

std::vector<int> LiveSchedule::SendsOf(int rank, int round) const {
  std::vector<int> out;
  for (auto it = messages_.lower_bound({rank, -1});
       it != messages_.end() && it->first.first == rank; ++it) {
    if (round < static_cast<int>(it->second.size()))
      out.push_back(it->first.second);
  }
  return out;
}

std::vector<int> LiveSchedule::ReceivesOf(int rank, int round) const {
  std::vector<int> out;
  for (int from : senders_[rank]) {
    if (round < static_cast<int>(messages_.at({from, rank}).size()))
      out.push_back(from);
  }
  return out;
}

int64_t LiveSchedule::Bytes(const std::vector<LiveBox>& boxes) {
  int64_t n = 0;
  for (const LiveBox& b : boxes) n += b.bytes;
  return n;
}

std::vector<int64_t> LiveSchedule::DestinationBytes(int rank) const {
  std::vector<int64_t> out;
  const Placement& to = plan_->to();
  if (rank < to.config().world_size()) {
    for (const TensorShard& s : to.shards(to.config().ShardGroup(rank)))
      out.push_back(s.bytes);
  }
  return out;
}

int64_t LiveSchedule::StagingBytes(int rank) const {
  int64_t most = 0;
  for (int round = 0; round < rounds_; ++round) {
    int64_t n = 0;
    for (int peer : SendsOf(rank, round))
      n += Bytes(message(rank, peer, round));
    for (int peer : ReceivesOf(rank, round))
      n += Bytes(message(peer, rank, round));
    most = std::max(most, n);
  }
  return most;
}

LiveMemory& HostTransport::MemoryOf(int rank) {
  if (rank < static_cast<int>(memories_.size()) && memories_[rank] != nullptr)
    return *memories_[rank];
  return host_;
}

absl::Status HostTransport::Exchange(int rank,
                                     const std::vector<Outgoing>& sends,
                                     const std::vector<Incoming>& receives) {
  std::unique_lock<std::mutex> lock(mu_);
  for (const Outgoing& m : sends) {
    if (m.peer < 0 || m.peer >= world_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, " sends to rank ", m.peer, " of a world of ", world_));
    }
    std::vector<std::byte> copy(m.bytes);
    RETURN_IF_ERROR(MemoryOf(rank).ToHost(copy.data(), m.data, m.bytes));
    queues_[{rank, m.peer}].push_back(std::move(copy));
  }
  arrived_.notify_all();
  for (const Incoming& m : receives) {
    std::deque<std::vector<std::byte>>& queue = queues_[{m.peer, rank}];
    if (!arrived_.wait_for(lock, absl::ToChronoNanoseconds(timeout_),
                           [&] { return !queue.empty(); })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", rank, " waited ", absl::FormatDuration(timeout_),
          " for a message from rank ", m.peer));
    }
    std::vector<std::byte> got = std::move(queue.front());
    queue.pop_front();
    if (static_cast<int64_t>(got.size()) != m.bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", m.peer, " sent ", got.size(), " bytes to rank ",
                       rank, ", which expected ", m.bytes));
    }
    RETURN_IF_ERROR(MemoryOf(rank).FromHost(m.data, got.data(), m.bytes));
  }
  return absl::OkStatus();
}

int64_t HostTransport::unclaimed() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [pair, queue] : queues_) n += queue.size();
  return n;
}

absl::StatusOr<LiveTraffic> RunLiveReshard(
    const LiveSchedule& schedule, int rank,
    const std::vector<const std::byte*>& a, const std::vector<std::byte*>& b,
    LiveTransport& transport, LiveMemory& memory) {
  const ReshardPlan& plan = schedule.plan();
  const Placement& from = plan.from();
  const Placement& to = plan.to();
  LiveTraffic traffic;
  const int own =
      rank < from.config().world_size() ? from.config().ShardGroup(rank) : -1;
  const size_t a_tensors = own >= 0 ? from.shards(own).size() : 0;
  if (a.size() != a_tensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " holds ", a.size(),
                     " tensors; its A shard has ", a_tensors));
  }
  if (b.size() != schedule.DestinationBytes(rank).size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, " has room for ", b.size(), " tensors; its B shard has ",
        schedule.DestinationBytes(rank).size()));
  }
  // The byte pointer and view of a box's source, and of its destination.
  auto source = [&](const LiveBox& box) {
    const TensorShard& s = from.shards(box.src.group)[box.src.shard];
    return std::make_pair(a[box.src.shard] + s.ViewOffset(box.src_piece) *
                                                 ElemBytes(from, box.src),
                          &s.ViewShape(box.src_piece));
  };
  auto destination = [&](const LiveBox& box) {
    const TensorShard& s = to.shards(box.dst.group)[box.dst.shard];
    return std::make_pair(
        b[box.dst.shard] + s.ViewOffset(box.dst_piece) * ElemBytes(to, box.dst),
        &s.ViewShape(box.dst_piece));
  };
  BoxBatch batch;
  for (const LiveBox& box : schedule.local(rank)) {
    const int elem = ElemBytes(to, box.dst);
    auto [dst, dst_view] = destination(box);
    if (!box.src.valid()) {
      RETURN_IF_ERROR(batch.AddZero(dst, *dst_view, box.dst_box.origin(),
                                    box.dst_box.shape(), elem));
    } else {
      auto [src, src_view] = source(box);
      RETURN_IF_ERROR(batch.AddCopy(src, *src_view, box.src_origin, dst,
                                    *dst_view, box.dst_box.origin(),
                                    box.dst_box.shape(), elem));
    }
    traffic.local_bytes += box.bytes;
  }
  if (!batch.empty()) RETURN_IF_ERROR(memory.Copy(batch));

  const int64_t staging_bytes = schedule.StagingBytes(rank);
  std::byte* staging_data = nullptr;
  if (staging_bytes > 0) {
    ASSIGN_OR_RETURN(staging_data, memory.Allocate(staging_bytes));
  }
  LiveBuffer staging(memory, staging_data);
  for (int round = 0; round < schedule.rounds(); ++round) {
    const std::vector<int> send_to = schedule.SendsOf(rank, round);
    const std::vector<int> receive_from = schedule.ReceivesOf(rank, round);
    if (send_to.empty() && receive_from.empty()) continue;
    // Each message packs its boxes one after another, each row-major; the
    // round's messages lie one after another in the staging buffer.
    std::byte* at = staging.data();
    batch.clear();
    std::vector<LiveTransport::Outgoing> sends;
    for (int peer : send_to) {
      const std::vector<LiveBox>& boxes = schedule.message(rank, peer, round);
      const int64_t bytes = LiveSchedule::Bytes(boxes);
      std::byte* packed = at;
      for (const LiveBox& box : boxes) {
        auto [src, src_view] = source(box);
        const Shape& shape = box.dst_box.shape();
        RETURN_IF_ERROR(batch.AddCopy(src, *src_view, box.src_origin, at, shape,
                                      Shape(shape.size(), 0), shape,
                                      ElemBytes(to, box.dst)));
        at += box.bytes;
      }
      traffic.sent_bytes += bytes;
      sends.push_back({peer, packed, bytes});
    }
    if (!batch.empty()) RETURN_IF_ERROR(memory.Copy(batch));
    std::vector<LiveTransport::Incoming> receives;
    for (int peer : receive_from) {
      const int64_t bytes =
          LiveSchedule::Bytes(schedule.message(peer, rank, round));
      receives.push_back({peer, at, bytes});
      at += bytes;
    }
    RETURN_IF_ERROR(transport.Exchange(rank, sends, receives));
    batch.clear();
    for (const LiveTransport::Incoming& m : receives) {
      const std::byte* packed = m.data;
      for (const LiveBox& box : schedule.message(m.peer, rank, round)) {
        auto [dst, dst_view] = destination(box);
        const Shape& shape = box.dst_box.shape();
        RETURN_IF_ERROR(batch.AddCopy(packed, shape, Shape(shape.size(), 0),
                                      dst, *dst_view, box.dst_box.origin(),
                                      shape, ElemBytes(to, box.dst)));
        packed += box.bytes;
      }
      traffic.received_bytes += m.bytes;
    }
    // Unpacked before the next round packs into the same staging: the
    // memory orders its copies.
    if (!batch.empty()) RETURN_IF_ERROR(memory.Copy(batch));
  }
  RETURN_IF_ERROR(memory.Finish());
  return traffic;
}

absl::StatusOr<LiveTraffic> RunLiveReshard(
    const LiveSchedule& schedule, int rank,
    const std::vector<std::vector<std::byte>>& a,
    std::vector<std::vector<std::byte>>& b, LiveTransport& transport) {
  std::vector<const std::byte*> a_data;
  for (const std::vector<std::byte>& t : a) a_data.push_back(t.data());
  b.clear();
  std::vector<std::byte*> b_data;
  for (int64_t bytes : schedule.DestinationBytes(rank)) {
    b.emplace_back(bytes);
    b_data.push_back(b.back().data());
  }
  HostMemory memory;
  return RunLiveReshard(schedule, rank, a_data, b_data, transport, memory);
}

}  // namespace scalai
