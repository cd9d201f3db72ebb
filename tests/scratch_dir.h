// A directory of its own for one test: made fresh under gtest's TempDir()
// (mkdtemp, so no two tests, binaries or runs ever share one) and removed,
// with all it holds, when the ScratchDir goes. A test fixture keeps one as
// its first member, so that it outlives the stores and files the test
// opens in it.
//
//   ScratchDir scratch_{"materializer"};
//   Store::Create((scratch_.path() / "store").string(), layout);
#ifndef SCALAI_TESTS_SCRATCH_DIR_H_
#define SCALAI_TESTS_SCRATCH_DIR_H_

#include <stdlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace scalai {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name) {
    std::string templ =
        (std::filesystem::path(::testing::TempDir()) / (name + ".XXXXXX"))
            .string();
    if (mkdtemp(templ.data()) == nullptr) {
      // A test cannot run without its directory; nothing to clean up.
      std::fprintf(stderr, "ScratchDir: mkdtemp %s: %s\n", templ.c_str(),
                   std::strerror(errno));
      std::abort();
    }
    path_ = templ;
  }
  ~ScratchDir() {
    std::error_code ignored;  // a test's failure is reported already
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace scalai

#endif  // SCALAI_TESTS_SCRATCH_DIR_H_
