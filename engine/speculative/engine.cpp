// SPDX-License-Identifier: Apache-2.0
#include "engine/speculative/engine.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>

#include "engine/sampling/logprobs.h"
#include "engine/sampling/rng.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/speculative.h"
#include "engine/speculative/engine_state.h"

namespace specula::speculative {
namespace {

int64_t row_bytes_of(const KvCacheSpec& spec) {
  return kv_bytes_per_sequence(spec);
}

}  // namespace

// ---------------------------------------------------------------------------
// Setup, admission, bookkeeping

void Engine::State::configure() {
  const EngineOptions& o = options;
  if (o.max_rows < 1) fail("max_rows must be >= 1, got {}", o.max_rows);
  if (o.max_batch_tokens < 0) fail("max_batch_tokens must be >= 0, got {}", o.max_batch_tokens);
  if (o.prefill_chunk < 0) fail("prefill_chunk must be >= 0, got {}", o.prefill_chunk);
  if (!(o.kv_memory >= 0) || !std::isfinite(o.kv_memory)) {
    fail("kv_memory must be a byte count or a fraction in (0, 1], got {}", o.kv_memory);
  }
  if (o.max_waiting < 0) fail("max_waiting must be >= 0, got {}", o.max_waiting);
  const DraftSchedule& schedule = o.schedule;
  if (drafter) {
    if (drafter->vocab_size() != V) {
      fail("the drafter's vocabulary ({}) differs from the target's ({})", drafter->vocab_size(),
           V);
    }
    if (schedule.draft_tokens < 1) fail("draft tokens must be >= 1, got {}", schedule.draft_tokens);
    if (schedule.adaptive && schedule.max_draft_tokens < 1) {
      fail("max draft tokens must be >= 1, got {}", schedule.max_draft_tokens);
    }
    max_k = std::max(schedule.draft_tokens, schedule.adaptive ? schedule.max_draft_tokens : 0);
    if (const int limit = drafter->max_draft_tokens(); limit > 0 && max_k > limit) {
      fail("draft tokens {} exceed the drafter's maximum of {} per round (its block size)", max_k,
           limit);
    }
    if (max_k > target.kv_spec().max_rollback - 1) {
      fail("draft tokens {} exceed what the sliding caches can roll back ({}); raise max_rollback",
           max_k, target.kv_spec().max_rollback - 1);
    }
  }
  const VerifySchedulerOptions& so = o.scheduler;
  if (so.mode != SchedulerMode::kOff) {
    if (!so.sps || so.sps->empty()) fail("the verify scheduler is on but has no SPS table");
    if (so.auto_min_rows < 1) {
      fail("the verify scheduler's auto_min_rows must be >= 1, got {}", so.auto_min_rows);
    }
  }
  scheduling = so.mode != SchedulerMode::kOff && drafter != nullptr &&
               !drafter->proposes_tokens() && drafter->has_confidences();
  if (scheduling) {
    sched_conf.reserve(static_cast<size_t>(o.max_rows) * static_cast<size_t>(max_k));
    sched_all_conf.reserve(static_cast<size_t>(o.max_rows) * static_cast<size_t>(max_k));
    sched_lengths.reserve(static_cast<size_t>(o.max_rows));
  }
  device_drafter = drafter == nullptr || (drafter->takes_device_inputs() && !o.modes.host_rounds);
  needs_hidden = drafter != nullptr && !drafter->proposes_tokens();
  if (drafter) {
    const std::span<const int> taps = drafter->taps();
    tap_layers.assign(taps.begin(), taps.end());
    for (int layer : tap_layers) {
      if (layer < 0 || layer > target.config().num_hidden_layers) {
        fail("the drafter asks for a tap of hidden_states[{}]; the target has {} layers", layer,
             target.config().num_hidden_layers);
      }
    }
  }
  committed.reserve(static_cast<size_t>(o.max_rows));

  row_bytes = row_bytes_of(target.kv_spec());
  max_rows = o.max_rows;
  if (o.kv_memory > 0) {
    double budget = o.kv_memory;
    if (budget <= 1.0) {
      const MemoryInfo mem = be.memory_info();
      budget *= static_cast<double>(mem.free_bytes);
    }
    const auto rows =
        static_cast<int64_t>(budget / static_cast<double>(std::max<int64_t>(1, row_bytes)));
    if (rows < 1) {
      fail("kv_memory of {:.0f} bytes holds no sequence: one needs {} bytes at a context of {}",
           budget, row_bytes, target.max_context());
    }
    max_rows = static_cast<int>(std::min<int64_t>(max_rows, rows));
  }
  slots.resize(static_cast<size_t>(max_rows));
  running.reserve(static_cast<size_t>(max_rows));
  updates.reserve(static_cast<size_t>(max_rows) + 16);
  active.reserve(static_cast<size_t>(max_rows));
  draft_rows.reserve(static_cast<size_t>(max_rows));
  draft_owner.reserve(static_cast<size_t>(max_rows));
  fwd.reserve(static_cast<size_t>(max_rows));
  pos0.reserve(static_cast<size_t>(max_rows));
  prefill_rows.reserve(static_cast<size_t>(max_rows));
  prefill_take.reserve(static_cast<size_t>(max_rows));
  draft_at_ids.reserve(static_cast<size_t>(max_k));
  row_pen_list.reserve(static_cast<size_t>(max_rows));
  prune_rows.reserve(static_cast<size_t>(max_rows));
  prune_owner.reserve(static_cast<size_t>(max_rows));
  prune_drafted.reserve(static_cast<size_t>(max_rows));
  prune_keep.reserve(static_cast<size_t>(max_rows));
  lp_owner.reserve(static_cast<size_t>(lp_cap()));
  lp_rows.reserve(static_cast<size_t>(lp_cap()));
  lp_ids.reserve(static_cast<size_t>(lp_cap()));
  lp_raw_at.reserve(static_cast<size_t>(max_rows));
  if (needs_hidden && device_drafter) {
    hidden_store = DeviceBuffer(be, static_cast<size_t>(3 * max_rows * H) * sizeof(float));
    hidden_idx = DeviceBuffer(be, static_cast<size_t>(3 * max_rows) * sizeof(int32_t));
    hidden_idx_host.resize(static_cast<size_t>(3 * max_rows));
  }
}

std::string Engine::State::check_request(const DecodeRequest& r) const {
  if (r.prompt.empty()) return "the prompt is empty";
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= V) {
      return fmt::format("prompt token {} at position {} is outside the vocabulary [0, {})",
                         r.prompt[i], i, V);
    }
  }
  try {
    r.params.validate();
  } catch (const Error& e) {
    return e.what();
  }
  const int64_t ctx = target.max_context();
  if (static_cast<int64_t>(r.prompt.size()) + r.params.max_tokens > ctx) {
    return fmt::format(
        "prompt of {} tokens plus max_tokens {} exceeds the context size of {} tokens",
        r.prompt.size(), r.params.max_tokens, ctx);
  }
  const int max_top = static_cast<int>(std::min<int64_t>(kMaxTopLogprobs, V));
  if (r.logprobs < -1 || r.logprobs > max_top) {
    return fmt::format("logprobs {} is outside [-1, {}]", r.logprobs, max_top);
  }
  // Without a drafter there is nothing to draft with: any setting means none.
  if (drafter && (r.draft_tokens < -1 || r.draft_tokens > max_k)) {
    return fmt::format("draft_tokens {} is outside [-1, {}] (the engine's maximum draft length)",
                       r.draft_tokens, max_k);
  }
  return {};
}

Row& Engine::State::admit_one(int64_t id, DecodeRequest&& req) {
  size_t slot = 0;
  while (slots[slot]) ++slot;
  auto owned = std::make_unique<Row>();
  Row& r = *owned;
  r.id = id;
  r.slot = slot;
  r.request = std::move(req);
  r.kv.emplace(target.new_sequence());
  r.rng = Rng(r.request.params.seed);
  const SamplingParams& p = r.request.params;
  const size_t history_cap =
      r.request.prompt.size() + static_cast<size_t>(p.max_tokens) + static_cast<size_t>(max_k) + 2;
  r.history.reserve(history_cap);
  r.history.assign(r.request.prompt.begin(), r.request.prompt.end());
  if (drafter) {
    r.k = r.request.draft_tokens < 0 ? options.schedule.draft_tokens : r.request.draft_tokens;
    if (needs_hidden) r.hidden.resize(static_cast<size_t>(H));
    r.drafts.reserve(static_cast<size_t>(max_k));
    r.round_u.reserve(static_cast<size_t>(2 * max_k + 1));
    // Host-sampled rounds keep each draft's distribution q.
    if (!p.greedy() && (!device_drafter || options.modes.host_sampling)) {
      r.q.resize(static_cast<size_t>(max_k) * static_cast<size_t>(V));
    }
  }
  if (p.has_penalties()) r.penalty_list.reserve(history_cap);
  r.result.finish_reason = "length";
  r.result.stats.prompt_tokens = static_cast<int64_t>(r.request.prompt.size());
  r.result.stats.round_drafted.reserve(static_cast<size_t>(p.max_tokens));
  r.result.stats.round_accepted.reserve(static_cast<size_t>(p.max_tokens));
  r.result.tokens.reserve(static_cast<size_t>(p.max_tokens));
  if (r.request.logprobs >= 0) {
    const auto n = static_cast<size_t>(r.request.logprobs);
    r.result.top_logprobs = r.request.logprobs;
    r.result.token_logprobs.reserve(static_cast<size_t>(p.max_tokens));
    r.result.top_ids.reserve(static_cast<size_t>(p.max_tokens) * n);
    r.result.top_values.reserve(static_cast<size_t>(p.max_tokens) * n);
  }
  r.t_admitted = Clock::now();
  slots[slot] = std::move(owned);
  running.push_back(&r);
  return r;
}

void Engine::State::admit() {
  while (!waiting.empty() && static_cast<int>(running.size()) < max_rows) {
    auto [id, req] = std::move(waiting.front());
    waiting.pop_front();
    admit_one(id, std::move(req));
  }
}

// Reports every row's new tokens and ends the finished ones (their caches go
// back to the pool now; the Row lives on until the next step for the views).
void Engine::State::finish_step() {
  for (auto& c : cancelled_waiting) {
    updates.push_back({.id = c->id,
                       .tokens = {},
                       .finished = true,
                       .finish_reason = c->result.finish_reason,
                       .stats = &c->result.stats});
    ended.push_back(std::move(c));
  }
  cancelled_waiting.clear();
  const auto now = Clock::now();
  size_t kept = 0;
  for (Row* r : running) {
    const size_t n = r->result.tokens.size();
    if (n > r->reported || r->done) {
      const DecodeResult& res = r->result;
      RequestUpdate u{
          .id = r->id,
          .tokens = std::span<const int32_t>(res.tokens.data() + r->reported, n - r->reported),
          .finished = r->done,
          .finish_reason = r->done ? res.finish_reason : std::string(),
          .stats = r->done ? &res.stats : nullptr};
      if (r->request.logprobs >= 0) {
        SPECULA_CHECK(res.token_logprobs.size() == n, "request {}: {} logprobs for {} tokens",
                      r->id, res.token_logprobs.size(), n);
        const auto top = static_cast<size_t>(res.top_logprobs);
        u.token_logprobs =
            std::span<const float>(res.token_logprobs.data() + r->reported, n - r->reported);
        u.top_logprobs = res.top_logprobs;
        u.top_ids = std::span<const int32_t>(res.top_ids.data() + r->reported * top,
                                             (n - r->reported) * top);
        u.top_values = std::span<const float>(res.top_values.data() + r->reported * top,
                                              (n - r->reported) * top);
      }
      updates.push_back(u);
      r->reported = n;
    }
    if (r->done) {
      if (drafter) drafter->release(static_cast<int>(r->slot));
      r->result.stats.decode_seconds = r->decoding ? seconds_between(r->t_first_token, now) : 0.0;
      r->kv.reset();
      ended.push_back(std::move(slots[r->slot]));
    } else {
      running[kept++] = r;
    }
  }
  running.resize(kept);
}

Modes Engine::State::modes_for(std::span<Row* const> rows) const {
  Modes m;
  m.device_greedy = std::all_of(rows.begin(), rows.end(), [](const Row* r) {
    return r->request.params.greedy() && !r->request.params.has_penalties();
  });
  m.device_sampling = !m.device_greedy && device_drafter && !options.modes.host_sampling;
  m.use_dev = (m.device_greedy && drafter && device_drafter) || m.device_sampling;
  return m;
}

DeviceRounds& Engine::State::device_rounds(const Modes& m, std::span<Row* const> rows) {
  if (!dev) dev.emplace(be, max_rows, max_k, H, V);
  DeviceRounds& d = *dev;
  d.sampling = m.device_sampling;
  if (d.sampling) d.enable_sampling(be);
  d.pen_on = m.device_sampling && std::any_of(rows.begin(), rows.end(), [](const Row* r) {
               return r->request.params.has_penalties();
             });
  if (d.pen_on) {
    const int64_t per_row = target.max_context() + max_k + 2;
    d.enable_penalties(be, static_cast<int64_t>(max_rows) * per_row);
  }
  return d;
}

// Emits one token for `r`; returns false once the row is finished.
bool Engine::State::emit(Row& r, int32_t token) {
  const SamplingParams& p = r.request.params;
  r.history.push_back(token);
  r.result.tokens.push_back(token);
  ++r.result.stats.generated_tokens;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
      p.stop_token_ids.end()) {
    r.result.finish_reason = "stop";
    r.done = true;
  } else if (static_cast<int>(r.result.tokens.size()) >= p.max_tokens) {
    r.done = true;
  }
  return !r.done;
}

// A token the device could not sample (its distribution held a NaN or no mass).
void Engine::State::check_sampled(const Row& r, int32_t token) const {
  if (token < 0 || token >= V) {
    fail(
        "request {}: sampling on {} failed: the distribution has a NaN, an infinity or no mass "
        "(non-finite logits?)",
        r.id, be.name());
  }
}

// Device outputs are read back into `staging` (grown, never shrunk).
const float* Engine::State::on_host(const Tensor& t, std::vector<float>* staging) {
  if (t.device().is_cpu()) return t.data_as<const float>();
  if (staging->size() < static_cast<size_t>(t.numel()))
    staging->resize(static_cast<size_t>(t.numel()));
  be.download(t, staging->data());
  return staging->data();
}

const int32_t* Engine::State::device_argmax(const Tensor& logits) {
  const int64_t n = logits.dim(0);
  if (argmax_buffer.size() < static_cast<size_t>(n) * sizeof(int32_t)) {
    argmax_buffer = DeviceBuffer(be, static_cast<size_t>(2 * n) * sizeof(int32_t));
    argmax_host.resize(static_cast<size_t>(2 * n));
  }
  const Tensor ids = argmax_buffer.view(DType::kI32, {n});
  be.argmax_rows(logits, ids);
  be.download(ids, argmax_host.data());
  return argmax_host.data();
}

// Device sampling: process the window rows' logits in place into p (params
// from the window section), then accept per row; `n_rows` windows given by
// idx's row offsets; results in `accepted`. `tokens`: i32 [window].
void Engine::State::device_accept(const Tensor& logits, const Tensor& tokens, int64_t n_rows) {
  DeviceRounds& d = *dev;
  const int64_t window = logits.dim(0);
  if (d.penalties()) be.apply_penalties_rows(d.penalty_rows(logits, d.window_at()));
  be.process_logits_rows(logits, d.params_slice(d.window_at(), window), logits);
  be.speculative_accept_rows({.p = logits,
                              .q = d.q_all(),
                              .tokens = tokens,
                              .q_rows = d.idx_slice(d.q_rows_at(), window),
                              .uniforms = d.uniforms_slice(d.window_at(), window),
                              .row_begin = d.idx_slice(d.row_begin_at(), n_rows + 1),
                              .out = d.accepted(n_rows)});
}

void Engine::State::add_taps(gemma4::ForwardOptions& options, int64_t M) {
  if (tap_layers.empty()) return;
  const auto n = static_cast<int64_t>(tap_layers.size());
  if (M > tap_tokens) {
    // Room for the largest verify round too, so that steady-state rounds never grow it.
    tap_tokens = std::max<int64_t>(M, static_cast<int64_t>(max_rows) * (max_k + 1));
    tap_buf = DeviceBuffer(be, static_cast<size_t>(n * tap_tokens * H) * sizeof(float));
  }
  options.tap_layers = tap_layers;
  options.tap_out = tap_buf.view(DType::kF32, {n, M, H});
}

void Engine::State::report_committed(const gemma4::ForwardOptions& options) {
  if (drafter && !committed.empty()) drafter->on_committed(committed, options.tap_out);
}

// ---------------------------------------------------------------------------
// Logprobs

bool Engine::State::any_logprobs(std::span<Row* const> rows) {
  return std::any_of(rows.begin(), rows.end(),
                     [](const Row* r) { return r->request.logprobs >= 0; });
}

Tensor Engine::State::keep_raw_rows(const Tensor& logits, std::span<const int32_t> src_rows) {
  const auto n = static_cast<int64_t>(src_rows.size());
  if (n > lp_raw_rows) {  // grows only (rounds with logprobs alone get here)
    lp_raw_rows = std::max<int64_t>(n, 2 * lp_raw_rows);
    lp_raw = DeviceBuffer(be, static_cast<size_t>(lp_raw_rows * V) * sizeof(float));
    lp_raw_idx = DeviceBuffer(be, static_cast<size_t>(lp_raw_rows) * sizeof(int32_t));
    lp_raw_idx_host.resize(static_cast<size_t>(lp_raw_rows));
  }
  std::copy(src_rows.begin(), src_rows.end(), lp_raw_idx_host.begin());
  const Tensor idx = lp_raw_idx.view(DType::kI32, {n});
  be.upload_async(lp_raw_idx_host.data(), idx);
  const Tensor raw = lp_raw.view(DType::kF32, {n, V});
  be.gather_rows(logits, idx, raw);
  return raw;
}

void Engine::State::lp_add(Row& r, int64_t logits_row, int32_t token) {
  lp_owner.push_back(&r);
  lp_rows.push_back(static_cast<int32_t>(logits_row));
  lp_ids.push_back(token);
}

void Engine::State::lp_finish(const Tensor& logits, const float* host) {
  const auto M = static_cast<int64_t>(lp_owner.size());
  if (M == 0) return;
  if (host != nullptr) {
    // The logits are on the host already (a host path): the host definition.
    std::array<int32_t, kMaxTopLogprobs> top{};
    for (int64_t e = 0; e < M; ++e) {
      Row& r = *lp_owner[static_cast<size_t>(e)];
      const std::span<const float> x(host + lp_rows[static_cast<size_t>(e)] * V,
                                     static_cast<size_t>(V));
      const RowLogSoftmax ls = row_log_softmax(x);
      const int32_t token = lp_ids[static_cast<size_t>(e)];
      r.result.token_logprobs.push_back(ls.at(x[static_cast<size_t>(token)]));
      const std::span<int32_t> ids(top.data(), static_cast<size_t>(r.result.top_logprobs));
      top_logit_ids(x, ids);
      for (int32_t id : ids) {
        r.result.top_ids.push_back(id);
        r.result.top_values.push_back(ls.at(x[static_cast<size_t>(id)]));
      }
    }
    return;
  }
  // On the device: rows and ids up, logprob_rows, and a readback of its own
  // (a second one in the rounds where some row asked; rounds where none did
  // never get here). TODO: fold it into the round's one readback.
  SPECULA_CHECK(M <= lp_cap(), "{} logprob entries, at most {}", M, lp_cap());
  int n = 0;
  for (const Row* r : lp_owner) n = std::max(n, r->result.top_logprobs);
  if (lp_in.size() == 0) {
    const auto words = static_cast<size_t>(lp_cap() * (1 + 2 * kMaxTopLogprobs));
    lp_in = DeviceBuffer(be, static_cast<size_t>(2 * lp_cap()) * sizeof(int32_t));
    lp_out = DeviceBuffer(be, words * sizeof(uint32_t));
    lp_in_host.resize(static_cast<size_t>(2 * lp_cap()));
    lp_out_host.resize(words);
  }
  std::copy(lp_rows.begin(), lp_rows.end(), lp_in_host.begin());
  std::copy(lp_ids.begin(), lp_ids.end(), lp_in_host.begin() + M);
  const Tensor in = lp_in.view(DType::kI32, {2 * lp_cap()});
  be.upload_async(lp_in_host.data(), in.slice_rows(0, 2 * M));
  const int64_t words = M * (1 + 2 * n);
  const Tensor out_i = lp_out.view(DType::kI32, {lp_cap() * (1 + 2 * kMaxTopLogprobs)});
  const Tensor out_f = lp_out.view(DType::kF32, {lp_cap() * (1 + 2 * kMaxTopLogprobs)});
  LogprobRowsParams p{.logits = logits,
                      .rows = in.slice_rows(0, M),
                      .ids = in.slice_rows(M, 2 * M).reshape(Shape{M, 1}),
                      .logprobs = out_f.slice_rows(0, M).reshape(Shape{M, 1})};
  if (n > 0) {
    p.top_ids = out_i.slice_rows(M, M + M * n).reshape(Shape{M, n});
    p.top_values = out_f.slice_rows(M + M * n, words).reshape(Shape{M, n});
  }
  be.logprob_rows(p);
  be.download(out_i.slice_rows(0, words), lp_out_host.data());
  const uint32_t* words_host = lp_out_host.data();
  for (int64_t e = 0; e < M; ++e) {
    Row& r = *lp_owner[static_cast<size_t>(e)];
    r.result.token_logprobs.push_back(std::bit_cast<float>(words_host[e]));
    for (int j = 0; j < r.result.top_logprobs; ++j) {
      r.result.top_ids.push_back(std::bit_cast<int32_t>(words_host[M + e * n + j]));
      r.result.top_values.push_back(std::bit_cast<float>(words_host[M + M * n + e * n + j]));
    }
  }
}

// ---------------------------------------------------------------------------
// Drafter inputs

// Copies rows src_rows of `src` into the hidden store (row j of `rows` to
// store row at + j).
void Engine::State::store_hiddens(const Tensor& src, std::span<Row* const> rows,
                                  std::span<const int64_t> src_rows, int64_t at) {
  const auto n = static_cast<int64_t>(rows.size());
  if (n == 0) return;
  for (int64_t j = 0; j < n; ++j) {
    hidden_idx_host[static_cast<size_t>(at + j)] =
        static_cast<int32_t>(src_rows[static_cast<size_t>(j)]);
  }
  const Tensor idx = hidden_idx.view(DType::kI32, {3 * max_rows}).slice_rows(at, at + n);
  be.upload_async(hidden_idx_host.data() + at, idx);
  const Tensor store = hidden_store.view(DType::kF32, {3 * max_rows, H});
  be.gather_rows(src, idx, store.slice_rows(at, at + n));
  for (int64_t j = 0; j < n; ++j) {
    rows[static_cast<size_t>(j)]->hidden_at = HiddenAt::kStore;
    rows[static_cast<size_t>(j)]->hidden_index = at + j;
  }
}

// Before a forward that would overwrite the last output: rows whose hidden is
// still there move it to the store (region 0).
void Engine::State::spill_last_output() {
  if (!last_hidden_valid) return;
  last_hidden_valid = false;
  spill_rows.clear();
  spill_src.clear();
  for (Row* r : running) {
    if (r->hidden_at != HiddenAt::kLastOutput) continue;
    spill_rows.push_back(r);
    spill_src.push_back(r->hidden_index);
  }
  store_hiddens(last_hidden, spill_rows, spill_src, /*at=*/0);
}

// Brings every active row's hidden where this round's step 0 reads it: for a
// device round, one tensor (the last output when every row is still there,
// else the store) that `round_hidden_src` names; for a host round, each row's
// host copy.
void Engine::State::prepare_round_hiddens(bool dev_round) {
  if (!needs_hidden) return;
  if (!dev_round) {
    for (Row* r : active) {
      if (r->hidden_at == HiddenAt::kHost) continue;
      SPECULA_CHECK(r->hidden_at != HiddenAt::kLastOutput || last_hidden_valid,
                    "request {}: its hidden is in an overwritten output", r->id);
      const Tensor src = r->hidden_at == HiddenAt::kLastOutput
                             ? last_hidden
                             : hidden_store.view(DType::kF32, {3 * max_rows, H});
      be.download(src.slice_rows(r->hidden_index, r->hidden_index + 1), r->hidden.data());
      r->hidden_at = HiddenAt::kHost;
    }
    return;
  }
  const bool all_last =
      last_hidden_valid && std::all_of(active.begin(), active.end(), [](const Row* r) {
        return r->hidden_at == HiddenAt::kLastOutput;
      });
  if (all_last) {
    round_hidden_src = last_hidden;
    return;
  }
  spill_last_output();
  const Tensor store = hidden_store.view(DType::kF32, {3 * max_rows, H});
  for (size_t a = 0; a < active.size(); ++a) {
    Row& r = *active[a];
    if (r.hidden_at != HiddenAt::kHost) continue;
    const int64_t at = 2 * max_rows + static_cast<int64_t>(a);
    be.upload_async(r.hidden.data(), store.slice_rows(at, at + 1));
    r.hidden_at = HiddenAt::kStore;
    r.hidden_index = at;
  }
  round_hidden_src = store;
}

// ---------------------------------------------------------------------------
// Prefill

// Prefills chunks of the admitted prompts in arrival order, within `budget`
// tokens (< 0: no limit); returns the tokens prefilled. With a prefill_chunk
// G, a prompt goes in pieces that end at multiples of G, each its own forward
// (so a piece's bits depend on its own tokens alone, never on the budget or
// the other prompts); a piece is never split, so a step may exceed its budget
// by less than one piece. With G = 0 every row's chunk goes in one forward.
int64_t Engine::State::prefill(int64_t budget) {
  const int64_t G = options.prefill_chunk;
  fresh_hiddens = 0;
  prefill_rows.clear();
  prefill_take.clear();
  int64_t used = 0;
  for (Row* r : running) {
    if (r->decoding || r->done) continue;
    const auto size = static_cast<int64_t>(r->request.prompt.size());
    int64_t at = r->prefilled;
    while (at < size) {
      const int64_t left = size - at;
      int64_t take = G > 0 ? std::min(left, G - at % G) : left;
      if (budget >= 0) {
        if (G == 0) take = std::min(take, budget - used);
        if (take <= 0 || (used > 0 && used + take > budget) || used >= budget) break;
      }
      prefill_rows.push_back(r);
      prefill_take.push_back(take);
      used += take;
      at += take;
      if (G == 0) break;
    }
    if (budget >= 0 && used >= budget) break;
  }
  if (prefill_rows.empty()) return 0;
  spill_last_output();
  final_rows.clear();
  if (G == 0) {
    prefill_forward(prefill_rows, prefill_take);
  } else {
    for (size_t i = 0; i < prefill_rows.size(); ++i) {
      prefill_forward(std::span<Row* const>(&prefill_rows[i], 1),
                      std::span<const int64_t>(&prefill_take[i], 1));
    }
  }
  if (!final_rows.empty()) first_tokens();
  return used;
}

// One prefill forward: rows[i] appends take[i] prompt tokens. The rows it
// completes keep their last logits (for first_tokens, which samples all of a
// step's at once: one readback) and their drafter input.
void Engine::State::prefill_forward(std::span<Row* const> rows, std::span<const int64_t> take) {
  fwd.clear();
  bool any_final = false;
  for (size_t i = 0; i < rows.size(); ++i) {
    Row& r = *rows[i];
    const auto begin = static_cast<size_t>(r.prefilled);
    fwd.push_back({.kv = &*r.kv,
                   .tokens = std::span<const int32_t>(r.request.prompt.data() + begin,
                                                      static_cast<size_t>(take[i])),
                   .all_logits = false});
    any_final |= r.prefilled + take[i] == static_cast<int64_t>(r.request.prompt.size());
  }
  // Prefill may take the backend's fast path (ForwardOptions::prefill; bf16
  // checkpoints only, an f32 one stays exact): on the CPU it is the
  // batch-invariant path itself; on CUDA its bits depend on the forward's
  // rows, which fixed pieces keep to one piece of one prompt.
  gemma4::ForwardOptions options{.compute_logits = any_final, .prefill = true};
  int64_t M = 0;
  committed.clear();
  for (size_t i = 0; i < rows.size(); ++i) {
    committed.push_back({.sequence = static_cast<int>(rows[i]->slot),
                         .position = rows[i]->prefilled,
                         .count = static_cast<int>(take[i]),
                         .tap_row = M});
    M += take[i];
  }
  add_taps(options, M);
  const gemma4::ForwardOutput& out = target.forward(fwd, options);
  last_hidden = out.hidden;
  report_committed(options);
  if (any_final && first_logits.size() == 0) {
    first_logits = DeviceBuffer(be, static_cast<size_t>(max_rows * V) * sizeof(float));
  }
  const Tensor kept = any_final ? first_logits.view(DType::kF32, {max_rows, V}) : Tensor();
  const size_t finals_before = final_rows.size();
  spill_src.clear();
  for (size_t i = 0; i < rows.size(); ++i) {
    Row& r = *rows[i];
    r.prefilled += take[i];
    ++r.result.stats.target_forwards;
    if (r.prefilled != static_cast<int64_t>(r.request.prompt.size())) continue;
    const int64_t out_row = out.row_out_begin[i];
    const auto j = static_cast<int64_t>(final_rows.size());
    be.copy(out.logits.slice_rows(out_row, out_row + 1), kept.slice_rows(j, j + 1));
    final_rows.push_back(&r);
    spill_src.push_back(out_row);
    if (needs_hidden && !device_drafter) {
      be.download(out.hidden.slice_rows(out_row, out_row + 1), r.hidden.data());
      r.hidden_at = HiddenAt::kHost;
    }
  }
  if (needs_hidden && device_drafter) {
    // Region 1 of the store: the step's finished prefills, in order.
    const std::span<Row* const> fresh(final_rows.data() + finals_before,
                                      final_rows.size() - finals_before);
    store_hiddens(out.hidden, fresh, spill_src, max_rows + fresh_hiddens);
    fresh_hiddens += static_cast<int64_t>(fresh.size());
  }
}

// The first token of every row whose prompt this step's prefill completed
// (final_rows[j] owns row j of first_logits), sampled as one batch.
void Engine::State::first_tokens() {
  std::span<Row* const> rows = final_rows;
  const auto n = static_cast<int64_t>(rows.size());
  const Tensor logits_all = first_logits.view(DType::kF32, {max_rows, V}).slice_rows(0, n);
  const Modes m = modes_for(rows);
  const int32_t* ids = nullptr;
  const int32_t* sampled = nullptr;
  const bool logprobs = any_logprobs(rows);
  // Device sampling processes the logits in place: the raw rows of the
  // prompts that asked for logprobs are kept first (lp_raw_at: their rows).
  Tensor lp_src = logits_all;
  if (logprobs && m.device_sampling) {
    lp_rows.clear();
    lp_raw_at.assign(rows.size(), -1);
    for (int64_t i = 0; i < n; ++i) {
      if (rows[static_cast<size_t>(i)]->request.logprobs < 0) continue;
      lp_raw_at[static_cast<size_t>(i)] = static_cast<int64_t>(lp_rows.size());
      lp_rows.push_back(static_cast<int32_t>(i));
    }
    lp_src = keep_raw_rows(logits_all, lp_rows);
  }
  if (m.device_greedy) {
    ids = device_argmax(logits_all);
  } else if (m.device_sampling) {
    // One window row per prompt (its last), k = 0: plain sampling from p.
    DeviceRounds& d = device_rounds(m, rows);
    int32_t* row_begin = d.host_idx.data() + d.row_begin_at();
    for (int64_t i = 0; i <= n; ++i) row_begin[i] = static_cast<int32_t>(i);
    d.pen_lists = 0;
    for (int64_t i = 0; i < n; ++i) {
      Row& r = *rows[static_cast<size_t>(i)];
      d.stage_sample(d.window_at() + i, r.rng, row_sampling_of(r.request.params));
      if (d.penalties()) {
        const int32_t list =
            d.stage_list(r.penalty_list, r.history, r.request.prompt.size(), r.request.params);
        d.stage_penalty_row(d.window_at() + i, list, r.request.params, {});
      }
    }
    be.upload_async(d.host_idx.data(), d.idx_slice(0, d.idx_size()));
    d.upload_sampling(be);
    if (d.penalties()) d.upload_penalties(be);
    device_accept(logits_all, d.ids_slice(0, n), n);
    be.download(d.accepted(n), d.host_ids.data());
    sampled = d.host_ids.data();  // {accepted = 0, token} per prompt
  }
  const float* logits =
      m.device_greedy || m.device_sampling ? nullptr : on_host(logits_all, &logits_host);
  if (logprobs) {
    lp_owner.clear();
    lp_rows.clear();
    lp_ids.clear();
  }
  const auto now = Clock::now();
  for (int64_t i = 0; i < n; ++i) {
    Row& r = *rows[static_cast<size_t>(i)];
    if (m.device_greedy) {
      r.pending = ids[i];
    } else if (m.device_sampling) {
      r.pending = sampled[2 * i + 1];
      check_sampled(r, r.pending);
    } else {
      std::span<const float> row_logits(logits + i * V, static_cast<size_t>(V));
      r.pending = sample_token(row_logits, r.history_view(), r.request.params, ws, r.rng);
    }
    r.decoding = true;
    r.t_first_token = now;
    r.result.stats.prefill_seconds = seconds_between(r.t_admitted, now);
    emit(r, r.pending);
    if (r.request.logprobs >= 0) {
      lp_add(r, m.device_sampling ? lp_raw_at[static_cast<size_t>(i)] : i, r.pending);
    }
  }
  if (logprobs) lp_finish(lp_src, logits);
}

// ---------------------------------------------------------------------------
// Rounds

// Tokens the next round verifies: one window of 1 + k per decoding row.
int64_t Engine::State::round_tokens() const {
  int64_t n = 0;
  for (const Row* r : running) {
    if (!r->decoding || r->done) continue;
    const int remaining = r->request.params.max_tokens - static_cast<int>(r->result.tokens.size());
    n += 1 + std::max(0, std::min(r->k, remaining - 1));
  }
  return n;
}

void Engine::State::run_round() {
  active.clear();
  for (Row* r : running) {
    if (r->decoding && !r->done) active.push_back(r);
  }
  if (active.empty()) return;
  const Modes m = modes_for(active);
  // Draft length per row: never past max_tokens (the round emits k + 1 at most).
  for (Row* r : active) {
    const int remaining = r->request.params.max_tokens - static_cast<int>(r->result.tokens.size());
    r->k_round = drafter ? std::max(0, std::min(r->k, remaining - 1)) : 0;
    r->drafts.clear();
  }
  // A token proposer may propose fewer (its drafts come first: the uniforms
  // below are drawn per draft).
  if (drafter && drafter->proposes_tokens()) propose_drafts();
  int round_k = 0;  // the longest draft of this round
  for (Row* r : active) round_k = std::max(round_k, r->k_round);
  if (m.use_dev) device_rounds(m, active);
  prepare_round_hiddens(m.use_dev);
  // A pruning drafter, and the verify scheduler, cut the drafts before the
  // window is planned: device rounds then upload their plan in two parts,
  // around the draft steps. The scheduler runs after pruning, over what it
  // kept, so the verified length is the min of both.
  const bool prune = round_k > 0 && drafter->prunes() && !drafter->proposes_tokens();
  const bool sched = schedule_round(round_k);
  const bool cut = prune || sched;
  if (m.use_dev) {
    plan_draft_steps(round_k);
    if (!cut) plan_window();
    upload_plan(cut ? PlanPart::kDraftSteps : PlanPart::kWhole);
    draft_on_device(round_k);
    if (cut) {
      if (prune) prune_drafts(/*dev_round=*/true);
      if (sched) schedule_drafts(/*dev_round=*/true);
      plan_window();
      upload_plan(PlanPart::kWindow);
    }
  } else {
    draw_round_uniforms(/*window=*/false);
    if (drafter && !drafter->proposes_tokens()) draft_on_host(m);
    if (prune) prune_drafts(/*dev_round=*/false);
    if (sched) schedule_drafts(/*dev_round=*/false);
    draw_round_uniforms(/*window=*/true);
  }
  accept(verify(m), m);
}

Engine::Engine(gemma4::Gemma4Model& target, Drafter* drafter, const EngineOptions& options)
    : state_(std::make_unique<State>(target, drafter, options)) {
  state_->configure();
}

Engine::~Engine() {
  // Rows still running (or ended but not yet collected) hold drafter state
  // under their slot: hand it back, so that the drafter serves a later engine.
  State& s = *state_;
  if (s.drafter == nullptr) return;
  for (Row* r : s.running) {
    try {
      s.drafter->release(static_cast<int>(r->slot));
    } catch (...) {
      // A destructor must not throw; the drafter's state for this slot is
      // then what it was, as before this hand-back existed.
    }
  }
}

Submission Engine::submit(DecodeRequest request) {
  State& s = *state_;
  std::string error = s.check_request(request);
  if (error.empty() && static_cast<int>(s.waiting.size()) >= s.options.max_waiting) {
    error = fmt::format("the queue is full ({} requests waiting)", s.waiting.size());
  }
  if (!error.empty()) return {.id = -1, .error = std::move(error)};
  const int64_t id = s.next_id++;
  s.waiting.emplace_back(id, std::move(request));
  return {.id = id, .error = {}};
}

bool Engine::cancel(int64_t id) {
  State& s = *state_;
  for (auto it = s.waiting.begin(); it != s.waiting.end(); ++it) {
    if (it->first != id) continue;
    auto row = std::make_unique<Row>();
    row->id = id;
    row->result.finish_reason = "cancelled";
    row->result.stats.prompt_tokens = static_cast<int64_t>(it->second.prompt.size());
    s.waiting.erase(it);
    s.cancelled_waiting.push_back(std::move(row));
    return true;
  }
  for (Row* r : s.running) {
    if (r->id != id || r->done) continue;
    r->done = true;
    r->result.finish_reason = "cancelled";
    r->kv.reset();  // the pool gets the cache back now
    return true;
  }
  return false;
}

std::span<const RequestUpdate> Engine::step() {
  State& s = *state_;
  s.updates.clear();
  s.ended.clear();
  s.admit();
  int64_t budget = s.options.max_batch_tokens > 0 ? s.options.max_batch_tokens : -1;
  // Running rows come first: their round takes its tokens from the budget,
  // prefill chunks what is left.
  if (budget >= 0) budget = std::max<int64_t>(0, budget - s.round_tokens());
  s.run_round();
  s.prefill(budget);
  s.finish_step();
  return s.updates;
}

bool Engine::has_work() const {
  const State& s = *state_;
  return !s.waiting.empty() || !s.running.empty() || !s.cancelled_waiting.empty();
}

KvPoolInfo Engine::kv_pool() const {
  const State& s = *state_;
  KvPoolInfo info;
  info.bytes_per_row = s.row_bytes;
  info.max_rows = s.max_rows;
  info.capacity_bytes = s.row_bytes * s.max_rows;
  for (const Row* r : s.running) {
    if (!r->kv) continue;
    ++info.rows_in_use;
    info.tokens_in_use += r->kv->length();
  }
  info.waiting = static_cast<int>(s.waiting.size());
  return info;
}

int Engine::max_draft_tokens() const {
  return state_->max_k;
}

bool Engine::schedules() const {
  return state_->scheduling;
}

}  // namespace specula::speculative
