// SPDX-License-Identifier: Apache-2.0
#include "engine/spec/decoder.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "engine/sampling/rng.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/speculative.h"

namespace specula::spec {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Everything the loop keeps per request.
struct Row {
  const DecodeRequest* request = nullptr;
  SequenceKv kv;
  Rng rng;
  std::vector<int32_t>
      history;          // prompt + generated (+ the drafts of the current round, popped after)
  int32_t pending = 0;  // emitted, not yet in the target cache
  std::vector<float> hidden;    // target post-norm hidden that produced `pending`
  int k = 0;                    // draft length of the next round
  int k_round = 0;              // draft length of the current round
  std::vector<int32_t> drafts;  // [k_round]
  std::vector<float> q;         // [k_round, V] processed proposals (sampling rows)
  bool done = false;
  DecodeResult result;
};

void validate(const gemma4::Gemma4Model& target, Drafter* drafter,
              std::span<const DecodeRequest> requests, const DraftSchedule& schedule) {
  if (requests.empty()) fail("decode: no requests");
  const int64_t ctx = target.max_context();
  for (size_t i = 0; i < requests.size(); ++i) {
    const DecodeRequest& r = requests[i];
    if (r.prompt.empty()) fail("request {}: the prompt is empty", i);
    r.params.validate();
    if (static_cast<int64_t>(r.prompt.size()) + r.params.max_tokens > ctx) {
      fail(
          "request {}: prompt of {} tokens plus max_tokens {} exceeds the context size of {} "
          "tokens",
          i, r.prompt.size(), r.params.max_tokens, ctx);
    }
  }
  if (drafter) {
    if (drafter->vocab_size() != target.config().vocab_size) {
      fail("the drafter's vocabulary ({}) differs from the target's ({})", drafter->vocab_size(),
           target.config().vocab_size);
    }
    const int max_k =
        std::max(schedule.draft_tokens, schedule.adaptive ? schedule.max_draft_tokens : 0);
    if (schedule.draft_tokens < 1) fail("draft tokens must be >= 1, got {}", schedule.draft_tokens);
    if (schedule.adaptive && schedule.max_draft_tokens < 1) {
      fail("max draft tokens must be >= 1, got {}", schedule.max_draft_tokens);
    }
    if (max_k > target.kv_spec().max_rollback - 1) {
      fail("draft tokens {} exceed what the sliding caches can roll back ({}); raise max_rollback",
           max_k, target.kv_spec().max_rollback - 1);
    }
  }
}

}  // namespace

void DecodeStats::merge(const DecodeStats& o) {
  prompt_tokens += o.prompt_tokens;
  generated_tokens += o.generated_tokens;
  target_forwards += o.target_forwards;
  rounds += o.rounds;
  drafted += o.drafted;
  accepted += o.accepted;
  if (drafted_at.size() < o.drafted_at.size()) drafted_at.resize(o.drafted_at.size());
  if (accepted_at.size() < o.accepted_at.size()) accepted_at.resize(o.accepted_at.size());
  for (size_t i = 0; i < o.drafted_at.size(); ++i) drafted_at[i] += o.drafted_at[i];
  for (size_t i = 0; i < o.accepted_at.size(); ++i) accepted_at[i] += o.accepted_at[i];
  prefill_seconds = std::max(prefill_seconds, o.prefill_seconds);
  decode_seconds = std::max(decode_seconds, o.decode_seconds);
}

std::vector<DecodeResult> decode(gemma4::Gemma4Model& target, Drafter* drafter,
                                 std::span<const DecodeRequest> requests,
                                 const DraftSchedule& schedule, const TokenCallback& on_tokens) {
  validate(target, drafter, requests, schedule);
  const int64_t V = target.config().vocab_size;
  const int64_t H = target.config().hidden_size;
  const int max_k =
      drafter ? std::max(schedule.draft_tokens, schedule.adaptive ? schedule.max_draft_tokens : 0)
              : 0;

  std::vector<Row> rows;
  rows.reserve(requests.size());
  for (const DecodeRequest& req : requests) {
    Row r{.request = &req, .kv = target.new_sequence(), .rng = Rng(req.params.seed), .history = {}};
    r.history.reserve(req.prompt.size() + static_cast<size_t>(req.params.max_tokens) +
                      static_cast<size_t>(max_k) + 2);
    r.history.assign(req.prompt.begin(), req.prompt.end());
    r.hidden.resize(static_cast<size_t>(H));
    r.k = drafter ? schedule.draft_tokens : 0;
    r.drafts.reserve(static_cast<size_t>(max_k));
    if (drafter && !req.params.greedy())
      r.q.resize(static_cast<size_t>(max_k) * static_cast<size_t>(V));
    r.result.finish_reason = "length";
    r.result.stats.prompt_tokens = static_cast<int64_t>(req.prompt.size());
    r.result.stats.round_drafted.reserve(static_cast<size_t>(req.params.max_tokens));
    r.result.stats.round_accepted.reserve(static_cast<size_t>(req.params.max_tokens));
    rows.push_back(std::move(r));
  }
  // Device outputs are read back once per forward into these (grown, never shrunk).
  Backend& be = target.backend();
  std::vector<float> logits_host, hidden_host, draft_logits_host;
  auto on_host = [&](const Tensor& t, std::vector<float>* staging) -> const float* {
    if (t.device().is_cpu()) return t.data_as<const float>();
    if (staging->size() < static_cast<size_t>(t.numel()))
      staging->resize(static_cast<size_t>(t.numel()));
    be.download(t, staging->data());
    return staging->data();
  };
  // Greedy rows without penalties on a device: the argmax runs there and only
  // token ids come back (not [rows, V] logits).
  const bool device_greedy =
      !be.device().is_cpu() &&
      std::all_of(requests.begin(), requests.end(), [](const DecodeRequest& r) {
        return r.params.greedy() && !r.params.has_penalties();
      });
  DeviceBuffer argmax_buffer;
  std::vector<int32_t> argmax_host;
  auto device_argmax = [&](const Tensor& logits) -> const int32_t* {
    const int64_t n = logits.dim(0);
    if (argmax_buffer.size() < static_cast<size_t>(n) * sizeof(int32_t)) {
      argmax_buffer = DeviceBuffer(be, static_cast<size_t>(2 * n) * sizeof(int32_t));
      argmax_host.resize(static_cast<size_t>(2 * n));
    }
    const Tensor ids = argmax_buffer.view(DType::kI32, {n});
    be.argmax_rows(logits, ids);
    be.download(ids, argmax_host.data());
    return argmax_host.data();
  };
  SamplingWorkspace ws(V);
  SamplingWorkspace ws_draft(V);
  std::vector<float> residual(static_cast<size_t>(V));

  // Emits one token for row `i`; returns false once the row is finished.
  auto emit = [&](size_t i, int32_t token) {
    Row& r = rows[i];
    const SamplingParams& p = r.request->params;
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
  };
  auto notify = [&](size_t i, size_t first_new) {
    Row& r = rows[i];
    if (!on_tokens || first_new >= r.result.tokens.size()) return;
    std::span<const int32_t> fresh(r.result.tokens.data() + first_new,
                                   r.result.tokens.size() - first_new);
    if (!on_tokens(static_cast<int>(i), fresh)) {
      r.result.finish_reason = "cancelled";
      r.done = true;
    }
  };
  // The target's choice at one position: greedy argmax or a sample of p.
  auto history_of = [&](const Row& r) {
    return TokenHistory{.tokens = r.history, .num_prompt = r.request->prompt.size()};
  };

  // Prefill every prompt in one forward.
  const auto t_prefill = Clock::now();
  std::vector<gemma4::ForwardRow> fwd;
  fwd.reserve(rows.size());
  for (Row& r : rows)
    fwd.push_back({.kv = &r.kv, .tokens = r.request->prompt, .all_logits = false});
  {
    // Prefill may take the backend's fast path: plain and speculative runs of
    // the same requests prefill identically, so outputs still agree.
    const gemma4::ForwardOutput& out = target.forward(fwd, {.prefill = true});
    const int32_t* prefill_ids = device_greedy ? device_argmax(out.logits) : nullptr;
    const float* prefill_logits = device_greedy ? nullptr : on_host(out.logits, &logits_host);
    const float* prefill_hidden = drafter ? on_host(out.hidden, &hidden_host) : nullptr;
    const double prefill_s = seconds_since(t_prefill);
    for (size_t i = 0; i < rows.size(); ++i) {
      Row& r = rows[i];
      r.result.stats.prefill_seconds = prefill_s;
      r.result.stats.target_forwards = 1;
      if (device_greedy) {
        r.pending = prefill_ids[i];
      } else {
        std::span<const float> logits(prefill_logits + i * V, static_cast<size_t>(V));
        r.pending = sample_token(logits, history_of(r), r.request->params, ws, r.rng);
      }
      if (drafter) {
        std::memcpy(r.hidden.data(), prefill_hidden + i * H,
                    static_cast<size_t>(H) * sizeof(float));
      }
      emit(i, r.pending);
      notify(i, 0);
    }
  }

  const auto t_decode = Clock::now();
  std::vector<size_t> active;
  std::vector<DraftRow> draft_rows;
  std::vector<size_t> draft_owner;
  std::vector<int32_t> verify_tokens;
  std::vector<int64_t> pos0;
  active.reserve(rows.size());
  fwd.reserve(rows.size());
  pos0.reserve(rows.size());
  draft_rows.reserve(rows.size());
  draft_owner.reserve(rows.size());
  while (true) {
    active.clear();
    for (size_t i = 0; i < rows.size(); ++i) {
      if (!rows[i].done) active.push_back(i);
    }
    if (active.empty()) break;

    // Draft length per row: never past max_tokens (the round emits k + 1 at most).
    for (size_t i : active) {
      Row& r = rows[i];
      const int remaining = r.request->params.max_tokens - static_cast<int>(r.result.tokens.size());
      r.k_round = std::max(0, std::min(r.k, remaining - 1));
      r.drafts.clear();
    }

    // Draft: step s runs the rows whose draft length exceeds s.
    for (int s = 0; drafter; ++s) {
      draft_rows.clear();
      draft_owner.clear();
      for (size_t i : active) {
        Row& r = rows[i];
        if (r.k_round <= s) continue;
        draft_rows.push_back({.request = static_cast<int>(i),
                              .token = s == 0 ? r.pending : r.drafts.back(),
                              .position = static_cast<int32_t>(r.kv.length()),
                              .target_kv = &r.kv,
                              .target_hidden = s == 0 ? r.hidden.data() : nullptr});
        draft_owner.push_back(i);
      }
      if (draft_rows.empty()) break;
      const Tensor step_logits = drafter->step(s, draft_rows);
      const int32_t* draft_ids = device_greedy ? device_argmax(step_logits) : nullptr;
      const float* draft_logits =
          device_greedy ? nullptr : on_host(step_logits, &draft_logits_host);
      for (size_t b = 0; b < draft_owner.size(); ++b) {
        Row& r = rows[draft_owner[b]];
        if (device_greedy) {
          r.drafts.push_back(draft_ids[b]);
          continue;
        }
        std::span<const float> row_logits(draft_logits + b * V, static_cast<size_t>(V));
        // Drafts extend the history (which already ends with the pending token) so
        // penalties see them exactly as the target will.
        for (int32_t d : r.drafts) r.history.push_back(d);
        const TokenHistory hist = history_of(r);
        int32_t d;
        if (r.request->params.greedy()) {
          d = greedy_token(row_logits, hist, r.request->params, ws_draft);
        } else {
          std::span<const float> q = process_logits(row_logits, hist, r.request->params, ws_draft);
          std::copy(q.begin(), q.end(), r.q.begin() + static_cast<std::ptrdiff_t>(s) * V);
          d = sample(q, r.rng);
        }
        r.history.resize(r.history.size() - r.drafts.size());
        r.drafts.push_back(d);
      }
    }

    // Verify every active row's [pending, d1..dk] in one target forward.
    fwd.clear();
    verify_tokens.clear();
    size_t total = 0;
    for (size_t i : active) total += 1 + static_cast<size_t>(rows[i].k_round);
    verify_tokens.reserve(total);
    for (size_t i : active) {
      Row& r = rows[i];
      const size_t begin = verify_tokens.size();
      verify_tokens.push_back(r.pending);
      verify_tokens.insert(verify_tokens.end(), r.drafts.begin(), r.drafts.end());
      fwd.push_back(
          {.kv = &r.kv,
           .tokens = std::span<const int32_t>(verify_tokens.data() + begin, 1 + r.drafts.size()),
           .all_logits = true});
    }
    pos0.resize(active.size());
    for (size_t a = 0; a < active.size(); ++a) pos0[a] = rows[active[a]].kv.length();
    const gemma4::ForwardOutput& out = target.forward(fwd);
    const int32_t* verify_ids = device_greedy ? device_argmax(out.logits) : nullptr;
    const float* verify_logits = device_greedy ? nullptr : on_host(out.logits, &logits_host);
    const float* verify_hidden = drafter ? on_host(out.hidden, &hidden_host) : nullptr;

    for (size_t a = 0; a < active.size(); ++a) {
      const size_t i = active[a];
      Row& r = rows[i];
      DecodeStats& st = r.result.stats;
      ++st.target_forwards;
      ++st.rounds;
      const int k = r.k_round;
      const int64_t out0 = out.row_out_begin[a];
      auto target_logits = [&](int j) {
        return std::span<const float>(verify_logits + (out0 + j) * V, static_cast<size_t>(V));
      };
      // The pending token is now in the cache; the drafts are judged in order,
      // each against the target's distribution given everything before it.
      int n = 0;
      int32_t next = 0;
      const SamplingParams& params = r.request->params;
      for (; n < k; ++n) {
        const TokenHistory hist = history_of(r);
        if (device_greedy) {
          next = verify_ids[out0 + n];
          if (next != r.drafts[static_cast<size_t>(n)]) break;
        } else if (params.greedy()) {
          next = greedy_token(target_logits(n), hist, params, ws);
          if (next != r.drafts[static_cast<size_t>(n)]) break;
        } else {
          std::span<const float> p = process_logits(target_logits(n), hist, params, ws);
          std::span<const float> q(r.q.data() + static_cast<size_t>(n) * V, static_cast<size_t>(V));
          if (!accept_draft(p, q, r.drafts[static_cast<size_t>(n)], r.rng.uniform())) {
            residual_distribution(p, q, residual);
            next = sample(residual, r.rng);
            break;
          }
        }
        r.history.push_back(r.drafts[static_cast<size_t>(n)]);
      }
      if (n == k) {
        next = device_greedy ? verify_ids[out0 + k]
                             : sample_token(target_logits(k), history_of(r), params, ws, r.rng);
      }
      r.history.resize(r.history.size() - static_cast<size_t>(n));  // emit() re-appends

      if (st.drafted_at.size() < static_cast<size_t>(k)) {
        st.drafted_at.resize(static_cast<size_t>(k));
        st.accepted_at.resize(static_cast<size_t>(k));
      }
      for (int j = 0; j < k; ++j) ++st.drafted_at[static_cast<size_t>(j)];
      for (int j = 0; j < n; ++j) ++st.accepted_at[static_cast<size_t>(j)];
      st.drafted += k;
      st.accepted += n;
      st.round_drafted.push_back(k);
      st.round_accepted.push_back(n);

      // Keep [pending, d1..dn] in the cache; the new pending token heads the next window.
      r.kv.truncate(pos0[a] + 1 + n);
      const size_t first_new = r.result.tokens.size();
      bool alive = true;
      for (int j = 0; j < n && alive; ++j) alive = emit(i, r.drafts[static_cast<size_t>(j)]);
      if (alive) {
        emit(i, next);
        r.pending = next;
        if (drafter) {
          std::memcpy(r.hidden.data(), verify_hidden + (out0 + n) * H,
                      static_cast<size_t>(H) * sizeof(float));
        }
      }
      notify(i, first_new);
      if (schedule.adaptive && k > 0) {
        r.k = n == k ? std::min(r.k + 2, schedule.max_draft_tokens) : std::max(1, r.k - 1);
      }
    }
  }
  const double decode_s = seconds_since(t_decode);
  std::vector<DecodeResult> results;
  results.reserve(rows.size());
  for (Row& r : rows) {
    r.result.stats.decode_seconds = decode_s;
    results.push_back(std::move(r.result));
  }
  return results;
}

}  // namespace specula::spec
