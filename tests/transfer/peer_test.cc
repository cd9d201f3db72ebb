// The peer service over loopback gRPC: a host hands out the bytes of its
// stored step, under the stored config and under others, and they equal the
// shards synth cuts directly; a call without the job's token, or over
// plaintext to a TLS host, gets nothing and is counted; a peer that is not
// there costs a bounded wait and is marked unreachable.
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "ptc/status_macros.h"
#include "tests/store_fixture.h"
#include "transfer/blob_checksum.h"
#include "transfer/blob_copy.h"
#include "transfer/fetch_ahead.h"
#include "transfer/fsck.h"
#include "transfer/materializer.h"
#include "transfer/peer.grpc.pb.h"
#include "transfer/peer_bytes.h"
#include "transfer/peer_call.h"
#include "transfer/peer_client.h"
#include "transfer/peer_server.h"
#include "transfer/step_view.h"
#include "transfer/step_writer.h"

namespace scalai {
namespace {

constexpr char kToken[] = "0123456789abcdef-job-token";

// Files under `dir` this process still maps or holds open after they were
// deleted: the space they keep in use.
std::string DeletedFilesHeld(const fs::path& dir) {
  std::string held;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find(dir.string()) != std::string::npos &&
        line.ends_with(" (deleted)")) {
      absl::StrAppend(&held, line, "\n");
    }
  }
  for (const auto& fd : fs::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::string target = fs::read_symlink(fd.path(), error).string();
    if (!error && target.starts_with(dir.string()) &&
        target.ends_with(" (deleted)")) {
      absl::StrAppend(&held, fd.path().string(), " -> ", target, "\n");
    }
  }
  return held;
}

class PeerTest : public StoreFixture {
 protected:
  std::unique_ptr<PeerServer> StartServer(
      std::optional<ClusterTls> tls = std::nullopt,
      decltype(PeerServer::Options::read_file) read_file = nullptr) {
    PeerServer::Options o;
    o.read_file = std::move(read_file);
    o.job = "gpt";
    o.host = "h0";
    o.address = "127.0.0.1:0";
    o.token = kToken;
    o.tls = std::move(tls);
    auto server = PeerServer::Start(*store_, o);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }

  PeerClient Client(const PeerServer& server, std::string token = kToken,
                    std::optional<ClusterTls> tls = std::nullopt) {
    PeerClient::Options o;
    o.host = "h1";
    o.token = std::move(token);
    o.tls = std::move(tls);
    o.deadline = absl::Seconds(10);
    return PeerClient({"h0", absl::StrCat("127.0.0.1:", server.port())}, o);
  }

  // A second host "b": a copy of the fixture's store (host "a", h0's
  // server), served on its own port.
  std::unique_ptr<Store> CopyStore() {
    store_.reset();
    fs::copy(dir_ / "store", dir_ / "store-b", fs::copy_options::recursive);
    store_ = *Store::Open((dir_ / "store").string());
    return *Store::Open((dir_ / "store-b").string());
  }
  std::unique_ptr<PeerServer> StartServerB(const Store& store_b) {
    PeerServer::Options o;
    o.job = "gpt";
    o.host = "b";
    o.address = "127.0.0.1:0";
    o.token = kToken;
    auto server = PeerServer::Start(store_b, o);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }
  // A client of `server` (named `to`) calling as host `from`.
  static PeerClient Between(const std::string& from, const std::string& to,
                            const PeerServer& server) {
    PeerClient::Options o;
    o.token = kToken;
    o.deadline = absl::Seconds(10);
    o.host = from;
    return PeerClient({to, absl::StrCat("127.0.0.1:", server.port())}, o);
  }

  // The bytes of shard `shard` of `rank` under `config`, cut directly.
  std::string DirectCut(const ParallelConfig& config, int rank, int shard) {
    Placement direct = *Placement::Create(layout_, model_, config);
    std::string file = DirectShardFile(config, rank);
    auto header =
        *SafetensorsHeader::Parse(file, static_cast<int64_t>(file.size()));
    const TensorShard& s = direct.shards(config.ShardGroup(rank))[shard];
    for (const SafetensorsEntry& e : header.tensors()) {
      if (e.name == s.local_name) {
        return file.substr(header.data_start() + e.data_begin,
                           e.data_end - e.data_begin);
      }
    }
    ADD_FAILURE() << "no " << s.local_name << " in the cut shard";
    return "";
  }

  // What b's peer a still serves between b's materialization of tp4 and
  // its release of the half it kept (StoreFirstQuarterKeepingSecondHalf):
  // the step under the config b kept (a has not stored tp4 yet), or under
  // tp4 (a has stored it and let go of what it kept). Checks b's views of
  // tp4 against the direct cut.
  enum class PeerServes { kKeptConfig, kNewConfig };
  void ExpectViewsOfKeptHalfAsCut(PeerServes serves);

  // Every tensor of every rank `view` shows under `config` equals the
  // direct cut.
  void ExpectEveryRankAsCut(const StepView& view,
                            const ParallelConfig& config) {
    const Placement p = *Placement::Create(layout_, model_, config);
    for (int rank = 0; rank < config.world_size(); ++rank) {
      const int g = config.ShardGroup(rank);
      for (size_t k = 0; k < p.shards(g).size(); ++k) {
        std::string got(p.shards(g)[k].bytes, '\0');
        absl::Status read =
            view.ReadTensor(g, static_cast<int>(k), 0, got.size(), got.data());
        ASSERT_TRUE(read.ok()) << "rank " << rank << ": " << read;
        ASSERT_EQ(got, DirectCut(config, rank, static_cast<int>(k)))
            << "rank " << rank << " " << p.shards(g)[k].local_name;
      }
    }
  }
};

TEST_F(PeerTest, ServesEveryTensorOfEveryRankAsCutDirectly) {
  std::unique_ptr<PeerServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  PeerClient client = Client(*server);
  auto hello = client.SayHello();
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(hello->job, "gpt");
  EXPECT_EQ(hello->host, "h0");
  int64_t fetched = 0;
  for (const char* text :
       {"tp=2,pp=1,dp=1", "tp=4,pp=1,dp=1", "tp=1,pp=3,dp=1"}) {
    SCOPED_TRACE(text);
    const ParallelConfig config = *ParallelConfig::Parse(text);
    Placement p = *Placement::Create(layout_, model_, config);
    for (int rank = 0; rank < config.world_size(); ++rank) {
      const int group = config.ShardGroup(rank);
      for (size_t i = 0; i < p.shards(group).size(); ++i) {
        const int64_t bytes = p.shards(group)[i].bytes;
        std::string got(bytes, '\0');
        absl::StatusOr<int64_t> read = client.ReadTensor(
            {42, text, group, static_cast<int>(i)}, 0, bytes, got.data());
        ASSERT_TRUE(read.ok()) << read.status();
        ASSERT_EQ(*read, bytes);
        ASSERT_EQ(got, DirectCut(config, rank, static_cast<int>(i)))
            << "rank " << rank << " " << p.shards(group)[i].local_name;
        fetched += bytes;
      }
    }
  }
  // A range from the middle of a tensor.
  Placement p = *Placement::Create(layout_, model_, saved_config());
  const int64_t bytes = p.shards(0)[1].bytes;
  std::string middle(bytes / 2, '\0');
  ASSERT_EQ(*client.ReadTensor({42, "tp=2,pp=1,dp=1", 0, 1}, bytes / 4,
                               bytes / 2, middle.data()),
            bytes / 2);
  EXPECT_EQ(middle,
            DirectCut(saved_config(), 0, 1).substr(bytes / 4, bytes / 2));
  fetched += bytes / 2;
  EXPECT_EQ(client.bytes_fetched(), fetched);
  EXPECT_EQ(server->counters().bytes_served.at("h1"), fetched);
  EXPECT_EQ(server->counters().refused, 0);
  EXPECT_TRUE(client.reachable());
}

// Cached reads in small blocks: read front to back in pieces that straddle
// blocks, every byte crosses once (the blocks read ahead are the ones read
// next), and read back to front, from blocks fetched anew, the bytes are
// the same.
TEST_F(PeerTest, CachedReadsFetchEachBlockOnceAndReturnTheCutBytes) {
  std::unique_ptr<PeerServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  PeerClient client = Client(*server);
  PeerBytes::Options o;
  o.block_bytes = 2048;
  o.cache_blocks = 6;
  o.read_ahead_blocks = 3;
  o.read_ahead_threads = 2;
  PeerBytes remote([&] { return std::vector<PeerClient*>{&client}; }, o);
  const ParallelConfig config = *ParallelConfig::Parse("tp=4,pp=1,dp=1");
  const Placement p = *Placement::Create(layout_, model_, config);
  const int group = config.ShardGroup(1);
  int64_t total = 0;
  for (size_t k = 0; k < p.shards(group).size(); ++k) {
    const int64_t bytes = p.shards(group)[k].bytes;
    const std::string want = DirectCut(config, 1, static_cast<int>(k));
    std::string got(bytes, '\0');
    for (int64_t at = 0; at < bytes; at += 1000) {
      const int64_t n = std::min<int64_t>(1000, bytes - at);
      absl::Status read = remote.Read(
          42, config.ToString(), {group, static_cast<int>(k)}, bytes, at, n,
          got.data() + at, RemoteBytes::Access::kCached);
      ASSERT_TRUE(read.ok()) << read;
    }
    ASSERT_EQ(got, want) << p.shards(group)[k].local_name;
    total += bytes;
  }
  EXPECT_EQ(client.bytes_fetched(), total);
  // An exact read (a materialization's) of what the cache holds fetches
  // nothing: the last shard's blocks are the ones cached.
  {
    const int k = static_cast<int>(p.shards(group).size()) - 1;
    const int64_t bytes = p.shards(group)[k].bytes;
    const int64_t tail = 3 * o.block_bytes + 100;
    std::string got(tail, '\0');
    ASSERT_TRUE(remote
                    .Read(42, config.ToString(), {group, k}, bytes,
                          bytes - tail, tail, got.data(),
                          RemoteBytes::Access::kExact)
                    .ok());
    EXPECT_EQ(got, DirectCut(config, 1, k).substr(bytes - tail));
    EXPECT_EQ(client.bytes_fetched(), total);
    EXPECT_EQ(remote.bytes_reused(), tail);
    // The shard's first blocks left the cache (it keeps the last
    // cache_blocks): of a range from its start into the cached ones, only
    // the first blocks are fetched.
    const int64_t blocks = (bytes + o.block_bytes - 1) / o.block_bytes;
    ASSERT_GT(blocks, static_cast<int64_t>(o.cache_blocks));
    const int64_t evicted =
        (blocks - static_cast<int64_t>(o.cache_blocks)) * o.block_bytes;
    got.assign(evicted + 5, '\0');
    ASSERT_TRUE(remote
                    .Read(42, config.ToString(), {group, k}, bytes, 0,
                          evicted + 5, got.data(), RemoteBytes::Access::kExact)
                    .ok());
    EXPECT_EQ(got, DirectCut(config, 1, k).substr(0, evicted + 5));
    total += evicted;
    EXPECT_EQ(client.bytes_fetched(), total);
    EXPECT_EQ(remote.bytes_reused(), tail + 5);
    // Step 42 committed again: nothing cached of it is used any more.
    remote.Forget(42);
    got.assign(tail, '\0');
    ASSERT_TRUE(remote
                    .Read(42, config.ToString(), {group, k}, bytes,
                          bytes - tail, tail, got.data(),
                          RemoteBytes::Access::kExact)
                    .ok());
    total += tail;
  }
  EXPECT_EQ(client.bytes_fetched(), total);
  const int64_t last = static_cast<int64_t>(p.shards(group).size()) - 1;
  const int64_t bytes = p.shards(group)[last].bytes;
  ASSERT_GT(bytes, 4 * o.block_bytes);
  const std::string want = DirectCut(config, 1, static_cast<int>(last));
  std::string got(bytes, '\0');
  for (int64_t end = bytes; end > 0; end -= 3000) {
    const int64_t at = std::max<int64_t>(0, end - 3000);
    ASSERT_TRUE(remote
                    .Read(42, config.ToString(),
                          {group, static_cast<int>(last)}, bytes, at, end - at,
                          got.data() + at, RemoteBytes::Access::kCached)
                    .ok());
  }
  EXPECT_EQ(got, want);
}

// Pieces fetched ahead come back in order, each with its own bytes, however
// many are in flight; a piece no host holds fails at its turn, after the
// ones before it arrived whole.
// A worker's read through a peer's mount is one this host's
// materialization gives way to; a peer's materialization fetching the same
// bytes is not. (A clock that moves only in Yield's sleeps: a marked read
// leaves exactly the quiet time to wait.)
TEST_F(PeerTest, AReadersFetchIsAForegroundReadOnTheServingHost) {
  std::atomic<int64_t> now{0};
  ForegroundReads reads(ForegroundReads::Clock{
      [&] { return now.load(); }, [&](int64_t nanos) { now += nanos; }});
  PeerServer::Options so;
  so.job = "gpt";
  so.host = "h0";
  so.address = "127.0.0.1:0";
  so.token = kToken;
  so.foreground = &reads;
  auto server = PeerServer::Start(*store_, so);
  ASSERT_TRUE(server.ok()) << server.status();
  PeerClient client = Client(**server);
  PeerBytes::Options o;
  o.read_ahead_blocks = 0;  // no fetch still running when Yield looks
  PeerBytes remote([&] { return std::vector<PeerClient*>{&client}; }, o);
  const ParallelConfig config = *ParallelConfig::Parse("tp=2,pp=1,dp=1");
  const Placement p = *Placement::Create(layout_, model_, config);
  const int64_t bytes = p.shards(0)[0].bytes;
  std::string got(bytes, '\0');
  ASSERT_TRUE(remote
                  .Read(42, config.ToString(), {0, 0}, bytes, 0, bytes,
                        got.data(), RemoteBytes::Access::kExact)
                  .ok());
  reads.Yield();
  EXPECT_EQ(reads.waited_nanos(), 0);
  ASSERT_TRUE(remote
                  .Read(42, config.ToString(), {0, 1}, p.shards(0)[1].bytes, 0,
                        1, got.data(), RemoteBytes::Access::kCached)
                  .ok());
  reads.Yield();
  EXPECT_EQ(reads.waited_nanos(), ForegroundReads::kQuietNanos);
}

TEST_F(PeerTest, FetchAheadReturnsPiecesInOrderAndFailsAtTheMissingOne) {
  std::unique_ptr<PeerServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  PeerClient client = Client(*server);
  PeerBytes remote([&] { return std::vector<PeerClient*>{&client}; });
  const ParallelConfig config = *ParallelConfig::Parse("tp=2,pp=1,dp=1");
  const Placement p = *Placement::Create(layout_, model_, config);
  std::vector<FetchAhead::Range> ranges;
  std::vector<std::string> want;
  for (int rank : {1, 0}) {
    const int g = config.ShardGroup(rank);
    for (size_t k = 0; k < p.shards(g).size(); ++k) {
      const int64_t bytes = p.shards(g)[k].bytes;
      const std::string cut = DirectCut(config, rank, static_cast<int>(k));
      for (int64_t at = 0; at < bytes; at += 5000) {
        const int64_t n = std::min<int64_t>(5000, bytes - at);
        ranges.push_back({{g, static_cast<int>(k)}, bytes, at, n});
        want.push_back(cut.substr(at, n));
      }
    }
  }
  for (int depth : {1, 4}) {
    FetchAhead ahead(remote, 42, config.ToString(), ranges, depth);
    for (size_t i = 0; i < ranges.size(); ++i) {
      absl::StatusOr<const char*> got = ahead.Next();
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(std::string(*got, ranges[i].length), want[i]) << i;
    }
    EXPECT_FALSE(ahead.Next().ok());
  }
  // The third piece lies past its shard's end: no host holds it.
  std::vector<FetchAhead::Range> broken(ranges.begin(), ranges.begin() + 6);
  broken[2].offset = broken[2].shard_bytes;
  FetchAhead ahead(remote, 42, config.ToString(), broken, 3);
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<const char*> got = ahead.Next();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(std::string(*got, broken[i].length), want[i]);
  }
  absl::StatusOr<const char*> got = ahead.Next();
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("held by no reachable host"),
            std::string::npos)
      << got.status();
}

TEST_F(PeerTest, FilesOfTheMountAreReadToTheirEndOrRefused) {
  // 3 MiB and a bit: several messages, and a short last read.
  std::string file((3 << 20) + 12345, '\0');
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<char>(i * 7);
  std::unique_ptr<PeerServer> server =
      StartServer(std::nullopt,
                  [&](const std::string& path, int64_t offset, int64_t length,
                      char* out) -> absl::StatusOr<int64_t> {
                    if (path != "ckpt/f")
                      return absl::NotFoundError("no " + path);
                    const int64_t n = std::max<int64_t>(
                        0, std::min<int64_t>(length, file.size() - offset));
                    std::memcpy(out, file.data() + offset, n);
                    return n;
                  });
  ASSERT_NE(server, nullptr);
  PeerClient client = Client(*server);
  std::string got(4 << 20, '\0');
  auto n = client.ReadFile("ckpt/f", 100, 4 << 20, got.data());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, static_cast<int64_t>(file.size()) - 100);
  EXPECT_EQ(got.substr(0, *n), file.substr(100));
  EXPECT_EQ(server->counters().bytes_served.at("h1"), *n);
  EXPECT_EQ(client.ReadFile("ckpt/g", 0, 10, got.data()).status().code(),
            absl::StatusCode::kNotFound);
  // A range whose end would overflow is refused before the mount is asked.
  EXPECT_EQ(client
                .ReadFile("ckpt/f", std::numeric_limits<int64_t>::max() - 5, 10,
                          got.data())
                .status()
                .code(),
            absl::StatusCode::kOutOfRange);
  // Without the token: nothing; a server with no mount: refused.
  PeerClient intruder = Client(*server, "wrong-token-of-16+chars");
  EXPECT_EQ(intruder.ReadFile("ckpt/f", 0, 10, got.data()).status().code(),
            absl::StatusCode::kUnauthenticated);
  std::unique_ptr<PeerServer> bare = StartServer();
  PeerClient to_bare = Client(*bare);
  EXPECT_EQ(to_bare.ReadFile("ckpt/f", 0, 10, got.data()).status().code(),
            absl::StatusCode::kUnimplemented);
}

// The server writes its chunks itself (not through protobuf): what it sends
// must parse as peer.proto's Chunk for any client, here the generated stub,
// whatever length prefix a chunk's size takes (1, 2 or 3 bytes).
TEST_F(PeerTest, ChunksSentParseAsProtobufChunks) {
  std::string file((1 << 20) + 200000, '\0');
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<char>(i * 13);
  std::unique_ptr<PeerServer> server =
      StartServer(std::nullopt,
                  [&](const std::string&, int64_t offset, int64_t length,
                      char* out) -> absl::StatusOr<int64_t> {
                    const int64_t n = std::max<int64_t>(
                        0, std::min<int64_t>(length, file.size() - offset));
                    std::memcpy(out, file.data() + offset, n);
                    return n;
                  });
  ASSERT_NE(server, nullptr);
  std::unique_ptr<peer::Peer::Stub> stub = peer::Peer::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                          grpc::InsecureChannelCredentials()));
  for (int64_t length : {int64_t{1}, int64_t{127}, int64_t{128}, int64_t{16383},
                         int64_t{16384}, static_cast<int64_t>(file.size())}) {
    SCOPED_TRACE(length);
    grpc::ClientContext ctx;
    ctx.AddMetadata(kPeerTokenKey, BearerToken(kToken));
    peer::ReadFileRequest request;
    request.set_path("ckpt/f");
    request.set_offset(3);
    request.set_length(length);
    std::unique_ptr<grpc::ClientReader<peer::Chunk>> reader =
        stub->ReadFile(&ctx, request);
    std::string got;
    std::vector<size_t> sizes;
    for (peer::Chunk chunk; reader->Read(&chunk);) {
      ASSERT_TRUE(chunk.has_xxh3());
      EXPECT_EQ(chunk.xxh3(),
                HashChunk(chunk.data().data(),
                          static_cast<int64_t>(chunk.data().size())));
      sizes.push_back(chunk.data().size());
      got += chunk.data();
    }
    grpc::Status finished = reader->Finish();
    ASSERT_TRUE(finished.ok()) << finished.error_message();
    const int64_t expected = std::min<int64_t>(length, file.size() - 3);
    EXPECT_TRUE(got == file.substr(3, expected));
    EXPECT_EQ(sizes.front(), std::min<int64_t>(expected, 1 << 20));
  }
}

// A chunk as a peer of this build sends it: its bytes and their XXH3.
peer::Chunk Summed(const std::string& data) {
  peer::Chunk chunk;
  chunk.set_data(data);
  chunk.set_xxh3(HashChunk(data.data(), static_cast<int64_t>(data.size())));
  return chunk;
}

// A peer that answers every ReadTensor with the same chunks, whatever was
// asked: what a newer peer, or a broken one, may send.
class ScriptedPeer final : public peer::Peer::Service {
 public:
  explicit ScriptedPeer(std::vector<peer::Chunk> reply)
      : reply_(std::move(reply)) {}
  grpc::Status ReadTensor(grpc::ServerContext*, const peer::ReadTensorRequest*,
                          grpc::ServerWriter<peer::Chunk>* writer) override {
    for (const peer::Chunk& chunk : reply_) {
      if (!writer->Write(chunk)) break;
    }
    return grpc::Status::OK;
  }

 private:
  const std::vector<peer::Chunk> reply_;
};

TEST(PeerClientTest, ChunksLandInTheCallersBufferAndOverlongOnesAreRefused) {
  // A chunk with fields this build does not know (a newer peer's), an
  // empty one, and one of megabytes that crosses many of gRPC's slices.
  peer::Chunk small = Summed("abcd");
  google::protobuf::UnknownFieldSet* unknown =
      small.GetReflection()->MutableUnknownFields(&small);
  unknown->AddVarint(7, 300);
  unknown->AddLengthDelimited(9, "a later field");
  unknown->AddFixed32(11, 5);
  unknown->AddFixed64(12, 6);
  std::string bytes(3 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  ScriptedPeer service({small, Summed(""), Summed(bytes)});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  PeerClient::Options o;
  o.host = "h1";
  o.token = kToken;
  o.deadline = absl::Seconds(10);
  PeerClient client({"h0", absl::StrCat("127.0.0.1:", port)}, o);

  const int64_t total = 4 + static_cast<int64_t>(bytes.size());
  std::string out(total + 8, 'z');
  absl::StatusOr<int64_t> got =
      client.ReadTensor({1, "tp=1,pp=1,dp=1", 0, 0}, 0, total, out.data());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, total);
  EXPECT_EQ(out.substr(0, 4), "abcd");
  EXPECT_TRUE(out.substr(4, bytes.size()) == bytes);
  EXPECT_EQ(out.substr(total), std::string(8, 'z'));  // nothing past it
  EXPECT_EQ(client.bytes_fetched(), total);

  // Asked for one byte fewer than it sends: refused, and nothing written
  // past what was asked.
  std::string short_out(total, 'z');
  got = client.ReadTensor({1, "tp=1,pp=1,dp=1", 0, 0}, 0, total - 1,
                          short_out.data());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(got.status().message().find("sent more than the"),
            std::string::npos)
      << got.status();
  EXPECT_EQ(short_out.back(), 'z');
  EXPECT_EQ(client.errors(), 1);
  server->Shutdown();
}

// Starts `service` on a port of loopback; `port` gets it.
std::unique_ptr<grpc::Server> StartScripted(ScriptedPeer& service, int& port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  return builder.BuildAndStart();
}

TEST(PeerClientTest, BytesThatFailTheirSumOrComeWithoutOneAreNeverUsed) {
  std::string bytes(3 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<char>(i * 11);
  const int64_t total = 4 + static_cast<int64_t>(bytes.size());
  // One bit flipped after the sum was taken, deep inside a chunk that
  // crosses many of gRPC's slices; a chunk that carries no sum.
  peer::Chunk damaged = Summed(bytes);
  (*damaged.mutable_data())[(2 << 20) + 12345] ^= 0x10;
  peer::Chunk unsummed;
  unsummed.set_data(bytes);
  // Two sums, the second (a later field of the same number) wrong: refused
  // whole, where protobuf's parser would keep the last.
  peer::Chunk twice = Summed(bytes);
  twice.GetReflection()->MutableUnknownFields(&twice)->AddFixed64(2, 1);
  ScriptedPeer honest({Summed("abcd"), Summed(bytes)});
  ScriptedPeer lying({Summed("abcd"), damaged});
  ScriptedPeer old({Summed("abcd"), unsummed});
  ScriptedPeer doubled({Summed("abcd"), twice});
  int honest_port = 0, lying_port = 0, old_port = 0, doubled_port = 0;
  std::unique_ptr<grpc::Server> honest_server =
      StartScripted(honest, honest_port);
  std::unique_ptr<grpc::Server> lying_server = StartScripted(lying, lying_port);
  std::unique_ptr<grpc::Server> old_server = StartScripted(old, old_port);
  std::unique_ptr<grpc::Server> doubled_server =
      StartScripted(doubled, doubled_port);
  ASSERT_TRUE(honest_server && lying_server && old_server && doubled_server);
  PeerClient::Options o;
  o.host = "h9";
  o.token = kToken;
  o.deadline = absl::Seconds(10);
  PeerClient to_honest({"h0", absl::StrCat("127.0.0.1:", honest_port)}, o);
  PeerClient to_lying({"h1", absl::StrCat("127.0.0.1:", lying_port)}, o);
  PeerClient to_old({"h2", absl::StrCat("127.0.0.1:", old_port)}, o);
  PeerClient to_doubled({"h3", absl::StrCat("127.0.0.1:", doubled_port)}, o);
  const PeerClient::TensorRef tensor{1, "tp=1,pp=1,dp=1", 0, 0};

  std::string out(total, 'z');
  absl::StatusOr<int64_t> got =
      to_lying.ReadTensor(tensor, 0, total, out.data());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(got.status().message().find(
                "3145728 bytes from byte 4 of the reply do not match the "
                "checksum they were sent with"),
            std::string::npos)
      << got.status();
  EXPECT_EQ(to_lying.errors(), 1);
  got = to_old.ReadTensor(tensor, 0, total, out.data());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(got.status().message().find("without their checksum"),
            std::string::npos)
      << got.status();
  got = to_doubled.ReadTensor(tensor, 0, total, out.data());
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("not a chunk of bytes"),
            std::string::npos)
      << got.status();

  // Reads through PeerBytes pass over the damaged replies for a peer whose
  // bytes check, whichever peer each range starts at.
  PeerBytes remote([&] {
    return std::vector<PeerClient*>{&to_lying, &to_old, &to_honest};
  });
  const std::string want = "abcd" + bytes;
  for (int group = 0; group < 3; ++group) {
    SCOPED_TRACE(group);
    std::string read(total, 'z');
    absl::Status status =
        remote.Read(1, "tp=1,pp=1,dp=1", {group, 0}, total, 0, total,
                    read.data(), RemoteBytes::Access::kExact);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_TRUE(read == want);
  }
  EXPECT_GE(to_lying.errors(), 2);
  EXPECT_GE(to_old.errors(), 2);
  // With only the damaged peers, the read fails naming why.
  PeerBytes only_bad([&] {
    return std::vector<PeerClient*>{&to_lying, &to_old};
  });
  std::string read(total, 'z');
  absl::Status status =
      only_bad.Read(1, "tp=1,pp=1,dp=1", {0, 0}, total, 0, total, read.data(),
                    RemoteBytes::Access::kExact);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("do not match the checksum"),
            std::string::npos)
      << status;
  for (auto* server :
       {&honest_server, &lying_server, &old_server, &doubled_server}) {
    (*server)->Shutdown();
  }
}

TEST_F(PeerTest, CallsWithoutTheTokenAreRefusedCountedAndServedNothing) {
  std::unique_ptr<PeerServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  for (std::string token : {std::string("wrong-token-of-16+chars"),
                            std::string(kToken) + "x", std::string()}) {
    PeerClient intruder = Client(*server, token);
    std::string out(64, '\xaa');
    absl::Status read =
        intruder.ReadTensor({42, "tp=2,pp=1,dp=1", 0, 0}, 0, 64, out.data())
            .status();
    EXPECT_EQ(read.code(), absl::StatusCode::kUnauthenticated) << read;
    EXPECT_EQ(out, std::string(64, '\xaa'));
    EXPECT_EQ(intruder.bytes_fetched(), 0);
    EXPECT_EQ(intruder.SayHello().status().code(),
              absl::StatusCode::kUnauthenticated);
  }
  EXPECT_EQ(server->counters().refused, 6);
  EXPECT_TRUE(server->counters().bytes_served.empty());
}

TEST_F(PeerTest, BadRequestsAreRefusedNamingWhat) {
  std::unique_ptr<PeerServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  PeerClient client = Client(*server);
  std::string out(1 << 20, '\0');
  absl::Status no_step =
      client.ReadTensor({7, "tp=2,pp=1,dp=1", 0, 0}, 0, 4, out.data()).status();
  EXPECT_EQ(no_step.code(), absl::StatusCode::kNotFound) << no_step;
  EXPECT_NE(no_step.message().find("no step 7"), std::string::npos);
  absl::Status past_end =
      client.ReadTensor({42, "tp=2,pp=1,dp=1", 0, 0}, 0, 1 << 20, out.data())
          .status();
  EXPECT_EQ(past_end.code(), absl::StatusCode::kOutOfRange) << past_end;
  absl::Status no_shard =
      client.ReadTensor({42, "tp=2,pp=1,dp=1", 5, 0}, 0, 4, out.data())
          .status();
  EXPECT_EQ(no_shard.code(), absl::StatusCode::kOutOfRange) << no_shard;
  absl::Status bad_config =
      client.ReadTensor({42, "tp=3,pp=1,dp=1", 0, 0}, 0, 4, out.data())
          .status();
  EXPECT_EQ(bad_config.code(), absl::StatusCode::kInvalidArgument)
      << bad_config;
  EXPECT_EQ(server->counters().failed, 4);
  EXPECT_TRUE(client.reachable());  // it answered, if only with refusals
}

TEST_F(PeerTest, AnAbsentPeerCostsABoundedWaitAndIsMarkedUnreachable) {
  std::unique_ptr<PeerServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  server.reset();  // nothing listens there now
  PeerClient::Options o;
  o.host = "h1";
  o.token = kToken;
  o.deadline = absl::Seconds(2);
  PeerClient gone({"h0", absl::StrCat("127.0.0.1:", port)}, o);
  std::string out(16, '\0');
  absl::Status read =
      gone.ReadTensor({42, "tp=2,pp=1,dp=1", 0, 0}, 0, 16, out.data()).status();
  EXPECT_TRUE(read.code() == absl::StatusCode::kUnavailable ||
              read.code() == absl::StatusCode::kDeadlineExceeded)
      << read;
  EXPECT_NE(read.message().find("peer h0"), std::string::npos) << read;
  EXPECT_FALSE(gone.reachable());
  EXPECT_EQ(gone.errors(), 1);
}

// The bytes of `shards` (of groups `groups` of `to`) that the shards of
// groups `held` of `from` do not hold: what a host holding those must fetch
// to store these, by box arithmetic alone (no reshard plan).
int64_t BytesLacking(const Placement& from, const std::vector<int>& held,
                     const Placement& to, const std::vector<int>& groups) {
  int64_t lacking = 0;
  for (int g : groups) {
    for (const TensorShard& want : to.shards(g)) {
      const int size = DTypeSize(to.model().tensor(want.tensor).dtype);
      for (const ShardPiece& piece : want.pieces) {
        if (piece.zero_fill) continue;
        int64_t missing = *piece.global.NumElements();
        // The held groups of a tp=2 placement overlap only in replicated
        // tensors; the tests below hold one group, so nothing is counted
        // twice.
        for (int h : held) {
          for (const TensorShard& have : from.shards(h)) {
            if (have.tensor != want.tensor) continue;
            for (const ShardPiece& q : have.pieces) {
              if (!q.zero_fill)
                missing -= *Intersect(piece.global, q.global).NumElements();
            }
          }
        }
        lacking += missing * size;
      }
    }
  }
  return lacking;
}

// Two hosts, each holding one of step 42's two shard groups: each reads
// every rank of another config through the other, serves only what it
// holds, and materializing its ranks of a new config fetches exactly the
// bytes it lacks; what it replaced stays served until released.
TEST_F(PeerTest, HostsHoldingHalvesReadAndMaterializeThroughEachOther) {
  std::unique_ptr<Store> store_b = CopyStore();
  const ParallelConfig halves =
      *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b");
  for (auto [store, group] : {std::pair{store_.get(), 0}, {store_b.get(), 1}}) {
    Materialization::Options o;
    o.hold = std::vector<int>{group};
    auto m = Materialization::Write(*store, halves, o);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->bytes_written(), 0);  // the same placement: all in place
    ASSERT_TRUE(m->Commit(*store).ok());
  }
  auto server_a = StartServer();
  auto server_b = StartServerB(*store_b);
  ASSERT_NE(server_a, nullptr);
  ASSERT_NE(server_b, nullptr);
  PeerClient a_to_b = Between("a", "b", *server_b);
  PeerClient b_to_a = Between("b", "a", *server_a);
  PeerBytes from_b([&] { return std::vector<PeerClient*>{&a_to_b}; });
  PeerBytes from_a([&] { return std::vector<PeerClient*>{&b_to_a}; });

  // A host asked for a shard it does not hold sends none of it, and of a
  // range that starts in what it holds, only that part.
  const Placement p_halves = *Placement::Create(layout_, model_, halves);
  const auto& group1 = p_halves.shards(1);
  const size_t split =
      std::find_if(group1.begin(), group1.end(),
                   [](const TensorShard& t) {
                     return t.local_name.ends_with("linear_qkv.weight");
                   }) -
      group1.begin();
  ASSERT_LT(split, group1.size());
  std::string out(group1[split].bytes, '\0');
  EXPECT_EQ(
      *b_to_a.ReadTensor({42, halves.ToString(), 1, static_cast<int>(split)}, 0,
                         group1[split].bytes, out.data()),
      0);
  EXPECT_EQ(
      *a_to_b.ReadTensor({42, halves.ToString(), 1, static_cast<int>(split)}, 0,
                         group1[split].bytes, out.data()),
      group1[split].bytes);

  // Views of another config read across the two hosts.
  const ParallelConfig tp4 = *ParallelConfig::Parse("tp=4,pp=1,dp=1,hosts=a+b");
  const Placement p4 = *Placement::Create(layout_, model_, tp4);
  auto check_views = [&](Store& store, const RemoteBytes& remote) {
    const StepRecord step = *store.ResolveStep(42);
    auto view = StepView::Create(store, step, tp4, &remote);
    ASSERT_TRUE(view.ok()) << view.status();
    ExpectEveryRankAsCut(**view, tp4);
  };
  check_views(*store_, from_b);
  check_views(*store_b, from_a);

  // The hosts swap halves: under tp=4 with b first, a runs ranks 2 and 3
  // (groups 2 and 3: b's half of tp=2) and b ranks 0 and 1. Each fetches
  // all it lacks, and keeps what it replaced for the other.
  const ParallelConfig swapped =
      *ParallelConfig::Parse("tp=4,pp=1,dp=1,hosts=b+a");
  auto materialize = [&](Store& store, std::vector<int> hold,
                         const RemoteBytes& remote, PeerClient& client,
                         int held_before) {
    const int64_t fetched_before = client.bytes_fetched();
    Materialization::Options o;
    o.hold = hold;
    o.remote = &remote;
    o.retain = true;
    auto m = Materialization::Write(store, swapped, o);
    ASSERT_TRUE(m.ok()) << m.status();
    const int64_t lacking = BytesLacking(p_halves, {held_before}, p4, hold);
    EXPECT_GT(lacking, 0);
    EXPECT_EQ(m->bytes_fetched(), lacking);
    EXPECT_EQ(client.bytes_fetched() - fetched_before, lacking);
    ASSERT_TRUE(m->Commit(store).ok());
    const StepRecord after = *store.ResolveStep(42);
    EXPECT_EQ(after.config, swapped.ToString());
    EXPECT_EQ(after.held, hold);
    ASSERT_EQ(after.retained.size(), 1u);
    EXPECT_EQ(after.retained[0].config, halves.ToString());
    EXPECT_TRUE(CheckStore(store, {})->empty());
  };
  // (Through fresh PeerBytes: those of the views above would copy what
  // their caches still hold instead of fetching it.)
  {
    PeerBytes fresh_from_b([&] { return std::vector<PeerClient*>{&a_to_b}; });
    materialize(*store_, {2, 3}, fresh_from_b, a_to_b, 0);
  }
  // b reads ranks 0 and 1 from what a retained, and then stores them.
  check_views(*store_b, from_a);
  {
    PeerBytes fresh_from_a([&] { return std::vector<PeerClient*>{&b_to_a}; });
    materialize(*store_b, {0, 1}, fresh_from_a, b_to_a, 1);
  }
  // Released, the old halves go; each host reads the other's new shards.
  for (Store* store : {store_.get(), store_b.get()}) {
    auto released = store->ReleaseRetained();
    ASSERT_TRUE(released.ok()) << released.status();
    // (The blobs may all stay: new shards of replicated tensors, such as
    // layer norms, use the old blob in place.)
    EXPECT_TRUE(store->ResolveStep(42)->retained.empty());
    EXPECT_TRUE(CheckStore(*store, {})->empty());
  }
  check_views(*store_, from_b);
  check_views(*store_b, from_a);
}

// The step as a full copy of it shows it under any config, except under
// the configs let go of: a peer that has released what it kept.
class LetGoPeer : public RemoteBytes {
 public:
  LetGoPeer(const Store& full, std::string let_go)
      : full_(full), let_go_(std::move(let_go)) {}
  absl::Status Read(int64_t step, const std::string& config, ShardRef shard,
                    int64_t, int64_t offset, int64_t length, char* out,
                    Access) const override {
    if (config == let_go_) {
      return absl::UnavailableError(absl::StrCat("let go of ", config));
    }
    ASSIGN_OR_RETURN(ParallelConfig parsed, ParallelConfig::Parse(config));
    ASSIGN_OR_RETURN(StepRecord record, full_.ResolveStep(step));
    ASSIGN_OR_RETURN(auto view, StepView::Create(full_, record, parsed));
    return view->ReadTensor(shard.group, shard.shard, offset, length, out);
  }
  void Forget(int64_t) const override {}

 private:
  const Store& full_;
  const std::string let_go_;
};

// Host b of `halves` (tp=2 over a+b) after it has stored the first quarter
// of `tp4` (tp=4 over b+a) and kept its half of `halves`; a is still the
// full store. Between such a materialization and the release of what it
// kept, b's views read the groups it does not store through what it kept.
struct KeptHalf {
  const ParallelConfig halves =
      *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b");
  const ParallelConfig tp4 = *ParallelConfig::Parse("tp=4,pp=1,dp=1,hosts=b+a");
  StepRecord step;  // b's record of the step
};

KeptHalf StoreFirstQuarterKeepingSecondHalf(const Store& a, Store& b) {
  KeptHalf kept;
  {
    Materialization::Options o;
    o.hold = std::vector<int>{1};
    auto m = Materialization::Write(b, kept.halves, o);
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) {
      EXPECT_TRUE(m->Commit(b).ok());
    }
  }
  {
    LetGoPeer peer(a, "");
    Materialization::Options o;
    o.hold = std::vector<int>{0};
    o.remote = &peer;
    o.retain = true;
    auto m = Materialization::Write(b, kept.tp4, o);
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) {
      EXPECT_TRUE(m->Commit(b).ok());
    }
  }
  kept.step = *b.ResolveStep(42);
  EXPECT_EQ(kept.step.retained.size(), 1u);
  if (!kept.step.retained.empty()) {
    EXPECT_EQ(kept.step.retained[0].config, kept.halves.ToString());
    EXPECT_EQ(kept.step.retained[0].groups.size(), 1u);
  }
  return kept;
}

void PeerTest::ExpectViewsOfKeptHalfAsCut(PeerServes serves) {
  std::unique_ptr<Store> store_b = CopyStore();
  const KeptHalf kept = StoreFirstQuarterKeepingSecondHalf(*store_, *store_b);
  if (HasFailure()) return;
  LetGoPeer peer(*store_, serves == PeerServes::kKeptConfig
                              ? kept.tp4.ToString()
                              : kept.halves.ToString());
  auto view = StepView::Create(*store_b, kept.step, kept.tp4, &peer);
  ASSERT_TRUE(view.ok()) << view.status();
  ExpectEveryRankAsCut(**view, kept.tp4);
}

// b reads the second half from what it kept and the second quarter from
// the peer under the config kept.
TEST_F(PeerTest, ViewsReadWhatThisHostKeptWhileThePeerHoldsTheOldConfig) {
  ExpectViewsOfKeptHalfAsCut(PeerServes::kKeptConfig);
}

// The second quarter is in neither of b's, and its peer holds no half any
// more: it is asked under the config stored now.
TEST_F(PeerTest, ViewsReadWhatPeersLetGoOfAsTheyStoreItNow) {
  ExpectViewsOfKeptHalfAsCut(PeerServes::kNewConfig);
}

// A host serves its peers while its own materializations commit: each
// commit moves the shards it held into `retained` and stores others, between
// the server's reading of the step record and of the shard records. Every
// read still gets every byte, as the host holds them all the while.
TEST_F(PeerTest, ReadsWhileTheServingHostCommitsGetEveryByte) {
  std::unique_ptr<Store> store_b = CopyStore();
  auto server_a = StartServer();
  auto server_b = StartServerB(*store_b);
  ASSERT_NE(server_a, nullptr);
  ASSERT_NE(server_b, nullptr);
  PeerClient a_to_b = Between("a", "b", *server_b);
  PeerClient reader = Client(*server_a);

  const ParallelConfig saved = saved_config();
  const Placement p = *Placement::Create(layout_, model_, saved);
  std::atomic<bool> done = false;
  std::atomic<int> commits = 0;
  absl::Status writing = absl::OkStatus();
  // Host a alternates between holding group 0 and group 1 of tp=2, each
  // time under a config named anew (no view of it cached), fetching what it
  // lacks from b and retaining what it held.
  std::thread writer([&] {
    for (int i = 0; i < 24 && writing.ok(); ++i) {
      const std::string other = absl::StrCat("x", i);
      const ParallelConfig config = *ParallelConfig::Parse(
          i % 2 == 0 ? absl::StrCat("tp=2,pp=1,dp=1,hosts=a+", other)
                     : absl::StrCat("tp=2,pp=1,dp=1,hosts=", other, "+a"));
      PeerBytes from_b([&] { return std::vector<PeerClient*>{&a_to_b}; });
      Materialization::Options o;
      o.hold = std::vector<int>{i % 2};
      o.remote = &from_b;
      o.retain = true;
      absl::StatusOr<Materialization> m =
          Materialization::Write(*store_, config, o);
      writing = m.ok() ? m->Commit(*store_) : m.status();
      ++commits;
    }
    done = true;
  });
  int reads = 0;
  while (!done) {
    for (int g = 0; g < 2; ++g) {
      const int rank = g;  // tp=2: rank r is shard group r
      for (size_t k = 0; k < p.shards(g).size(); ++k) {
        const int64_t bytes = p.shards(g)[k].bytes;
        std::string got(bytes, '\0');
        absl::StatusOr<int64_t> read =
            reader.ReadTensor({42, saved.ToString(), g, static_cast<int>(k)}, 0,
                              bytes, got.data());
        ASSERT_TRUE(read.ok())
            << read.status() << " after " << commits << " commits";
        ASSERT_EQ(*read, bytes) << p.shards(g)[k].local_name;
        ASSERT_EQ(got, DirectCut(saved, rank, static_cast<int>(k)));
        ++reads;
      }
    }
  }
  writer.join();
  ASSERT_TRUE(writing.ok()) << writing;
  EXPECT_EQ(commits, 24);
  EXPECT_GT(reads, 0);
}

// A bit flipped at rest in one of a host's blobs: that host serves none of
// the damaged chunk (its reads fail naming the blob's chunk, every other
// byte it serves is right), and reads across it and a replica return the
// cut bytes, the damaged range taken from the replica.
TEST_F(PeerTest, ABlobDamagedOnDiskIsNeverSentAndAReplicaServesInstead) {
  std::unique_ptr<Store> store_b = CopyStore();
  fs::path largest;
  for (const auto& entry : fs::directory_iterator(dir_ / "store" / "blobs")) {
    if (largest.empty() || fs::file_size(entry) > fs::file_size(largest)) {
      largest = entry.path();
    }
  }
  {
    std::fstream blob(largest, std::ios::in | std::ios::out | std::ios::binary);
    blob.seekg(static_cast<std::streamoff>(fs::file_size(largest) / 2));
    const char was = static_cast<char>(blob.get());
    blob.seekp(static_cast<std::streamoff>(fs::file_size(largest) / 2));
    blob.put(static_cast<char>(was ^ 0x04));
  }
  std::unique_ptr<PeerServer> a = StartServer();
  std::unique_ptr<PeerServer> b = StartServerB(*store_b);
  ASSERT_TRUE(a && b);
  PeerClient to_a = Between("c", "h0", *a);
  PeerClient to_b = Between("c", "b", *b);
  PeerBytes both([&] { return std::vector<PeerClient*>{&to_a, &to_b}; });
  const char* text = "tp=4,pp=1,dp=1";
  const ParallelConfig config = *ParallelConfig::Parse(text);
  Placement p = *Placement::Create(layout_, model_, config);
  int refused = 0;
  for (int rank = 0; rank < config.world_size(); ++rank) {
    const int group = config.ShardGroup(rank);
    for (size_t i = 0; i < p.shards(group).size(); ++i) {
      SCOPED_TRACE(
          absl::StrCat("rank ", rank, " ", p.shards(group)[i].local_name));
      const int64_t bytes = p.shards(group)[i].bytes;
      const std::string want = DirectCut(config, rank, static_cast<int>(i));
      std::string got(bytes, '\0');
      absl::StatusOr<int64_t> from_a = to_a.ReadTensor(
          {42, text, group, static_cast<int>(i)}, 0, bytes, got.data());
      if (from_a.ok()) {
        ASSERT_EQ(*from_a, bytes);
        EXPECT_TRUE(got == want);
      } else {
        ++refused;
        EXPECT_NE(from_a.status().message().find("does not match its checksum"),
                  std::string::npos)
            << from_a.status();
      }
      std::string read(bytes, '\0');
      absl::Status status =
          both.Read(42, text, {group, static_cast<int>(i)}, bytes, 0, bytes,
                    read.data(), RemoteBytes::Access::kExact);
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_TRUE(read == want);
    }
  }
  EXPECT_GE(refused, 1);  // the damaged chunk lies in some tensor
}

// A step stored again under a config it was stored under before, now with
// other groups held: what the host serves comes from what it holds now, not
// from a view it cached of what it held then.
TEST_F(PeerTest, AStepStoredAgainUnderAConfigSeenBeforeIsServedAsHeldNow) {
  std::unique_ptr<Store> store_b = CopyStore();
  auto server_a = StartServer();
  auto server_b = StartServerB(*store_b);
  ASSERT_NE(server_a, nullptr);
  ASSERT_NE(server_b, nullptr);
  PeerClient a_to_b = Between("a", "b", *server_b);
  PeerClient reader = Client(*server_a);
  const ParallelConfig x = *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=a+b");
  const ParallelConfig y = *ParallelConfig::Parse("tp=2,pp=1,dp=1,hosts=b+a");
  const Placement p = *Placement::Create(layout_, model_, x);
  auto store_as = [&](const ParallelConfig& config, int group) {
    PeerBytes from_b([&] { return std::vector<PeerClient*>{&a_to_b}; });
    Materialization::Options o;
    o.hold = std::vector<int>{group};
    o.remote = &from_b;
    absl::StatusOr<Materialization> m =
        Materialization::Write(*store_, config, o);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(m->Commit(*store_).ok());
  };
  auto read = [&](int group) {  // every tensor of the group
    for (size_t k = 0; k < p.shards(group).size(); ++k) {
      const int64_t bytes = p.shards(group)[k].bytes;
      std::string got(bytes, '\0');
      absl::StatusOr<int64_t> n = reader.ReadTensor(
          {42, x.ToString(), group, static_cast<int>(k)}, 0, bytes, got.data());
      ASSERT_TRUE(n.ok()) << n.status();
      ASSERT_EQ(*n, bytes) << p.shards(group)[k].local_name;
      // tp=2: rank r is group r.
      ASSERT_EQ(got, DirectCut(x, group, static_cast<int>(k)));
    }
  };
  store_as(x, 0);
  read(0);  // a view of step 42 under x, holding group 0
  store_as(y, 0);
  store_as(x, 1);
  read(1);
}

TEST_F(PeerTest, ViewsOfWhatTheStoreNoLongerHoldsLetGoOfItsBlobs) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  PeerClient reader = Client(*server);
  const Placement p = *Placement::Create(layout_, model_, saved_config());
  std::string got(p.shards(0)[0].bytes, '\0');
  ASSERT_TRUE(reader
                  .ReadTensor({42, saved_config().ToString(), 0, 0}, 0,
                              got.size(), got.data())
                  .ok());
  ASSERT_TRUE(store_->DeleteStep(42).ok());
  // The server's view of step 42 still maps its deleted blobs.
  EXPECT_NE(DeletedFilesHeld(dir_), "");
  server->DropStaleViews();
  EXPECT_EQ(DeletedFilesHeld(dir_), "");
  absl::StatusOr<int64_t> gone = reader.ReadTensor(
      {42, saved_config().ToString(), 0, 0}, 0, got.size(), got.data());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

// How a host describes a blob to the others (in etcd): a few dozen bytes
// whatever the blob's size, read back as written; the description of an
// earlier version, every chunk's sum, read as the same; anything else
// refused with what it is.
TEST(BlobDescriptionTest, StaysSmallForAnySizeAndReadsTheEarlierForm) {
  BlobRecord huge;
  huge.size = int64_t{1} << 40;  // 1 TiB: a million chunks
  huge.chunks.resize(static_cast<size_t>(ChunkCount(huge.size)));
  for (size_t i = 0; i < huge.chunks.size(); ++i)
    huge.chunks[i] = i * 0x9e3779b97f4a7c15ull;
  const BlobDescription d = BlobDescription::Of(huge);
  const std::string text = d.ToJson().dump();
  EXPECT_LT(text.size(), 64u) << text;
  auto back = BlobDescription::FromJson(nlohmann::json::parse(text));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->size, huge.size);
  EXPECT_EQ(back->digest, d.digest);
  // One chunk's sum changed, or two swapped: another digest.
  BlobRecord changed = huge;
  changed.chunks[123456] ^= 1;
  EXPECT_NE(BlobDescription::Of(changed).digest, d.digest);
  std::swap(changed.chunks[0], changed.chunks[1]);
  changed.chunks[123456] ^= 1;
  EXPECT_NE(BlobDescription::Of(changed).digest, d.digest);

  BlobRecord small;
  small.size = 3 * kBlobChunkBytes / 2;
  small.chunks = {1, 2};
  auto earlier = BlobDescription::FromJson(
      {{"size", small.size}, {"sums", EncodeChunkSums(small.chunks)}});
  ASSERT_TRUE(earlier.ok()) << earlier.status();
  EXPECT_EQ(earlier->digest, BlobDescription::Of(small).digest);

  for (const char* bad :
       {R"({"size": 5})", R"({"digest": "0000000000000001"})",
        R"({"size": -1, "digest": "0000000000000001"})",
        R"({"size": 5, "digest": "00000000000000010000000000000002"})",
        R"({"size": 5, "digest": "not hex at all!!"})", R"([1, 2])"}) {
    auto refused = BlobDescription::FromJson(nlohmann::json::parse(bad));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << bad;
  }
}

// A rank's extra file, saved on one host, copied into another host's store
// (CopyExtraFile): the same bytes, checked against the saving host's sums;
// a copy that does not match them, or of a file the host does not hold, is
// refused and leaves no blob.
TEST_F(PeerTest, ExtraFilesAreCopiedFromTheHostThatSavedThemChecked) {
  const ParallelConfig config = saved_config();
  auto writer = StepWriter::Create(*store_, 43, config);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (int rank = 0; rank < config.world_size(); ++rank) {
    if (config.Coords(rank).dp_rank != 0) continue;
    auto file = (*writer)->Open(rank);
    ASSERT_TRUE(file.ok()) << file.status();
    const std::string bytes = DirectShardFile(config, rank);
    ASSERT_TRUE((*file)
                    ->Write(bytes.data(), static_cast<int64_t>(bytes.size()), 0)
                    .ok());
    ASSERT_TRUE((*writer)->Close(rank, *file).ok());
  }
  std::string state(3 * kBlobChunkBytes / 2 + 7, '\0');
  for (size_t i = 0; i < state.size(); ++i)
    state[i] = static_cast<char>(i * 31);
  auto extra = (*writer)->OpenExtra(1, "rng/state.bin");
  ASSERT_TRUE(extra.ok()) << extra.status();
  ASSERT_TRUE((*extra)
                  ->Write(state.data(), static_cast<int64_t>(state.size()), 0)
                  .ok());
  ASSERT_TRUE((*writer)->CloseExtra(1, "rng/state.bin", *extra).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  const StepRecord step = **store_->FindStep(43);
  const BlobRecord saved = *store_->Blob(step.extra.at(1)[0].blob);

  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  PeerClient client = Client(*server);
  fs::create_directories(dir_ / "other");
  std::unique_ptr<Store> other =
      *Store::Create((dir_ / "other" / "store").string(), store_->layout());
  auto blob_files = [&] {
    return std::distance(fs::directory_iterator(other->blob_dir()),
                         fs::directory_iterator());
  };
  RemoteExtra want{43, 1, "rng/state.bin", BlobDescription::Of(saved)};
  ASSERT_EQ(want.described.size, static_cast<int64_t>(state.size()));
  auto copy = CopyExtraFile(*other, client, want);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->file.size, static_cast<int64_t>(state.size()));
  EXPECT_EQ(copy->record.chunks, saved.chunks);
  EXPECT_EQ(ReadAll(other->BlobPath(copy->file.blob)), state);
  EXPECT_EQ(blob_files(), 1);

  // The description of a blob whose second chunk differs.
  BlobRecord other_bytes = saved;
  other_bytes.chunks[1] ^= 1;
  RemoteExtra damaged = want;
  damaged.described = BlobDescription::Of(other_bytes);
  auto refused = CopyExtraFile(*other, client, damaged);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find("does not match"),
            std::string::npos)
      << refused.status();
  // Damage on the serving host's disk: the server refuses to send the
  // chunk, naming it, rather than leaving the receiver to find it.
  {
    std::fstream blob(store_->BlobPath(step.extra.at(1)[0].blob),
                      std::ios::in | std::ios::out | std::ios::binary);
    blob.seekp(kBlobChunkBytes + 5);
    blob.put(static_cast<char>(state[kBlobChunkBytes + 5] ^ 0x20));
  }
  auto rotten = CopyExtraFile(*other, client, want);
  EXPECT_EQ(rotten.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(rotten.status().message().find("chunk 1 "), std::string::npos)
      << rotten.status();
  RemoteExtra absent = want;
  absent.path = "rng/other.bin";
  auto missing = CopyExtraFile(*other, client, absent);
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("holds no extra/rng/other.bin"),
            std::string::npos)
      << missing.status();
  EXPECT_EQ(blob_files(), 1);
}

// A CA and a certificate for 127.0.0.1 it signed, made by openssl.
ClusterTls MakeCertificates(const fs::path& dir, const std::string& name) {
  fs::create_directories(dir);
  const std::string d = dir.string();
  std::ofstream(dir / "ext.cnf") << "subjectAltName=IP:127.0.0.1\n";
  const std::string script = absl::StrCat(
      "cd ", d,
      " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out "
      "ca.pem -days 2 -subj /CN=scalai-test-ca",
      " && openssl req -newkey rsa:2048 -nodes -keyout ", name,
      ".key -out host.csr -subj /CN=", name,
      " && openssl x509 -req -in host.csr -CA ca.pem -CAkey ca.key "
      "-CAcreateserial -days 2 -extfile ext.cnf -out ",
      name, ".pem) >", d, "/openssl.log 2>&1");
  const int rc = std::system(("(" + script).c_str());
  EXPECT_EQ(rc, 0) << ReadAll(d + "/openssl.log");
  return {ReadAll(d + "/" + name + ".pem"), ReadAll(d + "/" + name + ".key"),
          ReadAll(d + "/ca.pem")};
}

TEST_F(PeerTest, WithTlsOnlyTlsPeersOfTheSameCaAreServed) {
  const ClusterTls tls = MakeCertificates(dir_ / "tls", "h0");
  ASSERT_FALSE(tls.cert.empty());
  std::unique_ptr<PeerServer> server = StartServer(tls);
  ASSERT_NE(server, nullptr);
  PeerClient secure = Client(*server, kToken, tls);
  auto hello = secure.SayHello();
  ASSERT_TRUE(hello.ok()) << hello.status();
  std::string out(16, '\0');
  EXPECT_TRUE(
      secure.ReadTensor({42, "tp=2,pp=1,dp=1", 0, 0}, 0, 16, out.data()).ok());
  // Plaintext to a TLS port: the handshake fails, no call is made.
  PeerClient::Options o;
  o.host = "h1";
  o.token = kToken;
  o.deadline = absl::Seconds(3);
  PeerClient plain({"h0", absl::StrCat("127.0.0.1:", server->port())}, o);
  std::string untouched(16, '\xaa');
  absl::Status read =
      plain.ReadTensor({42, "tp=2,pp=1,dp=1", 0, 0}, 0, 16, untouched.data())
          .status();
  EXPECT_FALSE(read.ok());
  EXPECT_EQ(untouched, std::string(16, '\xaa'));
  EXPECT_EQ(plain.errors(), 1);
  // A certificate from another CA is refused too.
  const ClusterTls stranger = MakeCertificates(dir_ / "other", "h9");
  PeerClient forged = Client(*server, kToken, stranger);
  EXPECT_FALSE(
      forged.ReadTensor({42, "tp=2,pp=1,dp=1", 0, 0}, 0, 16, untouched.data())
          .ok());
  EXPECT_EQ(untouched, std::string(16, '\xaa'));
  EXPECT_EQ(server->counters().bytes_served.at("h1"), 16);
}

}  // namespace
}  // namespace scalai
