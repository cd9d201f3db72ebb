// libFuzzer's entry point over one parser target, chosen by the environment
// variable SCALAI_FUZZ_TARGET (tools/fuzz.sh sets it). With
// SCALAI_FUZZ_SEEDS=DIR it writes the target's seeds there and exits, to
// start a corpus. A parsed value that fails its checks aborts, which libFuzzer
// reports with the input that did it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/string_view.h"
#include "tests/fuzz/parser_targets.h"

namespace {

const scalai::FuzzTarget* target = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* name = std::getenv("SCALAI_FUZZ_TARGET");
  target = scalai::FindFuzzTarget(name != nullptr ? name : "");
  if (target == nullptr) {
    std::fprintf(stderr, "set SCALAI_FUZZ_TARGET to one of:");
    for (const scalai::FuzzTarget& t : scalai::FuzzTargets()) {
      std::fprintf(stderr, " %s", t.name);
    }
    std::fprintf(stderr, "\n");
    std::exit(2);
  }
  if (const char* dir = std::getenv("SCALAI_FUZZ_SEEDS")) {
    int i = 0;
    for (const std::string& seed : target->seeds()) {
      std::ofstream(std::string(dir) + "/seed-" + std::to_string(i++),
                    std::ios::binary)
          << seed;
    }
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const scalai::FuzzResult result =
      target->run(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (result.broken.has_value()) {
    std::fprintf(stderr, "%s: %s\n", target->name, result.broken->c_str());
    std::abort();
  }
  return 0;
}
