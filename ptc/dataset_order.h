// A DatasetOrder is the order in which a job consumes a dataset (docs/reference.md
// section 3, "Dataset position"): global position p maps to a sample through
// a seeded permutation per epoch, computed in O(1) memory (a keyed Feistel
// network walked back into range, never an array of ids); global batch i
// covers positions [i*B, (i+1)*B); a last partial batch of each epoch is
// dropped; data-parallel rank d consumes a contiguous slice of every batch,
// the first B % dp ranks one sample more. Because a rank's samples are a
// function of (position, dp, d) only, a change of dp at a batch boundary
// neither repeats nor skips a sample.
//
//   ASSIGN_OR_RETURN(DatasetOrder order, DatasetOrder::Create(n, 512, 1234));
//   int64_t sample = order.SampleAt(position);
//   BatchSlice s = order.Slice(dp, dp_rank);       // within every batch
//   int64_t id = order.RankSample(start, dp, dp_rank, k);
#ifndef SCALAI_PTC_DATASET_ORDER_H_
#define SCALAI_PTC_DATASET_ORDER_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace scalai {

// The part of each global batch one data-parallel rank consumes.
struct BatchSlice {
  int64_t offset = 0;  // within the batch
  int64_t count = 0;
};

class DatasetOrder {
 public:
  // `samples` >= 1, 1 <= `global_batch` <= samples, `epochs` >= 1.
  static absl::StatusOr<DatasetOrder> Create(int64_t samples,
                                             int64_t global_batch,
                                             uint64_t seed, int64_t epochs = 1);

  int64_t samples() const { return samples_; }
  int64_t global_batch() const { return global_batch_; }
  uint64_t seed() const { return seed_; }
  int64_t epochs() const { return epochs_; }
  int64_t batches_per_epoch() const { return samples_ / global_batch_; }
  // Samples of each epoch left out by its partial last batch.
  int64_t dropped_per_epoch() const { return samples_ % global_batch_; }
  // Positions of all epochs: the job ends at this one.
  int64_t total_positions() const {
    return epochs_ * batches_per_epoch() * global_batch_;
  }

  // The sample id at global position `position` (0 <= position <
  // total_positions()).
  int64_t SampleAt(int64_t position) const;

  // Rank `dp_rank`'s slice of every batch under `dp` ranks; dp must be at
  // most the global batch (CheckDp says why not).
  absl::Status CheckDp(int dp) const;
  BatchSlice Slice(int dp, int dp_rank) const;

  // How many samples rank `dp_rank` consumes from batch-aligned position
  // `start` to the end, and the k-th of them (its global position, then
  // SampleAt of it).
  int64_t RankSamples(int64_t start, int dp, int dp_rank) const;
  int64_t RankPosition(int64_t start, int dp, int dp_rank, int64_t k) const;
  int64_t RankSample(int64_t start, int dp, int dp_rank, int64_t k) const {
    return SampleAt(RankPosition(start, dp, dp_rank, k));
  }

 private:
  DatasetOrder() = default;
  // A bijection of [0, samples) chosen by (seed, epoch).
  int64_t Permute(int64_t index, int64_t epoch) const;

  int64_t samples_ = 0;
  int64_t global_batch_ = 0;
  uint64_t seed_ = 0;
  int64_t epochs_ = 1;
  int half_bits_ = 1;  // the Feistel network works on 2 * half_bits_ bits
};

}  // namespace scalai

#endif  // SCALAI_PTC_DATASET_ORDER_H_
