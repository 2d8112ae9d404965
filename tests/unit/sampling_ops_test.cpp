// SPDX-License-Identifier: Apache-2.0
// The device sampling ops on the CPU backend (process_logits_rows,
// sample_rows, speculative_accept_rows): the rows, parameters, uniforms and
// window offsets they are handed reach the host pipeline intact, and bad
// input is an Error naming the row or the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/core/buffer.h"
#include "engine/core/error.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/speculative.h"

namespace specula {
namespace {

Backend& cpu() {
  return backend_for(Device::cpu());
}

HostTensor params_tensor(const std::vector<RowSampling>& rows) {
  HostTensor t(DType::kI32, {static_cast<int64_t>(rows.size()), 4});
  std::memcpy(t.view().data(), rows.data(), rows.size() * sizeof(RowSampling));
  return t;
}

HostTensor i64_tensor(const std::vector<int64_t>& v) {
  HostTensor t(DType::kI64, {static_cast<int64_t>(v.size())});
  std::memcpy(t.view().data(), v.data(), v.size() * sizeof(int64_t));
  return t;
}

HostTensor i32_tensor(const std::vector<int32_t>& v) {
  HostTensor t(DType::kI32, {static_cast<int64_t>(v.size())});
  std::memcpy(t.view().data(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

SamplingParams as_params(const RowSampling& rs) {
  SamplingParams p;
  p.temperature = rs.temperature;
  p.top_k = rs.top_k;
  p.top_p = rs.top_p;
  p.min_p = rs.min_p;
  return p;
}

std::span<const float> row_of(const HostTensor& t, int64_t r) {
  const int64_t v = t.shape().dim(1);
  return {t.data<float>() + r * v, static_cast<size_t>(v)};
}

constexpr int64_t kVocab = 300;

TEST(SamplingOps, ProcessLogitsRowsIsTheHostPipelinePerRow) {
  const std::vector<RowSampling> cases = {{.temperature = 0.0f},
                                          {.temperature = 0.7f, .top_k = 20},
                                          {.temperature = 1.0f, .top_p = 0.8f},
                                          {.temperature = 1.2f, .top_k = 50, .min_p = 0.02f}};
  HostTensor logits(DType::kF32, {static_cast<int64_t>(cases.size()), kVocab});
  cpu().fill_uniform(logits, 1, -4.0f, 4.0f);
  HostTensor params = params_tensor(cases);
  HostTensor probs(DType::kF32, logits.shape());
  cpu().process_logits_rows(logits, params, probs);
  SamplingWorkspace ws(kVocab);
  for (size_t r = 0; r < cases.size(); ++r) {
    const auto want =
        process_logits(row_of(logits, static_cast<int64_t>(r)), {}, as_params(cases[r]), ws);
    const auto got = row_of(probs, static_cast<int64_t>(r));
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size_bytes()), 0) << "row " << r;
  }
  // In place gives the same.
  cpu().process_logits_rows(logits, params, logits);
  EXPECT_EQ(std::memcmp(logits.view().data(), probs.view().data(), probs.view().nbytes()), 0);
}

TEST(SamplingOps, BadRowsAndParamsNameTheRow) {
  HostTensor logits(DType::kF32, {2, kVocab});
  cpu().fill_uniform(logits, 2, -1.0f, 1.0f);
  logits.data<float>()[kVocab + 7] = std::numeric_limits<float>::quiet_NaN();
  HostTensor probs(DType::kF32, logits.shape());
  HostTensor ok = params_tensor({{.temperature = 1.0f}, {.temperature = 1.0f}});
  try {
    cpu().process_logits_rows(logits, ok, probs);
    FAIL() << "a NaN logit must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1"), std::string::npos) << e.what();
  }
  logits.data<float>()[kVocab + 7] = 0.0f;
  HostTensor bad = params_tensor({{.temperature = 1.0f}, {.temperature = 1.0f, .top_p = 1.5f}});
  try {
    cpu().process_logits_rows(logits, bad, probs);
    FAIL() << "top_p 1.5 must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_p"), std::string::npos) << e.what();
  }
  HostTensor wrong_shape(DType::kI32, {3, 4});
  EXPECT_THROW(cpu().process_logits_rows(logits, wrong_shape, probs), Error);
  // A uniform outside [0, 2^53).
  HostTensor u = i64_tensor({1, int64_t{1} << 53});
  HostTensor out(DType::kI32, {2});
  cpu().process_logits_rows(logits, ok, probs);
  try {
    cpu().sample_rows(probs, u, out);
    FAIL() << "a uniform of 2^53 must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("uniforms[1]"), std::string::npos) << e.what();
  }
}

TEST(SamplingOps, SampleRowsUsesEachRowsUniform) {
  HostTensor logits(DType::kF32, {3, kVocab});
  cpu().fill_uniform(logits, 3, -2.0f, 2.0f);
  HostTensor probs(DType::kF32, logits.shape());
  cpu().process_logits_rows(logits, params_tensor(std::vector<RowSampling>(3, RowSampling{})),
                            probs);
  const std::vector<int64_t> bits = {0, int64_t{1} << 52, (int64_t{1} << 53) - 1};
  HostTensor out(DType::kI32, {3});
  cpu().sample_rows(probs, i64_tensor(bits), out);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(out.data<int32_t>()[r],
              sample_at(row_of(probs, r),
                        static_cast<double>(bits[static_cast<size_t>(r)]) * kUniformScale))
        << r;
  }
}

// Two rows: row 0 with 2 drafts (q rows 1 and 0: out of order on purpose),
// row 1 with none. Whatever the uniforms, the op's verdict is the host rule's.
TEST(SamplingOps, SpeculativeAcceptRowsFollowsTheHostRule) {
  HostTensor p_logits(DType::kF32, {4, kVocab}), q_logits(DType::kF32, {2, kVocab});
  cpu().fill_uniform(p_logits, 4, -2.0f, 2.0f);
  cpu().fill_uniform(q_logits, 5, -2.0f, 2.0f);
  HostTensor p(DType::kF32, p_logits.shape()), q(DType::kF32, q_logits.shape());
  cpu().process_logits_rows(p_logits, params_tensor(std::vector<RowSampling>(4, RowSampling{})), p);
  cpu().process_logits_rows(q_logits, params_tensor(std::vector<RowSampling>(2, RowSampling{})), q);
  const std::vector<int32_t> tokens = {9, 17, 250, 4};
  const std::vector<int32_t> q_rows = {0, 1, 0, 0};
  const std::vector<int32_t> begin = {0, 3, 4};
  std::vector<float> residual(kVocab);
  for (int64_t trial = 0; trial < 50; ++trial) {
    Rng rng(static_cast<uint64_t>(trial));
    std::vector<int64_t> bits;
    for (int j = 0; j < 4; ++j) bits.push_back(static_cast<int64_t>(rng.uniform_bits()));
    // Small uniforms accept more often: spread them over [0, 1).
    bits[0] >>= trial % 8;
    bits[1] >>= trial % 5;
    HostTensor out(DType::kI32, {2, 2});
    cpu().speculative_accept_rows({.p = p,
                                   .q = q,
                                   .tokens = i32_tensor(tokens),
                                   .q_rows = i32_tensor(q_rows),
                                   .uniforms = i64_tensor(bits),
                                   .row_begin = i32_tensor(begin),
                                   .out = out});
    auto u = [&](int i) {
      return static_cast<double>(bits[static_cast<size_t>(i)]) * kUniformScale;
    };
    // Row 0 by hand.
    int n = 0;
    int32_t next = -1;
    for (; n < 2; ++n) {
      const auto qr = row_of(q, q_rows[static_cast<size_t>(n + 1)]);
      if (!accept_draft(row_of(p, n), qr, tokens[static_cast<size_t>(n + 1)], u(n))) {
        residual_distribution(row_of(p, n), qr, residual);
        next = sample_at(residual, u(2));
        break;
      }
    }
    if (n == 2) next = sample_at(row_of(p, 2), u(2));
    EXPECT_EQ(out.data<int32_t>()[0], n) << trial;
    EXPECT_EQ(out.data<int32_t>()[1], next) << trial;
    EXPECT_EQ(out.data<int32_t>()[2], 0) << trial;
    EXPECT_EQ(out.data<int32_t>()[3], sample_at(row_of(p, 3), u(3))) << trial;
  }
  // A q row out of range, and offsets that do not cover the window (the
  // tensors are named: a view of a temporary would dangle).
  HostTensor out(DType::kI32, {2, 2});
  const HostTensor tokens_t = i32_tensor(tokens), good_q_rows = i32_tensor(q_rows);
  const HostTensor bad_q_rows = i32_tensor({0, 1, 5, 0});
  const HostTensor uniforms_t = i64_tensor({1, 2, 3, 4});
  const HostTensor good_begin = i32_tensor(begin), short_begin = i32_tensor({0, 3, 3});
  SpeculativeAcceptParams bad{.p = p,
                              .q = q,
                              .tokens = tokens_t,
                              .q_rows = bad_q_rows,
                              .uniforms = uniforms_t,
                              .row_begin = good_begin,
                              .out = out};
  EXPECT_THROW(cpu().speculative_accept_rows(bad), Error);
  bad.q_rows = good_q_rows;
  bad.row_begin = short_begin;
  EXPECT_THROW(cpu().speculative_accept_rows(bad), Error);
}

HostTensor f32_tensor(const std::vector<float>& v, Shape shape) {
  HostTensor t(DType::kF32, shape);
  std::memcpy(t.view().data(), v.data(), v.size() * sizeof(float));
  return t;
}

// apply_penalties_rows with lists built from histories gives each row the
// host pipeline's penalised logits bit for bit (process_logits' step 1, read
// back through SamplingWorkspace::penalised_logits), -inf logits included.
TEST(SamplingOps, ApplyPenaltiesRowsIsTheHostPenaltyStep) {
  struct Row {
    std::vector<int32_t> history;
    size_t num_prompt;
    float repetition, presence, frequency;
  };
  const std::vector<Row> rows = {
      {{5, 9, 5, 17, 9, 9, 2}, 3, 1.3f, 0.5f, 0.75f},  // prompt and generated repeats
      {{1, 2, 3}, 3, 1.0f, 0.0f, 0.0f},                // no penalties: an empty list
      {{7, 7, 7, 7}, 1, 0.8f, -0.5f, 1.25f},           // repetition < 1, negative presence
      {{4, 11}, 0, 1.5f, 0.0f, 0.0f},                  // all generated, repetition only
  };
  const auto n = static_cast<int64_t>(rows.size());
  HostTensor logits(DType::kF32, {n, kVocab});
  cpu().fill_uniform(logits, 3, -4.0f, 4.0f);
  logits.data<float>()[0 * kVocab + 9] = -std::numeric_limits<float>::infinity();
  logits.data<float>()[2 * kVocab + 7] = 0.0f;
  std::vector<int32_t> begin = {0}, tokens, counts;
  std::vector<float> penalties;
  for (const Row& r : rows) {
    const bool on = r.repetition != 1.0f || r.presence != 0.0f || r.frequency != 0.0f;
    for (size_t i = 0; on && i < r.history.size(); ++i) {
      const auto it = std::find(tokens.begin() + begin.back(), tokens.end(), r.history[i]);
      size_t e = static_cast<size_t>(it - tokens.begin());
      if (it == tokens.end()) {
        tokens.push_back(r.history[i]);
        counts.push_back(0);
      }
      if (i >= r.num_prompt) ++counts[e];
    }
    begin.push_back(static_cast<int32_t>(tokens.size()));
    penalties.insert(penalties.end(), {r.repetition, r.presence, r.frequency});
  }
  HostTensor want_source(DType::kF32, logits.shape());
  std::memcpy(want_source.view().data(), logits.view().data(), logits.view().nbytes());
  const HostTensor b = i32_tensor(begin), t = i32_tensor(tokens), c = i32_tensor(counts);
  const HostTensor pen = f32_tensor(penalties, {n, 3});
  cpu().apply_penalties_rows(
      {.logits = logits, .list_begin = b, .tokens = t, .counts = c, .penalties = pen});
  SamplingWorkspace ws(kVocab);
  for (int64_t m = 0; m < n; ++m) {
    const Row& r = rows[static_cast<size_t>(m)];
    SamplingParams p;
    p.temperature = 1.0f;
    p.repetition_penalty = r.repetition;
    p.presence_penalty = r.presence;
    p.frequency_penalty = r.frequency;
    process_logits(row_of(want_source, m), {.tokens = r.history, .num_prompt = r.num_prompt}, p,
                   ws);
    const auto want = ws.penalised_logits();
    const auto got = row_of(logits, m);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size_bytes()), 0) << "row " << m;
  }
  EXPECT_NE(std::memcmp(logits.view().data(), want_source.view().data(), logits.view().nbytes()),
            0);
}

// Rows sharing lists (row_list) and reading extras (drafts on the device,
// extra_index into extra_source) are penalised as the host pipeline penalises
// the whole history, list then extras, bit for bit: extras the list holds
// (generated or prompt-only), extras it lacks, an extra repeated, -1 padding,
// a row without extras, an empty list.
TEST(SamplingOps, ApplyPenaltiesRowsSharedListsAndExtrasAreTheWholeHistory) {
  struct List {
    std::vector<int32_t> history;
    size_t num_prompt;
  };
  const std::vector<List> lists = {{{5, 9, 5, 17, 9, 9, 2}, 3}, {{8}, 1}, {{}, 0}};
  const std::vector<int32_t> source = {-7, 9, 40, 40, 17, 8, 5, 2, 123};  // -7: never indexed
  struct Row {
    int32_t list;
    std::vector<int32_t> extras;  // positions in source, -1 = none
    float repetition, presence, frequency;
  };
  const std::vector<Row> rows = {
      {0, {-1, -1, -1}, 1.3f, 0.5f, 0.75f},  // no extras
      {0, {1, -1, -1}, 1.3f, 0.5f, 0.75f},   // a generated token again
      {0, {1, 2, 3}, 1.3f, 0.5f, 0.75f},     // and a new one twice
      {0, {6, 4, 8}, 0.8f, -0.5f, 1.25f},    // a prompt-only token, a generated one, a new one
      {1, {5, 5, 7}, 1.5f, 0.0f, 0.0f},      // the list's prompt token twice
      {2, {2, 7, -1}, 1.1f, 2.0f, -2.0f},    // an empty list
  };
  const auto n = static_cast<int64_t>(rows.size());
  constexpr int64_t kExtras = 3;
  HostTensor logits(DType::kF32, {n, kVocab});
  cpu().fill_uniform(logits, 9, -4.0f, 4.0f);
  logits.data<float>()[1 * kVocab + 9] = -std::numeric_limits<float>::infinity();
  HostTensor want_source(DType::kF32, logits.shape());
  std::memcpy(want_source.view().data(), logits.view().data(), logits.view().nbytes());
  std::vector<int32_t> begin = {0}, tokens, counts, row_list, extra_index;
  for (const List& l : lists) {
    for (size_t i = 0; i < l.history.size(); ++i) {
      const auto it = std::find(tokens.begin() + begin.back(), tokens.end(), l.history[i]);
      const auto e = static_cast<size_t>(it - tokens.begin());
      if (it == tokens.end()) {
        tokens.push_back(l.history[i]);
        counts.push_back(0);
      }
      if (i >= l.num_prompt) ++counts[e];
    }
    begin.push_back(static_cast<int32_t>(tokens.size()));
  }
  std::vector<float> penalties;
  for (const Row& r : rows) {
    row_list.push_back(r.list);
    extra_index.insert(extra_index.end(), r.extras.begin(), r.extras.end());
    penalties.insert(penalties.end(), {r.repetition, r.presence, r.frequency});
  }
  const HostTensor b = i32_tensor(begin), t = i32_tensor(tokens), c = i32_tensor(counts);
  const HostTensor rl = i32_tensor(row_list), src = i32_tensor(source);
  HostTensor ei = i32_tensor(extra_index);
  const HostTensor pen = f32_tensor(penalties, {n, 3});
  cpu().apply_penalties_rows({.logits = logits,
                              .list_begin = b,
                              .tokens = t,
                              .counts = c,
                              .penalties = pen,
                              .row_list = rl,
                              .extra_source = src,
                              .extra_index = ei.view().reshape(Shape{n, kExtras})});
  SamplingWorkspace ws(kVocab);
  for (int64_t m = 0; m < n; ++m) {
    const Row& r = rows[static_cast<size_t>(m)];
    const List& l = lists[static_cast<size_t>(r.list)];
    std::vector<int32_t> history = l.history;
    for (int32_t at : r.extras) {
      if (at >= 0) history.push_back(source[static_cast<size_t>(at)]);
    }
    SamplingParams p;
    p.temperature = 1.0f;
    p.repetition_penalty = r.repetition;
    p.presence_penalty = r.presence;
    p.frequency_penalty = r.frequency;
    process_logits(row_of(want_source, m), {.tokens = history, .num_prompt = l.num_prompt}, p, ws);
    const auto want = ws.penalised_logits();
    const auto got = row_of(logits, m);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size_bytes()), 0) << "row " << m;
  }
}

TEST(SamplingOps, ApplyPenaltiesRowsRejectsBadRowListsAndExtrasNamingThem) {
  HostTensor logits(DType::kF32, {2, kVocab});
  cpu().fill_uniform(logits, 4, -1.0f, 1.0f);
  HostTensor before(DType::kF32, logits.shape());
  std::memcpy(before.view().data(), logits.view().data(), logits.view().nbytes());
  const HostTensor pen = f32_tensor({1.2f, 0.1f, 0.2f, 1.2f, 0.1f, 0.2f}, {2, 3});
  const HostTensor b = i32_tensor({0, 2}), t = i32_tensor({4, 5}), c = i32_tensor({0, 1});
  const HostTensor src = i32_tensor({7, kVocab, 9});
  const auto expect_error = [&](const std::vector<int32_t>& row_list,
                                const std::vector<int32_t>& extras, const std::string& needle) {
    const HostTensor rl = i32_tensor(row_list);
    HostTensor ei = i32_tensor(extras);
    try {
      cpu().apply_penalties_rows({.logits = logits,
                                  .list_begin = b,
                                  .tokens = t,
                                  .counts = c,
                                  .penalties = pen,
                                  .row_list = rl,
                                  .extra_source = src,
                                  .extra_index = ei.view().reshape(Shape{2, 2})});
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(std::memcmp(logits.view().data(), before.view().data(), logits.view().nbytes()), 0)
        << needle;
  };
  expect_error({0, 1}, {0, -1, -1, -1}, "row_list[1] = 1 names no list");
  expect_error({0, -1}, {0, -1, -1, -1}, "row_list[1] = -1");
  expect_error({0, 0}, {0, -1, 3, -1}, "extra_index[1, 0] = 3");
  expect_error({0, 0}, {0, -2, -1, -1}, "extra_index[0, 1] = -2");
  expect_error({0, 0}, {0, -1, -1, 1}, "extra_source[1] = 300");
  // Without a row_list, one list per row is required.
  try {
    cpu().apply_penalties_rows(
        {.logits = logits, .list_begin = b, .tokens = t, .counts = c, .penalties = pen});
    ADD_FAILURE() << "one list for two rows accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("without a row_list"), std::string::npos) << e.what();
  }
}

TEST(SamplingOps, ApplyPenaltiesRowsRejectsBadListsNamingTheEntry) {
  HostTensor logits(DType::kF32, {2, kVocab});
  cpu().fill_uniform(logits, 4, -1.0f, 1.0f);
  HostTensor before(DType::kF32, logits.shape());
  std::memcpy(before.view().data(), logits.view().data(), logits.view().nbytes());
  const HostTensor pen = f32_tensor({1.2f, 0.1f, 0.2f, 1.2f, 0.1f, 0.2f}, {2, 3});
  const auto expect_error = [&](const std::vector<int32_t>& begin,
                                const std::vector<int32_t>& tokens,
                                const std::vector<int32_t>& counts, const std::string& needle) {
    const HostTensor b = i32_tensor(begin), t = i32_tensor(tokens), c = i32_tensor(counts);
    try {
      cpu().apply_penalties_rows(
          {.logits = logits, .list_begin = b, .tokens = t, .counts = c, .penalties = pen});
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    // Nothing changed: every entry is checked before any logit is.
    EXPECT_EQ(std::memcmp(logits.view().data(), before.view().data(), logits.view().nbytes()), 0)
        << needle;
  };
  expect_error({0, 1, 3}, {4, 5, kVocab}, {0, 1, 0}, "tokens[2] = 300");
  expect_error({0, 2, 3}, {4, 4, 6}, {0, 1, 0}, "is listed twice");
  expect_error({0, 1, 2}, {4, 5}, {0, -1}, "negative count");
  expect_error({0, 2, 1}, {4, 5}, {0, 1}, "list_begin[2] = 1");
  expect_error({1, 1, 2}, {4, 5}, {0, 1}, "list_begin[0] = 1");
  expect_error({0, 2}, {4, 5}, {0, 1}, "list_begin");  // one entry short of M + 1
  // The same token in two rows is fine (lists are per row).
  const HostTensor b = i32_tensor({0, 1, 2}), t = i32_tensor({4, 4}), c = i32_tensor({1, 1});
  EXPECT_NO_THROW(cpu().apply_penalties_rows(
      {.logits = logits, .list_begin = b, .tokens = t, .counts = c, .penalties = pen}));
}

}  // namespace
}  // namespace specula
