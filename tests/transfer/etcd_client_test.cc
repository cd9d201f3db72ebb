// The etcd client against a real etcd member (Debian's etcd-server): keys
// read and written, transactions that apply whole or not at all, leases
// whose keys go with them, watches that see every change in order, and
// values larger than one request, put in parts (etcd_large_value.h).
#include "transfer/etcd_client.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/etcd_member.h"
#include "tests/scratch_dir.h"
#include "transfer/etcd_large_value.h"

namespace scalai {
namespace {

namespace fs = std::filesystem;

class EtcdClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    member_ = std::make_unique<EtcdMember>(dir_);
    absl::Status ready = member_->WaitReady();
    ASSERT_TRUE(ready.ok()) << ready << "\n" << member_->log();
    auto client = EtcdClient::Connect({member_->endpoint()});
    ASSERT_TRUE(client.ok()) << client.status();
    etcd_ = std::move(*client);
  }
  void TearDown() override {
    etcd_.reset();
    member_.reset();
  }

  ScratchDir scratch_{"etcd-client"};  // first: it outlives the member
  const fs::path dir_ = scratch_.path();
  std::unique_ptr<EtcdMember> member_;
  std::unique_ptr<EtcdClient> etcd_;
};

TEST_F(EtcdClientTest, KeysAreWrittenAndReadBackByKeyAndPrefix) {
  auto absent = etcd_->Get("/job/config");
  ASSERT_TRUE(absent.ok()) << absent.status();
  EXPECT_FALSE(absent->has_value());
  auto first = etcd_->PutValue("/job/config", "tp=2,pp=1,dp=1");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(etcd_->PutValue("/job/hosts/h1", "a").ok());
  ASSERT_TRUE(etcd_->PutValue("/job/hosts/h0", std::string("b\0c", 3)).ok());
  ASSERT_TRUE(etcd_->PutValue("/jobx/other", "not under /job/").ok());
  auto config = etcd_->Get("/job/config");
  ASSERT_TRUE(config.ok() && config->has_value());
  EXPECT_EQ((*config)->value, "tp=2,pp=1,dp=1");
  EXPECT_EQ((*config)->mod_revision, *first);
  auto hosts = etcd_->GetPrefix("/job/hosts/");
  ASSERT_TRUE(hosts.ok()) << hosts.status();
  ASSERT_EQ(hosts->kvs.size(), 2u);
  EXPECT_EQ(hosts->kvs[0].key, "/job/hosts/h0");  // in key order
  EXPECT_EQ(hosts->kvs[0].value, std::string("b\0c", 3));
  EXPECT_EQ(hosts->kvs[1].key, "/job/hosts/h1");
  EXPECT_GE(hosts->revision, *first + 3);
  // One key with the store's revision at the read, past the key's own.
  auto at = etcd_->GetAt("/job/config");
  ASSERT_TRUE(at.ok() && at->kv.has_value()) << at.status();
  EXPECT_EQ(at->kv->mod_revision, *first);
  EXPECT_EQ(at->revision, hosts->revision);
  auto nothing = etcd_->GetAt("/job/absent");
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_FALSE(nothing->kv.has_value());
  EXPECT_EQ(nothing->revision, hosts->revision);
  // Names and revisions alone.
  auto listed = etcd_->ListPrefix("/job/hosts/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->kvs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(listed->kvs[i].key, hosts->kvs[i].key);
    EXPECT_EQ(listed->kvs[i].value, "");
    EXPECT_EQ(listed->kvs[i].mod_revision, hosts->kvs[i].mod_revision);
  }
  EXPECT_EQ(listed->revision, hosts->revision);
  EXPECT_EQ(etcd_->GetPrefix("/job/")->kvs.size(), 3u);
  // A prefix of more than gRPC's default 4 MiB a message, read whole.
  const std::string mib(1 << 20, 'm');
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(etcd_->PutValue(absl::StrFormat("/big/%d", i), mib).ok());
  auto big = etcd_->GetPrefix("/big/");
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_EQ(big->kvs.size(), 5u);
  EXPECT_TRUE(big->kvs[4].value == mib);
}

// Named keys read together: those present, in the order asked, over more
// than one transaction's worth of keys; an absent key is left out and none
// asked makes no call.
TEST_F(EtcdClientTest, ManyNamedKeysAreReadTogether) {
  std::vector<std::string> keys;
  for (int i = 0; i < 300; ++i) {
    keys.push_back(absl::StrFormat("/job/progress/h%03d", i));
    if (i % 7 == 3) continue;  // never written
    ASSERT_TRUE(etcd_->PutValue(keys.back(), absl::StrCat("v", i)).ok());
  }
  std::reverse(keys.begin(), keys.end());
  auto read = etcd_->GetMany(keys);
  ASSERT_TRUE(read.ok()) << read.status();
  std::vector<std::string> expected;
  for (const std::string& key : keys) {
    if (std::stoi(key.substr(key.size() - 3)) % 7 != 3) expected.push_back(key);
  }
  ASSERT_EQ(read->kvs.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(read->kvs[i].key, expected[i]);
    EXPECT_EQ(read->kvs[i].value,
              absl::StrCat(
                  "v", std::stoi(expected[i].substr(expected[i].size() - 3))));
    EXPECT_GT(read->kvs[i].mod_revision, 0);
  }
  auto listed = etcd_->ListPrefix("/job/progress/");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(read->revision, listed->revision);
  auto none = etcd_->GetMany({});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->kvs.empty());
}

// A transaction on condition that nothing under a prefix changed since a
// read applies while nothing did, also when nothing is there, and not once
// a key under it was put again or added.
TEST_F(EtcdClientTest, APrefixUnchangedSinceAReadIsACondition) {
  ASSERT_TRUE(etcd_->PutValue("/job/saves/7/withdrawn", "").ok());
  ASSERT_TRUE(etcd_->PutValue("/job/saves/7/dropped/h0", "5").ok());
  ASSERT_TRUE(etcd_->PutValue("/job/saves/70/vote/h0", "").ok());
  auto read = etcd_->ListPrefix("/job/saves/7/");
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->kvs.size(), 2u);
  auto mark = [&](const std::string& prefix, int64_t since) {
    EtcdClient::Txn txn;
    txn.unchanged.push_back({prefix, since});
    txn.puts.push_back({"/job/mark", "x"});
    auto done = etcd_->Commit(txn);
    EXPECT_TRUE(done.ok()) << done.status();
    return done.ok() && done->applied;
  };
  EXPECT_TRUE(mark("/job/saves/7/", read->revision));
  EXPECT_TRUE(mark("/job/saves/8/", read->revision));  // nothing there
  // A key beside the prefix (step 70) is not under it.
  ASSERT_TRUE(etcd_->PutValue("/job/saves/70/vote/h1", "").ok());
  EXPECT_TRUE(mark("/job/saves/7/", read->revision));
  ASSERT_TRUE(etcd_->PutValue("/job/saves/7/vote/h1", "").ok());
  EXPECT_FALSE(mark("/job/saves/7/", read->revision));
  auto again = etcd_->ListPrefix("/job/saves/7/");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(mark("/job/saves/7/", again->revision));
  ASSERT_TRUE(etcd_->PutValue("/job/saves/7/withdrawn", "").ok());
  EXPECT_FALSE(mark("/job/saves/7/", again->revision));
}

// A value over what etcd takes in one request (1.5 MiB) is refused put
// whole, goes in parts, and reads back; a second writer finds it there; a
// small value is put as it is; a part changed or lost is an error naming
// the key, never a wrong value.
TEST_F(EtcdClientTest, LargeValuesGoInPartsAndReadBackChecked) {
  std::string value(5 * kEtcdPartBytes + 123, '\0');
  for (size_t i = 0; i < value.size(); ++i)
    value[i] = static_cast<char>((i * 2654435761u) >> 13);
  EXPECT_FALSE(etcd_->PutValue("/job/whole", value).ok());

  auto put = PutLargeIfAbsent(*etcd_, "/job/model", value);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_TRUE(*put);
  auto got = GetLarge(*etcd_, "/job/model");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->has_value());
  EXPECT_TRUE(**got == value);
  // The key names its parts: /job/model/parts/XXH3/00000000 and on.
  const std::string named = (*etcd_->Get("/job/model"))->value;
  ASSERT_EQ(named.rfind("scalai-parts:", 0), 0u) << named;
  const nlohmann::json j = nlohmann::json::parse(named.substr(13));
  EXPECT_EQ(j["parts"], 6);
  EXPECT_EQ(j["bytes"], value.size());
  const std::string part_prefix =
      "/job/model/parts/" + j["xxh3"].get<std::string>() + "/";
  for (int p = 0; p < 6; ++p) {
    auto part = etcd_->Get(absl::StrFormat("%s%08d", part_prefix, p));
    ASSERT_TRUE(part.ok() && part->has_value()) << p;
    EXPECT_TRUE((*part)->value ==
                value.substr(static_cast<size_t>(p * kEtcdPartBytes),
                             static_cast<size_t>(kEtcdPartBytes)));
  }

  auto again = PutLargeIfAbsent(*etcd_, "/job/model", value.substr(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(*again);
  EXPECT_TRUE(**GetLarge(*etcd_, "/job/model") == value);
  EXPECT_EQ((*etcd_->Get("/job/model"))->value, named);

  ASSERT_TRUE(*PutLargeIfAbsent(*etcd_, "/job/layout", "{\"rules\": []}"));
  EXPECT_EQ((*etcd_->Get("/job/layout"))->value, "{\"rules\": []}");
  EXPECT_EQ(**GetLarge(*etcd_, "/job/layout"), "{\"rules\": []}");
  EXPECT_FALSE(GetLarge(*etcd_, "/job/none")->has_value());

  const std::string third = absl::StrFormat("%s%08d", part_prefix, 2);
  ASSERT_TRUE(etcd_->PutValue(third, "x").ok());
  auto changed = GetLarge(*etcd_, "/job/model");
  EXPECT_EQ(changed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(changed.status().message().find("/job/model: its 6 parts do not"),
            std::string::npos)
      << changed.status();
  EtcdClient::Txn lose;
  lose.deletes.push_back(third);
  ASSERT_TRUE(etcd_->Commit(lose).ok());
  auto lost = GetLarge(*etcd_, "/job/model");
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(lost.status().message().find("is missing"), std::string::npos)
      << lost.status();
}

TEST_F(EtcdClientTest, TransactionsApplyWholeOrNotAtAll) {
  // Created only if absent: the second attempt finds it and changes nothing.
  EtcdClient::Txn create;
  create.conditions.push_back({"/job/config", 0});
  create.puts.push_back({"/job/config", "tp=2,pp=1,dp=1"});
  create.puts.push_back({"/job/generation", "1"});
  auto applied = etcd_->Commit(create);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_TRUE(applied->applied);
  EXPECT_EQ((*etcd_->Get("/job/config"))->mod_revision, applied->revision);
  create.puts[1].value = "99";
  EXPECT_FALSE(etcd_->Commit(create)->applied);
  EXPECT_EQ((*etcd_->Get("/job/generation"))->value, "1");

  // A compare-and-swap on the revision read: one of two racing writers wins.
  const int64_t seen = (*etcd_->Get("/job/config"))->mod_revision;
  EtcdClient::Txn a, b;
  for (auto [txn, config] :
       {std::pair{&a, "tp=4,pp=1,dp=1"}, std::pair{&b, "tp=1,pp=1,dp=4"}}) {
    txn->conditions.push_back({"/job/config", seen});
    txn->puts.push_back({"/job/config", config});
    txn->puts.push_back({"/job/generation", "2"});
    txn->deletes.push_back("/job/done/h0");
    txn->delete_prefixes.push_back("/job/progress/");
  }
  ASSERT_TRUE(etcd_->PutValue("/job/progress/h0", "x").ok());
  ASSERT_TRUE(etcd_->PutValue("/job/progress/h1", "y").ok());
  ASSERT_TRUE(etcd_->PutValue("/job/progressive", "kept").ok());
  EXPECT_TRUE(etcd_->Commit(a)->applied);
  EXPECT_FALSE(etcd_->Commit(b)->applied);
  EXPECT_EQ((*etcd_->Get("/job/config"))->value, "tp=4,pp=1,dp=1");
  EXPECT_TRUE(etcd_->GetPrefix("/job/progress/")->kvs.empty());
  EXPECT_TRUE(etcd_->Get("/job/progressive")->has_value());
}

TEST_F(EtcdClientTest, KeysOfALeaseGoWithIt) {
  auto lease = etcd_->GrantLease(absl::Seconds(30));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(etcd_->PutValue("/job/members/h0", "10.0.0.1:7070", *lease).ok());
  EXPECT_EQ((*etcd_->Get("/job/members/h0"))->lease, *lease);
  EXPECT_TRUE(etcd_->KeepAlive(*lease).ok());
  ASSERT_TRUE(etcd_->RevokeLease(*lease).ok());
  EXPECT_FALSE(etcd_->Get("/job/members/h0")->has_value());
  absl::Status expired = etcd_->KeepAlive(*lease);
  EXPECT_EQ(expired.code(), absl::StatusCode::kNotFound) << expired;
  // A lease left alone expires by itself.
  auto brief = etcd_->GrantLease(absl::Seconds(1));
  ASSERT_TRUE(brief.ok());
  ASSERT_TRUE(etcd_->PutValue("/job/members/h1", "x", *brief).ok());
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {  // etcd rounds a TTL up to ~2 s
    usleep(100 * 1000);
    gone = !etcd_->Get("/job/members/h1")->has_value();
  }
  EXPECT_TRUE(gone);
}

// The events a watch delivers (on its own thread), for a test to wait on.
// Declared before the watch, so that it outlives the watch's callbacks.
class WatchedEvents {
 public:
  std::function<void(const EtcdClient::Event&)> Collect() {
    return [this](const EtcdClient::Event& e) {
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(e);
      changed_.notify_all();
    };
  }
  // The events so far, once there are `n` of them or 20 s have passed.
  std::vector<EtcdClient::Event> WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(lock, std::chrono::seconds(20),
                      [&] { return events_.size() >= n; });
    return events_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<EtcdClient::Event> events_;  // guarded by mu_
};

TEST_F(EtcdClientTest, WatchSeesEveryChangeAfterTheRevisionInOrder) {
  const int64_t start = *etcd_->PutValue("/job/config", "tp=1,pp=1,dp=1");
  ASSERT_TRUE(etcd_->PutValue("/job/config", "tp=2,pp=1,dp=1").ok());
  WatchedEvents watched;
  auto watch = etcd_->WatchPrefix("/job/", start, watched.Collect());
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(etcd_->PutValue("/job/config", "tp=4,pp=1,dp=1").ok());
  ASSERT_TRUE(etcd_->PutValue("/elsewhere", "unseen").ok());
  EtcdClient::Txn del;
  del.deletes.push_back("/job/config");
  ASSERT_TRUE(etcd_->Commit(del)->applied);
  const std::vector<EtcdClient::Event> events = watched.WaitFor(3);
  ASSERT_EQ(events.size(), 3u);
  // The change made before the watch began, after `start`, comes first.
  EXPECT_EQ(events[0].kv.value, "tp=2,pp=1,dp=1");
  EXPECT_EQ(events[1].kv.value, "tp=4,pp=1,dp=1");
  EXPECT_TRUE(events[2].deleted);
  EXPECT_EQ(events[2].kv.key, "/job/config");
  EXPECT_LT(events[0].kv.mod_revision, events[1].kv.mod_revision);
  EXPECT_TRUE((*watch)->status().ok());
  watch->reset();  // stops and joins while etcd still runs
}

// Compaction forgets the history before a revision: a watch from before
// it is refused, naming the compaction; one from it on sees what follows;
// compacting again to the same or an earlier revision is no error, to a
// revision not yet made is.
TEST_F(EtcdClientTest, CompactionForgetsTheHistoryBeforeARevision) {
  const int64_t first = *etcd_->PutValue("/job/config", "tp=1,pp=1,dp=1");
  const int64_t second = *etcd_->PutValue("/job/config", "tp=2,pp=1,dp=1");
  ASSERT_TRUE(etcd_->Compact(second).ok());
  EXPECT_TRUE(etcd_->Compact(second).ok());
  EXPECT_TRUE(etcd_->Compact(first).ok());
  EXPECT_FALSE(etcd_->Compact(second + 1000).ok());
  EXPECT_EQ((*etcd_->Get("/job/config"))->value, "tp=2,pp=1,dp=1");

  auto forgotten =
      etcd_->WatchPrefix("/job/", first - 1, [](const EtcdClient::Event&) {});
  ASSERT_TRUE(forgotten.ok()) << forgotten.status();
  for (int i = 0; i < 200 && (*forgotten)->status().ok(); ++i)
    absl::SleepFor(absl::Milliseconds(50));
  EXPECT_NE((*forgotten)->status().message().find("compacted at"),
            std::string::npos)
      << (*forgotten)->status();

  WatchedEvents watched;
  auto watch = etcd_->WatchPrefix("/job/", second, watched.Collect());
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(etcd_->PutValue("/job/config", "tp=4,pp=1,dp=1").ok());
  const std::vector<EtcdClient::Event> events = watched.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kv.value, "tp=4,pp=1,dp=1");
  EXPECT_TRUE((*watch)->status().ok());
  watch->reset();
  forgotten->reset();
}

TEST_F(EtcdClientTest, AnEtcdThatIsGoneIsAnErrorWithinTheDeadline) {
  member_.reset();
  auto client = EtcdClient::Connect({"http://127.0.0.1:1"}, std::nullopt,
                                    absl::Seconds(2));
  ASSERT_TRUE(client.ok());
  auto got = (*client)->Get("/job/config");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded)
      << got.status();
  EXPECT_NE(got.status().message().find("http://127.0.0.1:1"),
            std::string::npos);
  EXPECT_NE(got.status().message().find("no answer within 2s"),
            std::string::npos)
      << got.status();
}

}  // namespace
}  // namespace scalai
