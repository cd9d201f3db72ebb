// Every parser of bytes that come from outside Scalai (files a user hands
// it, a config written to the mount, a cluster file), as a fuzz target: a
// function that takes any bytes, parses them, and when they parse, checks
// what the rest of Scalai relies on (a value that writes back out reads back
// the same; offsets inside the file). The same targets run under libFuzzer
// (tools/fuzz.sh) and, seeded and bounded, in the test suite.
//
//   for (const FuzzTarget& t : FuzzTargets()) {
//     FuzzResult r = t.run(bytes);  // r.broken: a finding
//   }
#ifndef SCALAI_TESTS_FUZZ_PARSER_TARGETS_H_
#define SCALAI_TESTS_FUZZ_PARSER_TARGETS_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace scalai {

struct FuzzResult {
  bool parsed = false;                // false: refused, which is fine
  std::optional<std::string> broken;  // what a parsed value failed
};

struct FuzzTarget {
  const char* name;
  // Parses `bytes` and checks what it parsed into. A crash or a hang is a
  // finding too.
  FuzzResult (*run)(absl::string_view bytes);
  // Valid inputs to start from.
  std::vector<std::string> (*seeds)();
};

const std::vector<FuzzTarget>& FuzzTargets();
const FuzzTarget* FindFuzzTarget(absl::string_view name);

}  // namespace scalai

#endif  // SCALAI_TESTS_FUZZ_PARSER_TARGETS_H_
