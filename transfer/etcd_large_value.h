// Values in etcd larger than one request takes: etcd refuses a request
// over 1.5 MiB (--max-request-bytes), and a job's model (every tensor's
// name, dtype and shape) passes that for models of tens of thousands of
// tensors, as mixture-of-experts models have. A large value is put in
// parts of 1 MiB under `KEY/parts/DIGEST/`, then `KEY` itself, in a
// transaction, names them and the XXH3 of the whole; a reader checks it.
// A value that fits in one part is put at `KEY` as it is, as before.
//
//   ASSIGN_OR_RETURN(bool created, PutLargeIfAbsent(etcd, "/job/model", text));
//   ASSIGN_OR_RETURN(std::optional<std::string> model,
//                    GetLarge(etcd, "/job/model"));
#ifndef SCALAI_TRANSFER_ETCD_LARGE_VALUE_H_
#define SCALAI_TRANSFER_ETCD_LARGE_VALUE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "transfer/etcd_client.h"

namespace scalai {

// The most bytes of a value put in one request.
inline constexpr int64_t kEtcdPartBytes = int64_t{1} << 20;

// Puts `value` at `key` unless `key` exists; whether it did. The parts of
// a large value that lost the race to another writer stay behind, unnamed
// (a few MiB, once).
absl::StatusOr<bool> PutLargeIfAbsent(EtcdClient& etcd, const std::string& key,
                                      const std::string& value);

// The value at `key` as PutLargeIfAbsent put it (or a plain put); nullopt
// when there is none. Parts missing or not matching their digest are
// DataLoss, naming the key.
absl::StatusOr<std::optional<std::string>> GetLarge(EtcdClient& etcd,
                                                    const std::string& key);

}  // namespace scalai

#endif  // SCALAI_TRANSFER_ETCD_LARGE_VALUE_H_
