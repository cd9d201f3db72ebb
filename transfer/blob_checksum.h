// A blob's checksum is one XXH3 per fixed-size chunk (the last one may be
// short), so that a reader can verify just the part it reads, the first time
// it reads it, instead of the whole blob. Writers feed a ChunkHasher the
// bytes in blob order; BlobReader and fsck check against the sums.
//
//   ChunkHasher hasher;
//   hasher.Update(data, n);                      // as the blob is written
//   BlobRecord record{size, hasher.Finish(), step};
#ifndef SCALAI_TRANSFER_BLOB_CHECKSUM_H_
#define SCALAI_TRANSFER_BLOB_CHECKSUM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct XXH3_state_s;

namespace scalai {

// 1 MiB: a FUSE read's size, so a sequential reader verifies one chunk a
// request; hashing it costs about 50 us, a twentieth of serving it.
inline constexpr int64_t kBlobChunkBytes = 1 << 20;

inline int64_t ChunkCount(int64_t blob_bytes) {
  return (blob_bytes + kBlobChunkBytes - 1) / kBlobChunkBytes;
}

// XXH3 of one chunk's bytes.
uint64_t HashChunk(const void* data, int64_t bytes);

// Hashes bytes fed in blob order, chunk by chunk.
class ChunkHasher {
 public:
  ChunkHasher();
  ~ChunkHasher();
  ChunkHasher(const ChunkHasher&) = delete;
  ChunkHasher& operator=(const ChunkHasher&) = delete;

  void Update(const void* data, int64_t bytes);
  // Bytes fed so far.
  int64_t bytes() const { return bytes_; }
  // The sums of the chunks completed so far (bytes() / kBlobChunkBytes).
  const std::vector<uint64_t>& full_chunks() const { return sums_; }
  // Every chunk's sum, the short last one included.
  std::vector<uint64_t> Finish() const;
  void Reset();

 private:
  XXH3_state_s* state_;  // the chunk being filled
  int64_t filled_ = 0;   // bytes of it fed to state_
  int64_t bytes_ = 0;
  std::vector<uint64_t> sums_;
};

// Chunk sums as the catalog stores them: 16 hex digits a chunk.
// One sum standing for a blob's chunk sums, in order (their XXH3): what a
// description of the blob carries where its size must not grow with the
// blob's, as a value in etcd does (transfer/blob_copy.h).
uint64_t ChunkSumsDigest(const std::vector<uint64_t>& sums);

std::string EncodeChunkSums(const std::vector<uint64_t>& sums);
absl::StatusOr<std::vector<uint64_t>> DecodeChunkSums(absl::string_view hex);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_BLOB_CHECKSUM_H_
