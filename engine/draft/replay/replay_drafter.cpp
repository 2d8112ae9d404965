// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/replay/replay_drafter.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "engine/core/error.h"

namespace specula::replay {
namespace {

constexpr size_t kKeyTokens = 16;

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t key_of(std::span<const int32_t> tokens) {
  uint64_t h = 0x243F6A8885A308D3ull;
  const size_t n = std::min(tokens.size(), kKeyTokens);
  for (size_t i = 0; i < n; ++i) h = mix(h ^ static_cast<uint32_t>(tokens[i]));
  return mix(h ^ n);
}

}  // namespace

std::vector<double> parse_acceptance_profile(const std::string& text) {
  std::vector<double> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    double v = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size() || !(v > 0) ||
        v > 1) {
      fail("acceptance profile '{}': '{}' is not a number in (0, 1]", text, item);
    }
    out.push_back(v);
    at = comma + 1;
  }
  return out;
}

ReplayDrafter::ReplayDrafter(Drafter& inner, Backend& backend, std::vector<double> profile,
                             uint64_t seed)
    : inner_(inner), backend_(backend), profile_(std::move(profile)), seed_(seed) {
  if (profile_.empty()) fail("replay drafter: the acceptance profile is empty");
  for (double a : profile_) {
    if (!(a > 0) || a > 1) fail("replay drafter: acceptance {} is outside (0, 1]", a);
  }
}

void ReplayDrafter::add_reference(std::vector<int32_t> sequence) {
  const uint64_t key = key_of(sequence);
  references_[key] = std::move(sequence);
}

double ReplayDrafter::keep_probability(int step_index) const {
  // Kept with probability a_s / a_{s-1}; past the profile, its last ratio.
  const size_t s = std::min(static_cast<size_t>(step_index), profile_.size() - 1);
  const double before = s == 0 ? 1.0 : profile_[s - 1];
  return std::min(1.0, profile_[s] / before);
}

void ReplayDrafter::draft_confidences(std::span<const DraftRow> rows, std::span<const int> drafted,
                                      int stride, std::span<double> conf) {
  SPECULA_CHECK(drafted.size() == rows.size() &&
                    conf.size() >= rows.size() * static_cast<size_t>(std::max(stride, 0)),
                "replay draft_confidences: {} rows, {} counts, {} values of stride {}", rows.size(),
                drafted.size(), conf.size(), stride);
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int j = 0; j < drafted[i]; ++j) {
      conf[i * static_cast<size_t>(stride) + static_cast<size_t>(j)] = keep_probability(j);
    }
  }
}

int32_t ReplayDrafter::proposal(int step_index, const DraftRow& row) const {
  const int64_t V = vocab_size();
  const int64_t target_at = static_cast<int64_t>(row.history.size()) + step_index;
  const auto it = references_.find(key_of(row.history));
  const bool known = it != references_.end() && target_at < static_cast<int64_t>(it->second.size());
  const int32_t right = known ? it->second[static_cast<size_t>(target_at)] : 0;
  const double keep = keep_probability(step_index);
  const uint64_t draw =
      mix(seed_ ^ mix(it != references_.end() ? it->first : 0) ^
          mix(static_cast<uint64_t>(target_at) * 131 + static_cast<uint64_t>(step_index)));
  const double u = static_cast<double>(draw >> 11) * 0x1.0p-53;
  if (known && u < keep) return right;
  // A wrong token: any other one.
  return static_cast<int32_t>(
      (right + 1 + static_cast<int64_t>(mix(draw) % static_cast<uint64_t>(V - 1))) % V);
}

Tensor ReplayDrafter::proposals(int step_index, std::span<const DraftRow> rows) {
  const auto n = static_cast<int64_t>(rows.size());
  const int64_t V = vocab_size();
  if (n > capacity_rows_) {
    capacity_rows_ = std::max<int64_t>(n, 2 * capacity_rows_);
    logits_ = DeviceBuffer(backend_, static_cast<size_t>(capacity_rows_ * V) * sizeof(float));
    scatter_ = DeviceBuffer(backend_, static_cast<size_t>(2 * capacity_rows_) * sizeof(float));
    host_values_.assign(static_cast<size_t>(capacity_rows_), 1.0f);
    host_ids_.resize(static_cast<size_t>(capacity_rows_));
  }
  for (int64_t i = 0; i < n; ++i)
    host_ids_[static_cast<size_t>(i)] = proposal(step_index, rows[static_cast<size_t>(i)]);
  char* base = static_cast<char*>(scatter_.data());
  const Device dev = backend_.device();
  const Tensor values(base, DType::kF32, {n, 1}, dev);
  const Tensor ids(base + static_cast<size_t>(capacity_rows_) * sizeof(float), DType::kI32, {n, 1},
                   dev);
  backend_.upload_async(host_values_.data(), values);
  backend_.upload_async(host_ids_.data(), ids);
  const Tensor out = logits_.view(DType::kF32, {capacity_rows_, V}).slice_rows(0, n);
  // Every other entry is the value minus 1: the proposal is the argmax, and
  // its processed distribution at temperature 1 is far from a point mass only
  // by e^-1 per token; greedy benchmarks are what this drafter is for.
  backend_.fill_scatter_rows(values, ids, out);
  return out;
}

Tensor ReplayDrafter::step(int step_index, std::span<const DraftRow> rows) {
  inner_.step(step_index, rows);
  return proposals(step_index, rows);
}

Tensor ReplayDrafter::step_on_device(int step_index, std::span<const DraftRow> rows,
                                     const DraftDeviceInputs& inputs) {
  inner_.step_on_device(step_index, rows, inputs);
  return proposals(step_index, rows);
}

}  // namespace specula::replay
