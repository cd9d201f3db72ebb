#include "transfer/write_behind.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>

#include "transfer/files.h"

namespace scalai {

WriteBehind::Spans WriteBehind::Advance(int64_t frontier) {
  Spans spans;
  const int64_t whole = frontier / kSpanBytes * kSpanBytes;
  if (whole > started_) {
    spans.start_from = started_;
    spans.start_to = whole;
    started_ = whole;
  }
  const int64_t behind = std::max<int64_t>(0, started_ - kWindowBytes);
  if (pages_ == Pages::kDrop && behind > dropped_) {
    spans.drop_from = dropped_;
    spans.drop_to = behind;
    dropped_ = behind;
  }
  return spans;
}

absl::Status WriteBehind::Apply(int fd, const Spans& spans,
                                const std::string& path) {
  if (spans.start_to > spans.start_from) {
    (void)sync_file_range(fd, spans.start_from,
                          spans.start_to - spans.start_from,
                          SYNC_FILE_RANGE_WRITE);
  }
  if (spans.drop_to > spans.drop_from) {
    const int64_t n = spans.drop_to - spans.drop_from;
    // Dirty pages are never dropped, so the wait comes first.
    if (sync_file_range(fd, spans.drop_from, n,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                            SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
      return ErrnoError(errno, "write back", path);
    }
    (void)posix_fadvise(fd, spans.drop_from, n, POSIX_FADV_DONTNEED);
  }
  return absl::OkStatus();
}

}  // namespace scalai
