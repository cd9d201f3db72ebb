// A DatasetView is a registered dataset seen by the data-parallel ranks of
// one config, from one position (docs/reference.md, `data/`): what each rank
// consumes from there to the end of the last epoch, as sample ids
// (`sample-ids.u64`, computed on read), as samples (`samples/K`) and, for
// JSONL, as one stream (`samples.jsonl`). Nothing is stored per sample: a
// view costs O(1) memory whatever the dataset's size, except the stream's
// seek table (one entry per kStreamStride samples), made at its first use.
//
//   ASSIGN_OR_RETURN(auto view, DatasetView::Create(source, dp, position));
//   int64_t n = view->RankSamples(dp_rank);
//   view->ReadSampleIds(dp_rank, 0, 8 * n, out);
#ifndef SCALAI_TRANSFER_DATASET_VIEW_H_
#define SCALAI_TRANSFER_DATASET_VIEW_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "ptc/dataset_order.h"
#include "transfer/dataset_source.h"

namespace scalai {

class DatasetView {
 public:
  // `position` is the number of samples the job has consumed (see "Dataset
  // position" in docs/reference.md); it must fall on a global batch boundary. A position past
  // the last epoch leaves every rank nothing to read.
  static absl::StatusOr<std::unique_ptr<DatasetView>> Create(
      std::shared_ptr<const DatasetSource> source, int dp, int64_t position);

  const DatasetSource& source() const { return *source_; }
  const DatasetOrder& order() const { return order_; }
  int dp() const { return dp_; }
  // The first global position the views show: the job's position, clamped
  // to the end of the last epoch.
  int64_t start() const { return start_; }
  int64_t RankSamples(int dp_rank) const;
  // The global position of the rank's K-th sample.
  int64_t RankPosition(int dp_rank, int64_t k) const {
    return order_.RankPosition(start_, dp_, dp_rank, k);
  }

  // `sample-ids.u64`: bytes [offset, offset + length) of the rank's ids as
  // uint64 little-endian.
  void ReadSampleIds(int dp_rank, int64_t offset, int64_t length,
                     char* out) const;
  // `samples/K`.
  absl::StatusOr<int64_t> SampleBytes(int dp_rank, int64_t k) const;
  absl::Status ReadSample(int dp_rank, int64_t k, int64_t offset,
                          int64_t length, char* out) const;
  // `samples.jsonl`: each of the rank's samples followed by a newline.
  int64_t StreamBytes(int dp_rank) const;
  absl::Status ReadStream(int dp_rank, int64_t offset, int64_t length,
                          char* out) const;

  static constexpr int64_t kStreamStride = 1024;

 private:
  DatasetView(std::shared_ptr<const DatasetSource> source, DatasetOrder order)
      : source_(std::move(source)), order_(order) {}
  struct Stream {
    std::once_flag once;
    // starts[i]: where sample i * kStreamStride begins in the stream; the
    // last entry is the stream's size.
    std::vector<int64_t> starts;
  };
  const Stream& StreamOf(int dp_rank) const;
  // Bytes of a JSONL sample from the store's index; cannot fail.
  int64_t LineBytes(int dp_rank, int64_t k) const;

  std::shared_ptr<const DatasetSource> source_;
  DatasetOrder order_;
  int dp_ = 1;
  int64_t start_ = 0;
  std::vector<std::unique_ptr<Stream>> streams_;  // by dp rank
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_DATASET_VIEW_H_
