// SPDX-License-Identifier: Apache-2.0
// Helpers of the engine tests on either backend (tests/unit/speculative,
// tests/cuda): requests of mixed lengths and settings, and a driver that
// serves them with random arrivals and cancellations and checks that each
// request gets the tokens it gets alone.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/speculative/decoder.h"
#include "engine/speculative/engine.h"

namespace specula::testing {

// n requests of mixed prompt lengths (2..60 tokens, some repeating
// themselves so that ngram drafts are accepted too), max_tokens (1..28),
// sampling settings and per-request draft lengths.
inline std::vector<speculative::DecodeRequest> mixed_requests(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<speculative::DecodeRequest> reqs;
  for (int i = 0; i < n; ++i) {
    speculative::DecodeRequest r;
    const int len = uniform(2, 60);
    const int period = uniform(3, 12);
    for (int j = 0; j < len; ++j) {
      r.prompt.push_back(j >= period && i % 2 == 0 ? r.prompt[static_cast<size_t>(j - period)]
                                                   : uniform(3, vocab - 1));
    }
    r.params.max_tokens = uniform(1, 28);
    switch (i % 4) {
      case 0:
        r.params.temperature = 0.0f;
        break;
      case 1:
        r.params.temperature = 0.8f;
        r.params.top_p = 0.9f;
        break;
      case 2:
        r.params.temperature = 0.0f;
        r.params.repetition_penalty = 1.3f;
        break;
      default:
        r.params.temperature = 1.0f;
        r.params.top_k = 20;
        r.params.frequency_penalty = 0.5f;
        break;
    }
    r.params.seed = 100 + static_cast<uint64_t>(i);
    r.draft_tokens = i % 5 == 4 ? 0 : (i % 3 == 2 ? 2 : -1);
    reqs.push_back(std::move(r));
  }
  return reqs;
}

// Requests arrive at random steps into `engine` (of `rows` rows, so some
// wait), requests 3 and 6 are cancelled a few steps after they arrive; each
// request's tokens must equal alone[i] (a cancelled one: a prefix of them),
// the pool must fill and give every row back.
inline void expect_alone_tokens_under_load(speculative::Engine& engine,
                                           const std::vector<speculative::DecodeRequest>& reqs,
                                           const std::vector<speculative::DecodeResult>& alone,
                                           int rows) {
  const int n = static_cast<int>(reqs.size());
  std::mt19937 rng(11);
  std::vector<int> arrive(n), cancel_at(n, -1);
  for (int i = 0; i < n; ++i)
    arrive[static_cast<size_t>(i)] = std::uniform_int_distribution<int>(0, 12)(rng);
  for (int i : {3, 6})
    cancel_at[static_cast<size_t>(i)] = arrive[static_cast<size_t>(i)] + 1 + i % 3;
  std::map<int64_t, int> request_of;
  std::vector<int64_t> id_of(n, -1);
  std::vector<std::vector<int32_t>> got(n);
  std::vector<std::string> reason(n);
  int finished = 0, most_rows = 0;
  for (int step = 0; finished < n; ++step) {
    ASSERT_LT(step, 2000) << "the engine stopped making progress";
    for (int i = 0; i < n; ++i) {
      if (arrive[static_cast<size_t>(i)] == step) {
        const speculative::Submission s = engine.submit(reqs[static_cast<size_t>(i)]);
        ASSERT_TRUE(s.accepted()) << s.error;
        id_of[static_cast<size_t>(i)] = s.id;
        request_of[s.id] = i;
      }
      if (cancel_at[static_cast<size_t>(i)] == step && reason[static_cast<size_t>(i)].empty()) {
        engine.cancel(id_of[static_cast<size_t>(i)]);
      }
    }
    EXPECT_LE(engine.kv_pool().rows_in_use, rows);
    most_rows = std::max(most_rows, engine.kv_pool().rows_in_use);
    for (const speculative::RequestUpdate& u : engine.step()) {
      const int i = request_of.at(u.id);
      auto& g = got[static_cast<size_t>(i)];
      g.insert(g.end(), u.tokens.begin(), u.tokens.end());
      if (u.finished) {
        reason[static_cast<size_t>(i)] = u.finish_reason;
        ++finished;
      }
    }
  }
  EXPECT_FALSE(engine.has_work());
  EXPECT_EQ(engine.kv_pool().rows_in_use, 0);
  EXPECT_EQ(most_rows, rows) << "the schedule must fill the pool (so that requests wait)";
  for (int i = 0; i < n; ++i) {
    const auto& want = alone[static_cast<size_t>(i)].tokens;
    const auto& g = got[static_cast<size_t>(i)];
    if (reason[static_cast<size_t>(i)] == "cancelled") {
      ASSERT_LE(g.size(), want.size()) << "request " << i;
      EXPECT_TRUE(std::equal(g.begin(), g.end(), want.begin())) << "request " << i;
    } else {
      EXPECT_EQ(g, want) << "request " << i;
      EXPECT_EQ(reason[static_cast<size_t>(i)], alone[static_cast<size_t>(i)].finish_reason);
    }
  }
  EXPECT_EQ(reason[3], "cancelled");
}

}  // namespace specula::testing
