// SPDX-License-Identifier: Apache-2.0
// The hardware-aware prefix scheduler of the DSpark paper (Alg. 1, §3.2.2),
// as a pure function of the rows' confidences and a profiled cost table.
// It decides how many of each row's drafts are verified; it never changes a
// draft, so a row's verified window is a prefix of what was drafted and
// speculative sampling stays exact (see the early break below, and
// tests/unit/speculative/verify_scheduler_test.cpp for the paper's Appendix A case).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace specula::speculative {

// One profiled point: a verify forward of `tokens` tokens (all rows' windows
// together) runs `steps_per_sec` times a second.
struct SpsPoint {
  int64_t tokens = 0;
  double steps_per_sec = 0.0;
};

// SPS(B), steps per second at a forward of B tokens, from profiled points
// (the paper profiles it once at start-up; so would `specula`, caching it in
// a JSON file). Between points the step TIME 1/SPS is linear in B (a forward's
// cost grows about linearly between profiled sizes); below the first point
// SPS is the first point's; past the last the step time grows in proportion
// to B (tokens/s held at the last point's: a larger forward is never assumed
// to be cheaper per token). Lookups are O(1) up to the last profiled B (a
// dense table built at construction).
class SpsTable {
 public:
  SpsTable() = default;  // empty: steps_per_sec() throws
  // points: tokens strictly increasing and >= 1, steps_per_sec finite and > 0;
  // the last tokens at most kMaxTokens. `device` and `model` say what was
  // profiled (a cache made for another device or model is not reused).
  // Throws Error naming the point and value otherwise.
  explicit SpsTable(std::vector<SpsPoint> points, std::string device = "", std::string model = "");

  static constexpr int64_t kMaxTokens = 1 << 20;

  // SPS(B) for B >= 1 by the rule above. Throws Error for B < 1 or an empty table.
  double steps_per_sec(int64_t tokens) const;

  bool empty() const { return points_.empty(); }
  const std::vector<SpsPoint>& points() const { return points_; }
  const std::string& device() const { return device_; }
  const std::string& model() const { return model_; }

  // JSON text: {"kind": "specula-sps-table", "version": 1, "device": ...,
  // "model": ..., "points": [{"tokens": B, "steps_per_sec": s}, ...]}.
  std::string to_json() const;
  // Parses to_json()'s form; errors name `origin`, the field and the value.
  static SpsTable from_json(const std::string& text, const std::string& origin);
  // File forms of the two; errors name the path.
  void save(const std::string& path) const;
  static SpsTable load(const std::string& path);

  // The table as `--verbose` prints it: a header naming device and model,
  // then one line per profiled point (B, steps/s, ms/step, tokens/s).
  std::string describe() const;

 private:
  std::vector<SpsPoint> points_;
  std::vector<double> dense_;  // dense_[B] = SPS(B) for 1 <= B <= last profiled B
  std::string device_;
  std::string model_;
};

// A cached table: the one at `path` when it was profiled for `device` and
// `model` (SpsTable::device / model, compared exactly) and reaches
// `max_tokens`; nullopt when there is no file or it reaches fewer tokens
// (the caller profiles again and overwrites it). A table made for another
// device or model is refused: an Error names the file and both identities
// (so that a cache is never reused on the wrong machine, nor silently
// overwritten). A malformed file is an Error naming it.
std::optional<SpsTable> load_sps_cache(const std::string& path, const std::string& device,
                                       const std::string& model, int64_t max_tokens);

// The scheduler's answer.
struct PrefixSchedule {
  std::vector<int> lengths;      // [rows] ℓ_r, 0 <= ℓ_r <= k_r: verify drafts 0..ℓ_r-1
  int64_t batch_tokens = 0;      // B = Σ_r (1 + ℓ_r)
  double expected_tokens = 0.0;  // τ = Σ_r (1 + Σ_{j<=ℓ_r} a_{r,j})
  double throughput = 0.0;       // Θ = τ · SPS(B), expected tokens per second
};

// Alg. 1 with reusable scratch (no allocation once it has seen the largest
// rows × k). Row r's confidences c_{r,1..k_r} are conditional survival
// probabilities (each in [0, 1], e.g. STS-calibrated); a_{r,j} = Π_{i<=j}
// c_{r,i}. Candidates (r, j) with a_{r,j} > 0 are admitted in descending
// a_{r,j}, ties to the lower row, then the lower position — deterministic,
// and since a_{r,j} never rises with j, every row's admitted positions form a
// prefix. Starting from ℓ = 0 (B = R, τ = R), each admission adds one token
// to B and a_{r,j} to τ; it is kept while Θ = τ·SPS(B) strictly rises, and
// the scan BREAKS at the first candidate that does not raise it. The break is
// what keeps sampling exact: the Markov confidence c_{r,j+1} depends on the
// sampled draft j, so a search that looked past the first drop would let a
// draft's own value decide whether it is verified (paper Appendix A). It
// also means the result is the global optimum only when Θ is unimodal along
// the admission order.
class VerifyScheduler {
 public:
  // `confidences`: row r's k_r values at [r * stride, r * stride + k_r);
  // `draft_lengths`: k_r per row (0 <= k_r <= stride). Throws Error naming
  // the row and position for a confidence that is not a finite value in
  // [0, 1], and for bad lengths. The returned reference stays valid until
  // the next call.
  const PrefixSchedule& schedule(std::span<const double> confidences, int stride,
                                 std::span<const int> draft_lengths, const SpsTable& sps);

  // Convenience: row r's confidences are rows[r] (k_r = rows[r].size()).
  const PrefixSchedule& schedule(const std::vector<std::vector<double>>& rows, const SpsTable& sps);

 private:
  struct Candidate {
    double survival;
    int row;
    int position;  // 1-based: admitting it verifies drafts 0..position-1
  };
  std::vector<Candidate> candidates_;
  std::vector<double> flat_;
  std::vector<int> lengths_;
  PrefixSchedule result_;
};

}  // namespace specula::speculative
