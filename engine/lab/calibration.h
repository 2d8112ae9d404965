// SPDX-License-Identifier: Apache-2.0
// Calibration of a block drafter's confidence head (issue #33), model-free:
// the inputs are what an unpruned drafter's verify rounds produced, the
// outputs are numbers for dspark.json. Two fits:
// - Fit 1, per-position pruning thresholds: the seed's `fitStsThresholds`
//   rule exactly (../shared/reference/seed-system.md §4.8);
// - Fit 2, Sequential Temperature Scaling (DSpark paper §3.2.1): one
//   temperature per position on the confidence logit, fit left to right so
//   the cumulative survival product is calibrated (what Alg. 1 consumes).
// ECE everywhere uses equal-width bins on [0, 1], kDefaultEceBins (15) unless
// a caller asks for another count.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace specula::lab {

inline constexpr int kDefaultEceBins = 15;

// One drafted position of one verify round, as the seed collects it:
// `position` k (0-based within the block), the drafter's confidence c_k, and
// `accepted` = k < (drafts the round accepted), i.e. the prefix label.
struct CalibrationSample {
  int position = 0;
  double confidence = 0.0;
  bool accepted = false;
};

// One verify round of an unpruned drafter: confidences c_0..c_{n-1} of the n
// drafted positions, and how many of them (a prefix) the target accepted,
// 0 <= accepted <= n. STS needs rounds, not flat samples, because its label
// and its survival product both run along the round's block.
struct DraftRound {
  std::vector<double> confidences;
  int accepted = 0;
};

// The seed's samples of a set of rounds: one per drafted position, in round
// order. Throws Error naming the round when `accepted` is outside [0, n].
std::vector<CalibrationSample> samples_from_rounds(std::span<const DraftRound> rounds);

// ---- Fit 1: thresholds (seed rule) ----

struct ThresholdFitOptions {
  int block_size = 0;        // γ: positions 0..γ-1; must be >= 1
  double target = 0.5;       // Laplace precision a threshold must reach, in (0, 1]
  int64_t min_samples = 50;  // fewer samples at a position k >= 1 -> threshold 0
};

struct ThresholdFit {
  std::vector<double> thresholds;  // [block_size]; thresholds[0] == 0
  double target = 0.5;
  int64_t samples = 0;  // samples kept after the filter (finite confidence, position in range)
};

// The seed's rule (§4.8), deterministic in the multiset of samples:
// 1. drop samples with a non-finite confidence or a position outside [0, γ);
// 2. position 0 -> 0 (never pruned);
// 3. position k >= 1 with fewer than min_samples samples -> 0;
// 4. else scan the observed confidences τ at k ascending; precision(τ) =
//    (accepted with conf >= τ + 1) / (samples with conf >= τ + 2); the first τ
//    whose precision >= target is the threshold;
// 5. none qualifies -> 1.0 (prune always).
// Throws Error on block_size < 1, a target outside (0, 1] or min_samples < 0.
ThresholdFit fit_thresholds(std::span<const CalibrationSample> samples,
                            const ThresholdFitOptions& options);

// ---- ECE and reliability bins ----

// One equal-width bin of predicted probabilities on [0, 1]: [lo, hi) (the last
// bin includes 1). mean_predicted and observed_rate are 0 when count is 0.
struct ReliabilityBin {
  double lo = 0.0;
  double hi = 0.0;
  double mean_predicted = 0.0;
  double observed_rate = 0.0;
  int64_t count = 0;
};

// Bins predicted[i] (in [0, 1]; values outside are clamped into the end bins)
// against the binary outcomes observed[i] (same length). `bins` >= 1.
// Throws Error on a length mismatch, bins < 1 or a non-finite prediction.
std::vector<ReliabilityBin> reliability_bins(std::span<const double> predicted,
                                             std::span<const uint8_t> observed,
                                             int bins = kDefaultEceBins);

// Expected calibration error (Naeini et al. 2015): Σ_b (n_b / N) |mean
// predicted_b − observed rate_b| over equal-width bins; 0 for no samples.
double ece(std::span<const double> predicted, std::span<const uint8_t> observed,
           int bins = kDefaultEceBins);
double ece(std::span<const ReliabilityBin> bins);

// ---- Fit 2: STS ----

// c' = σ(logit(c) / T). c is clamped into [kStsClamp, 1 − kStsClamp] first so
// that 0 and 1 stay finite; T > 0. Monotone in c, so ranks are kept.
inline constexpr double kStsClamp = 1e-7;
double temperature_scale(double confidence, double temperature);

// The calibrated conditional confidences of one round: out[k] =
// temperature_scale(c[k], temperatures[k]); positions past temperatures.size()
// keep T = 1. `out` must hold c.size() values (may alias c).
void apply_temperatures(std::span<const double> confidences, std::span<const double> temperatures,
                        std::span<double> out);

// The survival products a_k = Π_{i<=k} c'_i of one round (c' as above), the
// probability that positions 0..k are all accepted. `out` holds c.size().
void survival_products(std::span<const double> confidences, std::span<const double> temperatures,
                       std::span<double> out);

struct StsOptions {
  int block_size = 0;   // γ; positions >= γ in a round are ignored
  double t_min = 0.05;  // temperature grid: t_min, t_min + t_step, ..., <= t_max
  double t_max = 5.0;
  double t_step = 0.01;
  int bins = kDefaultEceBins;
};

struct StsFit {
  std::vector<double> temperatures;  // [block_size]; 1.0 at positions no round reached
  std::vector<double> ece_before;    // [block_size] ECE of the raw survival products
  std::vector<double> ece_after;     // [block_size] ECE with the fitted temperatures
  std::vector<int64_t> counts;       // [block_size] rounds that drafted the position
  int64_t rounds = 0;                // rounds kept (all confidences finite and in [0, 1])
};

// Sequential Temperature Scaling: for k = 0..γ-1 in order, with T_0..T_{k-1}
// fixed, T_k = the grid temperature minimising the ECE of a_k (over rounds
// that drafted position k) against the prefix label 1[k < accepted]. Ties go
// to the temperature closest to 1, then the smaller. A round with a
// non-finite confidence or one outside [0, 1] is dropped whole (its products
// would be meaningless). Deterministic. Throws Error on block_size < 1, a bad
// grid (t_min <= 0, t_step <= 0, t_max < t_min) or bins < 1; rounds with
// accepted outside [0, n] throw naming the round.
StsFit fit_sts(std::span<const DraftRound> rounds, const StsOptions& options);

// Per-position ECE of the survival products under `temperatures` (all ones:
// the raw head), for held-out evaluation. [block_size]; 0 where no round
// drafted the position. Rounds are filtered as in fit_sts.
std::vector<double> survival_ece(std::span<const DraftRound> rounds,
                                 std::span<const double> temperatures, int block_size,
                                 int bins = kDefaultEceBins);

// Reliability bins of the survival products a_k at `position` under
// `temperatures` against the prefix label (the reliability diagram's data).
std::vector<ReliabilityBin> survival_reliability(std::span<const DraftRound> rounds,
                                                 std::span<const double> temperatures, int position,
                                                 int bins = kDefaultEceBins);

// ---- dspark.json ----

// Returns `dspark_json` (the text of a dspark.json; `origin` names it in
// errors) with `calibration` set to {thresholds, target, samples,
// sts_temperatures}; every other field, and any other key inside
// `calibration`, is kept, in the file's order. Throws Error when the text is
// not a JSON object, when `calibration` exists and is not an object, or when
// `config.block_size` exists and differs from either fit's length (naming both).
std::string with_calibration(const std::string& dspark_json, const std::string& origin,
                             const ThresholdFit& thresholds, const StsFit& sts);

// Reads the dspark.json at `path`, applies with_calibration and writes it back
// (through a temporary file and a rename, so a failure leaves the old file).
// Errors name the path.
void write_calibration_file(const std::string& path, const ThresholdFit& thresholds,
                            const StsFit& sts);

}  // namespace specula::lab
