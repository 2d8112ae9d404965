// SPDX-License-Identifier: Apache-2.0
#include "engine/lab/dspark_shard.h"

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "engine/core/dtype.h"
#include "engine/core/error.h"
#include "engine/core/tensor.h"
#include "engine/io/safetensors.h"

namespace specula::lab {
namespace {

int64_t parse_int(const std::string& text, const std::string& what) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || p != end || text.empty()) fail("{}: '{}' is not an integer", what, text);
  return v;
}

std::string meta_value(const std::map<std::string, std::string>& meta, const std::string& key,
                       const std::string& path) {
  auto it = meta.find(key);
  if (it == meta.end())
    fail("{}: __metadata__ has no '{}' (not a {} shard?)", path, key, kShardFormat);
  return it->second;
}

// The tensor `name` of `file`, checked to be `dtype` of rank 1 (or 2).
Tensor shard_tensor(const io::SafetensorsFile& file, const std::string& name, DType dtype,
                    int rank) {
  if (!file.contains(name)) fail("{}: no tensor '{}'", file.path(), name);
  const Tensor t = file.get(name);
  if (t.dtype() != dtype || t.shape().rank() != rank) {
    fail("{}: tensor '{}' is {}, expected {} of rank {}", file.path(), name, t.describe(),
         dtype_name(dtype), rank);
  }
  return t;
}

template <typename T>
std::vector<T> copy_out(const Tensor& t) {
  std::vector<T> v(static_cast<size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data(), v.size() * sizeof(T));
  return v;
}

}  // namespace

void DSparkShard::add_sequence(std::span<const int32_t> tokens, int64_t response_offset,
                               const TapRowsView& taps, int64_t first_row) {
  const auto n = static_cast<int64_t>(tokens.size());
  const auto m = static_cast<int64_t>(meta.tap_layers.size());
  const int64_t H = meta.hidden_size;
  SPECULA_CHECK(n > 0 && response_offset >= 1 && response_offset <= n,
                "shard sequence: response offset {} outside [1, {}]", response_offset, n);
  SPECULA_CHECK(taps.taps == m && taps.hidden == H,
                "shard sequence: taps [{}, *, {}], meta [{}, {}]", taps.taps, taps.hidden, m, H);
  SPECULA_CHECK(first_row >= 0 && first_row + n <= taps.rows,
                "shard sequence: rows [{}, {}) outside the forward's {}", first_row, first_row + n,
                taps.rows);
  const int64_t base = rows();
  resp_starts.push_back(base + response_offset);
  ids.insert(ids.end(), tokens.begin(), tokens.end());
  seq_starts.push_back(base + n);
  hidden.resize(static_cast<size_t>((base + n) * m * H));
  for (int64_t p = 0; p < n; ++p) {
    uint16_t* dst = hidden.data() + (base + p) * m * H;
    for (int64_t k = 0; k < m; ++k) {
      const float* src = taps.data + (k * taps.rows + first_row + p) * H;
      for (int64_t h = 0; h < H; ++h) dst[k * H + h] = f32_to_bf16(src[h]);
    }
  }
}

void DSparkShard::clear() {
  hidden.clear();
  ids.clear();
  seq_starts.assign(1, 0);
  resp_starts.clear();
}

std::string shard_file_name(int64_t index) {
  return fmt::format("shard_{:05d}.safetensors", index);
}

std::string tap_list(std::span<const int> taps) {
  return fmt::format("{}", fmt::join(taps, ","));
}

std::vector<int> parse_tap_list(const std::string& text, const std::string& what) {
  std::vector<int> out;
  size_t at = 0;
  while (at <= text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(at, comma - at);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    const int64_t v = parse_int(item, fmt::format("{} '{}'", what, text));
    if (v < 0 || v > 1'000'000) fail("{} '{}': tap {} is out of range", what, text, v);
    out.push_back(static_cast<int>(v));
    at = comma + 1;
  }
  return out;
}

void check_shard(const DSparkShard& s, const std::string& origin) {
  const int64_t T = s.rows(), S = s.sequences();
  if (s.meta.tap_layers.empty() || s.meta.hidden_size <= 0 || s.meta.vocab_size <= 0) {
    fail("{}: metadata tap_layers '{}', hidden_size {}, vocab_size {}: all must be set", origin,
         tap_list(s.meta.tap_layers), s.meta.hidden_size, s.meta.vocab_size);
  }
  if (static_cast<int64_t>(s.hidden.size()) != T * s.width()) {
    fail("{}: hidden holds {} values, expected [{}, {}]", origin, s.hidden.size(), T, s.width());
  }
  if (static_cast<int64_t>(s.seq_starts.size()) != S + 1 || s.seq_starts.front() != 0 ||
      s.seq_starts.back() != T) {
    fail("{}: seq_starts has {} entries from {} to {}, expected {} from 0 to {} (the rows)", origin,
         s.seq_starts.size(), s.seq_starts.empty() ? -1 : s.seq_starts.front(),
         s.seq_starts.empty() ? -1 : s.seq_starts.back(), S + 1, T);
  }
  for (int64_t i = 0; i < S; ++i) {
    const auto u = static_cast<size_t>(i);
    if (s.seq_starts[u + 1] <= s.seq_starts[u])
      fail("{}: seq_starts[{}] = {} is not above seq_starts[{}] = {}", origin, i + 1,
           s.seq_starts[u + 1], i, s.seq_starts[u]);
    if (s.resp_starts[u] <= s.seq_starts[u] || s.resp_starts[u] > s.seq_starts[u + 1])
      fail("{}: resp_starts[{}] = {} is outside sequence {}'s rows ({}, {}]", origin, i,
           s.resp_starts[u], i, s.seq_starts[u], s.seq_starts[u + 1]);
  }
  for (int64_t p = 0; p < T; ++p) {
    const int32_t id = s.ids[static_cast<size_t>(p)];
    if (id < 0 || id >= s.meta.vocab_size)
      fail("{}: ids[{}] = {} is outside the vocabulary [0, {})", origin, p, id, s.meta.vocab_size);
  }
}

void write_shard(const std::string& path, const DSparkShard& s) {
  check_shard(s, path);
  const int64_t T = s.rows(), S = s.sequences();
  auto* hidden = const_cast<uint16_t*>(s.hidden.data());
  auto* ids = const_cast<int32_t*>(s.ids.data());
  auto* seq = const_cast<int64_t*>(s.seq_starts.data());
  auto* resp = const_cast<int64_t*>(s.resp_starts.data());
  const std::vector<io::NamedTensor> tensors = {
      {"hidden", Tensor(hidden, DType::kBF16, Shape({T, s.width()}))},
      {"ids", Tensor(ids, DType::kI32, Shape({T}))},
      {"seq_starts", Tensor(seq, DType::kI64, Shape({S + 1}))},
      {"resp_starts", Tensor(resp, DType::kI64, Shape({S}))},
  };
  const std::map<std::string, std::string> meta = {
      {"format", kShardFormat},
      {"tap_layers", tap_list(s.meta.tap_layers)},
      {"hidden_size", std::to_string(s.meta.hidden_size)},
      {"vocab_size", std::to_string(s.meta.vocab_size)},
      {"target_config_hash", s.meta.target_config_hash},
      {"seed", std::to_string(s.meta.seed)},
      {"temperature", fmt::format("{:g}", s.meta.temperature)},
  };
  const std::string tmp = path + ".tmp";
  try {
    io::write_safetensors(tmp, tensors, meta);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    fail("cannot rename '{}' to '{}': {}", tmp, path, ec.message());
  }
}

DSparkShard read_shard(const std::string& path) {
  const io::SafetensorsFile file(path);
  const std::map<std::string, std::string>& meta = file.metadata();
  const std::string format = meta_value(meta, "format", path);
  if (format != kShardFormat)
    fail("{}: __metadata__ format is '{}', expected '{}'", path, format, kShardFormat);
  DSparkShard s;
  s.meta.tap_layers = parse_tap_list(meta_value(meta, "tap_layers", path), path + " tap_layers");
  s.meta.hidden_size = parse_int(meta_value(meta, "hidden_size", path), path + " hidden_size");
  s.meta.vocab_size = parse_int(meta_value(meta, "vocab_size", path), path + " vocab_size");
  s.meta.target_config_hash = meta_value(meta, "target_config_hash", path);
  s.meta.seed = static_cast<uint64_t>(parse_int(meta_value(meta, "seed", path), path + " seed"));
  const std::string temp = meta_value(meta, "temperature", path);
  char* end = nullptr;
  s.meta.temperature = std::strtod(temp.c_str(), &end);
  if (temp.empty() || end != temp.c_str() + temp.size())
    fail("{}: __metadata__ temperature '{}' is not a number", path, temp);

  const Tensor hidden = shard_tensor(file, "hidden", DType::kBF16, 2);
  const Tensor ids = shard_tensor(file, "ids", DType::kI32, 1);
  const Tensor seq = shard_tensor(file, "seq_starts", DType::kI64, 1);
  const Tensor resp = shard_tensor(file, "resp_starts", DType::kI64, 1);
  if (hidden.dim(0) != ids.dim(0) || hidden.dim(1) != s.width()) {
    fail("{}: hidden is {}, expected [{}, {}] (ids' rows, {} taps x hidden_size {})", path,
         hidden.describe(), ids.dim(0), s.width(), s.meta.tap_layers.size(), s.meta.hidden_size);
  }
  if (seq.dim(0) != resp.dim(0) + 1)
    fail("{}: seq_starts has {} entries, expected resp_starts' {} + 1", path, seq.dim(0),
         resp.dim(0));
  s.hidden = copy_out<uint16_t>(hidden);
  s.ids = copy_out<int32_t>(ids);
  s.seq_starts = copy_out<int64_t>(seq);
  s.resp_starts = copy_out<int64_t>(resp);
  check_shard(s, path);
  return s;
}

}  // namespace specula::lab
