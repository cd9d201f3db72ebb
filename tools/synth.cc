#include "tools/synth.h"

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "ptc/safetensors.h"
#include "ptc/status_macros.h"
#include "xxhash.h"

namespace scalai {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint16_t FloatToHalf(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  if (exponent <= 0) return sign;  // too small for a normal half: zero
  if (exponent >= 31) return sign | 0x7bff;
  return sign | static_cast<uint16_t>(exponent << 10) |
         static_cast<uint16_t>((bits >> 13) & 0x3ff);
}

template <typename T>
void Put(std::byte* out, int64_t i, T value) {
  std::memcpy(out + i * sizeof(T), &value, sizeof(T));
}

// Writes `data` of `size` bytes to `file`, naming `path` on failure.
absl::Status WriteAll(std::FILE* file, const void* data, size_t size,
                      const std::string& path) {
  if (size > 0 && std::fwrite(data, 1, size, file) != size) {
    return absl::ErrnoToStatus(errno, absl::StrCat("write ", path));
  }
  return absl::OkStatus();
}

// Writes a safetensors file whose tensor bytes `fill(i, buffer)` produces, via
// a temporary name so that a failed run leaves no half-written file behind.
template <typename Fill>
absl::Status WriteFile(const std::string& path, const SafetensorsHeader& header,
                       Fill fill) {
  std::string tmp = path + ".tmp";
  std::FILE* file = std::fopen(tmp.c_str(), "wb");
  if (file == nullptr)
    return absl::ErrnoToStatus(errno, absl::StrCat("create ", tmp));
  absl::Cleanup remove_tmp = [&] { std::remove(tmp.c_str()); };
  absl::Status status = [&]() -> absl::Status {
    std::string head = header.Serialize();
    RETURN_IF_ERROR(WriteAll(file, head.data(), head.size(), tmp));
    std::vector<std::byte> buffer;
    for (size_t i = 0; i < header.tensors().size(); ++i) {
      const SafetensorsEntry& e = header.tensors()[i];
      buffer.assign(e.data_end - e.data_begin, std::byte{0});
      fill(i, buffer.data());
      RETURN_IF_ERROR(WriteAll(file, buffer.data(), buffer.size(), tmp));
    }
    return absl::OkStatus();
  }();
  if (std::fclose(file) != 0 && status.ok()) {
    status = absl::ErrnoToStatus(errno, absl::StrCat("close ", tmp));
  }
  RETURN_IF_ERROR(status);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("rename ", tmp, " to ", path));
  }
  std::move(remove_tmp).Cancel();
  return absl::OkStatus();
}

}  // namespace

void FillSynthValues(uint64_t seed, absl::string_view name, DType dtype,
                     int64_t first, int64_t count, std::byte* out) {
  const uint64_t key = XXH3_64bits_withSeed(name.data(), name.size(), seed);
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t r =
        SplitMix64(key ^ SplitMix64(static_cast<uint64_t>(first + i)));
    // Uniform in [-1, 1) with 24 bits of precision.
    const float f =
        static_cast<float>(static_cast<int64_t>(r >> 40) - (1 << 23)) *
        0x1p-23f;
    switch (dtype) {
      case DType::kF64:
        Put(out, i, static_cast<double>(f));
        break;
      case DType::kF32:
        Put(out, i, f);
        break;
      case DType::kF16:
        Put(out, i, FloatToHalf(f));
        break;
      case DType::kBF16:
        Put(out, i, static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16));
        break;
      case DType::kF8E4M3:
      case DType::kF8E5M2:
        // Below 0x70 in magnitude neither format has an infinity or NaN.
        Put(out, i, static_cast<uint8_t>(((r >> 8) % 0x70) | (r & 0x80)));
        break;
      case DType::kBool:
        Put(out, i, static_cast<uint8_t>(r & 1));
        break;
      default:
        std::memcpy(out + i * DTypeSize(dtype), &r, DTypeSize(dtype));
        break;
    }
  }
}

absl::Status WriteSynthShard(const Placement& placement, int rank,
                             uint64_t seed, const std::string& path) {
  const Model& model = placement.model();
  const std::vector<TensorShard>& shards =
      placement.shards(placement.config().ShardGroup(rank));
  std::vector<SafetensorsEntry> entries;
  for (const TensorShard& s : shards) {
    entries.push_back(
        {s.local_name, model.tensor(s.tensor).dtype, s.local_shape, 0, 0});
  }
  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   SafetensorsHeader::Build(
                       std::move(entries),
                       {{"scalai.rank", absl::StrCat(rank)},
                        {"scalai.config", placement.config().ToString()}}));
  return WriteFile(path, header, [&](size_t i, std::byte* out) {
    const TensorShard& s = shards[i];
    const TensorInfo& t = model.tensor(s.tensor);
    const int elem = DTypeSize(t.dtype);
    const Shape global_strides = RowMajorStrides(t.shape);
    const int rank_dims = static_cast<int>(t.shape.size());
    for (int p = 0; p < static_cast<int>(s.pieces.size()); ++p) {
      const ShardPiece& piece = s.pieces[p];
      if (piece.zero_fill || piece.local.empty())
        continue;  // the buffer starts zeroed
      // The piece's box indexes the local tensor, or a view of it (distopt).
      const Shape local_strides = RowMajorStrides(s.ViewShape(p));
      // One call per row along the last dim, which is contiguous in both.
      const int64_t row = rank_dims == 0 ? 1 : piece.local.shape().back();
      const int outer_dims = std::max(0, rank_dims - 1);
      Shape idx(outer_dims, 0);
      while (true) {
        int64_t local = s.ViewOffset(p), global = 0;
        for (int d = 0; d < outer_dims; ++d) {
          local += (piece.local.begin(d) + idx[d]) * local_strides[d];
          global += (piece.global.begin(d) + idx[d]) * global_strides[d];
        }
        if (rank_dims > 0) {
          local += piece.local.begin(rank_dims - 1);
          global += piece.global.begin(rank_dims - 1);
        }
        FillSynthValues(seed, t.name, t.dtype, global, row, out + local * elem);
        int d = outer_dims - 1;
        while (d >= 0 && ++idx[d] == piece.local.shape()[d]) idx[d--] = 0;
        if (d < 0) break;
      }
    }
  });
}

absl::Status WriteSynthFull(const Model& model, uint64_t seed,
                            const std::string& path) {
  std::vector<SafetensorsEntry> entries;
  for (const TensorInfo& t : model.tensors())
    entries.push_back({t.name, t.dtype, t.shape, 0, 0});
  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   SafetensorsHeader::Build(std::move(entries), {}));
  return WriteFile(path, header, [&](size_t i, std::byte* out) {
    const TensorInfo& t = model.tensor(static_cast<int>(i));
    FillSynthValues(seed, t.name, t.dtype, 0, *NumElements(t.shape), out);
  });
}

}  // namespace scalai
