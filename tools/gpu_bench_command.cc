// `scalai gpu-bench`: measures the GPU backend's three parts on this
// machine's GPU, each against the CUDA runtime's own copy of the same bytes
// in the same run, as a ratio:
//   box copy      a batch of column bands (rows of 1 MiB) in one launch,
//                 against cudaMemcpy device to device; checked against the
//                 host's copy of the same boxes;
//   live reshard  a real plan's bytes packed, sent over a one-rank NCCL
//                 communicator to itself and unpacked, against cudaMemcpy;
//   loader        a safetensors file from the page cache onto the device
//                 through pinned double buffering, against cudaMemcpy from
//                 pinned host memory.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "ptc/placement.h"
#include "ptc/reshard_plan.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/human_bytes.h"
#include "tools/model_options.h"
#include "transfer/box_copy.h"
#include "transfer/cuda/cuda_memory.h"
#include "transfer/cuda/cuda_status.h"
#include "transfer/cuda/device_loader.h"
#include "transfer/cuda/nccl_transport.h"
#include "transfer/live_reshard.h"

namespace scalai {
namespace {

constexpr int kRepeats = 5;

struct BenchOptions {
  int device = 0;
  int64_t size_mib = 1024;
  std::string dir = "/tmp";
  std::string file;  // a safetensors file to load instead of a written one
  ModelOptions model;
};

// Median seconds of `repeats` runs of `fn`, timed by events on `stream`.
absl::StatusOr<double> TimeOnStream(cudaStream_t stream, int repeats,
                                    const std::function<absl::Status()>& fn) {
  cudaEvent_t start, stop;
  RETURN_IF_ERROR(CUDA_CALL(cudaEventCreate(&start)));
  RETURN_IF_ERROR(CUDA_CALL(cudaEventCreate(&stop)));
  std::vector<double> seconds;
  absl::Status status;
  for (int i = 0; i < repeats && status.ok(); ++i) {
    status.Update(CUDA_CALL(cudaEventRecord(start, stream)));
    status.Update(fn());
    status.Update(CUDA_CALL(cudaEventRecord(stop, stream)));
    status.Update(CUDA_CALL(cudaEventSynchronize(stop)));
    float ms = 0;
    status.Update(CUDA_CALL(cudaEventElapsedTime(&ms, start, stop)));
    seconds.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RETURN_IF_ERROR(status);
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

double GBps(int64_t bytes, double seconds) { return bytes / seconds / 1e9; }

void Report(const char* part, const std::string& what, int64_t bytes,
            double seconds, const char* reference, double reference_seconds) {
  std::printf("%-13s %-44s %8.1f GB/s   %-22s %8.1f GB/s   %.2fx\n", part,
              what.c_str(), GBps(bytes, seconds), reference,
              GBps(bytes, reference_seconds), reference_seconds / seconds);
}

absl::Status BenchBoxCopy(CudaMemory& memory, int64_t size) {
  // Column bands: rows of 1 MiB taken from the middle of rows of 2 MiB.
  constexpr int64_t kRow = 1 << 20;
  const int64_t rows = std::max<int64_t>(1, size / kRow);
  const int64_t bytes = rows * kRow;
  std::vector<std::byte> host(rows * 2 * kRow);
  for (size_t i = 0; i < host.size(); ++i) {
    host[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  }
  ASSIGN_OR_RETURN(std::byte * src_data, memory.Allocate(host.size()));
  LiveBuffer src(memory, src_data);
  ASSIGN_OR_RETURN(std::byte * dst_data, memory.Allocate(bytes));
  LiveBuffer dst(memory, dst_data);
  RETURN_IF_ERROR(memory.FromHost(src.data(), host.data(), host.size()));
  BoxBatch batch;
  constexpr int64_t kRowsPerBox = 16;
  for (int64_t r = 0; r < rows; r += kRowsPerBox) {
    const int64_t n = std::min(kRowsPerBox, rows - r);
    // bf16 elements: a row of 2 MiB is 1 Mi elements.
    RETURN_IF_ERROR(batch.AddCopy(src.data(), {rows, kRow}, {r, kRow / 4},
                                  dst.data(), {rows, kRow / 2}, {r, 0},
                                  {n, kRow / 2}, 2));
  }
  ASSIGN_OR_RETURN(double boxes, TimeOnStream(memory.stream(), kRepeats, [&] {
                     return memory.Copy(batch);
                   }));
  ASSIGN_OR_RETURN(
      double memcpy_s, TimeOnStream(memory.stream(), kRepeats, [&] {
        return CUDA_CALL(cudaMemcpyAsync(dst.data(), src.data(), bytes,
                                         cudaMemcpyDeviceToDevice,
                                         memory.stream()));
      }));
  // The check runs last, on the batch's own result.
  RETURN_IF_ERROR(memory.Copy(batch));
  std::vector<std::byte> got(bytes), want(bytes);
  RETURN_IF_ERROR(memory.ToHost(got.data(), dst.data(), bytes));
  CopyBox(host.data(), {rows, kRow}, {0, kRow / 4}, want.data(),
          {rows, kRow / 2}, {0, 0}, {rows, kRow / 2}, 2);
  if (got != want) {
    return absl::DataLossError(
        "the device box copy differs from the host's copy of the same boxes");
  }
  Report("box copy",
         absl::StrCat(batch.boxes().size(), " boxes, ", rows,
                      " rows of 1 MiB, 1 launch (= host copy)"),
         bytes, boxes, "cudaMemcpy D2D", memcpy_s);
  return absl::OkStatus();
}

absl::Status BenchLiveReshard(CudaMemory& memory, const BenchOptions& o) {
  ASSIGN_OR_RETURN(LoadedModel m, o.model.Load());
  ASSIGN_OR_RETURN(ParallelConfig one, ParallelConfig::Parse("tp=1,pp=1,dp=1"));
  ASSIGN_OR_RETURN(Placement p, Placement::Create(m.layout, m.model, one));
  auto placement = std::make_shared<const Placement>(std::move(p));
  ASSIGN_OR_RETURN(ReshardPlan plan, ReshardPlan::Create(placement, placement));
  LiveSchedule::Options options;
  options.round_bytes = 256 << 20;
  options.local_through_transport = true;
  ASSIGN_OR_RETURN(LiveSchedule schedule, LiveSchedule::Create(plan, options));
  std::vector<std::unique_ptr<LiveBuffer>> buffers;
  std::vector<const std::byte*> a;
  std::vector<std::byte*> b;
  int64_t bytes = 0;
  for (int64_t n : schedule.DestinationBytes(0)) {
    ASSIGN_OR_RETURN(std::byte * from, memory.Allocate(n));
    buffers.push_back(std::make_unique<LiveBuffer>(memory, from));
    RETURN_IF_ERROR(CUDA_CALL(cudaMemsetAsync(from, 0x3c, n, memory.stream())));
    ASSIGN_OR_RETURN(std::byte * to, memory.Allocate(n));
    buffers.push_back(std::make_unique<LiveBuffer>(memory, to));
    a.push_back(from);
    b.push_back(to);
    bytes += n;
  }
  ncclComm_t comm = nullptr;
  int device = memory.device();
  RETURN_IF_ERROR(NCCL_CALL(ncclCommInitAll(&comm, 1, &device)));
  NcclTransport transport(comm, memory.stream());
  absl::Status status;
  std::vector<double> runs;
  for (int i = 0; i < kRepeats && status.ok(); ++i) {
    RETURN_IF_ERROR(memory.Finish());
    const absl::Time start = absl::Now();
    status.Update(
        RunLiveReshard(schedule, 0, a, b, transport, memory).status());
    runs.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  ncclCommDestroy(comm);
  RETURN_IF_ERROR(status);
  std::sort(runs.begin(), runs.end());
  // The reference moves the same bytes once, tensor by tensor.
  ASSIGN_OR_RETURN(
      double memcpy_s, TimeOnStream(memory.stream(), kRepeats, [&] {
        absl::Status s;
        for (size_t k = 0; k < a.size(); ++k) {
          s.Update(CUDA_CALL(
              cudaMemcpyAsync(b[k], a[k], schedule.DestinationBytes(0)[k],
                              cudaMemcpyDeviceToDevice, memory.stream())));
        }
        return s;
      }));
  Report("live reshard",
         absl::StrCat(a.size(), " tensors, ", HumanBytes(bytes),
                      ", NCCL to self, ", schedule.rounds(), " rounds"),
         bytes, runs[runs.size() / 2], "cudaMemcpy D2D", memcpy_s);
  return absl::OkStatus();
}

absl::StatusOr<std::string> WriteShardFile(const std::string& dir,
                                           int64_t size) {
  constexpr int64_t kTensor = 256 << 20;
  std::vector<SafetensorsEntry> entries;
  for (int64_t at = 0, i = 0; at < size; at += kTensor, ++i) {
    SafetensorsEntry e;
    e.name = absl::StrCat("layers.", i, ".weight");
    e.dtype = DType::kBF16;
    e.shape = {std::min(kTensor, size - at) / 2};
    entries.push_back(std::move(e));
  }
  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   SafetensorsHeader::Build(entries, {}));
  const std::string path =
      absl::StrCat(dir, "/scalai-gpu-bench-", getpid(), ".safetensors");
  std::ofstream out(path, std::ios::binary);
  const std::string head = header.Serialize();
  out.write(head.data(), head.size());
  std::vector<char> block(16 << 20);
  for (size_t i = 0; i < block.size(); ++i)
    block[i] = static_cast<char>(i * 31);
  for (int64_t left = header.data_bytes(); left > 0;) {
    const int64_t n = std::min<int64_t>(left, block.size());
    out.write(block.data(), n);
    left -= n;
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("writing ", path));
  return path;
}

absl::Status BenchLoader(CudaMemory& memory, const BenchOptions& o) {
  std::string path = o.file;
  const bool written = path.empty();
  if (written) {
    ASSIGN_OR_RETURN(path, WriteShardFile(o.dir, o.size_mib << 20));
  }
  LoadOptions options;
  options.device = memory.device();
  // One load first, so that the page cache holds the file.
  absl::StatusOr<DeviceShard> warm = LoadShardToDevice(path, options);
  if (!warm.ok()) {
    if (written) unlink(path.c_str());
    return warm.status();
  }
  const int64_t bytes = warm->bytes();
  warm = DeviceShard();
  std::vector<double> runs;
  absl::Status status;
  for (int i = 0; i < kRepeats && status.ok(); ++i) {
    const absl::Time start = absl::Now();
    absl::StatusOr<DeviceShard> shard = LoadShardToDevice(path, options);
    runs.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    status.Update(shard.status());
  }
  if (written) unlink(path.c_str());
  RETURN_IF_ERROR(status);
  std::sort(runs.begin(), runs.end());
  ASSIGN_OR_RETURN(std::byte * device_data, memory.Allocate(bytes));
  LiveBuffer device(memory, device_data);
  std::byte* pinned = nullptr;
  RETURN_IF_ERROR(
      CUDA_CALL(cudaMallocHost(reinterpret_cast<void**>(&pinned), bytes)));
  absl::StatusOr<double> memcpy_s =
      TimeOnStream(memory.stream(), kRepeats, [&] {
        return CUDA_CALL(cudaMemcpyAsync(device.data(), pinned, bytes,
                                         cudaMemcpyHostToDevice,
                                         memory.stream()));
      });
  cudaFreeHost(pinned);
  RETURN_IF_ERROR(memcpy_s.status());
  Report("loader",
         absl::StrCat(HumanBytes(bytes), " from the page cache, ",
                      options.read_threads, " readers, 2 x ",
                      HumanBytes(options.chunk_bytes), " pinned"),
         bytes, runs[runs.size() / 2], "cudaMemcpy pinned H2D", *memcpy_s);
  return absl::OkStatus();
}

absl::Status RunGpuBench(const BenchOptions& o) {
  cudaDeviceProp prop;
  RETURN_IF_ERROR(CUDA_CALL(cudaGetDeviceProperties(&prop, o.device)));
  std::printf("GPU %d: %s, %d multiprocessors, %s; %s per part, median of %d\n",
              o.device, prop.name, prop.multiProcessorCount,
              HumanBytes(prop.totalGlobalMem).c_str(),
              HumanBytes(o.size_mib << 20).c_str(), kRepeats);
  ASSIGN_OR_RETURN(auto memory, CudaMemory::Create(o.device));
  RETURN_IF_ERROR(BenchBoxCopy(*memory, o.size_mib << 20));
  RETURN_IF_ERROR(BenchLiveReshard(*memory, o));
  return BenchLoader(*memory, o);
}

}  // namespace

Command AddGpuBenchCommand(CLI::App& root) {
  auto o = std::make_shared<BenchOptions>();
  o->model.model = "layers=4,hidden=4096,heads=32,vocab=32000";
  CLI::App* app = root.add_subcommand(
      "gpu-bench",
      "Measure the GPU backend (box copy, live reshard, loader) against "
      "cudaMemcpy on this machine's GPU");
  app->add_option("--device", o->device, "CUDA device")->capture_default_str();
  app->add_option("--size-mib", o->size_mib,
                  "bytes per part for the box copy and the loader, in MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app->add_option("--dir", o->dir,
                  "directory for the loader's file (written, then removed)")
      ->capture_default_str();
  app->add_option("--file", o->file,
                  "load this safetensors file (a rank's shard on a mount) "
                  "instead of writing one");
  o->model.Register(app, /*required=*/false);
  return {app, [o] { return RunGpuBench(*o); }};
}

}  // namespace scalai
