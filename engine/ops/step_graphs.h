// SPDX-License-Identifier: Apache-2.0
// StepGraphCache: recorded steps (Backend::begin_capture) by shape, for the
// callers that replay decode steps, verify windows and draft steps.
//
// A step is run directly the first time its key is seen (which also sizes every
// scratch buffer a recording must not grow), recorded and replayed the second
// time, and replayed from then on. A graph the backend reports stale (its
// scratch moved) is recorded again. The key must capture everything the
// recorded launches depend on (shapes, buffers, caches); what changes from step
// to step must live in device memory. Not thread-safe (like the forwards using it).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "engine/ops/backend.h"

namespace specula {

class StepGraphCache {
 public:
  // At most `max_graphs` keys are kept; past that the cache starts over.
  explicit StepGraphCache(size_t max_graphs = 64) : max_graphs_(max_graphs) {}

  // Runs `step` (a callable returning the step's output view, possibly empty)
  // for `key` on `be` as described above; returns that output (on a replay, the
  // one the recording returned: views into the same buffers).
  template <typename Step>
  Tensor run(Backend& be, const std::vector<int64_t>& key, Step&& step) {
    if (graphs_.size() >= max_graphs_ && graphs_.find(key) == graphs_.end()) graphs_.clear();
    Entry& e = graphs_[key];
    ++e.seen;
    if (e.graph != nullptr && be.replay(*e.graph)) {
      ++replays_;
      return e.output;
    }
    if (e.seen < 2 && e.graph == nullptr) return step();
    e.graph.reset();
    be.begin_capture();
    try {
      e.output = step();
    } catch (...) {
      abandon_capture(be);
      throw;
    }
    e.graph = be.end_capture();
    if (!be.replay(*e.graph)) fail("a step graph went stale as soon as it was recorded");
    ++replays_;
    return e.output;
  }

  void clear() { graphs_.clear(); }
  // Steps that ran as a replayed graph so far (for tests and benchmarks).
  int64_t replays() const { return replays_; }

 private:
  struct Entry {
    int64_t seen = 0;
    std::unique_ptr<StepGraph> graph;
    Tensor output;
  };
  // Ends a capture a failing step left open (the step's error is what counts).
  static void abandon_capture(Backend& be) noexcept {
    try {
      be.end_capture();
    } catch (...) {
    }
  }

  size_t max_graphs_;
  std::map<std::vector<int64_t>, Entry> graphs_;
  int64_t replays_ = 0;
};

}  // namespace specula
