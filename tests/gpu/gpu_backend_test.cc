// The GPU backend on a real device (suite "gpu": run where a GPU is; built
// wherever /usr/local/cuda holds CUDA and NCCL):
//  - the device box copy writes what the host's writes, byte for byte, on
//    random boxes and on long rows that the kernel cuts into parts;
//  - the live reshard with every rank's buffers on the GPU (ranks are
//    threads, HostTransport between them) gives every rank the oracle's
//    direct cut, for random real plans;
//  - through NCCL, a one-rank communicator sending to itself;
//  - the loader puts a safetensors file's bytes on the device exactly;
//  - a failing CUDA call's error names the call.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ptc/safetensors.h"
#include "tests/ptc/plan_oracle.h"
#include "tests/transfer/random_boxes.h"
#include "transfer/box_copy.h"
#include "transfer/cuda/cuda_memory.h"
#include "transfer/cuda/cuda_status.h"
#include "transfer/cuda/device_loader.h"
#include "transfer/cuda/nccl_transport.h"
#include "transfer/live_reshard.h"

namespace scalai {
namespace {

using namespace oracle;  // NOLINT: the oracle is this test's vocabulary

// A host vector's copy in device memory, freed with the test.
class DeviceBytes {
 public:
  DeviceBytes(CudaMemory& memory, const std::vector<std::byte>& host)
      : memory_(memory), bytes_(host.size()) {
    data_ = *memory.Allocate(bytes_);
    EXPECT_TRUE(memory.FromHost(data_, host.data(), bytes_).ok());
  }
  DeviceBytes(const DeviceBytes&) = delete;
  ~DeviceBytes() { memory_.Free(data_); }
  std::byte* data() const { return data_; }
  std::vector<std::byte> Read() const {
    std::vector<std::byte> host(bytes_);
    EXPECT_TRUE(memory_.ToHost(host.data(), data_, bytes_).ok());
    return host;
  }

 private:
  CudaMemory& memory_;
  int64_t bytes_;
  std::byte* data_ = nullptr;
};

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, int64_t n) {
  std::vector<std::byte> v(n);
  for (std::byte& x : v) x = static_cast<std::byte>(rng());
  return v;
}

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess)
        << "the gpu suite runs where a GPU is";
    ASSERT_GT(count, 0);
    auto memory = CudaMemory::Create(0);
    ASSERT_TRUE(memory.ok()) << memory.status();
    memory_ = std::move(*memory);
  }
  std::unique_ptr<CudaMemory> memory_;
};

TEST_F(Gpu, BoxCopyMatchesTheHostsOnRandomBoxes) {
  for (int seed = 1; seed <= 200; ++seed) {
    std::mt19937_64 rng(seed);
    const int elem = std::vector<int>{1, 2, 4, 8, 16, 3}[rng() % 6];
    const int boxes = 1 + static_cast<int>(rng() % 6);
    std::vector<RandomBox> drawn;
    std::vector<std::vector<std::byte>> want;
    std::vector<std::unique_ptr<DeviceBytes>> src, dst;
    BoxBatch batch;
    for (int i = 0; i < boxes; ++i) {
      drawn.push_back(DrawRandomBox(rng));
      const RandomBox& b = drawn.back();
      const auto src_host = RandomBytes(rng, Elements(b.src_shape) * elem);
      want.push_back(RandomBytes(rng, Elements(b.dst_shape) * elem));
      src.push_back(std::make_unique<DeviceBytes>(*memory_, src_host));
      dst.push_back(std::make_unique<DeviceBytes>(*memory_, want.back()));
      if (i % 3 == 2) {
        ZeroBox(want[i].data(), b.dst_shape, b.dst_origin, b.box, elem);
        ASSERT_TRUE(
            batch
                .AddZero(dst[i]->data(), b.dst_shape, b.dst_origin, b.box, elem)
                .ok());
      } else {
        CopyBox(src_host.data(), b.src_shape, b.src_origin, want[i].data(),
                b.dst_shape, b.dst_origin, b.box, elem);
        ASSERT_TRUE(batch
                        .AddCopy(src[i]->data(), b.src_shape, b.src_origin,
                                 dst[i]->data(), b.dst_shape, b.dst_origin,
                                 b.box, elem)
                        .ok());
      }
    }
    ASSERT_TRUE(memory_->Copy(batch).ok());
    ASSERT_TRUE(memory_->Finish().ok());
    for (int i = 0; i < boxes; ++i) {
      ASSERT_EQ(dst[i]->Read(), want[i]) << "seed " << seed << " box " << i;
    }
  }
}

TEST_F(Gpu, BoxCopyCutsLongRowsIntoParts) {
  // Column bands of rows longer than the kernel's unit, at odd offsets
  // (byte words) and at aligned ones (16-byte words), and a zero fill.
  std::mt19937_64 rng(7);
  for (const auto& [rows, src_cols, dst_cols, at, width] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {3, 300001, 200003, 17, 199999},
           {5, 4 << 20, 2 << 20, 1 << 20, 2 << 20},
           {1, 1 << 20, 1 << 20, 0, 1 << 20}}) {
    const auto src_host = RandomBytes(rng, rows * src_cols);
    auto want = RandomBytes(rng, rows * dst_cols);
    DeviceBytes src(*memory_, src_host), dst(*memory_, want);
    BoxBatch batch;
    CopyBox(src_host.data(), {rows, src_cols}, {0, at}, want.data(),
            {rows, dst_cols}, {0, 0}, {rows, width}, 1);
    ASSERT_TRUE(batch
                    .AddCopy(src.data(), {rows, src_cols}, {0, at}, dst.data(),
                             {rows, dst_cols}, {0, 0}, {rows, width}, 1)
                    .ok());
    ZeroBox(want.data(), {rows, dst_cols}, {rows - 1, 0}, {1, dst_cols}, 1);
    ASSERT_TRUE(batch
                    .AddZero(dst.data(), {rows, dst_cols}, {rows - 1, 0},
                             {1, dst_cols}, 1)
                    .ok());
    ASSERT_TRUE(memory_->Copy(batch).ok());
    ASSERT_EQ(dst.Read(), want) << rows << " rows of " << width << " bytes";
  }
}

// Runs the plan from `pa` to `pb` with every rank's buffers on the GPU and
// checks every rank's B bytes against the oracle.
void RunOnDevice(const Scenario& s, std::shared_ptr<const Placement> pa,
                 std::shared_ptr<const Placement> pb,
                 LiveSchedule::Options options, bool through_nccl) {
  const ParallelConfig& ca = pa->config();
  const ParallelConfig& cb = pb->config();
  SCOPED_TRACE(absl::StrCat(s.layout_name, " ", ca.ToString(), " -> ",
                            cb.ToString(), through_nccl ? " over NCCL" : ""));
  auto plan = ReshardPlan::Create(pa, pb);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto schedule = LiveSchedule::Create(*plan, options);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  const auto bytes_a = OracleBytes(*pa, OracleGroups(s, ca));
  const auto bytes_b = OracleBytes(*pb, OracleGroups(s, cb));
  const int world = schedule->world();
  std::vector<std::unique_ptr<CudaMemory>> memories;
  std::vector<LiveMemory*> views;
  for (int r = 0; r < world; ++r) {
    auto m = CudaMemory::Create(0);
    ASSERT_TRUE(m.ok()) << m.status();
    memories.push_back(std::move(*m));
    views.push_back(memories.back().get());
  }
  HostTransport host_transport(world, absl::Seconds(60), views);
  ncclComm_t comm = nullptr;
  if (through_nccl) {
    ASSERT_EQ(world, 1);
    int device = 0;
    ASSERT_TRUE(NCCL_CALL(ncclCommInitAll(&comm, 1, &device)).ok());
  }
  std::vector<absl::StatusOr<LiveTraffic>> traffic(world, LiveTraffic());
  std::vector<std::vector<std::vector<std::byte>>> got(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      CudaMemory& memory = *memories[r];
      std::vector<std::unique_ptr<DeviceBytes>> a_dev, b_dev;
      std::vector<const std::byte*> a;
      std::vector<std::byte*> b;
      if (r < ca.world_size()) {
        for (const auto& t : bytes_a[ca.ShardGroup(r)]) {
          a_dev.push_back(std::make_unique<DeviceBytes>(memory, t));
          a.push_back(a_dev.back()->data());
        }
      }
      for (int64_t n : schedule->DestinationBytes(r)) {
        b_dev.push_back(std::make_unique<DeviceBytes>(
            memory, std::vector<std::byte>(n, std::byte{0x5a})));
        b.push_back(b_dev.back()->data());
      }
      if (through_nccl) {
        NcclTransport transport(comm, memory.stream(), absl::Seconds(60));
        traffic[r] = RunLiveReshard(*schedule, r, a, b, transport, memory);
      } else {
        traffic[r] = RunLiveReshard(*schedule, r, a, b, host_transport, memory);
      }
      for (const auto& t : b_dev) got[r].push_back(t->Read());
    });
  }
  for (std::thread& t : ranks) t.join();
  if (comm != nullptr) ncclCommDestroy(comm);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(traffic[r].ok()) << "rank " << r << ": " << traffic[r].status();
    if (r >= cb.world_size()) continue;
    const int g = cb.ShardGroup(r);
    ASSERT_EQ(got[r].size(), bytes_b[g].size());
    for (size_t k = 0; k < got[r].size(); ++k) {
      ASSERT_EQ(got[r][k], bytes_b[g][k])
          << "rank " << r << " " << pb->shards(g)[k].local_name;
    }
    EXPECT_EQ(traffic[r]->local_bytes + traffic[r]->received_bytes,
              pb->group_bytes(g));
  }
}

TEST_F(Gpu, LiveReshardOnTheDeviceGivesEveryRankItsDirectCut) {
  for (int seed = 1; seed <= 40; ++seed) {
    std::mt19937_64 rng(seed);
    Scenario s = RandomScenario(rng);
    LiveSchedule::Options options;
    options.round_bytes = std::vector<int64_t>{64, 1000, 1 << 20}[rng() % 3];
    auto pa = RandomPlacement(rng, s, 8);
    auto pb = RandomPlacement(rng, s, 8);
    RunOnDevice(s, pa, pb, options, /*through_nccl=*/false);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Gpu, LiveReshardOverNcclSendsARanksOwnBytesToItself) {
  for (int seed = 1; seed <= 10; ++seed) {
    std::mt19937_64 rng(seed);
    Scenario s = RandomScenario(rng);
    auto p = Placement::Create(s.layout, s.model,
                               *ParallelConfig::Parse("tp=1,pp=1,dp=1"));
    ASSERT_TRUE(p.ok()) << p.status();
    auto one = std::make_shared<const Placement>(*std::move(p));
    LiveSchedule::Options options;
    options.round_bytes = std::vector<int64_t>{1000, 1 << 20}[rng() % 2];
    options.local_through_transport = true;
    RunOnDevice(s, one, one, options, /*through_nccl=*/true);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Gpu, LoaderPutsAFilesTensorsOnTheDevice) {
  std::mt19937_64 rng(3);
  std::vector<SafetensorsEntry> entries;
  std::vector<std::byte> data;
  for (int i = 0; i < 5; ++i) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 300);
    const int64_t cols = 1 + static_cast<int64_t>(rng() % 3000);
    SafetensorsEntry e;
    e.name = absl::StrCat("t", i);
    e.dtype = DType::kBF16;
    e.shape = {rows, cols};
    entries.push_back(e);
    const auto bytes = RandomBytes(rng, rows * cols * 2);
    data.insert(data.end(), bytes.begin(), bytes.end());
  }
  auto header = SafetensorsHeader::Build(entries, {});
  ASSERT_TRUE(header.ok()) << header.status();
  char path[] = "/tmp/scalai-gpu-loader-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream out(path, std::ios::binary);
    const std::string head = header->Serialize();
    out.write(head.data(), head.size());
    out.write(reinterpret_cast<const char*>(data.data()), data.size());
  }
  for (int64_t chunk : {int64_t{4097}, int64_t{1} << 20, int64_t{64} << 20}) {
    LoadOptions options;
    options.chunk_bytes = chunk;
    options.read_threads = 3;
    auto shard = LoadShardToDevice(path, options);
    ASSERT_TRUE(shard.ok()) << shard.status();
    ASSERT_EQ(shard->bytes(), static_cast<int64_t>(data.size()));
    std::vector<std::byte> back(data.size());
    ASSERT_EQ(cudaMemcpy(back.data(), shard->data(), back.size(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(back, data) << "chunks of " << chunk;
    ASSERT_EQ(shard->tensors().size(), entries.size());
    EXPECT_EQ(shard->tensors()[2].data,
              shard->data() + header->tensors()[2].data_begin);
  }
  std::remove(path);
  auto missing = LoadShardToDevice("/nonexistent/model.safetensors", {});
  EXPECT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              ::testing::HasSubstr("/nonexistent/model.safetensors"));
}

TEST_F(Gpu, AFailingCallNamesItself) {
  auto too_big = memory_->Allocate(int64_t{1} << 60);
  ASSERT_FALSE(too_big.ok());
  EXPECT_THAT(std::string(too_big.status().message()),
              ::testing::HasSubstr("cudaMalloc"));
}

}  // namespace
}  // namespace scalai
