#include "transfer/fsck.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "transfer/blob_checksum.h"
#include "transfer/dataset_source.h"
#include "xxhash.h"

namespace scalai {

absl::StatusOr<std::optional<std::string>> CheckBlob(const std::string& path,
                                                     const BlobRecord& record,
                                                     Progress* progress) {
  XXH3_state_t* whole = XXH3_createState();
  absl::Cleanup free_whole = [whole] { XXH3_freeState(whole); };
  XXH3_64bits_reset(whole);
  ChunkHasher chunks;
  RETURN_IF_ERROR(ReadChunks(path, [&](const char* data, int64_t n) {
    if (record.whole_xxh3) {
      XXH3_64bits_update(whole, data, n);
    } else {
      chunks.Update(data, n);
    }
    if (progress != nullptr) progress->Add(n);
    return absl::OkStatus();
  }));
  if (record.whole_xxh3) {
    const uint64_t got = XXH3_64bits_digest(whole);
    if (got == *record.whole_xxh3) return std::nullopt;
    return absl::StrFormat("checksum %016x, the catalog says %016x", got,
                           *record.whole_xxh3);
  }
  const std::vector<uint64_t> got = chunks.Finish();
  for (size_t c = 0; c < got.size() && c < record.chunks.size(); ++c) {
    if (got[c] != record.chunks[c]) {
      const int64_t begin = static_cast<int64_t>(c) * kBlobChunkBytes;
      return absl::StrFormat(
          "chunk %d (bytes %d-%d): checksum %016x, the catalog says %016x", c,
          begin, std::min(begin + kBlobChunkBytes, record.size), got[c],
          record.chunks[c]);
    }
  }
  if (got.size() != record.chunks.size()) {
    return absl::StrCat(got.size(), " chunks, the catalog says ",
                        record.chunks.size());
  }
  return std::nullopt;
}

namespace {

// What is wrong, and the file behind it when the file was not found (for
// CheckStoreBesideWriter to tell a file retired from a file lost).
struct Problem {
  std::string text;
  std::string gone_blob;
  std::string gone_index;
};

struct Findings {
  std::vector<Problem> problems;
  size_t blobs = 0;  // blobs checked
};

absl::StatusOr<Findings> FindProblems(const Store& store,
                                      ProgressFn progress_fn) {
  std::vector<Problem> problems;
  std::mutex mu;  // guards problems while blobs are hashed in parallel
  auto problem = [&](std::string text, std::string gone_blob = "") {
    std::lock_guard<std::mutex> lock(mu);
    problems.push_back({std::move(text), std::move(gone_blob), ""});
  };
  ASSIGN_OR_RETURN(auto blobs, store.Blobs());
  std::vector<std::pair<std::string, BlobRecord>> list(blobs.begin(),
                                                       blobs.end());
  int64_t total = 0;
  for (const auto& [name, b] : list) total += b.size;
  Progress progress(total, std::move(progress_fn));
  RETURN_IF_ERROR(
      ParallelFor(list.size(), IoThreads(), [&](size_t i) -> absl::Status {
        const auto& [name, record] = list[i];
        auto size = FileSize(store.BlobPath(name));
        if (!size.ok()) {
          problem(
              absl::StrCat("blob ", name, " (step ", record.step, "): missing"),
              absl::IsNotFound(size.status()) ? name : "");
          return absl::OkStatus();
        }
        if (*size != record.size) {
          problem(absl::StrCat("blob ", name, " (step ", record.step,
                               "): ", *size, " bytes, the catalog says ",
                               record.size));
          return absl::OkStatus();
        }
        auto wrong = CheckBlob(store.BlobPath(name), record, &progress);
        if (!wrong.ok()) {
          problem(absl::StrCat("blob ", name, ": ", wrong.status().message()),
                  absl::IsNotFound(wrong.status()) ? name : "");
        } else if (*wrong) {
          problem(absl::StrCat("blob ", name, " (step ", record.step,
                               "): ", **wrong));
        }
        return absl::OkStatus();
      }));

  std::set<std::string> used;
  ASSIGN_OR_RETURN(std::vector<StepRecord> steps, store.Steps());
  for (const StepRecord& step : steps) {
    // An extra file is its blob, whose size and checksum were checked above.
    for (const auto& [rank, files] : step.extra) {
      for (const ExtraFile& f : files) {
        used.insert(f.blob);
        if (!blobs.contains(f.blob)) {
          problem(absl::StrCat("step ", step.step, " rank ", rank, " extra/",
                               f.path, ": blob ", f.blob, " is not recorded"));
        } else if (blobs.at(f.blob).size != f.size) {
          problem(absl::StrCat("step ", step.step, " rank ", rank, " extra/",
                               f.path, ": ", f.size, " bytes recorded, blob ",
                               f.blob, " has ", blobs.at(f.blob).size));
        }
      }
    }
    auto placement = store.StepPlacement(step);
    if (!placement.ok()) {
      problem(
          absl::StrCat("step ", step.step, ": ", placement.status().message()));
      continue;
    }
    if ((*placement)->num_groups() != step.groups) {
      problem(absl::StrCat("step ", step.step, ": ", step.groups,
                           " shard groups recorded, ",
                           (*placement)->num_groups(), " expected"));
      continue;
    }
    // Shards kept for peers after a materialization in a cluster: their
    // blobs were checked above like any other.
    for (const RetainedShards& kept : step.retained) {
      for (const auto& [g, shard] : kept.groups) {
        for (const std::string& b : shard.blobs) {
          used.insert(b);
          if (!blobs.contains(b)) {
            problem(absl::StrCat("step ", step.step, " retained group ", g,
                                 ": blob ", b, " is not recorded"));
          }
        }
      }
    }
    for (int g = 0; g < step.groups; ++g) {
      if (!step.holds(g)) continue;  // another host of the cluster holds it
      auto shard = store.Shard(step.step, g);
      if (!shard.ok()) {
        problem(
            absl::StrCat("step ", step.step, ": ", shard.status().message()));
        continue;
      }
      const std::vector<TensorShard>& expected = (*placement)->shards(g);
      if (shard->tensors.size() != expected.size()) {
        problem(absl::StrCat("step ", step.step, " group ", g, ": ",
                             shard->tensors.size(), " tensors recorded, ",
                             expected.size(), " expected"));
        continue;
      }
      // Each recorded location must be the named tensor in its blob's header.
      std::vector<std::optional<SafetensorsHeader>> headers;
      for (const std::string& b : shard->blobs) {
        used.insert(b);
        auto h =
            blobs.contains(b)
                ? ReadSafetensorsHeader(store.BlobPath(b))
                : absl::StatusOr<SafetensorsHeader>(absl::NotFoundError(""));
        if (!h.ok()) {
          problem(absl::StrCat("step ", step.step, " group ", g, ": blob ", b,
                               blobs.contains(b) ? " has a bad header: "
                                                 : " is not recorded",
                               h.status().message()),
                  blobs.contains(b) && absl::IsNotFound(h.status()) ? b : "");
          headers.emplace_back();
        } else {
          headers.emplace_back(*std::move(h));
        }
      }
      // A tensor may sit in a blob written under another config, where its
      // local name differs (pipeline stages number layers locally): the
      // location must start an entry of the right dtype and shape.
      for (size_t k = 0; k < expected.size(); ++k) {
        const ShardRecord::Location& loc = shard->tensors[k];
        const std::optional<SafetensorsHeader>& h = headers[loc.blob];
        if (!h) continue;
        const TensorInfo& t = store.model()->tensor(expected[k].tensor);
        const bool found = std::any_of(
            h->tensors().begin(), h->tensors().end(),
            [&](const SafetensorsEntry& e) {
              return h->data_start() + e.data_begin == loc.offset &&
                     e.shape == expected[k].local_shape && e.dtype == t.dtype;
            });
        if (!found) {
          problem(absl::StrCat("step ", step.step, " group ", g, ": tensor ",
                               expected[k].local_name,
                               " is not where the catalog says (blob ",
                               shard->blobs[loc.blob], ")"));
        }
      }
    }
  }
  // A jsonl dataset's line index is the store's own file, written once.
  ASSIGN_OR_RETURN(auto datasets, store.Datasets());
  for (const auto& [name, record] : datasets) {
    if (record.format != "jsonl") continue;
    absl::StatusOr<MappedFile> index = OpenLineIndex(store, record, name);
    if (index.ok()) continue;
    problem(std::string(index.status().message()));
    if (!FileSize(store.dataset_dir() + "/" + record.index).ok())
      problems.back().gone_index = record.index;
  }
  // A step saved here that the cluster has not committed yet keeps its
  // blobs (its records are checked when it commits).
  ASSIGN_OR_RETURN(std::vector<PendingStep> pending, store.PendingSteps());
  for (const PendingStep& p : pending) {
    for (const std::string& blob : p.Blobs()) used.insert(blob);
  }
  for (const auto& [name, record] : blobs) {
    if (!used.contains(name)) {
      problem(absl::StrCat("blob ", name, " (step ", record.step,
                           "): no step uses it"));
    }
  }
  return Findings{std::move(problems), blobs.size()};
}

}  // namespace

absl::StatusOr<std::vector<std::string>> CheckStore(const Store& store,
                                                    ProgressFn progress) {
  ASSIGN_OR_RETURN(Findings found, FindProblems(store, std::move(progress)));
  std::vector<std::string> problems;
  for (Problem& p : found.problems) problems.push_back(std::move(p.text));
  return problems;
}

absl::StatusOr<CheckBesideWriter> CheckStoreBesideWriter(
    const StoreOpener& open_store, ProgressFn progress) {
  ASSIGN_OR_RETURN(std::unique_ptr<Store> store, open_store());
  ASSIGN_OR_RETURN(Findings findings,
                   FindProblems(*store, std::move(progress)));
  CheckBesideWriter out;
  out.blobs = findings.blobs;
  std::vector<Problem>& found = findings.problems;
  const bool any_gone =
      std::any_of(found.begin(), found.end(), [](const Problem& p) {
        return !p.gone_blob.empty() || !p.gone_index.empty();
      });
  std::map<std::string, BlobRecord> named_blobs;
  std::set<std::string> named_indexes;
  if (any_gone) {
    ASSIGN_OR_RETURN(std::unique_ptr<Store> later, open_store());
    ASSIGN_OR_RETURN(named_blobs, later->Blobs());
    ASSIGN_OR_RETURN(auto datasets, later->Datasets());
    for (const auto& [name, d] : datasets) named_indexes.insert(d.index);
  }
  std::set<std::string> retired;
  for (Problem& p : found) {
    if (!p.gone_blob.empty() && !named_blobs.contains(p.gone_blob)) {
      retired.insert(p.gone_blob);
    } else if (p.gone_index.empty() || named_indexes.contains(p.gone_index)) {
      out.problems.push_back(std::move(p.text));
    }
  }
  out.retired = retired.size();
  return out;
}

}  // namespace scalai
