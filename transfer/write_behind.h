// WriteBehind streams a file that is written front to back onto the disk as
// it grows, keeping only a short window of it in the page cache. Every 8 MiB
// written starts the writeback of that span; the span 16 MiB behind is
// waited for and its pages dropped, so that the next writes reuse pages that
// are still warm instead of taking fresh ones. Fresh pages are what buffered
// writes cost on this VM's memory: writing 1.93 GiB with fsync took 3.8-4.5 s
// plainly and 0.8-0.9 s with this window (4 threads, same disk, same run).
// Saves through the mount, imports and exports use it; a materialization
// keeps its pages (Pages::kKeep), since the restarted job reads them next.
//
//   WriteBehind behind;                        // guarded by the writer's mutex
//   WriteBehind::Spans spans = behind.Advance(bytes_written_in_order);
//   RETURN_IF_ERROR(WriteBehind::Apply(fd, spans, path));  // unlocked: waits
#ifndef SCALAI_TRANSFER_WRITE_BEHIND_H_
#define SCALAI_TRANSFER_WRITE_BEHIND_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace scalai {

class WriteBehind {
 public:
  // Byte ranges [from, to); empty when from == to.
  struct Spans {
    int64_t start_from = 0, start_to = 0;  // start writeback
    int64_t drop_from = 0, drop_to = 0;    // wait for writeback, then drop
  };
  static constexpr int64_t kSpanBytes = 8 << 20;
  static constexpr int64_t kWindowBytes = 16 << 20;

  // kKeep only starts the writeback, for files that will be read again
  // soon (a materialized shard, read by the restarted job): their pages
  // stay cached.
  enum class Pages { kDrop, kKeep };
  explicit WriteBehind(Pages pages = Pages::kDrop) : pages_(pages) {}

  // `frontier` bytes from the start of the file are written; returns what
  // is newly due. Not thread-safe: the caller serializes calls.
  Spans Advance(int64_t frontier);
  // The file was emptied: start again from its beginning.
  void Reset() { started_ = dropped_ = 0; }

  // Starting writeback is advisory. Waiting is not: it consumes the file's
  // record of a failed writeback, so a later fsync would no longer report
  // it, and the error must be kept and reported by the caller instead.
  static absl::Status Apply(int fd, const Spans& spans,
                            const std::string& path);

 private:
  Pages pages_;
  int64_t started_ = 0;  // writeback started for [0, started_)
  int64_t dropped_ = 0;  // dropped from the page cache: [0, dropped_)
};

}  // namespace scalai

#endif  // SCALAI_TRANSFER_WRITE_BEHIND_H_
