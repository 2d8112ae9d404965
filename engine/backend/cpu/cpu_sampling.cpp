// SPDX-License-Identifier: Apache-2.0
// The device sampling ops (process_logits_rows, sample_rows,
// speculative_accept_rows) on the CPU: row by row through the host sampling
// pipeline itself (engine/sampling), so that these ops are by construction
// what the decoder's host path computes, and every other backend is tested
// against them.
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "engine/backend/cpu/cpu_backend.h"
#include "engine/sampling/logprobs.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/speculative.h"

namespace specula {
namespace {

// A workspace for the vocabulary at hand, one per thread, rebuilt only when
// the vocabulary size changes (so steady-state calls allocate nothing).
SamplingWorkspace& workspace_for(int64_t vocab) {
  thread_local std::optional<SamplingWorkspace> ws;
  if (!ws || ws->vocab_size() != vocab) ws.emplace(vocab);
  return *ws;
}

SamplingParams params_of(const int32_t* row) {
  RowSampling rs;
  std::memcpy(static_cast<void*>(&rs), row, sizeof(RowSampling));
  SamplingParams p;
  p.temperature = rs.temperature;
  p.top_k = rs.top_k;
  p.top_p = rs.top_p;
  p.min_p = rs.min_p;
  return p;
}

double uniform_of(const char* op, int64_t bits, int64_t at) {
  if (bits < 0 || bits >= (int64_t{1} << 53)) {
    fail("{}: uniforms[{}] = {} is outside [0, 2^53)", op, at, bits);
  }
  return static_cast<double>(bits) * kUniformScale;
}

}  // namespace

void CpuBackend::process_logits_rows(const Tensor& logits, const Tensor& params,
                                     const Tensor& probs) {
  constexpr const char* kOp = "process_logits_rows";
  cpu::check_host(kOp, "logits", logits);
  cpu::check_host(kOp, "params", params);
  cpu::check_host(kOp, "probs", probs);
  const ops::SamplingRowsDims d = ops::check_process_logits_rows(kOp, logits, params, probs);
  if (d.rows == 0) return;
  SamplingWorkspace& ws = workspace_for(d.vocab);
  const size_t v = static_cast<size_t>(d.vocab);
  for (int64_t m = 0; m < d.rows; ++m) {
    const SamplingParams p = params_of(params.data_as<const int32_t>() + m * 4);
    std::span<const float> row(logits.data_as<const float>() + m * d.vocab, v);
    try {
      p.validate();
      // process_logits reads the row into its workspace first, so probs may be logits.
      const std::span<const float> out = process_logits(row, TokenHistory{}, p, ws);
      std::memcpy(probs.data_as<float>() + m * d.vocab, out.data(), v * sizeof(float));
    } catch (const Error& e) {
      fail("{}: row {}: {}", kOp, m, e.what());
    }
  }
}

void CpuBackend::sample_rows(const Tensor& probs, const Tensor& uniforms, const Tensor& out) {
  constexpr const char* kOp = "sample_rows";
  cpu::check_host(kOp, "probs", probs);
  cpu::check_host(kOp, "uniforms", uniforms);
  cpu::check_host(kOp, "out", out);
  const ops::SamplingRowsDims d = ops::check_sample_rows(kOp, probs, uniforms, out);
  const int64_t* u = uniforms.data_as<const int64_t>();
  for (int64_t m = 0; m < d.rows; ++m) {
    std::span<const float> row(probs.data_as<const float>() + m * d.vocab,
                               static_cast<size_t>(d.vocab));
    const double um = uniform_of(kOp, u[m], m);
    try {
      out.data_as<int32_t>()[m] = sample_at(row, um);
    } catch (const Error& e) {
      fail("{}: row {}: {}", kOp, m, e.what());
    }
  }
}

void CpuBackend::speculative_accept_rows(const SpeculativeAcceptParams& p) {
  constexpr const char* kOp = "speculative_accept_rows";
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"p", &p.p},
                                {"q", &p.q},
                                {"tokens", &p.tokens},
                                {"q_rows", &p.q_rows},
                                {"uniforms", &p.uniforms},
                                {"row_begin", &p.row_begin},
                                {"out", &p.out}}) {
    cpu::check_host(kOp, name, *t);
  }
  const ops::SpeculativeAcceptDims d = ops::check_speculative_accept(kOp, p);
  const int32_t* begin = p.row_begin.data_as<const int32_t>();
  if (begin[0] != 0 || begin[d.rows] != d.window_rows) {
    fail("{}: row_begin must run from 0 to the {} window rows, got {} .. {}", kOp, d.window_rows,
         begin[0], begin[d.rows]);
  }
  const size_t v = static_cast<size_t>(d.vocab);
  auto p_row = [&](int64_t i) {
    return std::span<const float>(p.p.data_as<const float>() + i * d.vocab, v);
  };
  const int32_t* tokens = p.tokens.data_as<const int32_t>();
  const int32_t* q_rows = p.q_rows.data_as<const int32_t>();
  const int64_t* uniforms = p.uniforms.data_as<const int64_t>();
  thread_local std::vector<float> residual;
  thread_local std::vector<double> u;
  residual.resize(v);
  for (int64_t r = 0; r < d.rows; ++r) {
    const int64_t b = begin[r], e = begin[r + 1];
    if (e <= b) fail("{}: row {} has no window rows (row_begin {} .. {})", kOp, r, b, e);
    const int64_t k = e - b - 1;
    try {
      u.clear();
      for (int64_t w = b; w < e; ++w) u.push_back(uniform_of(kOp, uniforms[w], w));
      const WindowVerdict verdict = verify_window(
          std::span<const int32_t>(tokens + b + 1, static_cast<size_t>(k)),
          [&](int j) { return p_row(b + j); },
          [&](int j) {
            const int64_t qr = q_rows[b + 1 + j];
            if (qr < 0 || qr >= d.q_rows) {
              fail("q_rows[{}] = {} is outside [0, {})", b + 1 + j, qr, d.q_rows);
            }
            return std::span<const float>(p.q.data_as<const float>() + qr * d.vocab, v);
          },
          u, residual);
      p.out.data_as<int32_t>()[2 * r] = static_cast<int32_t>(verdict.accepted);
      p.out.data_as<int32_t>()[2 * r + 1] = verdict.next;
    } catch (const Error& err) {
      fail("{}: row {}: {}", kOp, r, err.what());
    }
  }
}

void CpuBackend::apply_penalties_rows(const PenaltyRowsParams& p) {
  constexpr const char* kOp = "apply_penalties_rows";
  for (const ops::NamedTensor& t : ops::penalty_rows_tensors(p))
    cpu::check_host(kOp, t.name, *t.tensor);
  const ops::PenaltyRowsDims d = ops::check_penalty_rows(kOp, p);
  const auto* begin = p.list_begin.data_as<const int32_t>();
  const auto* tokens = p.tokens.data_as<const int32_t>();
  const auto* counts = p.counts.data_as<const int32_t>();
  const auto* pen = p.penalties.data_as<const float>();
  const int32_t* row_list = p.row_list.empty() ? nullptr : p.row_list.data_as<const int32_t>();
  const int32_t* extra_index = d.extras > 0 ? p.extra_index.data_as<const int32_t>() : nullptr;
  const int32_t* extra_source = d.extras > 0 ? p.extra_source.data_as<const int32_t>() : nullptr;
  const int64_t sources = d.extras > 0 ? p.extra_source.dim(0) : 0;
  const int64_t entries = p.tokens.dim(0);
  if (begin[0] != 0) fail("{}: list_begin[0] = {}, want 0", kOp, begin[0]);
  for (int64_t l = 0; l < d.lists; ++l) {
    if (begin[l + 1] < begin[l] || begin[l + 1] > entries) {
      fail("{}: list_begin[{}] = {} must lie in [list_begin[{}] = {}, {}] (tokens {})", kOp, l + 1,
           begin[l + 1], l, begin[l], entries, p.tokens.describe());
    }
  }
  for (int64_t m = 0; row_list != nullptr && m < d.rows; ++m) {
    if (row_list[m] < 0 || row_list[m] >= d.lists) {
      fail("{}: row_list[{}] = {} names no list (there are {})", kOp, m, row_list[m], d.lists);
    }
  }
  for (int64_t i = 0; i < d.rows * d.extras; ++i) {
    const int32_t at = extra_index[i];
    if (at < -1 || at >= sources) {
      fail("{}: extra_index[{}, {}] = {} must be -1 or lie in [0, {}) (extra_source {})", kOp,
           i / d.extras, i % d.extras, at, sources, p.extra_source.describe());
    }
    if (at >= 0 && (extra_source[at] < 0 || extra_source[at] >= d.vocab)) {
      fail("{}: extra_source[{}] = {} (row {}'s extra {}) is outside the vocabulary [0, {})", kOp,
           at, extra_source[at], i / d.extras, i % d.extras, d.vocab);
    }
  }
  // Every entry is checked before any logit changes. Per-token scratch kept
  // per thread (steady-state calls allocate nothing) and left all zero:
  // `seen` marks a list's tokens during the check, and, while a row is
  // penalised, `extra` counts its extras' occurrences (-1 once the token's
  // list entry has taken them).
  thread_local std::vector<uint8_t> seen;
  thread_local std::vector<int32_t> extra;
  if (seen.size() < static_cast<size_t>(d.vocab)) {
    seen.assign(static_cast<size_t>(d.vocab), 0);
    extra.assign(static_cast<size_t>(d.vocab), 0);
  }
  const auto clear_marks = [&](int32_t from, int32_t to) {
    for (int32_t e = from; e < to; ++e) {
      if (tokens[e] >= 0 && tokens[e] < d.vocab) seen[static_cast<size_t>(tokens[e])] = 0;
    }
  };
  for (int64_t l = 0; l < d.lists; ++l) {
    for (int32_t e = begin[l]; e < begin[l + 1]; ++e) {
      const int32_t t = tokens[e];
      const char* problem = t < 0 || t >= d.vocab               ? "is outside the vocabulary"
                            : counts[e] < 0                     ? "has a negative count"
                            : seen[static_cast<size_t>(t)] != 0 ? "is listed twice"
                                                                : nullptr;
      if (problem != nullptr) {
        clear_marks(begin[l], e);
        fail("{}: tokens[{}] = {} (list {}, counts[{}] = {}) {} (vocabulary [0, {}))", kOp, e, t, l,
             e, counts[e], problem, d.vocab);
      }
      seen[static_cast<size_t>(t)] = 1;
    }
    clear_marks(begin[l], begin[l + 1]);
  }
  for (int64_t m = 0; m < d.rows; ++m) {
    float* row = p.logits.data_as<float>() + m * d.vocab;
    const int64_t l = row_list != nullptr ? row_list[m] : m;
    const float repetition = pen[m * 3], presence = pen[m * 3 + 1], frequency = pen[m * 3 + 2];
    const int32_t* row_extras = extra_index != nullptr ? extra_index + m * d.extras : nullptr;
    for (int64_t e = 0; e < d.extras; ++e) {
      if (row_extras[e] >= 0) extra[static_cast<size_t>(extra_source[row_extras[e]])] += 1;
    }
    for (int32_t e = begin[l]; e < begin[l + 1]; ++e) {
      int32_t& more = extra[static_cast<size_t>(tokens[e])];
      const int32_t count = counts[e] + (more > 0 ? more : 0);
      more = -1;  // done: the extras' pass below leaves it alone
      float& x = row[tokens[e]];
      x = penalised_logit(x, count, repetition, presence, frequency);
    }
    for (int64_t e = 0; e < d.extras; ++e) {
      if (row_extras[e] < 0) continue;
      int32_t& more = extra[static_cast<size_t>(extra_source[row_extras[e]])];
      if (more > 0) {  // an extra the list lacks, at its first occurrence
        float& x = row[extra_source[row_extras[e]]];
        x = penalised_logit(x, more, repetition, presence, frequency);
      }
      more = 0;
    }
    // Tokens of the list that no extra named are still marked -1.
    for (int32_t e = begin[l]; e < begin[l + 1]; ++e) extra[static_cast<size_t>(tokens[e])] = 0;
  }
}

void CpuBackend::logprob_rows(const LogprobRowsParams& p) {
  constexpr const char* kOp = "logprob_rows";
  cpu::check_host(kOp, "logits", p.logits);
  cpu::check_host(kOp, "rows", p.rows);
  if (!p.ids.empty()) cpu::check_host(kOp, "ids", p.ids);
  if (!p.logprobs.empty()) cpu::check_host(kOp, "logprobs", p.logprobs);
  if (!p.top_ids.empty()) cpu::check_host(kOp, "top_ids", p.top_ids);
  if (!p.top_values.empty()) cpu::check_host(kOp, "top_values", p.top_values);
  const ops::LogprobRowsDims d = ops::check_logprob_rows(kOp, p);
  cpu::check_ids_below(kOp, "rows", p.rows, d.logit_rows);
  if (d.ids > 0) cpu::check_ids_below(kOp, "ids", p.ids, d.vocab);
  const size_t v = static_cast<size_t>(d.vocab);
  for (int64_t m = 0; m < d.rows; ++m) {
    const int32_t r = p.rows.data_as<const int32_t>()[m];
    std::span<const float> x(p.logits.data_as<const float>() + r * d.vocab, v);
    const RowLogSoftmax ls = row_log_softmax(x);
    for (int64_t c = 0; c < d.ids; ++c) {
      const int32_t id = p.ids.data_as<const int32_t>()[m * d.ids + c];
      p.logprobs.data_as<float>()[m * d.ids + c] = ls.at(x[static_cast<size_t>(id)]);
    }
    if (d.top == 0) continue;
    int32_t* top = p.top_ids.data_as<int32_t>() + m * d.top;
    top_logit_ids(x, std::span<int32_t>(top, static_cast<size_t>(d.top)));
    float* values = p.top_values.data_as<float>() + m * d.top;
    for (int64_t j = 0; j < d.top; ++j) values[j] = ls.at(x[static_cast<size_t>(top[j])]);
  }
}

}  // namespace specula
