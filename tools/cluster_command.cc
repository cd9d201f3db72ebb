// `scalai cluster status MOUNTPOINT`: every host of the cluster a mount
// belongs to, as that mount last read them from etcd.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "tools/command.h"
#include "tools/human_bytes.h"

namespace scalai {
namespace {

std::string Text(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return "-";
  return j[key].is_string() ? j[key].get<std::string>() : j[key].dump();
}

absl::Status RunClusterStatus(const std::string& mountpoint, bool json) {
  std::ifstream in(mountpoint + "/status");
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(mountpoint, " is not a scalai mount"));
  }
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json status = nlohmann::json::parse(text.str(), nullptr, false);
  if (status.is_discarded() || !status.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(mountpoint, "/status is not a scalai status"));
  }
  if (!status.contains("cluster")) {
    return absl::FailedPreconditionError(absl::StrCat(
        mountpoint, " is a single-host mount (mounted without --cluster)"));
  }
  const nlohmann::json& c = status["cluster"];
  if (json) {
    std::printf("%s\n", c.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("job %s, seen from %s, cluster generation %s\n",
              Text(c, "job").c_str(), Text(c, "host").c_str(),
              Text(c, "generation").c_str());
  if (!c["etcd_error"].is_null()) {
    std::printf("etcd: %s\n", Text(c, "etcd_error").c_str());
  }
  std::printf("%-8s %-20s %-5s %-7s %-11s %-34s %-13s %10s %10s  %s\n", "HOST",
              "ADDRESS", "LIVE", "RANKS", "GENERATION", "CONFIG", "STATE",
              "HELD", "MOVED", "ERROR");
  for (const nlohmann::json& h : c["hosts"]) {
    const int64_t moved = h.value("bytes_moved", int64_t{0});
    const int64_t held = h.value("bytes_held", int64_t{0});
    std::string ranks = "-";
    if (h.contains("ranks") && h["ranks"].is_array()) {
      ranks =
          absl::StrCat(h["ranks"][0].get<int>(), "-", h["ranks"][1].get<int>());
    }
    std::printf("%-8s %-20s %-5s %-7s %-11s %-34s %-13s %10s %10s  %s\n",
                Text(h, "name").c_str(), Text(h, "address").c_str(),
                h.value("live", false) ? "yes" : "no", ranks.c_str(),
                Text(h, "generation").c_str(), Text(h, "config").c_str(),
                Text(h, "state").c_str(), HumanBytes(held).c_str(),
                HumanBytes(moved).c_str(), Text(h, "error").c_str());
  }
  if (c.contains("peers") && c["peers"].is_object()) {
    std::printf("peers of %s:", Text(c, "host").c_str());
    for (const auto& [name, p] : c["peers"].items()) {
      std::printf(" %s %s", name.c_str(),
                  p.value("reachable", false) ? "reachable" : "UNREACHABLE");
      const int64_t fetched =
          p.contains("bytes_fetched") && p["bytes_fetched"].is_number_integer()
              ? p["bytes_fetched"].get<int64_t>()
              : 0;
      if (fetched > 0) std::printf(", %s fetched", HumanBytes(fetched).c_str());
      if (!p["error"].is_null()) std::printf(" (%s)", Text(p, "error").c_str());
      std::printf(";");
    }
    std::printf("\n");
  }
  std::printf("calls from peers refused (no token): %s, failed: %s\n",
              Text(c, "peer_calls_refused").c_str(),
              Text(c, "peer_calls_failed").c_str());
  // Steps saved on some hosts, waiting for the others' votes.
  if (c.contains("saves") && c["saves"].is_array()) {
    for (const nlohmann::json& save : c["saves"]) {
      std::string voted;
      if (save.contains("voted") && save["voted"].is_array()) {
        for (const nlohmann::json& h : save["voted"]) {
          absl::StrAppend(&voted, voted.empty() ? "" : " ",
                          h.is_string() ? h.get<std::string>() : h.dump());
        }
      }
      std::printf("step %s saved on %s, waiting for the other hosts\n",
                  Text(save, "step").c_str(), voted.c_str());
    }
  }
  if (c.contains("datasets_refused") && c["datasets_refused"].is_object()) {
    for (const auto& [name, why] : c["datasets_refused"].items()) {
      std::printf("%s\n", why.is_string() ? why.get<std::string>().c_str()
                                          : why.dump().c_str());
    }
  }
  return absl::OkStatus();
}

}  // namespace

Command AddClusterCommand(CLI::App& root) {
  struct Options {
    std::string mountpoint;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app =
      root.add_subcommand("cluster", "The hosts of a job that spans hosts");
  app->require_subcommand(1);
  CLI::App* status = app->add_subcommand(
      "status", "One line per host: live, generation, config, state");
  status->add_option("MOUNTPOINT", o->mountpoint, "a host's scalai mount")
      ->required();
  status->add_flag("--json", o->json, "the same as JSON, for scripts");
  return {app, [o] { return RunClusterStatus(o->mountpoint, o->json); }};
}

}  // namespace scalai
