#include "transfer/cluster_file.h"

#include <cstdint>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "transfer/files.h"

namespace scalai {
namespace {

// A cluster file, a token or a certificate larger than this is not one.
constexpr int64_t kMaxFileBytes = 1 << 20;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("cluster file: ", what));
}

absl::StatusOr<std::string> StringField(const nlohmann::json& j,
                                        const char* key, const char* where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string() || it->get<std::string>().empty()) {
    return Bad(absl::StrCat(where, " needs \"", key, "\": a non-empty string"));
  }
  return it->get<std::string>();
}

std::string Resolve(const std::string& dir, const std::string& path) {
  if (absl::StartsWith(path, "/") || dir.empty()) return path;
  return absl::StrCat(dir, "/", path);
}

absl::StatusOr<std::string> ReadReferenced(const std::string& dir,
                                           const std::string& path,
                                           const char* key) {
  absl::StatusOr<std::string> text =
      ReadSmallFile(Resolve(dir, path), kMaxFileBytes);
  if (!text.ok()) {
    return Bad(absl::StrCat("\"", key, "\": ", text.status().message()));
  }
  return text;
}

// "host:port" with a port gRPC can dial; a host may be "[v6]".
bool IsAddress(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return false;
  uint32_t port = 0;
  return absl::SimpleAtoi(address.substr(colon + 1), &port) && port > 0 &&
         port < 65536;
}

}  // namespace

absl::StatusOr<ClusterFile> ClusterFile::Load(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxFileBytes));
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : path.substr(0, slash);
  absl::StatusOr<ClusterFile> cluster = Parse(text, dir.empty() ? "/" : dir);
  if (!cluster.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", cluster.status().message()));
  }
  return cluster;
}

absl::StatusOr<ClusterFile> ClusterFile::Parse(absl::string_view text,
                                               const std::string& dir) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Bad("not a JSON object");
  for (const auto& [key, value] : j.items()) {
    static const std::set<std::string> kKnown = {
        "job", "etcd", "etcd_history_seconds", "token_file", "tls", "hosts"};
    if (!kKnown.count(key)) {
      return Bad(absl::StrCat("unknown key \"", key, "\" (expected ",
                              absl::StrJoin(kKnown, ", "), ")"));
    }
  }
  ClusterFile c;
  ASSIGN_OR_RETURN(c.job, StringField(j, "job", "the file"));
  if (!IsHostName(c.job)) {
    return Bad(absl::StrCat("job \"", c.job,
                            "\": use 1 to 64 letters, digits, '_' or '-'"));
  }

  auto etcd = j.find("etcd");
  if (etcd == j.end() || !etcd->is_array() || etcd->empty()) {
    return Bad(
        "\"etcd\" needs a list of endpoints, e.g. "
        "[\"http://10.0.0.9:2379\"]");
  }
  for (const auto& e : *etcd) {
    const std::string endpoint = e.is_string() ? e.get<std::string>() : "";
    absl::string_view rest = endpoint;
    if (!absl::ConsumePrefix(&rest, "http://") &&
        !absl::ConsumePrefix(&rest, "https://")) {
      rest = "";
    }
    if (!IsAddress(rest)) {
      return Bad(absl::StrCat("etcd endpoint ", e.dump(),
                              ": expected http(s)://host:port"));
    }
    c.etcd.push_back(endpoint);
  }

  if (auto history = j.find("etcd_history_seconds"); history != j.end()) {
    if (!history->is_number_integer() || history->get<int64_t>() < 1 ||
        history->get<int64_t>() > 7 * 24 * 3600) {
      return Bad(absl::StrCat("\"etcd_history_seconds\" ", history->dump(),
                              ": expected whole seconds from 1 to 604800"));
    }
    c.etcd_history = absl::Seconds(history->get<int64_t>());
  }

  ASSIGN_OR_RETURN(std::string token_file,
                   StringField(j, "token_file", "the file"));
  ASSIGN_OR_RETURN(std::string token,
                   ReadReferenced(dir, token_file, "token_file"));
  c.token = std::string(absl::StripAsciiWhitespace(token));
  if (c.token.size() < 16) {
    return Bad(absl::StrCat("the token in ", token_file,
                            " is shorter than 16 characters: every peer call "
                            "is let in by it alone, so make it long"));
  }
  for (char ch : c.token) {
    if (ch < 0x21 || ch > 0x7e) {
      return Bad(absl::StrCat("the token in ", token_file,
                              " must be printable ASCII without spaces"));
    }
  }

  if (auto tls = j.find("tls"); tls != j.end()) {
    if (!tls->is_object()) return Bad("\"tls\" must be an object");
    ClusterTls t;
    for (auto [key, pem] :
         {std::pair{"cert", &t.cert}, {"key", &t.key}, {"ca", &t.ca}}) {
      ASSIGN_OR_RETURN(std::string path, StringField(*tls, key, "\"tls\""));
      ASSIGN_OR_RETURN(*pem, ReadReferenced(dir, path, key));
      if (!absl::StrContains(*pem, "-----BEGIN ")) {
        return Bad(absl::StrCat("tls ", key, " ", path, " is not PEM"));
      }
    }
    c.tls = std::move(t);
  }

  auto hosts = j.find("hosts");
  if (hosts == j.end() || !hosts->is_array() || hosts->empty()) {
    return Bad("\"hosts\" needs a list of {\"name\", \"address\"}");
  }
  std::set<std::string> names, addresses;
  for (const auto& h : *hosts) {
    if (!h.is_object()) return Bad("each host must be an object");
    ClusterHost host;
    ASSIGN_OR_RETURN(host.name, StringField(h, "name", "each host"));
    ASSIGN_OR_RETURN(host.address, StringField(h, "address", "each host"));
    if (!IsHostName(host.name)) {
      return Bad(absl::StrCat("host \"", host.name,
                              "\": use 1 to 64 letters, digits, '_' or '-'"));
    }
    if (!IsAddress(host.address)) {
      return Bad(absl::StrCat("host ", host.name, ": address \"", host.address,
                              "\" is not host:port"));
    }
    if (!names.insert(host.name).second) {
      return Bad(absl::StrCat("host ", host.name, " is listed twice"));
    }
    if (!addresses.insert(host.address).second) {
      return Bad(absl::StrCat("hosts share the address ", host.address));
    }
    c.hosts.push_back(std::move(host));
  }
  return c;
}

absl::StatusOr<const ClusterHost*> ClusterFile::FindHost(
    absl::string_view name) const {
  std::vector<std::string> names;
  for (const ClusterHost& h : hosts) {
    if (h.name == name) return &h;
    names.push_back(h.name);
  }
  return absl::NotFoundError(absl::StrCat("no host \"", name,
                                          "\" in the cluster file (it has ",
                                          absl::StrJoin(names, ", "), ")"));
}

}  // namespace scalai
