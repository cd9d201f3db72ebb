#include "transfer/fetch_ahead.h"

#include <algorithm>
#include <utility>

namespace scalai {

FetchAhead::FetchAhead(const RemoteBytes& remote, int64_t step,
                       std::string config, std::vector<Range> ranges, int depth)
    : remote_(remote),
      step_(step),
      config_(std::move(config)),
      ranges_(std::move(ranges)) {
  int64_t longest = 0;
  for (const Range& r : ranges_) longest = std::max(longest, r.length);
  const size_t slots =
      std::min(ranges_.size(), static_cast<size_t>(std::max(depth, 1)) + 1);
  for (size_t i = 0; i < slots; ++i) {
    buffers_.push_back(std::make_unique_for_overwrite<char[]>(longest));
  }
  while (started_ < ranges_.size() && started_ < slots - 1) Start(started_);
}

FetchAhead::~FetchAhead() {
  for (std::future<absl::Status>& f : in_flight_) f.wait();
}

void FetchAhead::Start(size_t index) {
  const Range& r = ranges_[index];
  char* out = buffers_[index % buffers_.size()].get();
  in_flight_.push_back(std::async(std::launch::async, [this, r, out] {
    return remote_.Read(step_, config_, r.shard, r.shard_bytes, r.offset,
                        r.length, out, RemoteBytes::Access::kExact);
  }));
  ++started_;
}

absl::StatusOr<const char*> FetchAhead::Next() {
  if (next_ >= ranges_.size()) {
    return absl::OutOfRangeError("FetchAhead: every range was read");
  }
  // The buffer the caller held until now is free again: the range after
  // those in flight lands in it.
  if (started_ < ranges_.size()) Start(started_);
  absl::Status fetched = in_flight_.front().get();
  in_flight_.pop_front();
  const size_t index = next_++;
  if (!fetched.ok()) return fetched;
  return buffers_[index % buffers_.size()].get();
}

}  // namespace scalai
