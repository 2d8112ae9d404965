// SPDX-License-Identifier: Apache-2.0
// DeviceRounds: the device side of speculative rounds whose tokens never
// leave the device between steps (internal to the engine).
//
// Used for greedy rows without penalties with a drafter that takes device
// inputs, and (device sampling) for rows of any temperature and penalties,
// with or without such a drafter. Each draft step's token lands in `ids` (its
// argmax, or a sample of its processed distribution q, kept in `q`), the next
// step's tokens and the verify window's tokens are gathered from there, and
// ONE download per round brings back every draft and the target's choices
// (greedy: its argmaxes; sampling: each row's accepted count and next token
// from speculative_accept_rows).
//
// Sized once for the engine's capacity: B rows (the most that decode at
// once; a round uses the first `active` of them) and drafts of up to max_k
// tokens. The sampling buffers (q is max_k·B·V floats) are allocated the
// first time a round samples, the penalty buffers the first time a row has
// penalties; neither shrinks, so steady-state rounds allocate nothing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/core/buffer.h"
#include "engine/core/error.h"
#include "engine/ops/backend.h"
#include "engine/sampling/penalty_list.h"
#include "engine/sampling/rng.h"
#include "engine/sampling/sampling_params.h"

namespace specula::speculative {

struct DeviceRounds {
  int64_t B = 0, max_k = 0, V = 0, H = 0;
  bool sampling = false;        // this round samples (set per round; needs enable_sampling)
  bool sampling_ready = false;  // the sampling buffers exist
  // i32 [pending: B | draft step s: B each, max_k of them | verify ids: B·(max_k+1) |
  //      accepted (sampling): B × {n, next}]
  DeviceBuffer ids;
  // i32 [hidden rows: B | step s token gather: B each | verify gather: B·(max_k+1) |
  //      q rows of the window (sampling): B·(max_k+1) | window row offsets: B + 1]
  // The draft steps read [0, window_idx_at()), the verify window the rest
  // (planned after the drafts when the drafter prunes).
  DeviceBuffer idx;
  // i32 [verify tokens: B·(max_k+1) | step s tokens: B each]
  DeviceBuffer gathered;
  DeviceBuffer hidden;  // f32 [B, H]: step 0's target hiddens
  // Sampling only: uniforms i64 and RowSampling rows for [draft step s: B each | window:
  // B·(max_k+1)], and the drafts' distributions q f32 [max_k·B, V] (step s at row s·B).
  DeviceBuffer uniforms, params, q;
  std::vector<int32_t> host_idx;  // staging of `idx`, one upload per round
  std::vector<int32_t> host_pending;
  std::vector<int32_t> host_ids;  // the round's readback: drafts, verify ids, accepted
  std::vector<int64_t> host_uniforms;
  std::vector<RowSampling> host_params;

  DeviceRounds(Backend& be, int64_t rows, int64_t k, int64_t hidden_size, int64_t vocab)
      : B(rows), max_k(k), V(vocab), H(hidden_size) {
    ids = DeviceBuffer(be, static_cast<size_t>(ids_size()) * sizeof(int32_t));
    idx = DeviceBuffer(be, static_cast<size_t>(idx_size()) * sizeof(int32_t));
    gathered = DeviceBuffer(be, static_cast<size_t>(verify_cap() + max_k * B) * sizeof(int32_t));
    hidden = DeviceBuffer(be, static_cast<size_t>(B * H) * sizeof(float));
    host_idx.resize(static_cast<size_t>(idx_size()));
    host_pending.resize(static_cast<size_t>(B));
    host_ids.resize(static_cast<size_t>(ids_size() - B));
    // Zeroed once: the round's one readback spans the whole section, slots
    // this round did not write included (fewer rows or drafts than the
    // capacity), so it never reads uninitialised device memory.
    std::vector<int32_t> zeros(static_cast<size_t>(std::max(ids_size(), idx_size())), 0);
    be.upload(zeros.data(), ids.view(DType::kI32, {ids_size()}));
    be.upload(zeros.data(), idx.view(DType::kI32, {idx_size()}));
  }
  // Allocates the sampling buffers (once; later calls do nothing).
  void enable_sampling(Backend& be) {
    if (sampling_ready) return;
    uniforms = DeviceBuffer(be, static_cast<size_t>(sample_rows()) * sizeof(int64_t));
    params = DeviceBuffer(be, static_cast<size_t>(sample_rows()) * sizeof(RowSampling));
    if (max_k > 0) q = DeviceBuffer(be, static_cast<size_t>(max_k * B * V) * sizeof(float));
    host_uniforms.resize(static_cast<size_t>(sample_rows()));
    host_params.resize(static_cast<size_t>(sample_rows()));
    sampling_ready = true;
  }
  int64_t verify_cap() const { return B * (max_k + 1); }
  int64_t ids_size() const { return B + max_k * B + verify_cap() + 2 * B; }
  int64_t idx_size() const { return B + verify_cap() + max_k * B + verify_cap() + B + 1; }
  int64_t sample_rows() const { return max_k * B + verify_cap(); }
  int64_t draft_at(int64_t s) const { return B + s * B; }               // in ids
  int64_t verify_at() const { return B + max_k * B; }                   // in ids
  int64_t accepted_at() const { return verify_at() + verify_cap(); }    // in ids
  int64_t token_gather_at(int64_t s) const { return B + s * B; }        // in idx
  int64_t window_idx_at() const { return B + max_k * B; }               // in idx
  int64_t q_rows_at() const { return window_idx_at() + verify_cap(); }  // in idx
  int64_t row_begin_at() const { return q_rows_at() + verify_cap(); }   // in idx
  int64_t window_at() const { return max_k * B; }                       // in uniforms / params
  static Tensor slice(const DeviceBuffer& buf, int64_t total, int64_t at, int64_t n) {
    return buf.view(DType::kI32, {total}).slice_rows(at, at + n);
  }
  Tensor ids_slice(int64_t at, int64_t n) const { return slice(ids, ids_size(), at, n); }
  Tensor idx_slice(int64_t at, int64_t n) const { return slice(idx, idx_size(), at, n); }
  Tensor gathered_slice(int64_t at, int64_t n) const {
    return slice(gathered, verify_cap() + max_k * B, at, n);
  }
  Tensor uniforms_slice(int64_t at, int64_t n) const {
    return uniforms.view(DType::kI64, {sample_rows()}).slice_rows(at, at + n);
  }
  Tensor params_slice(int64_t at, int64_t n) const {
    return params.view(DType::kI32, {sample_rows(), 4}).slice_rows(at, at + n);
  }
  // Draft distributions, all steps ([max_k·B, V]; 0 rows without drafts).
  Tensor q_all() const {
    return max_k > 0 ? q.view(DType::kF32, {max_k * B, V}) : ids.view(DType::kF32, {0, V});
  }
  Tensor accepted(int64_t rows) const {
    return ids_slice(accepted_at(), 2 * rows).reshape(Shape{rows, 2});
  }
  // Sampling: row `at` of the uniforms / params sections gets the next uniform
  // of `rng` and the row's settings.
  void stage_sample(int64_t at, Rng& rng, const RowSampling& rs) {
    host_uniforms[static_cast<size_t>(at)] = static_cast<int64_t>(rng.uniform_bits());
    host_params[static_cast<size_t>(at)] = rs;
  }
  // Uploads the round's uniforms and row parameters (sampling): rows [at, at + n)
  // of their sections (default: all).
  void upload_sampling(Backend& be, int64_t at = 0, int64_t n = -1) const {
    if (n < 0) n = sample_rows() - at;
    be.upload_async(host_uniforms.data() + at, uniforms_slice(at, n));
    be.upload_async(host_params.data() + at, params_slice(at, n));
  }

  // Penalties on the device. Each round stages one list per active row (its
  // history's distinct tokens and generated counts: the row's PenaltyList,
  // brought up to the history the host holds, which ends with the pending
  // token) and, for every penalty row, in the sections of the uniforms (draft
  // step s: B each | window: B·(max_k+1)), the row's list, penalties and
  // extras: the drafts before it, as positions in `ids` (PenaltyRowsParams).
  // So draft step s sees the history and d1..ds, window row j the history and
  // d1..dj, as the host path does. Allocated once, like the rest.
  DeviceBuffer pen_begin, pen_tokens, pen_counts, pen_params, pen_row_list, pen_extras;
  std::vector<int32_t> host_pen_begin, host_pen_tokens, host_pen_counts, host_pen_row_list,
      host_pen_extras;
  std::vector<float> host_pen_params;
  bool pen_on = false;     // this round applies penalties (set per round)
  bool pen_ready = false;  // the penalty buffers exist
  int64_t pen_lists = 0;
  // Allocates the penalty buffers for lists of up to `entries` tokens in all
  // (once; later calls do nothing).
  void enable_penalties(Backend& be, int64_t entries) {
    if (pen_ready) return;
    const auto rows = static_cast<size_t>(sample_rows());
    pen_begin = DeviceBuffer(be, static_cast<size_t>(B + 1) * sizeof(int32_t));
    pen_tokens = DeviceBuffer(be, static_cast<size_t>(entries) * sizeof(int32_t));
    pen_counts = DeviceBuffer(be, static_cast<size_t>(entries) * sizeof(int32_t));
    pen_params = DeviceBuffer(be, rows * 3 * sizeof(float));
    pen_row_list = DeviceBuffer(be, rows * sizeof(int32_t));
    host_pen_begin.assign(static_cast<size_t>(B + 1), 0);
    host_pen_tokens.resize(static_cast<size_t>(entries));
    host_pen_counts.resize(static_cast<size_t>(entries));
    host_pen_params.resize(rows * 3);
    host_pen_row_list.assign(rows, 0);
    if (max_k > 0) {
      pen_extras = DeviceBuffer(be, rows * static_cast<size_t>(max_k) * sizeof(int32_t));
      host_pen_extras.assign(rows * static_cast<size_t>(max_k), -1);
    }
    pen_ready = true;
  }
  bool penalties() const { return pen_on; }
  // Appends the next list (returned): when p has penalties, `list` brought up
  // to `history` (whose first num_prompt tokens are the prompt) and staged;
  // else an empty list.
  int32_t stage_list(PenaltyList& list, std::span<const int32_t> history, size_t num_prompt,
                     const SamplingParams& p) {
    SPECULA_CHECK(pen_lists < B, "more than {} penalty lists in a round", B);
    const int32_t start = host_pen_begin[static_cast<size_t>(pen_lists)];
    int32_t n = start;
    if (p.has_penalties()) {
      list.update(history, num_prompt);
      const auto size = static_cast<int32_t>(list.tokens().size());
      SPECULA_CHECK(static_cast<size_t>(start + size) <= host_pen_tokens.size(),
                    "penalty lists outgrew their {} entries", host_pen_tokens.size());
      std::copy(list.tokens().begin(), list.tokens().end(), host_pen_tokens.begin() + start);
      std::copy(list.counts().begin(), list.counts().end(), host_pen_counts.begin() + start);
      n += size;
    }
    host_pen_begin[static_cast<size_t>(++pen_lists)] = n;
    return static_cast<int32_t>(pen_lists - 1);
  }
  // Penalty row `at` (a uniforms-section row) reads `list` under p's
  // penalties (none: 1, 0, 0) and then the tokens at `extras`, positions in
  // `ids` (at most max_k).
  void stage_penalty_row(int64_t at, int32_t list, const SamplingParams& p,
                         std::span<const int32_t> extras) {
    SPECULA_CHECK(static_cast<int64_t>(extras.size()) <= max_k, "{} extras, at most {}",
                  extras.size(), max_k);
    host_pen_row_list[static_cast<size_t>(at)] = list;
    float* pen = host_pen_params.data() + at * 3;
    pen[0] = p.repetition_penalty;
    pen[1] = p.presence_penalty;
    pen[2] = p.frequency_penalty;
    if (max_k == 0) return;
    int32_t* row = host_pen_extras.data() + at * max_k;
    const size_t n = p.has_penalties() ? extras.size() : 0;  // none: extras change nothing
    std::copy_n(extras.begin(), n, row);
    std::fill(row + n, row + max_k, -1);
  }
  // The staged lists and rows, queued for upload; the next round stages anew.
  void upload_penalties(Backend& be) {
    upload_penalty_lists(be);
    upload_penalty_rows(be, 0, sample_rows());
  }
  // The two halves of upload_penalties: the lists, and penalty rows [at, at + n)
  // (a pruning round uploads the window's rows after its drafts).
  void upload_penalty_lists(Backend& be) {
    const int64_t entries = host_pen_begin[static_cast<size_t>(pen_lists)];
    be.upload_async(host_pen_begin.data(), pen_begin.view(DType::kI32, {pen_lists + 1}));
    if (entries > 0) {
      be.upload_async(host_pen_tokens.data(), pen_tokens.view(DType::kI32, {entries}));
      be.upload_async(host_pen_counts.data(), pen_counts.view(DType::kI32, {entries}));
    }
  }
  void upload_penalty_rows(Backend& be, int64_t at, int64_t n) {
    be.upload_async(host_pen_params.data() + at * 3,
                    pen_params.view(DType::kF32, {sample_rows(), 3}).slice_rows(at, at + n));
    be.upload_async(host_pen_row_list.data() + at,
                    pen_row_list.view(DType::kI32, {sample_rows()}).slice_rows(at, at + n));
    if (max_k > 0) {
      be.upload_async(host_pen_extras.data() + at * max_k,
                      pen_extras.view(DType::kI32, {sample_rows(), max_k}).slice_rows(at, at + n));
    }
  }
  // The penalty step of `logits`, whose rows are penalty rows [at, at + rows).
  PenaltyRowsParams penalty_rows(const Tensor& logits, int64_t at) const {
    const int64_t n = logits.dim(0);
    const int64_t entries = host_pen_begin[static_cast<size_t>(pen_lists)];
    PenaltyRowsParams p{
        .logits = logits,
        .list_begin = pen_begin.view(DType::kI32, {pen_lists + 1}),
        .tokens = pen_tokens.view(DType::kI32, {entries}),
        .counts = pen_counts.view(DType::kI32, {entries}),
        .penalties = pen_params.view(DType::kF32, {sample_rows(), 3}).slice_rows(at, at + n),
        .row_list = pen_row_list.view(DType::kI32, {sample_rows()}).slice_rows(at, at + n)};
    if (max_k > 0) {
      p.extra_source = ids.view(DType::kI32, {ids_size()});
      p.extra_index = pen_extras.view(DType::kI32, {sample_rows(), max_k}).slice_rows(at, at + n);
    }
    return p;
  }
};

inline RowSampling row_sampling_of(const SamplingParams& p) {
  return RowSampling{
      .temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p, .min_p = p.min_p};
}

}  // namespace specula::speculative
