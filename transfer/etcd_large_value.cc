#include "transfer/etcd_large_value.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"

namespace scalai {
namespace {

// What `key` holds for a value put in parts. No JSON value starts so, nor
// any value of a version that put every value whole.
constexpr char kPartsMark[] = "scalai-parts:";

std::string PartKey(const std::string& key, const std::string& digest,
                    int64_t part) {
  return absl::StrFormat("%s/parts/%s/%08d", key, digest, part);
}

}  // namespace

absl::StatusOr<bool> PutLargeIfAbsent(EtcdClient& etcd, const std::string& key,
                                      const std::string& value) {
  EtcdClient::Txn txn;
  txn.conditions.push_back({key, 0});
  const int64_t size = static_cast<int64_t>(value.size());
  if (size <= kEtcdPartBytes) {
    txn.puts.push_back({key, value});
  } else {
    // Named by the value's digest: parts of different values never mix,
    // and parts put twice are the same bytes.
    const std::string digest = EncodeChunkSums(
        {HashChunk(value.data(), static_cast<int64_t>(value.size()))});
    // Put no parts for a value that is there already.
    ASSIGN_OR_RETURN(std::optional<EtcdClient::KeyValue> there, etcd.Get(key));
    if (there) return false;
    int64_t parts = 0;
    for (int64_t at = 0; at < size; at += kEtcdPartBytes, ++parts) {
      RETURN_IF_ERROR(
          etcd.PutValue(PartKey(key, digest, parts),
                        value.substr(static_cast<size_t>(at),
                                     static_cast<size_t>(kEtcdPartBytes)))
              .status());
    }
    txn.puts.push_back(
        {key, absl::StrCat(kPartsMark, nlohmann::json{{"parts", parts},
                                                      {"bytes", size},
                                                      {"xxh3", digest}}
                                           .dump())});
  }
  ASSIGN_OR_RETURN(EtcdClient::Committed done, etcd.Commit(txn));
  return done.applied;
}

absl::StatusOr<std::optional<std::string>> GetLarge(EtcdClient& etcd,
                                                    const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<EtcdClient::KeyValue> kv, etcd.Get(key));
  if (!kv) return std::nullopt;
  if (!absl::StartsWith(kv->value, kPartsMark)) return std::move(kv->value);
  const nlohmann::json j = nlohmann::json::parse(
      kv->value.substr(sizeof(kPartsMark) - 1), nullptr, false);
  if (!j.is_object() || !j.contains("parts") ||
      !j["parts"].is_number_integer() || !j.contains("bytes") ||
      !j["bytes"].is_number_integer() || !j.contains("xxh3") ||
      !j["xxh3"].is_string()) {
    return absl::DataLossError(absl::StrCat(
        "etcd key ", key, " names parts as it cannot: ", kv->value));
  }
  const int64_t parts = j["parts"].get<int64_t>();
  const int64_t bytes = j["bytes"].get<int64_t>();
  const std::string digest = j["xxh3"].get<std::string>();
  if (parts < 0 || bytes < 0 || bytes > parts * kEtcdPartBytes) {
    return absl::DataLossError(absl::StrCat(
        "etcd key ", key, " names parts as it cannot: ", kv->value));
  }
  std::string value;
  value.reserve(static_cast<size_t>(bytes));
  for (int64_t p = 0; p < parts; ++p) {
    const std::string part_key = PartKey(key, digest, p);
    ASSIGN_OR_RETURN(std::optional<EtcdClient::KeyValue> part,
                     etcd.Get(part_key));
    if (!part) {
      return absl::DataLossError(absl::StrCat("etcd key ", key, ": its part ",
                                              part_key, " is missing"));
    }
    value += part->value;
  }
  if (static_cast<int64_t>(value.size()) != bytes ||
      EncodeChunkSums({HashChunk(value.data(), bytes)}) != digest) {
    return absl::DataLossError(
        absl::StrCat("etcd key ", key, ": its ", parts,
                     " parts do not make the value it names (", bytes,
                     " bytes, XXH3 ", digest, ")"));
  }
  return value;
}

}  // namespace scalai
