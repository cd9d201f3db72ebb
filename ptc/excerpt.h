// How bytes a user sent appear inside an error message: escaped to
// printable ASCII (a message may end up in JSON, which needs valid UTF-8)
// and cut to a length a person reads, saying how long the input was.
//
//   return absl::InvalidArgumentError(
//       absl::StrCat("config \"", Excerpt(text), "\": unknown key"));
#ifndef SCALAI_PTC_EXCERPT_H_
#define SCALAI_PTC_EXCERPT_H_

#include <cstddef>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace scalai {

inline constexpr size_t kExcerptBytes = 80;

inline std::string Excerpt(absl::string_view text) {
  if (text.size() <= kExcerptBytes) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, kExcerptBytes)), "... (",
                      text.size(), " bytes)");
}

}  // namespace scalai

#endif  // SCALAI_PTC_EXCERPT_H_
