#include "transfer/blob_copy.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/files.h"

namespace scalai {
namespace {

// Bytes asked of the other host per call: a few of the server's 1 MiB
// messages, so that the stream runs at the link's rate.
constexpr int64_t kPieceBytes = 8 * kBlobChunkBytes;

}  // namespace

BlobDescription BlobDescription::Of(const BlobRecord& record) {
  return {record.size, ChunkSumsDigest(record.chunks)};
}

nlohmann::json BlobDescription::ToJson() const {
  return {{"size", size}, {"digest", EncodeChunkSums({digest})}};
}

absl::StatusOr<BlobDescription> BlobDescription::FromJson(
    const nlohmann::json& j) {
  const bool has_digest =
      j.is_object() && j.contains("digest") && j["digest"].is_string();
  const bool has_sums =
      j.is_object() && j.contains("sums") && j["sums"].is_string();
  if (!j.is_object() || !j.contains("size") || !j["size"].is_number_integer() ||
      j["size"].get<int64_t>() < 0 || (!has_digest && !has_sums)) {
    return absl::DataLossError(
        absl::StrCat("not a blob's description: ", j.dump().substr(0, 200)));
  }
  BlobDescription d;
  d.size = j["size"].get<int64_t>();
  if (has_digest) {
    ASSIGN_OR_RETURN(std::vector<uint64_t> digest,
                     DecodeChunkSums(j["digest"].get<std::string>()));
    if (digest.size() != 1) {
      return absl::DataLossError(absl::StrCat(
          "a blob's digest is 16 hex digits, not ", j["digest"].dump()));
    }
    d.digest = digest[0];
  } else {
    ASSIGN_OR_RETURN(std::vector<uint64_t> sums,
                     DecodeChunkSums(j["sums"].get<std::string>()));
    d.digest = ChunkSumsDigest(sums);
  }
  return d;
}

absl::StatusOr<std::pair<std::string, BlobRecord>> CopyRemoteBlob(
    const Store& store, int64_t step, const RemoteBlob& remote,
    const std::string& what) {
  const std::string name = Store::NewBlobName();
  const std::string path = store.BlobPath(name);
  ASSIGN_OR_RETURN(UniqueFd fd,
                   OpenFile(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC));
  bool kept = false;
  absl::Cleanup remove = [&] {
    if (!kept) unlink(path.c_str());
  };
  const int64_t size = remote.described.size;
  ChunkHasher hasher;
  std::string buffer(
      static_cast<size_t>(std::min(kPieceBytes, std::max<int64_t>(size, 1))),
      '\0');
  for (int64_t at = 0; at < size;) {
    const int64_t n = std::min(static_cast<int64_t>(buffer.size()), size - at);
    ASSIGN_OR_RETURN(int64_t got, remote.read(at, n, buffer.data()));
    if (got != n) {
      return absl::DataLossError(absl::StrCat(
          "only ", at + got, " of the ", size, " bytes of ", what, " came"));
    }
    hasher.Update(buffer.data(), n);
    RETURN_IF_ERROR(WriteAll(fd.get(), buffer.data(), n, path));
    at += n;
  }
  BlobRecord record;
  record.size = size;
  record.step = step;
  record.chunks = hasher.Finish();
  if (ChunkSumsDigest(record.chunks) != remote.described.digest) {
    return absl::DataLossError(
        absl::StrCat(what, " does not match the checksums it was saved with"));
  }
  if (fdatasync(fd.get()) != 0) return ErrnoError(errno, "sync", path);
  kept = true;
  return std::pair{name, record};
}

absl::StatusOr<CopiedExtra> CopyExtraFile(const Store& store, PeerClient& peer,
                                          const RemoteExtra& extra) {
  RemoteBlob remote{extra.described,
                    [&](int64_t offset, int64_t length, char* out) {
                      return peer.ReadExtra(extra.step, extra.rank, extra.path,
                                            offset, length, out);
                    }};
  ASSIGN_OR_RETURN(
      auto copy,
      CopyRemoteBlob(store, extra.step, remote,
                     absl::StrCat("rank ", extra.rank, "'s extra/", extra.path,
                                  " of step ", extra.step, " from host ",
                                  peer.peer().name)));
  return CopiedExtra{{extra.path, copy.first, extra.described.size},
                     copy.second};
}

}  // namespace scalai
