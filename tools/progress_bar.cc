#include "tools/progress_bar.h"

#include <unistd.h>

#include <cstdio>

#include "tools/human_bytes.h"

namespace scalai {

ProgressBar::ProgressBar(std::string label)
    : label_(std::move(label)),
      enabled_(isatty(STDOUT_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

ProgressFn ProgressBar::Callback() {
  if (!enabled_) return nullptr;
  return [this](int64_t done, int64_t total) { Draw(done, total); };
}

void ProgressBar::Draw(int64_t done, int64_t total) {
  auto now = std::chrono::steady_clock::now();
  // Redraw at most ten times a second, and once at the end.
  if (done < total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const double fraction = total > 0 ? static_cast<double>(done) / total : 1.0;
  const double seconds = std::chrono::duration<double>(now - start_).count();
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(fraction * kWidth);
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  std::printf("\r%s [%s] %3.0f%% %s / %s  %.0f MiB/s ", label_.c_str(),
              bar.c_str(), fraction * 100, HumanBytes(done).c_str(),
              HumanBytes(total).c_str(),
              seconds > 0 ? done / seconds / (1 << 20) : 0.0);
  std::fflush(stdout);
  drawn_ = true;
}

void ProgressBar::Finish() {
  if (drawn_) std::printf("\n");
  drawn_ = false;
}

}  // namespace scalai
