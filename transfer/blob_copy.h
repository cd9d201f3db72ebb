// Copies of blobs that another host of a cluster holds, brought into this
// store: fetched from that host in pieces into a new blob, synced, and
// checked against the chunk sums the other host recorded (their digest, as
// it described the blob), so that a damaged copy is never recorded. The blob is an orphan until the caller's catalog
// batch names it (a crash before leaves it to the next open's sweep).
//
//   ASSIGN_OR_RETURN(CopiedExtra copy,
//                    CopyExtraFile(store, peer, {step, rank, path, described}));
//   batch.Put(Table::kBlobs, copy.file.blob, Store::EncodeBlob(copy.record));
#ifndef SCALAI_TRANSFER_BLOB_COPY_H_
#define SCALAI_TRANSFER_BLOB_COPY_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "transfer/peer_client.h"
#include "transfer/store.h"

namespace scalai {

// A blob as one host describes it to the others: its size and the digest
// of its chunk sums (ChunkSumsDigest), as that host recorded them. The
// description's size does not grow with the blob's: a vote in etcd names
// every blob of a host's part of a step, and etcd refuses values over
// 1.5 MiB, which every chunk's sum (16 bytes a MiB) passed at 100 GB.
struct BlobDescription {
  int64_t size = 0;
  uint64_t digest = 0;

  static BlobDescription Of(const BlobRecord& record);
  // {"size": N, "digest": "<16 hex digits>"}.
  nlohmann::json ToJson() const;
  // Reads ToJson's form, and the form of earlier versions, which gave
  // every chunk's sum ("sums") instead of their digest.
  static absl::StatusOr<BlobDescription> FromJson(const nlohmann::json& j);
};

// A blob of another host, as described, and how to read it (bytes
// [offset, offset + length) into `out`; returns how many came).
struct RemoteBlob {
  BlobDescription described;
  std::function<absl::StatusOr<int64_t>(int64_t offset, int64_t length,
                                        char* out)>
      read;
};

// Copies `remote` into a new blob of `store` for step `step`; returns its
// name and record. Errors name it as `what`.
absl::StatusOr<std::pair<std::string, BlobRecord>> CopyRemoteBlob(
    const Store& store, int64_t step, const RemoteBlob& remote,
    const std::string& what);

// A file that rank `rank` saved under its extra/ on another host, as that
// host describes it.
struct RemoteExtra {
  int64_t step = 0;
  int rank = 0;  // of the config the step was saved under
  std::string path;
  BlobDescription described;  // its blob's
};

struct CopiedExtra {
  ExtraFile file;
  BlobRecord record;
};

// The file, fetched from `peer` (PeerClient::ReadExtra).
absl::StatusOr<CopiedExtra> CopyExtraFile(const Store& store, PeerClient& peer,
                                          const RemoteExtra& extra);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_BLOB_COPY_H_
