// Whether bytes are valid UTF-8. Names that end up in the catalog's JSON
// records (extra/ paths, dataset files) must be: JSON has no way to hold
// other bytes, and a lossy replacement would change the name.
//
//   if (!IsUtf8(name)) return absl::InvalidArgumentError("...");
#ifndef SCALAI_PTC_UTF8_H_
#define SCALAI_PTC_UTF8_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace scalai {

inline bool IsUtf8(absl::string_view text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const uint8_t c = *p;
    int more = 0;
    uint32_t code = 0;
    if (c < 0x80) {
      ++p;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      more = 1, code = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      more = 2, code = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      more = 3, code = c & 0x07;
    } else {
      return false;  // a continuation byte first, an overlong C0/C1, F5..FF
    }
    if (end - p <= more) return false;
    for (int i = 1; i <= more; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      code = (code << 6) | (p[i] & 0x3F);
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
    if ((more == 2 && code < 0x800) || (more == 3 && code < 0x10000) ||
        (code >= 0xD800 && code <= 0xDFFF) || code > 0x10FFFF) {
      return false;
    }
    p += more + 1;
  }
  return true;
}

}  // namespace scalai

#endif  // SCALAI_PTC_UTF8_H_
