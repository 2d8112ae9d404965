// SPDX-License-Identifier: Apache-2.0
// Profiles SPS(B), the verify steps per second of the target at B tokens, on
// the device the target runs on: the cost table of the verify scheduler
// (EngineOptions::scheduler, engine/speculative/verify_scheduler.h). The paper
// profiles it once at start-up; the CLI caches the table in a JSON file.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/model/gemma4/gemma4.h"
#include "engine/speculative/verify_scheduler.h"

namespace specula::speculative {

struct SpsProfileOptions {
  // The B values (verify tokens of all rows together): strictly increasing, >= 1.
  std::vector<int64_t> sizes;
  // Tokens per row's verify window (k + 1): B tokens run as ⌈B / window⌉ rows,
  // the last one shorter, as a round of that many rows verifies them.
  int window = 9;
  // Positions each row's cache holds before its window (attention's reach).
  int64_t context = 256;
  int reps = 3;  // timed forwards per size (the median counts), after one untimed
  // Called once per size with a progress line (may be empty).
  std::function<void(const std::string&)> progress;
  // What the table records as profiled (SpsTable::device / model).
  std::string device, model;
};

// Times target forwards of every size (all logits, as a verify window asks)
// and returns the table. The rows' caches come from the target's pool and go
// back to it. Throws Error for bad options (naming the field and value) or a
// size whose rows do not fit the context.
SpsTable profile_sps(gemma4::Gemma4Model& target, const SpsProfileOptions& options);

// 1, 2, 4, 8, ... below max_tokens, then max_tokens (>= 1).
std::vector<int64_t> sps_sizes(int64_t max_tokens);

}  // namespace specula::speculative
