#include "transfer/dataset_view.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::StatusOr<std::unique_ptr<DatasetView>> DatasetView::Create(
    std::shared_ptr<const DatasetSource> source, int dp, int64_t position) {
  const DatasetRecord& r = source->record();
  ASSIGN_OR_RETURN(
      DatasetOrder order,
      DatasetOrder::Create(r.samples, r.global_batch, r.seed, r.epochs));
  auto named = [&](const absl::Status& s) {
    return absl::Status(
        s.code(), absl::StrCat("dataset ", source->name(), ": ", s.message()));
  };
  if (absl::Status s = order.CheckDp(dp); !s.ok()) return named(s);
  if (position < 0 || position % r.global_batch != 0) {
    return named(absl::InvalidArgumentError(absl::StrCat(
        "the job's position ", position, " (consumed samples) is not a ",
        "multiple of the global batch ", r.global_batch)));
  }
  std::unique_ptr<DatasetView> view(new DatasetView(std::move(source), order));
  view->dp_ = dp;
  view->start_ = std::min(position, order.total_positions());
  for (int d = 0; d < dp; ++d)
    view->streams_.push_back(std::make_unique<Stream>());
  return view;
}

int64_t DatasetView::RankSamples(int dp_rank) const {
  return order_.RankSamples(start_, dp_, dp_rank);
}

void DatasetView::ReadSampleIds(int dp_rank, int64_t offset, int64_t length,
                                char* out) const {
  int64_t done = 0;
  while (done < length) {
    const int64_t k = (offset + done) / 8;
    const int64_t within = (offset + done) % 8;
    const uint64_t id =
        static_cast<uint64_t>(order_.SampleAt(RankPosition(dp_rank, k)));
    const int64_t n = std::min<int64_t>(8 - within, length - done);
    std::memcpy(out + done, reinterpret_cast<const char*>(&id) + within, n);
    done += n;
  }
}

absl::StatusOr<int64_t> DatasetView::SampleBytes(int dp_rank, int64_t k) const {
  return source_->SampleBytes(order_.SampleAt(RankPosition(dp_rank, k)));
}

absl::Status DatasetView::ReadSample(int dp_rank, int64_t k, int64_t offset,
                                     int64_t length, char* out) const {
  return source_->ReadSample(order_.SampleAt(RankPosition(dp_rank, k)), offset,
                             length, out);
}

int64_t DatasetView::LineBytes(int dp_rank, int64_t k) const {
  // A JSONL source's sizes come from the store's own index.
  return *source_->SampleBytes(order_.SampleAt(RankPosition(dp_rank, k)));
}

const DatasetView::Stream& DatasetView::StreamOf(int dp_rank) const {
  Stream& s = *streams_[dp_rank];
  std::call_once(s.once, [&] {
    const int64_t n = RankSamples(dp_rank);
    int64_t at = 0;
    for (int64_t k = 0; k < n; ++k) {
      if (k % kStreamStride == 0) s.starts.push_back(at);
      at += LineBytes(dp_rank, k) + 1;
    }
    s.starts.push_back(at);
  });
  return s;
}

int64_t DatasetView::StreamBytes(int dp_rank) const {
  return StreamOf(dp_rank).starts.back();
}

absl::Status DatasetView::ReadStream(int dp_rank, int64_t offset,
                                     int64_t length, char* out) const {
  const Stream& s = StreamOf(dp_rank);
  const int64_t n = RankSamples(dp_rank);
  if (n == 0 || offset >= s.starts.back()) return absl::OkStatus();
  // The last entry is the end; the others start strides.
  const int64_t strides = static_cast<int64_t>(s.starts.size()) - 1;
  int64_t stride =
      std::upper_bound(s.starts.begin(), s.starts.begin() + strides, offset) -
      s.starts.begin() - 1;
  int64_t k = stride * kStreamStride;
  int64_t at = s.starts[stride];
  int64_t done = 0;
  while (done < length && k < n) {
    const int64_t bytes = LineBytes(dp_rank, k);
    const int64_t pos = offset + done;
    if (pos < at + bytes + 1) {
      const int64_t within = pos - at;
      if (within < bytes) {
        const int64_t m = std::min(length - done, bytes - within);
        RETURN_IF_ERROR(ReadSample(dp_rank, k, within, m, out + done));
        done += m;
      }
      if (done < length && offset + done == at + bytes) out[done++] = '\n';
    }
    at += bytes + 1;
    ++k;
  }
  return absl::OkStatus();
}

}  // namespace scalai
