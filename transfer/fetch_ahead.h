// FetchAhead reads a known sequence of ranges of shards held by other hosts,
// in order, keeping the next few in flight while the caller uses the last:
// a materialization writes one range to disk while the following ones cross
// the network, instead of waiting for each in turn.
//
//   FetchAhead ahead(remote, step, "tp=2,pp=1,dp=1", ranges, /*depth=*/4);
//   for (...) {
//     ASSIGN_OR_RETURN(const char* bytes, ahead.Next());  // ranges[i]
//     RETURN_IF_ERROR(writer.Append(bytes, ranges[i].length));
//   }
#ifndef SCALAI_TRANSFER_FETCH_AHEAD_H_
#define SCALAI_TRANSFER_FETCH_AHEAD_H_

#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/reshard_plan.h"
#include "transfer/remote_bytes.h"

namespace scalai {

class FetchAhead {
 public:
  // Bytes [offset, offset + length) of a `shard_bytes`-long shard.
  struct Range {
    ShardRef shard;
    int64_t shard_bytes = 0;
    int64_t offset = 0;
    int64_t length = 0;
  };

  // Starts fetching the first `depth` ranges of step `step` seen under
  // `config`; `remote` outlives this.
  FetchAhead(const RemoteBytes& remote, int64_t step, std::string config,
             std::vector<Range> ranges, int depth);
  // Waits for the fetches still in flight (each bounded by the peers'
  // deadlines) and drops their bytes.
  ~FetchAhead();
  FetchAhead(const FetchAhead&) = delete;
  FetchAhead& operator=(const FetchAhead&) = delete;

  // The next range's bytes, valid until the next call; an error names what
  // no reachable host holds. Called once per range.
  absl::StatusOr<const char*> Next();

 private:
  void Start(size_t index);

  const RemoteBytes& remote_;
  const int64_t step_;
  const std::string config_;
  const std::vector<Range> ranges_;
  // depth + 1 buffers: the one the caller holds and those in flight; range
  // i lands in buffers_[i % buffers_.size()].
  std::vector<std::unique_ptr<char[]>> buffers_;
  std::deque<std::future<absl::Status>> in_flight_;  // ranges next_..
  size_t next_ = 0;                                  // the range Next() returns
  size_t started_ = 0;                               // ranges started so far
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_FETCH_AHEAD_H_
