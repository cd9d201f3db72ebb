#include "transfer/exporter.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <map>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/reshard_plan.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "transfer/blob_reader.h"
#include "transfer/box_copy.h"
#include "transfer/mapping_guard.h"
#include "transfer/megatron_checkpoint.h"
#include "transfer/step_bytes.h"
#include "transfer/torch_archive.h"
#include "transfer/write_behind.h"

namespace scalai {
namespace {

// One output file: which destination shards it holds, in order.
struct OutputFile {
  std::string name;  // relative to the output directory
  std::vector<ShardRef> shards;
  std::map<std::string, std::string> metadata;
  // A Megatron rank file (model_optim_rng.pt) rather than safetensors: its
  // config and step, and the blob of the remainder it starts from (null for
  // none).
  bool megatron = false;
  const ParallelConfig* config = nullptr;
  int64_t step = 0;
  std::shared_ptr<const BlobReader> remainder;
};

// An output file written front to back, streamed to disk as it grows
// (WriteBehind), a span at a time so that the disk keeps up with the copy.
class OutputStream {
 public:
  OutputStream(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}

  // From now on, bytes written are summed into crc() (and never copied
  // inside the kernel, where they would not pass by).
  void StartCrc() {
    crc_on_ = true;
    crc_ = 0;
  }
  uint32_t crc() const { return crc_; }

  absl::Status Write(const void* data, int64_t length) {
    if (crc_on_) crc_ = Crc32(crc_, data, length);
    const char* at = static_cast<const char*>(data);
    for (int64_t done = 0; done < length;) {
      const int64_t n = std::min(length - done, WriteBehind::kSpanBytes);
      RETURN_IF_ERROR(WriteAll(fd_, at + done, n, path_));
      RETURN_IF_ERROR(Advance(n));
      done += n;
    }
    return absl::OkStatus();
  }

  // `length` bytes from `offset` within a stored tensor: inside the kernel
  // (as cp does), or from the mapping where it cannot.
  absl::Status CopyStored(const StepBytes::Tensor& t, int64_t offset,
                          int64_t length) {
    RETURN_IF_ERROR(t.Verify(offset, length));
    loff_t in = t.offset + offset;
    int64_t done = 0;
    absl::StatusOr<UniqueFd> source = t.blob->OpenFd();
    while (source.ok() && !crc_on_ && done < length) {
      const int64_t want = std::min(length - done, WriteBehind::kSpanBytes);
      ssize_t n = copy_file_range(source->get(), &in, fd_, nullptr, want, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // EXDEV, ENOSYS, EINVAL: fall back to the mapping
      RETURN_IF_ERROR(Advance(n));
      done += n;
    }
    return Write(t.data + offset + done, length - done);
  }

  absl::Status Zeros(int64_t length) {
    static const std::vector<std::byte> zeros(1 << 20);
    for (int64_t done = 0; done < length;) {
      const int64_t n = std::min<int64_t>(length - done, zeros.size());
      RETURN_IF_ERROR(Write(zeros.data(), n));
      done += n;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Advance(int64_t n) {
    written_ += n;
    return WriteBehind::Apply(fd_, behind_.Advance(written_), path_);
  }

  int fd_;
  std::string path_;
  int64_t written_ = 0;
  WriteBehind behind_;
  bool crc_on_ = false;
  uint32_t crc_ = 0;
};

// Segments at least this long (on average) are copied inside the kernel;
// shorter ones (rows of a split along dim 1) are gathered in memory first.
constexpr int64_t kKernelCopyMinBytes = 256 << 10;

absl::Status WriteShard(OutputStream& stream, ShardRef r,
                        const ReshardPlan& plan, const StepBytes& src,
                        std::vector<std::byte>& buffer);

absl::Status WriteOutput(const std::string& dir, const OutputFile& file,
                         const ReshardPlan& plan, const StepBytes& src,
                         Progress& progress) {
  const Placement& to = plan.to();
  const Model& model = to.model();
  std::vector<SafetensorsEntry> entries;
  for (ShardRef r : file.shards) {
    const TensorShard& s = to.shards(r.group)[r.shard];
    entries.push_back(
        {s.local_name, model.tensor(s.tensor).dtype, s.local_shape, 0, 0});
  }
  const std::string path = dir + "/" + file.name;
  const std::string tmp = path + ".tmp";
  ASSIGN_OR_RETURN(UniqueFd out,
                   OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  OutputStream stream(out.get(), tmp);
  std::vector<std::byte> buffer;
  if (file.megatron) {
    // A torch.save zip: the pickle, then each tensor as its storage's
    // record, then the storages the pickle takes from the remainder.
    std::optional<std::string> remainder;
    if (file.remainder != nullptr) {
      remainder.emplace(file.remainder->size(), '\0');
      RETURN_IF_ERROR(
          file.remainder->Read(remainder->data(), remainder->size(), 0));
    }
    ASSIGN_OR_RETURN(MegatronRankOutput rank,
                     BuildMegatronRank(entries, std::move(remainder),
                                       *file.config, file.step));
    TorchArchiveWriter zip(
        "archive",
        [&](const void* data, int64_t n) { return stream.Write(data, n); },
        [&](int64_t at, const void* data, int64_t n) {
          if (pwrite(out.get(), data, n, at) != n)
            return ErrnoError(errno, "write", tmp);
          return absl::OkStatus();
        });
    RETURN_IF_ERROR(zip.Add("data.pkl", rank.pickle));
    for (size_t k = 0; k < file.shards.size(); ++k) {
      const TensorShard& dst =
          to.shards(file.shards[k].group)[file.shards[k].shard];
      RETURN_IF_ERROR(zip.Begin(absl::StrCat("data/", k), dst.bytes));
      stream.StartCrc();
      RETURN_IF_ERROR(WriteShard(stream, file.shards[k], plan, src, buffer));
      RETURN_IF_ERROR(zip.End(stream.crc()));
      progress.Add(dst.bytes);
    }
    for (const auto& [key, bytes] : rank.storages)
      RETURN_IF_ERROR(zip.Add("data/" + key, bytes));
    RETURN_IF_ERROR(zip.Finish());
  } else {
    ASSIGN_OR_RETURN(
        SafetensorsHeader header,
        SafetensorsHeader::Build(std::move(entries), file.metadata));
    std::string head = header.Serialize();
    RETURN_IF_ERROR(stream.Write(head.data(), head.size()));
    for (ShardRef r : file.shards) {
      RETURN_IF_ERROR(WriteShard(stream, r, plan, src, buffer));
      progress.Add(to.shards(r.group)[r.shard].bytes);
    }
  }
  if (rename(tmp.c_str(), path.c_str()) != 0)
    return ErrnoError(errno, "rename", tmp);
  return absl::OkStatus();
}

// Writes destination shard `r`'s bytes to `stream`: an identical stored
// shard's as they are, else gathered through the plan.
absl::Status WriteShard(OutputStream& stream, ShardRef r,
                        const ReshardPlan& plan, const StepBytes& src,
                        std::vector<std::byte>& buffer) {
  const Placement& to = plan.to();
  const Model& model = to.model();
  const TensorShard& dst = to.shards(r.group)[r.shard];
  const int elem = DTypeSize(model.tensor(dst.tensor).dtype);
  ShardRef same = plan.in_place_source(r.group, r.shard);
  if (same.valid()) {
    // An identical stored shard: its bytes go out as they are.
    return stream.CopyStored(src.tensor(same), 0, dst.bytes);
  }
  ASSIGN_OR_RETURN(std::vector<Segment> segments,
                   plan.Resolve(r.group, r.shard, 0, dst.bytes));
  if (static_cast<int64_t>(segments.size()) * kKernelCopyMinBytes <=
      dst.bytes) {
    for (const Segment& seg : segments) {
      if (seg.src.valid()) {
        RETURN_IF_ERROR(
            stream.CopyStored(src.tensor(seg.src), seg.src_offset, seg.length));
      } else {
        RETURN_IF_ERROR(stream.Zeros(seg.length));
      }
    }
  } else {
    buffer.resize(dst.bytes);
    for (const CopyOp& op : plan.ops(r.group, r.shard)) {
      std::byte* dst_view = buffer.data() + dst.ViewOffset(op.dst_piece) * elem;
      if (!op.src.valid()) {
        ZeroBox(dst_view, dst.ViewShape(op.dst_piece), op.dst.origin(),
                op.dst.shape(), elem);
        continue;
      }
      const TensorShard& s = plan.from().shards(op.src.group)[op.src.shard];
      const StepBytes::Tensor& t = src.tensor(op.src);
      RETURN_IF_ERROR(t.Verify(0, s.bytes));
      if (!ReadMapped([&] {
            CopyBox(t.data + s.ViewOffset(op.src_piece) * elem,
                    s.ViewShape(op.src_piece), op.src_origin, dst_view,
                    dst.ViewShape(op.dst_piece), op.dst.origin(),
                    op.dst.shape(), elem);
          })) {
        return t.blob->CutShort();
      }
    }
    RETURN_IF_ERROR(stream.Write(buffer.data(), dst.bytes));
  }
  return absl::OkStatus();
}

absl::Status MakeOutDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0755) == 0) return absl::OkStatus();
  if (errno != EEXIST) return ErrnoError(errno, "create", dir);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::AlreadyExistsError(
        absl::StrCat(dir, " exists and is not a directory"));
  }
  // An old export's leftovers (other ranks) would mix with the new one.
  if (rmdir(dir.c_str()) == 0) return MakeOutDir(dir);
  return absl::AlreadyExistsError(
      absl::StrCat(dir, " exists and is not empty"));
}

// Copies the extra/ files that rank `rank` of `config` sees (the mount's
// rule, ExtraSourceRank) into OUT/rank-R/extra/.
absl::Status ExportExtraFiles(const StepSnapshot& snap,
                              const ParallelConfig& config, int rank,
                              const std::string& out) {
  ASSIGN_OR_RETURN(std::vector<ExtraFile> files,
                   snap.step().ExtraFilesSeenBy(config, rank));
  for (const ExtraFile& f : files) {
    const std::string path =
        absl::StrFormat("%s/rank-%05d/extra/%s", out, rank, f.path);
    for (size_t slash = path.find('/', out.size() + 1);
         slash != std::string::npos; slash = path.find('/', slash + 1)) {
      const std::string dir = path.substr(0, slash);
      if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
        return ErrnoError(errno, "create", dir);
    }
    ASSIGN_OR_RETURN(std::shared_ptr<const BlobReader> blob,
                     snap.extra_blob(f.blob));
    RETURN_IF_ERROR(blob->Verify(0, blob->size()));
    ASSIGN_OR_RETURN(UniqueFd fd,
                     OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
    RETURN_IF_ERROR(WriteAll(fd.get(), blob->data(), blob->size(), path));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExportResult> ExportCheckpoint(const StepSnapshot& snap,
                                              const ExportOptions& o) {
  const Store& store = snap.store();
  const StepRecord& step = snap.step();
  const std::shared_ptr<const Placement>& from = snap.placement();
  if (!snap.bytes().holds_every_group()) {
    int held = 0;
    for (int g = 0; g < step.groups; ++g) held += step.holds(g) ? 1 : 0;
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step.step, ": this store holds ", held, " of its ",
        step.groups,
        " shard groups (the other hosts of its cluster hold the rest), and "
        "an export needs every one: copy the ranks' files out of the "
        "cluster's mount instead, which shows every rank"));
  }
  std::shared_ptr<const Placement> to;
  std::vector<OutputFile> files;
  if (o.merged) {
    to =
        std::make_shared<const Placement>(Placement::CreateFull(store.model()));
    const std::vector<TensorShard>& shards = to->shards(0);
    int64_t size = 0;
    for (size_t k = 0; k < shards.size(); ++k) {
      if (files.empty() ||
          (size > 0 && size + shards[k].bytes > o.max_file_bytes)) {
        OutputFile file;
        file.metadata = {{"format", "pt"}};
        files.push_back(std::move(file));
        size = 0;
      }
      files.back().shards.push_back({0, static_cast<int>(k)});
      size += shards[k].bytes;
    }
    for (size_t f = 0; f < files.size(); ++f) {
      files[f].name = absl::StrFormat("model-%05d-of-%05d.safetensors", f + 1,
                                      files.size());
    }
  } else {
    if (!o.config)
      return absl::InvalidArgumentError("export needs --config or --merged");
    auto placement =
        Placement::Create(store.layout(), store.model(), *o.config);
    if (!placement.ok()) return placement.status();
    to = std::make_shared<const Placement>(*std::move(placement));
    const ParallelConfig& c = *o.config;
    if (o.megatron && (c.fsdp() > 1 || c.distopt())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a Megatron checkpoint is written for a config without fsdp or "
          "distopt, not ",
          c.ToString()));
    }
    for (int g = 0; g < c.num_shard_groups(); ++g) {
      const int rank = c.SaverOfGroup(g);
      OutputFile file;
      file.name = absl::StrFormat("rank-%05d/model.safetensors", rank);
      if (o.megatron) {
        const RankCoords at = c.Coords(rank);
        file.name = MegatronRankPath(step.step, at.tp_rank, at.pp_rank, c.pp());
        file.megatron = true;
        file.config = &c;
        file.step = step.step;
        ASSIGN_OR_RETURN(std::vector<ExtraFile> extras,
                         step.ExtraFilesSeenBy(c, rank));
        for (const ExtraFile& f : extras) {
          if (f.path == kMegatronRemainderPath) {
            ASSIGN_OR_RETURN(file.remainder, snap.extra_blob(f.blob));
          }
        }
      }
      for (size_t k = 0; k < to->shards(g).size(); ++k) {
        file.shards.push_back({g, static_cast<int>(k)});
      }
      file.metadata = {{"scalai.rank", absl::StrCat(rank)},
                       {"scalai.config", c.ToString()},
                       {"scalai.step", absl::StrCat(step.step)}};
      files.push_back(std::move(file));
    }
  }
  ASSIGN_OR_RETURN(ReshardPlan plan, ReshardPlan::Create(from, to));
  const StepBytes& src = snap.bytes();

  RETURN_IF_ERROR(MakeOutDir(o.out));
  // The directory is new (or was empty): a failed export (a damaged blob, a
  // full disk) takes it away again rather than leave half a checkpoint.
  bool done = false;
  absl::Cleanup remove_partial = [&] {
    std::error_code ignored;
    if (!done) std::filesystem::remove_all(o.out, ignored);
  };
  std::set<std::string> dirs = {o.out};
  for (const OutputFile& f : files) {
    for (size_t slash = f.name.find('/'); slash != std::string::npos;
         slash = f.name.find('/', slash + 1)) {
      std::string dir = o.out + "/" + f.name.substr(0, slash);
      if (dirs.insert(dir).second && mkdir(dir.c_str(), 0755) != 0) {
        return ErrnoError(errno, "create", dir);
      }
    }
  }
  int64_t total = 0;
  for (const OutputFile& f : files) {
    for (ShardRef r : f.shards) total += to->shards(r.group)[r.shard].bytes;
  }
  Progress progress(total, o.progress);
  RETURN_IF_ERROR(ParallelFor(files.size(), IoThreads(), [&](size_t i) {
    return WriteOutput(o.out, files[i], plan, src, progress);
  }));
  if (o.megatron) {
    const std::string text = absl::StrCat(step.step, "\n");
    const std::string path = o.out + "/latest_checkpointed_iteration.txt";
    ASSIGN_OR_RETURN(UniqueFd fd,
                     OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
    RETURN_IF_ERROR(WriteAll(fd.get(), text.data(), text.size(), path));
  } else if (!o.merged) {
    const ParallelConfig& c = *o.config;
    for (int g = 0; g < c.num_shard_groups(); ++g) {
      RETURN_IF_ERROR(ExportExtraFiles(snap, c, c.SaverOfGroup(g), o.out));
    }
  }
  if (o.merged) {
    nlohmann::json index = {{"metadata", {{"total_size", total}}},
                            {"weight_map", nlohmann::json::object()}};
    for (const OutputFile& f : files) {
      for (ShardRef r : f.shards)
        index["weight_map"][to->shards(0)[r.shard].local_name] = f.name;
    }
    std::string text = index.dump(2) + "\n";
    std::string path = o.out + "/model.safetensors.index.json";
    ASSIGN_OR_RETURN(UniqueFd fd,
                     OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
    RETURN_IF_ERROR(WriteAll(fd.get(), text.data(), text.size(), path));
  }
  RETURN_IF_ERROR(SyncFilesystem(o.out));
  done = true;
  return ExportResult{step.step, static_cast<int>(files.size()),
                      progress.done()};
}

}  // namespace scalai
