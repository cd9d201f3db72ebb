#include "transfer/blob_checksum.h"

#include <xxhash.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace scalai {

uint64_t HashChunk(const void* data, int64_t bytes) {
  return XXH3_64bits(data, static_cast<size_t>(bytes));
}

ChunkHasher::ChunkHasher() : state_(XXH3_createState()) {
  XXH3_64bits_reset(state_);
}

ChunkHasher::~ChunkHasher() { XXH3_freeState(state_); }

void ChunkHasher::Update(const void* data, int64_t bytes) {
  const char* at = static_cast<const char*>(data);
  bytes_ += bytes;
  while (bytes > 0) {
    const int64_t take = std::min(bytes, kBlobChunkBytes - filled_);
    if (filled_ == 0 && take == kBlobChunkBytes) {
      sums_.push_back(HashChunk(at, take));  // a whole chunk in one call
    } else {
      XXH3_64bits_update(state_, at, static_cast<size_t>(take));
      filled_ += take;
      if (filled_ == kBlobChunkBytes) {
        sums_.push_back(XXH3_64bits_digest(state_));
        XXH3_64bits_reset(state_);
        filled_ = 0;
      }
    }
    at += take;
    bytes -= take;
  }
}

std::vector<uint64_t> ChunkHasher::Finish() const {
  std::vector<uint64_t> sums = sums_;
  if (filled_ > 0) sums.push_back(XXH3_64bits_digest(state_));
  return sums;
}

void ChunkHasher::Reset() {
  XXH3_64bits_reset(state_);
  filled_ = 0;
  bytes_ = 0;
  sums_.clear();
}

std::string EncodeChunkSums(const std::vector<uint64_t>& sums) {
  std::string hex;
  hex.reserve(16 * sums.size());
  for (uint64_t s : sums) absl::StrAppendFormat(&hex, "%016x", s);
  return hex;
}

absl::StatusOr<std::vector<uint64_t>> DecodeChunkSums(absl::string_view hex) {
  if (hex.size() % 16 != 0)
    return absl::DataLossError("chunk sums: not 16 hex digits a chunk");
  std::vector<uint64_t> sums(hex.size() / 16);
  for (size_t i = 0; i < sums.size(); ++i) {
    if (!absl::SimpleHexAtoi(hex.substr(16 * i, 16), &sums[i]))
      return absl::DataLossError("chunk sums: not hexadecimal");
  }
  return sums;
}

}  // namespace scalai
