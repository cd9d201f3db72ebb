// The cluster file: a good one is read whole, with its token and
// certificates; each kind of mistake is one line naming it.
#include "transfer/cluster_file.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "tests/scratch_dir.h"

namespace scalai {
namespace {

namespace fs = std::filesystem;

constexpr char kGood[] = R"({"job": "gpt-7b",
 "etcd": ["http://10.0.0.9:2379", "https://10.0.0.10:2379"],
 "token_file": "token",
 "hosts": [{"name": "h0", "address": "10.0.0.1:7070"},
           {"name": "h1", "address": "10.0.0.2:7070"}]})";

class ClusterFileTest : public ::testing::Test {
 protected:
  void SetUp() override { Write("token", "  s3cret-token-of-the-job-0123\n"); }

  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  // The error of `text` with `from` replaced by `to`.
  std::string ErrorOf(const std::string& from, const std::string& to) {
    std::string text = absl::StrReplaceAll(kGood, {{from, to}});
    EXPECT_NE(text, kGood) << "the replacement of " << from << " missed";
    auto c = ClusterFile::Parse(text, dir_.string());
    EXPECT_FALSE(c.ok()) << text;
    return std::string(c.status().message());
  }

  ScratchDir scratch_{"cluster-file"};
  const fs::path dir_ = scratch_.path();
};

TEST_F(ClusterFileTest, AGoodFileIsReadWhole) {
  Write("cluster.json", kGood);
  auto c = ClusterFile::Load((dir_ / "cluster.json").string());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->job, "gpt-7b");
  EXPECT_EQ(c->etcd.size(), 2u);
  EXPECT_EQ(c->token, "s3cret-token-of-the-job-0123");  // trimmed
  EXPECT_FALSE(c->tls.has_value());
  ASSERT_EQ(c->hosts.size(), 2u);
  EXPECT_EQ(c->hosts[1].name, "h1");
  EXPECT_EQ(c->hosts[1].address, "10.0.0.2:7070");
  EXPECT_EQ((*c->FindHost("h0"))->address, "10.0.0.1:7070");
  EXPECT_EQ(c->etcd_history, absl::Minutes(5));  // the default
  auto hourly = ClusterFile::Parse(
      absl::StrReplaceAll(kGood, {{"\"token_file\"",
                                   "\"etcd_history_seconds\": 3600, "
                                   "\"token_file\""}}),
      dir_.string());
  ASSERT_TRUE(hourly.ok()) << hourly.status();
  EXPECT_EQ(hourly->etcd_history, absl::Hours(1));
  absl::Status missing = c->FindHost("h7").status();
  EXPECT_EQ(missing.message(),
            "no host \"h7\" in the cluster file (it has h0, h1)");
}

TEST_F(ClusterFileTest, TlsFilesAreReadRelativeToTheClusterFile) {
  for (const char* name : {"host.pem", "host.key", "ca.pem"}) {
    Write(name, absl::StrCat("-----BEGIN SOMETHING-----\n", name, "\n"));
  }
  std::string text =
      absl::StrReplaceAll(kGood, {{"\"token_file\"",
                                   "\"tls\": {\"cert\": \"host.pem\", \"key\": "
                                   "\"host.key\", \"ca\": \"ca.pem\"},\n "
                                   "\"token_file\""}});
  auto c = ClusterFile::Parse(text, dir_.string());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->tls.has_value());
  EXPECT_NE(c->tls->key.find("host.key"), std::string::npos);
  Write("ca.pem", "not a certificate");
  EXPECT_EQ(ClusterFile::Parse(text, dir_.string()).status().message(),
            "cluster file: tls ca ca.pem is not PEM");
}

TEST_F(ClusterFileTest, EachMistakeIsOneLineNamingIt) {
  EXPECT_EQ(ErrorOf("\"job\"", "\"jobs\""),
            "cluster file: unknown key \"jobs\" (expected etcd, "
            "etcd_history_seconds, hosts, job, tls, token_file)");
  EXPECT_EQ(ErrorOf("gpt-7b", "gpt 7b"),
            "cluster file: job \"gpt 7b\": use 1 to 64 letters, digits, '_' "
            "or '-'");
  EXPECT_EQ(ErrorOf("http://10.0.0.9:2379", "10.0.0.9:2379"),
            "cluster file: etcd endpoint \"10.0.0.9:2379\": expected "
            "http(s)://host:port");
  EXPECT_EQ(ErrorOf("\"name\": \"h1\"", "\"name\": \"h0\""),
            "cluster file: host h0 is listed twice");
  EXPECT_EQ(ErrorOf("10.0.0.2:7070", "10.0.0.1:7070"),
            "cluster file: hosts share the address 10.0.0.1:7070");
  EXPECT_EQ(ErrorOf("10.0.0.2:7070", "10.0.0.2"),
            "cluster file: host h1: address \"10.0.0.2\" is not host:port");
  EXPECT_EQ(ErrorOf("\"name\": \"h1\"", "\"name\": \"h+1\""),
            "cluster file: host \"h+1\": use 1 to 64 letters, digits, '_' "
            "or '-'");
  const std::string no_token = ErrorOf("\"token\"", "\"no-such-file\"");
  EXPECT_NE(no_token.find("\"token_file\": open "), std::string::npos)
      << no_token;
  EXPECT_NE(no_token.find("/no-such-file"), std::string::npos) << no_token;
  EXPECT_EQ(ErrorOf("\"hosts\": [{", "\"hosts\": [], \"x\": [{"),
            "cluster file: unknown key \"x\" (expected etcd, "
            "etcd_history_seconds, hosts, job, tls, token_file)");
  for (const char* bad : {"0", "-5", "2.5", "\"60\"", "604801"}) {
    EXPECT_EQ(ErrorOf("\"token_file\"",
                      absl::StrCat("\"etcd_history_seconds\": ", bad,
                                   ", \"token_file\"")),
              absl::StrCat("cluster file: \"etcd_history_seconds\" ", bad,
                           ": expected whole seconds from 1 to 604800"));
  }
  Write("token", "short\n");
  EXPECT_NE(ErrorOf("gpt-7b", "gpt").find("shorter than 16 characters"),
            std::string::npos);
  EXPECT_EQ(ClusterFile::Parse("[1, 2]", dir_.string()).status().message(),
            "cluster file: not a JSON object");
  auto missing = ClusterFile::Load((dir_ / "absent.json").string());
  EXPECT_FALSE(missing.ok());
}

TEST_F(ClusterFileTest, HostNames) {
  EXPECT_TRUE(IsHostName("h0"));
  EXPECT_TRUE(IsHostName("gpu-node_12"));
  EXPECT_FALSE(IsHostName(""));
  EXPECT_FALSE(IsHostName("a+b"));
  EXPECT_FALSE(IsHostName("a,b"));
  EXPECT_FALSE(IsHostName(std::string(65, 'a')));
}

}  // namespace
}  // namespace scalai
