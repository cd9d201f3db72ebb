#include "ptc/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "ptc/checked_math.h"
#include "ptc/model.h"
#include "ptc/status_macros.h"

namespace scalai {
namespace {

using nlohmann::json;

absl::Status HeaderError(absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors header: ", why));
}

absl::Status EntryError(absl::string_view name, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors header: tensor \"", name, "\": ", why));
}

// A JSON number that is a non-negative integer within int64.
bool AsIndex(const json& j, int64_t* out) {
  if (j.is_number_unsigned()) {
    uint64_t v = j.get<uint64_t>();
    if (v > static_cast<uint64_t>(INT64_MAX)) return false;
    *out = static_cast<int64_t>(v);
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    *out = j.get<int64_t>();
    return true;
  }
  return false;
}

absl::StatusOr<SafetensorsEntry> ParseEntry(const std::string& name,
                                            const json& j) {
  if (name.empty()) return HeaderError("a tensor has an empty name");
  if (!j.is_object()) return EntryError(name, "entry is not an object");
  for (const auto& [key, value] : j.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return EntryError(name, absl::StrCat("unknown key \"", key, "\""));
    }
  }
  SafetensorsEntry e;
  e.name = name;
  if (!j.contains("dtype") || !j["dtype"].is_string()) {
    return EntryError(name, "\"dtype\" missing or not a string");
  }
  auto dtype = ParseSafetensorsDType(j["dtype"].get<std::string>());
  if (!dtype.ok()) return EntryError(name, dtype.status().message());
  e.dtype = *dtype;
  if (!j.contains("shape") || !j["shape"].is_array()) {
    return EntryError(name, "\"shape\" missing or not an array");
  }
  for (const json& d : j["shape"]) {
    int64_t extent;
    if (!AsIndex(d, &extent)) {
      return EntryError(
          name, "\"shape\" holds something other than non-negative integers");
    }
    e.shape.push_back(extent);
  }
  if (!j.contains("data_offsets") || !j["data_offsets"].is_array() ||
      j["data_offsets"].size() != 2 ||
      !AsIndex(j["data_offsets"][0], &e.data_begin) ||
      !AsIndex(j["data_offsets"][1], &e.data_end)) {
    return EntryError(
        name, "\"data_offsets\" must be [begin, end] of non-negative integers");
  }
  if (e.data_end < e.data_begin) {
    return EntryError(
        name, absl::StrCat("data_offsets [", e.data_begin, ", ", e.data_end,
                           "] end before they begin"));
  }
  auto bytes = TensorBytes(e.shape, e.dtype);
  if (!bytes.ok()) return EntryError(name, bytes.status().message());
  if (*bytes != e.data_end - e.data_begin) {
    return EntryError(
        name,
        absl::StrCat(ShapeToString(e.shape), " of ", DTypeName(e.dtype), " is ",
                     *bytes, " bytes but data_offsets [", e.data_begin, ", ",
                     e.data_end, "] hold ", e.data_end - e.data_begin));
  }
  return e;
}

}  // namespace

absl::StatusOr<int64_t> SafetensorsHeader::ParseLength(absl::string_view first8,
                                                       int64_t file_size) {
  if (file_size < 8 || first8.size() < 8) {
    return HeaderError(
        absl::StrCat("file is ", file_size,
                     " bytes, too short for the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(first8[i]);
  if (n > static_cast<uint64_t>(kMaxHeaderBytes)) {
    return HeaderError(absl::StrCat("header length ", n,
                                    " exceeds the limit of ", kMaxHeaderBytes,
                                    " bytes"));
  }
  if (static_cast<int64_t>(n) + 8 > file_size) {
    return HeaderError(absl::StrCat("header length ", n,
                                    " runs past the end of the file (",
                                    file_size, " bytes)"));
  }
  if (n < 2)
    return HeaderError(
        absl::StrCat("header length ", n, " cannot hold a JSON object"));
  return static_cast<int64_t>(n);
}

absl::StatusOr<SafetensorsHeader> SafetensorsHeader::Parse(
    absl::string_view prefix, int64_t file_size) {
  ASSIGN_OR_RETURN(int64_t n, ParseLength(prefix, file_size));
  if (static_cast<int64_t>(prefix.size()) < 8 + n) {
    return HeaderError(absl::StrCat("only ", prefix.size(), " of ", 8 + n,
                                    " header bytes given"));
  }
  absl::string_view text = prefix.substr(8, n);
  // nlohmann keeps the last of duplicate keys silently; a duplicate tensor
  // name is an error here, so top-level keys are checked as they are parsed.
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t check_keys = [&](int depth, json::parse_event_t event,
                                           json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      if (!seen.insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  json j = json::parse(text, check_keys, /*allow_exceptions=*/false);
  if (j.is_discarded()) return HeaderError("not valid JSON");
  if (!duplicate.empty()) {
    return HeaderError(
        absl::StrCat("tensor \"", duplicate, "\" appears twice"));
  }
  if (!j.is_object()) return HeaderError("not a JSON object");

  SafetensorsHeader h;
  h.data_start_ = 8 + n;
  h.data_bytes_ = file_size - h.data_start_;
  for (const auto& [name, value] : j.items()) {
    if (name == "__metadata__") {
      if (!value.is_object())
        return HeaderError("__metadata__ is not an object");
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) {
          return HeaderError(
              absl::StrCat("__metadata__ \"", key, "\" is not a string"));
        }
        h.metadata_[key] = v.get<std::string>();
      }
      continue;
    }
    ASSIGN_OR_RETURN(SafetensorsEntry e, ParseEntry(name, value));
    h.tensors_.push_back(std::move(e));
  }
  std::sort(h.tensors_.begin(), h.tensors_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.data_begin != b.data_begin ? a.data_begin < b.data_begin
                                                  : a.data_end < b.data_end;
            });
  int64_t expected = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& e : h.tensors_) {
    if (e.data_begin < expected) {
      return EntryError(
          e.name,
          absl::StrCat("data_offsets [", e.data_begin, ", ", e.data_end,
                       "] overlap tensor \"", previous->name, "\" [",
                       previous->data_begin, ", ", previous->data_end, "]"));
    }
    if (e.data_begin > expected) {
      return EntryError(
          e.name, absl::StrCat("data starts at ", e.data_begin,
                               " leaving a hole", " after byte ", expected));
    }
    expected = e.data_end;
    previous = &e;
  }
  if (expected > h.data_bytes_) {
    return EntryError(previous->name, absl::StrCat("data ends at ", expected,
                                                   " past the data section of ",
                                                   h.data_bytes_, " bytes"));
  }
  if (expected < h.data_bytes_) {
    return HeaderError(absl::StrCat("the data section has ",
                                    h.data_bytes_ - expected,
                                    " bytes after the last tensor"));
  }
  return h;
}

absl::StatusOr<SafetensorsHeader> SafetensorsHeader::Build(
    std::vector<SafetensorsEntry> tensors,
    std::map<std::string, std::string> metadata) {
  SafetensorsHeader h;
  std::set<absl::string_view> names;
  int64_t offset = 0;
  for (SafetensorsEntry& e : tensors) {
    if (e.name.empty() || e.name == "__metadata__") {
      return HeaderError(absl::StrCat("invalid tensor name \"", e.name, "\""));
    }
    if (!names.insert(e.name).second) {
      return HeaderError(absl::StrCat("tensor \"", e.name, "\" appears twice"));
    }
    ASSIGN_OR_RETURN(int64_t bytes, TensorBytes(e.shape, e.dtype));
    e.data_begin = offset;
    ASSIGN_OR_RETURN(offset, CheckedAdd(offset, bytes));
    e.data_end = offset;
  }
  h.tensors_ = std::move(tensors);
  h.metadata_ = std::move(metadata);
  h.data_bytes_ = offset;
  h.data_start_ = static_cast<int64_t>(h.Serialize().size());
  return h;
}

const SafetensorsEntry* SafetensorsHeader::Find(absl::string_view name) const {
  for (const SafetensorsEntry& e : tensors_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::string SafetensorsHeader::Serialize() const {
  // Written by hand to keep the file's tensor order (nlohmann sorts keys).
  std::string text = "{";
  bool first = true;
  if (!metadata_.empty()) {
    text += "\"__metadata__\":";
    text += json(metadata_).dump();
    first = false;
  }
  for (const SafetensorsEntry& e : tensors_) {
    if (!first) text += ',';
    first = false;
    absl::StrAppend(&text, json(e.name).dump(), ":{\"dtype\":\"",
                    DTypeName(e.dtype), "\",\"shape\":", json(e.shape).dump(),
                    ",\"data_offsets\":[", e.data_begin, ",", e.data_end, "]}");
  }
  text += '}';
  while ((text.size() + 8) % 8 != 0) text += ' ';
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(
    const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  absl::Cleanup closer = [fd] { close(fd); };
  struct stat st;
  if (fstat(fd, &st) != 0)
    return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
  auto read_at = [&](int64_t offset,
                     int64_t length) -> absl::StatusOr<std::string> {
    std::string buf(length, '\0');
    int64_t done = 0;
    while (done < length) {
      ssize_t got = pread(fd, buf.data() + done, length - done, offset + done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0)
        return absl::ErrnoToStatus(errno, absl::StrCat("read ", path));
      if (got == 0)
        return absl::DataLossError(
            absl::StrCat(path, ": file shrank while read"));
      done += got;
    }
    return buf;
  };
  ASSIGN_OR_RETURN(std::string first8,
                   read_at(0, std::min<int64_t>(8, st.st_size)));
  auto length = SafetensorsHeader::ParseLength(first8, st.st_size);
  if (!length.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", length.status().message()));
  ASSIGN_OR_RETURN(std::string prefix, read_at(0, 8 + *length));
  auto header = SafetensorsHeader::Parse(prefix, st.st_size);
  if (!header.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", header.status().message()));
  return header;
}

}  // namespace scalai
