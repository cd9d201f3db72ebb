// CopyExtraFile brings a file that another host of a cluster saved under a
// rank's extra/ into this store: fetched from that host (PeerClient's
// ReadExtra) into a new blob, synced, and checked against the chunk sums the
// saving host recorded, so that a damaged copy is never recorded. The blob
// is an orphan until the caller's catalog batch names it (a crash before
// leaves it to the next open's sweep).
//
//   ASSIGN_OR_RETURN(CopiedExtra copy,
//                    CopyExtraFile(store, peer, {step, rank, path, size, sums}));
//   batch.Put(Table::kBlobs, copy.file.blob, Store::EncodeBlob(copy.record));
#ifndef SCALAI_TRANSFER_EXTRA_COPY_H_
#define SCALAI_TRANSFER_EXTRA_COPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transfer/peer_client.h"
#include "transfer/store.h"

namespace scalai {

// A file as the host that saved it describes it.
struct RemoteExtra {
  int64_t step = 0;
  int rank = 0;  // of the config the step was saved under
  std::string path;
  int64_t size = 0;
  std::vector<uint64_t> sums;  // its blob's chunk sums
};

struct CopiedExtra {
  ExtraFile file;
  BlobRecord record;
};

absl::StatusOr<CopiedExtra> CopyExtraFile(const Store& store, PeerClient& peer,
                                          const RemoteExtra& extra);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_EXTRA_COPY_H_
