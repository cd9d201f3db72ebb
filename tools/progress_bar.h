// A one-line progress bar for long commands, drawn on stdout only when it is
// a terminal (docs/reference.md: quiet otherwise).
//
//   ProgressBar bar("import");
//   options.progress = bar.Callback();   ... bar.Finish();
#ifndef SCALAI_TOOLS_PROGRESS_BAR_H_
#define SCALAI_TOOLS_PROGRESS_BAR_H_

#include <chrono>
#include <string>

#include "transfer/parallel.h"

namespace scalai {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label);
  // Empty when stdout is not a terminal.
  ProgressFn Callback();
  void Finish();

 private:
  void Draw(int64_t done, int64_t total);
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace scalai

#endif  // SCALAI_TOOLS_PROGRESS_BAR_H_
