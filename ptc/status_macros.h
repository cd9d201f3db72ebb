// Early-return helpers for absl::Status and absl::StatusOr<T>, defined once.
//
//   RETURN_IF_ERROR(catalog.Put(key, value));
//   ASSIGN_OR_RETURN(ParallelConfig config, ParallelConfig::Parse(text));
#ifndef SCALAI_PTC_STATUS_MACROS_H_
#define SCALAI_PTC_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SCALAI_CONCAT_INNER_(a, b) a##b
#define SCALAI_CONCAT_(a, b) SCALAI_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                                           \
  do {                                                                  \
    if (::absl::Status scalai_status_ = (expr); !scalai_status_.ok()) { \
      return scalai_status_;                                            \
    }                                                                   \
  } while (false)

#define SCALAI_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();       \
  lhs = std::move(*tmp)

#define ASSIGN_OR_RETURN(lhs, rexpr)                                        \
  SCALAI_ASSIGN_OR_RETURN_IMPL_(SCALAI_CONCAT_(scalai_statusor_, __LINE__), \
                                lhs, rexpr)

#endif  // SCALAI_PTC_STATUS_MACROS_H_
