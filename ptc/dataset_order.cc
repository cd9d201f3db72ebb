#include "ptc/dataset_order.h"

#include <algorithm>
#include <bit>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace scalai {
namespace {

// SplitMix64's finalizer: a fast, well-mixed 64-bit hash.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rounds of the Feistel network; four make a keyed permutation that mixes
// every input bit into every output bit.
constexpr int kRounds = 4;

}  // namespace

absl::StatusOr<DatasetOrder> DatasetOrder::Create(int64_t samples,
                                                  int64_t global_batch,
                                                  uint64_t seed,
                                                  int64_t epochs) {
  if (samples < 1) {
    return absl::InvalidArgumentError("a dataset needs at least one sample");
  }
  if (global_batch < 1 || global_batch > samples) {
    return absl::InvalidArgumentError(
        absl::StrCat("global batch ", global_batch, " must be between 1 and ",
                     "the number of samples (", samples, ")"));
  }
  if (epochs < 1 ||
      epochs > INT64_MAX / ((samples / global_batch) * global_batch)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "epochs ", epochs, " out of range for ", samples, " samples"));
  }
  DatasetOrder order;
  order.samples_ = samples;
  order.global_batch_ = global_batch;
  order.seed_ = seed;
  order.epochs_ = epochs;
  // The smallest even number of bits that holds every index: at most 4x the
  // samples, so walking back into range takes under 4 steps on average.
  const int bits = std::max(
      2, static_cast<int>(std::bit_width(static_cast<uint64_t>(samples - 1))));
  order.half_bits_ = (bits + 1) / 2;
  return order;
}

int64_t DatasetOrder::Permute(int64_t index, int64_t epoch) const {
  const uint64_t key = Mix(seed_ ^ Mix(static_cast<uint64_t>(epoch)));
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  uint64_t x = static_cast<uint64_t>(index);
  do {  // cycle walking: a permutation of [0, 4^h) restricted to [0, n)
    uint64_t left = x >> half_bits_;
    uint64_t right = x & mask;
    for (int round = 0; round < kRounds; ++round) {
      const uint64_t f =
          Mix(right ^ key ^ (static_cast<uint64_t>(round) << 58)) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= static_cast<uint64_t>(samples_));
  return static_cast<int64_t>(x);
}

int64_t DatasetOrder::SampleAt(int64_t position) const {
  const int64_t per_epoch = batches_per_epoch() * global_batch_;
  return Permute(position % per_epoch, position / per_epoch);
}

absl::Status DatasetOrder::CheckDp(int dp) const {
  if (dp < 1 || dp > global_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat("global batch ", global_batch_, " is smaller than dp=", dp,
                     ": every data-parallel rank needs a sample per batch"));
  }
  return absl::OkStatus();
}

BatchSlice DatasetOrder::Slice(int dp, int dp_rank) const {
  const int64_t base = global_batch_ / dp;
  const int64_t extra = global_batch_ % dp;
  return {dp_rank * base + std::min<int64_t>(dp_rank, extra),
          base + (dp_rank < extra ? 1 : 0)};
}

int64_t DatasetOrder::RankSamples(int64_t start, int dp, int dp_rank) const {
  const int64_t batches = (total_positions() - start) / global_batch_;
  return batches * Slice(dp, dp_rank).count;
}

int64_t DatasetOrder::RankPosition(int64_t start, int dp, int dp_rank,
                                   int64_t k) const {
  const BatchSlice s = Slice(dp, dp_rank);
  return start + (k / s.count) * global_batch_ + s.offset + k % s.count;
}

}  // namespace scalai
