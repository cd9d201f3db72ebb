// The zip container of a `torch.save` file: NAME/data.pkl (the pickle),
// NAME/data/KEY (one record per storage, raw little-endian bytes),
// NAME/version. Read with libzip, whose CRC check runs on every record read
// whole; written here (stored records, data aligned to 64 bytes as torch
// aligns it, streamed for records of any size), so that `torch.load` reads
// what Scalai writes.
//
//   ASSIGN_OR_RETURN(auto archive, TorchArchive::Open(path, "mp_rank_00/model_optim_rng.pt"));
//   ASSIGN_OR_RETURN(std::string pickle, archive->ReadRecord("data.pkl"));
//   ASSIGN_OR_RETURN(std::string bytes, archive->ReadStorage("0", 4096));
//
//   ASSIGN_OR_RETURN(std::string zip,
//                    TorchArchiveBytes("archive", {{"data.pkl", pickle},
//                                                  {"data/0", storage}}));
#ifndef SCALAI_TRANSFER_TORCH_ARCHIVE_H_
#define SCALAI_TRANSFER_TORCH_ARCHIVE_H_

#include <cstdint>
#include <functional>
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
  // The same over a file's bytes held in memory.
  static absl::StatusOr<std::unique_ptr<TorchArchive>> FromBytes(
      std::string bytes, std::string label);
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
  // The same into `out`, which must have room for `bytes`: a caller
  // streaming many storages reuses one buffer (fresh pages cost as much
  // as the read).
  absl::Status ReadStorageInto(const std::string& key, int64_t bytes,
                               char* out);

 private:
  TorchArchive(zip* archive, std::string label)
      : zip_(archive), label_(std::move(label)) {}
  // Finds the prefix of an archive just opened.
  static absl::StatusOr<std::unique_ptr<TorchArchive>> Adopt(
      std::unique_ptr<TorchArchive> archive);
  absl::Status Error(const std::string& what) const;
  // Record `full` of `size` bytes into `out`, whole and CRC-checked.
  absl::Status ReadInto(const std::string& full, int64_t index, uint64_t size,
                        char* out);

  zip* zip_;
  std::string label_;
  std::string prefix_;
  std::unique_ptr<std::string> bytes_;  // what FromBytes reads
};

// Writes a torch.save zip front to back: records in the order added, each
// stored, its data starting at a multiple of 64 bytes; ZIP64 where sizes
// or offsets need it. A record is added whole, or begun with its size,
// its bytes then written by the caller through `write`, and ended with
// their CRC-32, which is patched into its header (`patch`). Finish adds
// `version` when it was not added, then the central directory.
//
//   TorchArchiveWriter out("archive", write, patch);
//   RETURN_IF_ERROR(out.Add("data.pkl", pickle));
//   RETURN_IF_ERROR(out.Begin("data/0", bytes));
//   ... write `bytes` bytes, computing crc ...
//   RETURN_IF_ERROR(out.End(crc));
//   RETURN_IF_ERROR(out.Finish());
class TorchArchiveWriter {
 public:
  using Write = std::function<absl::Status(const void*, int64_t)>;
  using Patch = std::function<absl::Status(int64_t, const void*, int64_t)>;
  TorchArchiveWriter(std::string prefix, Write write, Patch patch)
      : prefix_(std::move(prefix)),
        write_(std::move(write)),
        patch_(std::move(patch)) {}

  absl::Status Add(const std::string& name, const std::string& bytes);
  absl::Status Begin(const std::string& name, int64_t bytes);
  absl::Status End(uint32_t crc);
  absl::Status Finish();

 private:
  struct Record {
    std::string name;
    uint64_t size = 0;
    uint64_t offset = 0;
    uint32_t crc = 0;
  };
  absl::Status Put(const std::string& bytes);

  std::string prefix_;
  Write write_;
  Patch patch_;
  uint64_t position_ = 0;
  std::vector<Record> records_;
  bool open_ = false;  // a record begun and not ended
};

// A whole torch.save zip in memory, from its records (name, bytes) below
// `prefix`.
absl::StatusOr<std::string> TorchArchiveBytes(
    const std::string& prefix,
    const std::vector<std::pair<std::string, std::string>>& records);

// The CRC-32 of bytes, continuing `crc` (0 to start).
uint32_t Crc32(uint32_t crc, const void* data, int64_t bytes);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_TORCH_ARCHIVE_H_
