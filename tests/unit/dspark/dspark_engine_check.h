// SPDX-License-Identifier: Apache-2.0
// The DSpark steady-state check (rule: no allocation in steady-state decode),
// shared by the CPU test (tests/unit/dspark/dspark_test.cpp) and the CUDA one
// (tests/cuda/dspark_cuda_test.cpp): an engine of several rows (greedy and
// sampled alternately) decodes with a DSpark drafter; after warm-up steps
// (prefill, the first rounds, which size every arena and buffer), further
// rounds must allocate nothing on the backend (Backend::allocation_count).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/speculative/engine.h"
#include "tests/unit/speculative/sampling_test_util.h"

namespace specula::testing {

struct DSparkSteadyCase {
  int rows = 4;
  int draft_tokens = 4;
  bool host_rounds = false;
  int warm_steps = 8;
  int measured_steps = 8;
};

// Runs the case on `target` with `drafter` over `model`. Expects that every row
// is still decoding through the measured steps and that the model's scratch
// arenas did not grow in them (on the CPU they are host memory, which the
// backend does not count), and returns the backend allocations made in them.
inline int64_t dspark_steady_allocations(gemma4::Gemma4Model& target,
                                         dspark::DSparkDrafter& drafter,
                                         const dspark::DSparkModel& model,
                                         const DSparkSteadyCase& c) {
  const int vocab = target.config().vocab_size;
  speculative::Engine engine(target, &drafter,
                             {.schedule = {.draft_tokens = c.draft_tokens},
                              .max_rows = c.rows,
                              .modes = {.host_rounds = c.host_rounds}});
  std::vector<int64_t> ids;
  for (int i = 0; i < c.rows; ++i) {
    speculative::DecodeRequest r;
    r.prompt = test_prompt(i, vocab);
    // More than the steps can emit: every row decodes through the check.
    r.params.max_tokens = (c.warm_steps + c.measured_steps) * (c.draft_tokens + 1) + 2;
    r.params.stop_token_ids.clear();
    if (i % 2 == 1) {
      r.params.temperature = 0.8f;
      r.params.top_p = 0.9f;
      r.params.seed = 11 + static_cast<uint64_t>(i);
    } else {
      r.params.temperature = 0;
    }
    const speculative::Submission sub = engine.submit(r);
    EXPECT_TRUE(sub.accepted()) << sub.error;
    ids.push_back(sub.id);
  }
  Backend& be = target.backend();
  auto steps = [&](int n) {
    for (int s = 0; s < n; ++s) {
      for (const speculative::RequestUpdate& u : engine.step())
        EXPECT_FALSE(u.finished) << "request " << u.id << " finished during the check";
    }
  };
  steps(c.warm_steps);
  be.synchronize();
  const int64_t before = be.allocation_count();
  const size_t scratch = model.scratch_bytes();
  steps(c.measured_steps);
  be.synchronize();
  const int64_t allocations = be.allocation_count() - before;
  EXPECT_EQ(model.scratch_bytes(), scratch) << "the drafter's scratch grew in steady state";
  // End every request through the engine, so that the drafter releases each
  // sequence before the engine goes (it may serve another engine next).
  for (int64_t id : ids) engine.cancel(id);
  while (engine.has_work()) engine.step();
  return allocations;
}

}  // namespace specula::testing
