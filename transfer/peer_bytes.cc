#include "transfer/peer_bytes.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ptc/status_macros.h"

namespace scalai {

absl::Status PeerBytes::Read(int64_t step, const std::string& config,
                             ShardRef shard, int64_t shard_bytes,
                             int64_t offset, int64_t length, char* out,
                             Access access) const {
  if (access == Access::kExact)
    return Fetch(step, config, shard, offset, length, out);
  for (int64_t at = offset; at < offset + length;) {
    const int64_t index = at / kBlockBytes;
    const int64_t begin = index * kBlockBytes;
    const int64_t end = std::min(begin + kBlockBytes, shard_bytes);
    const BlockKey key{step, config, shard.group, shard.shard, index};
    std::shared_ptr<const std::string> block;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
        if (it->first != key) continue;
        block = it->second;
        blocks_.splice(blocks_.begin(), blocks_, it);  // the newest now
        break;
      }
    }
    if (block == nullptr) {
      auto fetched = std::make_shared<std::string>(end - begin, '\0');
      RETURN_IF_ERROR(
          Fetch(step, config, shard, begin, end - begin, fetched->data()));
      block = fetched;
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.emplace_front(key, block);
      if (blocks_.size() > kCacheBlocks) blocks_.pop_back();
    }
    const int64_t n = std::min(end, offset + length) - at;
    std::memcpy(out + (at - offset), block->data() + (at - begin), n);
    at += n;
  }
  return absl::OkStatus();
}

absl::Status PeerBytes::Fetch(int64_t step, const std::string& config,
                              ShardRef shard, int64_t offset, int64_t length,
                              char* out) const {
  std::vector<PeerClient*> peers = peers_();
  const PeerClient::TensorRef ref{step, config, shard.group, shard.shard};
  // Spread ranges over the peers: the replicas of a shard share the reads.
  const size_t start =
      peers.empty() ? 0
                    : static_cast<size_t>(shard.group * 131 + shard.shard +
                                          offset / (4 << 20)) %
                          peers.size();
  std::vector<std::string> errors;
  int64_t done = 0;
  // Each pass asks every peer once for what is still missing; a pass in
  // which none had any byte of it ends the read.
  for (bool progress = true; progress && done < length;) {
    progress = false;
    for (size_t i = 0; i < peers.size() && done < length; ++i) {
      PeerClient& peer = *peers[(start + i) % peers.size()];
      absl::StatusOr<int64_t> got =
          peer.ReadTensor(ref, offset + done, length - done, out + done);
      if (!got.ok()) {
        errors.push_back(std::string(got.status().message()));
        continue;
      }
      done += *got;
      progress |= *got > 0;
    }
  }
  if (done == length) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "step ", step, ": bytes [", offset + done, ", ", offset + length,
      ") of shard ", shard.shard, " of group ", shard.group, " under ", config,
      " are held by no reachable host",
      errors.empty() ? ""
                     : absl::StrCat(" (", absl::StrJoin(errors, "; "), ")")));
}

}  // namespace scalai
