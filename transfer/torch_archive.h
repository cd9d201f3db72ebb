// The zip container of a `torch.save` file: NAME/data.pkl (the pickle),
// NAME/data/KEY (one record per storage, raw little-endian bytes),
// NAME/version. Read with libzip, whose CRC check runs on every record read
// whole; written here (stored records, data aligned to 64 bytes as torch
// aligns it), so that `torch.load` reads what Scalai writes.
//
//   ASSIGN_OR_RETURN(auto archive, TorchArchive::Open(path, "mp_rank_00/model_optim_rng.pt"));
//   ASSIGN_OR_RETURN(std::string pickle, archive->ReadRecord("data.pkl"));
//   ASSIGN_OR_RETURN(std::string bytes, archive->ReadStorage("0", 4096));
//
//   TorchArchiveWriter out("archive");
//   out.Add("data.pkl", pickle);
//   out.Add("data/0", storage_bytes);
//   ASSIGN_OR_RETURN(std::string zip, out.Finish());
#ifndef SCALAI_TRANSFER_TORCH_ARCHIVE_H_
#define SCALAI_TRANSFER_TORCH_ARCHIVE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

struct zip;

namespace scalai {

class TorchArchive {
 public:
  // `label` names the file in errors.
  static absl::StatusOr<std::unique_ptr<TorchArchive>> Open(
      const std::string& path, std::string label);
  TorchArchive(const TorchArchive&) = delete;
  TorchArchive& operator=(const TorchArchive&) = delete;
  ~TorchArchive();

  // The directory every record lies in ("archive", or the saved file's
  // stem).
  const std::string& prefix() const { return prefix_; }
  // A record below the prefix, whole and CRC-checked, refused when larger
  // than `limit` bytes.
  absl::StatusOr<std::string> ReadRecord(const std::string& name,
                                         int64_t limit = int64_t{1} << 30);
  // The record of storage `key`, which must hold exactly `bytes` bytes.
  absl::StatusOr<std::string> ReadStorage(const std::string& key,
                                          int64_t bytes);

 private:
  TorchArchive(zip* archive, std::string label)
      : zip_(archive), label_(std::move(label)) {}
  absl::Status Error(const std::string& what) const;

  zip* zip_;
  std::string label_;
  std::string prefix_;
};

// Builds a torch.save zip in memory: records in the order added, each
// stored, its data starting at a multiple of 64 bytes. Finish adds
// `version` when it was not added.
class TorchArchiveWriter {
 public:
  explicit TorchArchiveWriter(std::string prefix)
      : prefix_(std::move(prefix)) {}
  void Add(const std::string& name, std::string bytes);
  // The zip's bytes; an error when it would need ZIP64 (4 GiB or more).
  absl::StatusOr<std::string> Finish();

 private:
  std::string prefix_;
  std::vector<std::pair<std::string, std::string>> records_;
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_TORCH_ARCHIVE_H_
