// Every parser target of parser_targets.h, fed its valid seeds and thousands
// of mutations of them (bits flipped, bytes inserted, removed and
// overwritten with boundary values, pieces of seeds spliced in, numbers
// grown): each input is refused or parses into a value that passes the
// target's checks, and none crashes. Deterministic: SCALAI_TEST_SEED (as in
// the Python tests) replays a run; the seed is printed. tools/fuzz.sh runs
// the same targets under libFuzzer with coverage guidance, for longer.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "tests/fuzz/parser_targets.h"

namespace scalai {
namespace {

constexpr int kMutantsPerTarget = 100000;

uint64_t TestSeed() {
  const char* env = std::getenv("SCALAI_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 20261205;
}

// One random edit of `s`; several are stacked per mutant.
void Mutate(std::string& s, const std::vector<std::string>& seeds,
            std::mt19937_64& rng) {
  auto below = [&rng](size_t n) { return n == 0 ? 0 : rng() % n; };
  static const char* const kTokens[] = {"0",
                                        "-1",
                                        "9223372036854775807",
                                        "18446744073709551616",
                                        "1e308",
                                        "[]",
                                        "{}",
                                        "null",
                                        "\"\"",
                                        ",",
                                        ":",
                                        "=",
                                        "\xff",
                                        "\x80",
                                        "\\u0000",
                                        "2147483648",
                                        "65537"};
  switch (rng() % 8) {
    case 0:  // flip a bit
      if (!s.empty()) s[below(s.size())] ^= static_cast<char>(1 << (rng() % 8));
      break;
    case 1:  // overwrite a byte with a boundary value
      if (!s.empty()) {
        static const unsigned char kBytes[] = {0,   1,   0x7f, 0x80, 0xff, '9',
                                               '"', '.', '(',  ')',  ']',  '}'};
        s[below(s.size())] = static_cast<char>(kBytes[rng() % sizeof(kBytes)]);
      }
      break;
    case 2:  // remove a run
      if (!s.empty()) {
        const size_t at = below(s.size());
        s.erase(at, 1 + below(std::min<size_t>(16, s.size() - at)));
      }
      break;
    case 3:  // insert a token
      s.insert(below(s.size() + 1), kTokens[rng() % std::size(kTokens)]);
      break;
    case 4: {  // splice in a piece of a seed
      const std::string& other = seeds[below(seeds.size())];
      if (other.empty()) break;
      const size_t from = below(other.size());
      const size_t n = 1 + below(std::min<size_t>(64, other.size() - from));
      s.insert(below(s.size() + 1), other.substr(from, n));
      break;
    }
    case 5:  // overwrite eight bytes with a little-endian boundary number
      if (s.size() >= 8) {
        static const uint64_t kNumbers[] = {
            0,          1,          ~uint64_t{0}, uint64_t{1} << 63,
            0x7fffffff, 0x80000000, 1 << 20};
        uint64_t v = kNumbers[rng() % std::size(kNumbers)];
        const size_t at = below(s.size() - 7);
        for (int i = 0; i < 8; ++i) s[at + i] = static_cast<char>(v >> (8 * i));
      }
      break;
    case 6:  // duplicate a run
      if (!s.empty()) {
        const size_t at = below(s.size());
        const std::string run = s.substr(at, 1 + below(32));
        s.insert(at, run);
      }
      break;
    default:  // cut the end
      s.resize(below(s.size() + 1));
      break;
  }
}

class ParserMutation : public ::testing::TestWithParam<FuzzTarget> {};

TEST_P(ParserMutation, EveryInputIsRefusedOrParsesIntoACheckedValue) {
  const FuzzTarget& target = GetParam();
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed ^ std::hash<std::string>{}(target.name));
  const std::vector<std::string> seeds = target.seeds();
  ASSERT_FALSE(seeds.empty());
  int broken = 0;
  int parsed = 0;
  auto check = [&](const std::string& input) {
    FuzzResult result = target.run(input);
    parsed += result.parsed;
    if (result.broken.has_value() && ++broken <= 5) {
      ADD_FAILURE() << target.name << ": " << *result.broken
                    << "\n  input (C-escaped): \"" << absl::CEscape(input)
                    << "\"";
    }
  };
  for (const std::string& s : seeds) check(s);
  for (int i = 0; i < kMutantsPerTarget; ++i) {
    std::string input = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 6);
    for (int e = 0; e < edits; ++e) Mutate(input, seeds, rng);
    check(input);
  }
  EXPECT_EQ(broken, 0) << "SCALAI_TEST_SEED=" << seed << " replays this run";
  // Mutants that parse are the ones whose checks run; all refused would mean
  // the mutations never get past the first check.
  EXPECT_GT(parsed, static_cast<int>(seeds.size()))
      << target.name << ": no mutant parsed";
  std::printf("%s: %d of %d inputs parsed, seed %llu\n", target.name, parsed,
              kMutantsPerTarget + static_cast<int>(seeds.size()),
              static_cast<unsigned long long>(seed));
}

INSTANTIATE_TEST_SUITE_P(Targets, ParserMutation,
                         ::testing::ValuesIn(FuzzTargets()),
                         [](const ::testing::TestParamInfo<FuzzTarget>& info) {
                           return std::string(info.param.name);
                         });

// The seeds themselves must parse, or the mutants explore nothing but errors.
TEST(ParserSeeds, EverySeedParses) {
  for (const FuzzTarget& target : FuzzTargets()) {
    for (const std::string& seed : target.seeds()) {
      FuzzResult result = target.run(seed);
      EXPECT_TRUE(result.parsed)
          << target.name << ": \"" << absl::CEscape(seed) << "\" is refused";
      EXPECT_FALSE(result.broken.has_value()) << target.name;
    }
  }
}

}  // namespace
}  // namespace scalai
