// Byte counts as people read them, for tables and progress bars.
//
//   HumanBytes(512)         // "512 B"
//   HumanBytes(1610612736)  // "1.50 GiB"
#ifndef SCALAI_TOOLS_HUMAN_BYTES_H_
#define SCALAI_TOOLS_HUMAN_BYTES_H_

#include <cstdint>
#include <string>

namespace scalai {

std::string HumanBytes(int64_t bytes);

}  // namespace scalai

#endif  // SCALAI_TOOLS_HUMAN_BYTES_H_
