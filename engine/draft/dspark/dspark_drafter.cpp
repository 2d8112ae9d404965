// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/dspark/dspark_drafter.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/lab/calibration.h"

namespace specula::dspark {

DSparkDrafter::DSparkDrafter(gemma4::Gemma4Model& target, DSparkModel& model)
    : target_(target), model_(model), backend_(target.backend()) {
  if (&model.backend() != &target.backend() || &model.target() != &target) {
    fail("the DSpark drafter must be built for this target and run on its backend ({})",
         target.backend().device().str());
  }
  step_slots_.resize(static_cast<size_t>(model.block_size()));
}

void DSparkDrafter::on_committed(std::span<const CommittedRow> rows, const Tensor& taps) {
  if (rows.empty()) return;
  // Validate every row before creating or growing any cache.
  for (const CommittedRow& r : rows) {
    const auto it = contexts_.find(r.sequence);
    const int64_t have = it == contexts_.end() ? 0 : it->second.length();
    if (r.position != have) {
      fail(
          "dspark: sequence {} commits positions from {}, but its context cache holds {} "
          "(every committed position must reach the drafter once, in order)",
          r.sequence, r.position, have);
    }
  }
  pieces_.clear();
  for (const CommittedRow& r : rows) {
    auto it = contexts_.find(r.sequence);
    if (it == contexts_.end()) it = contexts_.emplace(r.sequence, model_.new_context()).first;
    pieces_.push_back(
        {.kv = &it->second, .position = r.position, .count = r.count, .tap_row = r.tap_row});
  }
  model_.commit_context(pieces_, taps);
}

void DSparkDrafter::release(int sequence) {
  contexts_.erase(sequence);
}

int64_t DSparkDrafter::context_length(int sequence) const {
  const auto it = contexts_.find(sequence);
  return it == contexts_.end() ? -1 : it->second.length();
}

int64_t DSparkDrafter::context_positions() const {
  int64_t n = 0;
  for (const auto& [seq, kv] : contexts_) n += kv.length();
  return n;
}

Tensor DSparkDrafter::step(int step_index, std::span<const DraftRow> rows) {
  return draft_step(step_index, rows, nullptr);
}

Tensor DSparkDrafter::step_on_device(int step_index, std::span<const DraftRow> rows,
                                     const DraftDeviceInputs& inputs) {
  const int64_t B = static_cast<int64_t>(rows.size());
  if (inputs.tokens.dtype() != DType::kI32 || inputs.tokens.shape() != Shape{B} ||
      inputs.tokens.device() != backend_.device()) {
    fail("dspark draft step {}: device tokens {} must be i32 [{}] on {}", step_index,
         inputs.tokens.describe(), B, backend_.device().str());
  }
  return draft_step(step_index, rows, &inputs.tokens);
}

Tensor DSparkDrafter::draft_step(int step_index, std::span<const DraftRow> rows,
                                 const Tensor* device_tokens) {
  const int G = model_.block_size();
  const int64_t B = static_cast<int64_t>(rows.size());
  SPECULA_CHECK(B > 0, "dspark draft step {} has no rows", step_index);
  if (step_index < 0 || step_index >= G) {
    fail("dspark draft step {}: a block drafts at most {} tokens (block_size)", step_index, G);
  }
  if (step_index > 0 && step_index > round_steps_) {
    fail("dspark draft step {} after {} steps of the round", step_index, round_steps_);
  }
  std::vector<int32_t>& slots = step_slots_[static_cast<size_t>(step_index)];
  slots.clear();
  if (step_index == 0) {
    round_sequences_.clear();
    round_ctx_.clear();
    for (const DraftRow& r : rows) {
      const auto it = contexts_.find(r.sequence);
      if (it == contexts_.end()) {
        fail("dspark draft step 0: sequence {} has no context (no committed positions)",
             r.sequence);
      }
      if (it->second.length() != r.position ||
          (r.target_kv != nullptr && r.target_kv->length() != r.position)) {
        fail(
            "dspark draft step 0: sequence {} drafts at position {}, but its context cache holds "
            "{} positions and the target's {}",
            r.sequence, r.position, it->second.length(), r.target_kv ? r.target_kv->length() : -1);
      }
      round_sequences_.push_back(r.sequence);
      round_ctx_.push_back(&it->second);
      slots.push_back(static_cast<int32_t>(slots.size()));
    }
    for (auto& s : step_slots_) {
      if (&s != &slots) s.clear();
    }
  } else {
    size_t next = 0;
    for (const DraftRow& r : rows) {
      while (next < round_sequences_.size() && round_sequences_[next] != r.sequence) ++next;
      if (next == round_sequences_.size()) {
        fail(
            "dspark draft step {}: sequence {} was not a row of step 0 of this round (rows must "
            "be a subset of step 0's, in the same order)",
            step_index, r.sequence);
      }
      slots.push_back(static_cast<int32_t>(next++));
    }
  }
  round_steps_ = step_index + 1;
  conf_read_ = false;

  const int64_t B0 = static_cast<int64_t>(round_sequences_.size());
  if (B0 > cap_) {
    // Grown only for more rows than any round before.
    cap_ = B0;
    tokens_ = DeviceBuffer(backend_, static_cast<size_t>(G * cap_) * sizeof(int32_t));
    confidences_ = DeviceBuffer(backend_, static_cast<size_t>(G * cap_) * sizeof(float));
  }
  Tensor tokens;
  if (device_tokens != nullptr) {
    tokens = *device_tokens;
  } else {
    host_tokens_.clear();
    for (const DraftRow& r : rows) host_tokens_.push_back(r.token);
    tokens = Tensor(static_cast<int32_t*>(tokens_.data()) + step_index * cap_, DType::kI32, {B},
                    backend_.device());
    backend_.upload_async(host_tokens_.data(), tokens);
  }
  if (step_index == 0) model_.run_block(round_ctx_, tokens);
  u_rows_.clear();
  for (int32_t s : slots) u_rows_.push_back(s * G + step_index);
  const Tensor conf = model_.has_confidence_head()
                          ? Tensor(static_cast<float*>(confidences_.data()) + step_index * cap_,
                                   DType::kF32, {B}, backend_.device())
                          : Tensor();
  return model_.head_step(step_index, u_rows_, tokens, conf);
}

std::span<const float> DSparkDrafter::last_confidences() {
  if (!model_.has_confidence_head() || round_steps_ == 0) return {};
  if (conf_read_) return conf_out_;
  const int G = model_.block_size();
  conf_raw_.resize(static_cast<size_t>(G * cap_));
  backend_.download(confidences_.view(DType::kF32, {G * cap_}), conf_raw_.data());
  const int64_t B0 = static_cast<int64_t>(round_sequences_.size());
  conf_out_.assign(static_cast<size_t>(B0 * G), std::numeric_limits<float>::quiet_NaN());
  for (int k = 0; k < round_steps_; ++k) {
    const std::vector<int32_t>& slots = step_slots_[static_cast<size_t>(k)];
    for (size_t i = 0; i < slots.size(); ++i) {
      const float c = conf_raw_[static_cast<size_t>(k * cap_) + i];
      conf_out_[static_cast<size_t>(slots[i]) * G + k] = 1.0f / (1.0f + std::exp(-c));
    }
  }
  conf_read_ = true;
  return conf_out_;
}

void DSparkDrafter::set_thresholds(std::vector<float> thresholds) {
  const int G = model_.block_size();
  if (!thresholds.empty() && static_cast<int>(thresholds.size()) != G) {
    fail("DSpark pruning thresholds: {} given, the drafter's block has {} positions",
         thresholds.size(), G);
  }
  for (size_t k = 0; k < thresholds.size(); ++k) {
    if (!(thresholds[k] >= 0.0f && thresholds[k] <= 1.0f)) {
      fail("DSpark pruning threshold of position {} is {}, expected a value in [0, 1]", k,
           thresholds[k]);
    }
  }
  if (!thresholds.empty() && !model_.has_confidence_head()) {
    fail("DSpark pruning needs a confidence head; {} has none", model_.description());
  }
  thresholds_ = std::move(thresholds);
}

void DSparkDrafter::set_sts_temperatures(std::vector<float> temperatures) {
  const int G = model_.block_size();
  if (!temperatures.empty() && static_cast<int>(temperatures.size()) != G) {
    fail("DSpark STS temperatures: {} given, the drafter's block has {} positions",
         temperatures.size(), G);
  }
  for (size_t k = 0; k < temperatures.size(); ++k) {
    if (!(temperatures[k] > 0.0f) || !std::isfinite(temperatures[k])) {
      fail("DSpark STS temperature of position {} is {}, expected a finite value > 0", k,
           temperatures[k]);
    }
  }
  if (!temperatures.empty() && !model_.has_confidence_head()) {
    fail("DSpark STS temperatures need a confidence head; {} has none", model_.description());
  }
  sts_ = std::move(temperatures);
}

bool DSparkDrafter::prunes() const {
  // Position 0 is never pruned, so thresholds only there change nothing.
  for (size_t k = 1; k < thresholds_.size(); ++k) {
    if (thresholds_[k] > 0.0f) return true;
  }
  return false;
}

void DSparkDrafter::draft_lengths(std::span<const DraftRow> rows, std::span<const int> drafted,
                                  std::span<int> keep) {
  const std::span<const float> conf = last_confidences();
  const int G = model_.block_size();
  SPECULA_CHECK(rows.size() == round_sequences_.size(),
                "draft_lengths for {} rows, the round's step 0 had {}", rows.size(),
                round_sequences_.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    SPECULA_CHECK(rows[i].sequence == round_sequences_[i],
                  "draft_lengths row {} is sequence {}, step 0's was {}", i, rows[i].sequence,
                  round_sequences_[i]);
    // Cut at the first position k >= 1 whose confidence is below its
    // threshold: c_k reads draft k - 1, never draft k, so the cut depends only
    // on drafts before it (what keeps sampled rows exact).
    int n = drafted[i];
    for (int k = 1; k < drafted[i]; ++k) {
      const float c = conf[i * static_cast<size_t>(G) + static_cast<size_t>(k)];
      if (c < thresholds_[static_cast<size_t>(k)]) {
        n = k;
        break;
      }
    }
    keep[i] = n;
  }
}

void DSparkDrafter::draft_confidences(std::span<const DraftRow> rows, std::span<const int> drafted,
                                      int stride, std::span<double> conf) {
  if (!model_.has_confidence_head()) {
    fail("DSpark draft confidences need a confidence head; {} has none", model_.description());
  }
  const std::span<const float> c = last_confidences();
  const int G = model_.block_size();
  SPECULA_CHECK(rows.size() == round_sequences_.size() && drafted.size() == rows.size(),
                "draft_confidences for {} rows, the round's step 0 had {}", rows.size(),
                round_sequences_.size());
  SPECULA_CHECK(conf.size() >= rows.size() * static_cast<size_t>(stride),
                "draft_confidences: {} values for {} rows of stride {}", conf.size(), rows.size(),
                stride);
  for (size_t i = 0; i < rows.size(); ++i) {
    SPECULA_CHECK(rows[i].sequence == round_sequences_[i],
                  "draft_confidences row {} is sequence {}, step 0's was {}", i, rows[i].sequence,
                  round_sequences_[i]);
    SPECULA_CHECK(drafted[i] >= 0 && drafted[i] <= std::min(stride, round_steps_),
                  "draft_confidences row {}: {} drafts (stride {}, {} steps ran)", i, drafted[i],
                  stride, round_steps_);
    // c_k reads draft k − 1 (the Markov features), never draft k.
    for (int k = 0; k < drafted[i]; ++k) {
      const double ck = c[i * static_cast<size_t>(G) + static_cast<size_t>(k)];
      conf[i * static_cast<size_t>(stride) + static_cast<size_t>(k)] =
          sts_.empty() ? ck : lab::temperature_scale(ck, sts_[static_cast<size_t>(k)]);
    }
  }
}

}  // namespace specula::dspark
