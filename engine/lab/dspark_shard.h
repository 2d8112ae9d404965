// SPDX-License-Identifier: Apache-2.0
// DSpark training shards (docs/dspark.md, "Training data: specula regen"):
// what `specula regen` writes and the trainer reads. One shard is one
// safetensors file holding whole sequences (prompt then the target's own
// response) and the target's hidden states at every position:
//   hidden       bf16 [T, m·H]  row p = the m taps of position p, concatenated
//                               along features in tap_layers order
//   ids          i32  [T]       the sequences' tokens, concatenated
//   seq_starts   i64  [S+1]     sequence s spans rows [seq_starts[s], seq_starts[s+1])
//   resp_starts  i64  [S]       the row of sequence s's first generated token
//   __metadata__ format = "specula-dspark-shard-v1", tap_layers = "a,b,c",
//                hidden_size (H), vocab_size, target_config_hash, seed, temperature
// Taps follow the engine convention (Drafter::taps): 0 = scaled embeddings,
// l = after layer l, L = after the final norm.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace specula::lab {

inline constexpr const char* kShardFormat = "specula-dspark-shard-v1";

// What every shard of one regen run records (the __metadata__ map).
struct ShardMeta {
  std::vector<int> tap_layers;     // m engine taps, in feature order
  int64_t hidden_size = 0;         // H (one tap's width)
  int64_t vocab_size = 0;          // V
  std::string target_config_hash;  // dspark::target_config_hash of the target
  uint64_t seed = 0;
  double temperature = 0;  // 0 = greedy
  bool operator==(const ShardMeta&) const = default;
};

// The taps of a batched target forward as ForwardOptions::tap_out lays them
// out, on the host: f32 [m, rows, H] (tap-major), not owned.
struct TapRowsView {
  const float* data = nullptr;
  int64_t taps = 0;  // m
  int64_t rows = 0;  // all rows' tokens of the forward
  int64_t hidden = 0;
};

// One shard in memory. hidden holds bf16 bits, row-major [rows(), m·H].
struct DSparkShard {
  ShardMeta meta;
  std::vector<uint16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<int64_t> seq_starts{0};
  std::vector<int64_t> resp_starts;

  int64_t rows() const { return static_cast<int64_t>(ids.size()); }
  int64_t sequences() const { return static_cast<int64_t>(resp_starts.size()); }
  int64_t width() const { return static_cast<int64_t>(meta.tap_layers.size()) * meta.hidden_size; }
  // Appends one sequence: `tokens` (prompt then response), its first response
  // token at `response_offset` within it (in [1, tokens.size()]; equal to the
  // size when the response is empty), and its hidden states: rows
  // [first_row, first_row + tokens.size()) of `taps` (m and H must match
  // meta), rounded to bf16 (nearest even).
  void add_sequence(std::span<const int32_t> tokens, int64_t response_offset,
                    const TapRowsView& taps, int64_t first_row);
  // Drops every sequence (meta kept).
  void clear();
};

// "shard_00012.safetensors"
std::string shard_file_name(int64_t index);

// Checks the shard's invariants (sizes agree, starts increasing and in range,
// ids in [0, V)); throws an Error naming `origin` and the field otherwise.
void check_shard(const DSparkShard& shard, const std::string& origin);

// Writes `shard` to `path` through `path + ".tmp"` and a rename, so `path`
// never holds a partial shard; an I/O error (full disk, closed or renamed
// file) throws an Error naming the file, and leaves no .tmp behind.
void write_shard(const std::string& path, const DSparkShard& shard);

// Reads a shard, checking the format tag, the tensor names, dtypes and shapes
// and the invariants above; errors name the file and the field.
DSparkShard read_shard(const std::string& path);

// "a,b,c" for meta and manifests; parse_tap_list is its inverse (an Error
// names `what` and the bad item).
std::string tap_list(std::span<const int> taps);
std::vector<int> parse_tap_list(const std::string& text, const std::string& what);

}  // namespace specula::lab
