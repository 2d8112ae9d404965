// SPDX-License-Identifier: Apache-2.0
#include "engine/speculative/sps_profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "engine/core/error.h"

namespace specula::speculative {

std::vector<int64_t> sps_sizes(int64_t max_tokens) {
  if (max_tokens < 1) fail("SPS profile: the largest size must be >= 1, got {}", max_tokens);
  std::vector<int64_t> sizes;
  for (int64_t b = 1; b < max_tokens; b *= 2) sizes.push_back(b);
  sizes.push_back(max_tokens);
  return sizes;
}

SpsTable profile_sps(gemma4::Gemma4Model& target, const SpsProfileOptions& o) {
  if (o.sizes.empty()) fail("SPS profile: no sizes");
  for (size_t i = 0; i < o.sizes.size(); ++i) {
    if (o.sizes[i] < 1 || (i > 0 && o.sizes[i] <= o.sizes[i - 1])) {
      fail("SPS profile: size {} is {} (sizes must be >= 1 and strictly increasing)", i,
           o.sizes[i]);
    }
  }
  if (o.window < 1) fail("SPS profile: window must be >= 1, got {}", o.window);
  if (o.reps < 1) fail("SPS profile: reps must be >= 1, got {}", o.reps);
  if (o.context < 1 || o.context + o.window > target.max_context()) {
    fail("SPS profile: context {} plus a window of {} must fit the target's context of {}",
         o.context, o.window, target.max_context());
  }
  Backend& be = target.backend();
  const int64_t rows = (o.sizes.back() + o.window - 1) / o.window;
  const int vocab = static_cast<int>(target.config().vocab_size);
  // Every row's context: pseudo-random ids away from the special tokens.
  std::vector<int32_t> ids(static_cast<size_t>(o.context + o.window));
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int32_t& id : ids) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int32_t>(3 + (state >> 33) % static_cast<uint64_t>(std::max(1, vocab - 3)));
  }
  std::vector<SequenceKv> kvs;
  kvs.reserve(static_cast<size_t>(rows));
  std::vector<gemma4::ForwardRow> fwd;
  const std::span<const int32_t> ctx(ids.data(), static_cast<size_t>(o.context));
  for (int64_t r = 0; r < rows; ++r) {
    kvs.push_back(target.new_sequence());
    // One prefill per row keeps the forwards small (the context is not timed).
    const gemma4::ForwardRow row{.kv = &kvs.back(), .tokens = ctx, .all_logits = false};
    gemma4::ForwardOptions fo;
    fo.prefill = true;
    target.forward(std::span(&row, 1), fo);
  }
  const std::span<const int32_t> window(ids.data() + o.context, static_cast<size_t>(o.window));
  std::vector<SpsPoint> points;
  std::vector<double> times;
  for (const int64_t B : o.sizes) {
    fwd.clear();
    for (int64_t r = 0, left = B; left > 0; ++r, left -= o.window) {
      const auto n = static_cast<size_t>(std::min<int64_t>(left, o.window));
      fwd.push_back(
          {.kv = &kvs[static_cast<size_t>(r)], .tokens = window.first(n), .all_logits = true});
    }
    times.clear();
    for (int rep = 0; rep <= o.reps; ++rep) {
      be.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      target.forward(fwd);
      be.synchronize();
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) times.push_back(t);  // the first may record a graph or grow scratch
      for (const gemma4::ForwardRow& row : fwd) row.kv->truncate(o.context);
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    points.push_back({.tokens = B, .steps_per_sec = 1.0 / std::max(median, 1e-9)});
    if (o.progress) {
      o.progress(fmt::format("SPS profile: B = {:>5} ({} rows): {:.3f} ms/step", B, fwd.size(),
                             median * 1e3));
    }
  }
  return SpsTable(std::move(points), o.device, o.model);
}

}  // namespace specula::speculative
