// SPDX-License-Identifier: Apache-2.0
// One speculative round of the engine's decoding rows: plan (device rounds),
// draft, verify in one target forward, accept, roll back (see decoder.h).
#include <algorithm>
#include <cstring>

#include "engine/sampling/speculative.h"
#include "engine/speculative/engine_state.h"

namespace specula::speculative {

// Device rounds, the draft steps' part of the plan: where every step's
// tokens come from, step 0's hidden rows, and for sampling rows their draft
// uniforms (and penalty lists and draft penalty rows), one per draft.
void Engine::State::plan_draft_steps(int round_k) {
  DeviceRounds& d = *dev;
  int32_t* hidden_rows = d.host_idx.data();  // [B]
  const auto mk = static_cast<size_t>(max_k);
  row_slots.assign(active.size() * mk, -1);
  step_rows.assign(static_cast<size_t>(round_k), 0);
  d.pen_lists = 0;
  for (int s = 0; s < round_k; ++s) {
    int32_t* token_idx = d.host_idx.data() + d.token_gather_at(s);  // [B]
    int32_t n = 0;
    for (size_t a = 0; a < active.size(); ++a) {
      const Row& r = *active[a];
      if (r.k_round <= s) continue;
      // Where this row's step-s token sits in `ids`: its pending token, or its
      // step s-1 draft.
      const size_t at = a * mk;
      token_idx[n] = static_cast<int32_t>(s == 0 ? static_cast<int64_t>(a)
                                                 : d.draft_at(s - 1) + row_slots[at + s - 1]);
      if (s == 0) hidden_rows[n] = static_cast<int32_t>(r.hidden_index);
      row_slots[at + static_cast<size_t>(s)] = n++;
    }
    step_rows[static_cast<size_t>(s)] = n;
  }
  row_pen_list.assign(active.size(), 0);
  for (size_t a = 0; a < active.size(); ++a) {
    Row& r = *active[a];
    d.host_pending[a] = r.pending;
    if (!d.sampling) continue;
    // The round's uniforms come from the row's stream in a fixed order: one
    // per draft here, then one per window row (plan_window).
    const RowSampling rs = row_sampling_of(r.request.params);
    for (int j = 0; j < r.k_round; ++j) {
      d.stage_sample(j * d.B + row_slots[a * mk + static_cast<size_t>(j)], r.rng, rs);
    }
    if (!d.penalties()) continue;
    // Draft step j sees the history and d1..dj.
    row_pen_list[a] =
        d.stage_list(r.penalty_list, r.history, r.request.prompt.size(), r.request.params);
    draft_at_ids.clear();
    for (int j = 0; j < r.k_round; ++j) {
      const int64_t slot = row_slots[a * mk + static_cast<size_t>(j)];
      d.stage_penalty_row(j * d.B + slot, row_pen_list[a], r.request.params, draft_at_ids);
      draft_at_ids.push_back(static_cast<int32_t>(d.draft_at(j) + slot));
    }
  }
}

// Device rounds, the verify window's part of the plan (after pruning, when
// the drafter prunes): the window's gather of [pending, d1..dk] per row (k =
// k_round), the window rows' q rows and row offsets, and for sampling rows
// one uniform per window row (the accept tests, and last the replacement or
// bonus token) and the window penalty rows.
void Engine::State::plan_window() {
  DeviceRounds& d = *dev;
  int32_t* verify_idx = d.host_idx.data() + d.window_idx_at();  // [B·(max_k+1)]
  int32_t* q_rows = d.host_idx.data() + d.q_rows_at();          // [B·(max_k+1)]
  int32_t* row_begin = d.host_idx.data() + d.row_begin_at();    // [B + 1]
  const auto mk = static_cast<size_t>(max_k);
  int64_t m = 0;
  for (size_t a = 0; a < active.size(); ++a) {
    Row& r = *active[a];
    row_begin[a] = static_cast<int32_t>(m);
    q_rows[m] = 0;  // the pending token is no draft
    verify_idx[m++] = static_cast<int32_t>(a);
    for (int j = 0; j < r.k_round; ++j) {
      verify_idx[m] =
          static_cast<int32_t>(d.draft_at(j) + row_slots[a * mk + static_cast<size_t>(j)]);
      q_rows[m] = static_cast<int32_t>(verify_idx[m] - d.B);  // step j's q row
      ++m;
    }
    if (!d.sampling) continue;
    const RowSampling rs = row_sampling_of(r.request.params);
    for (int64_t w = row_begin[a]; w < m; ++w) d.stage_sample(d.window_at() + w, r.rng, rs);
    if (!d.penalties()) continue;
    // Window row j sees the history and d1..dj.
    draft_at_ids.clear();
    for (int j = 0; j <= r.k_round; ++j) {
      d.stage_penalty_row(d.window_at() + row_begin[a] + j, row_pen_list[a], r.request.params,
                          draft_at_ids);
      if (j < r.k_round) {
        draft_at_ids.push_back(
            static_cast<int32_t>(d.draft_at(j) + row_slots[a * mk + static_cast<size_t>(j)]));
      }
    }
  }
  row_begin[active.size()] = static_cast<int32_t>(m);
}

// Device rounds: queues the upload of what plan_draft_steps and plan_window
// staged (kWhole: both, at once), or of one part.
void Engine::State::upload_plan(PlanPart part) {
  DeviceRounds& d = *dev;
  if (part == PlanPart::kWhole) {
    be.upload_async(d.host_pending.data(), d.ids_slice(0, static_cast<int64_t>(active.size())));
    be.upload_async(d.host_idx.data(), d.idx_slice(0, d.idx_size()));
    if (d.sampling) d.upload_sampling(be);
    if (d.penalties()) d.upload_penalties(be);
  } else if (part == PlanPart::kDraftSteps) {
    be.upload_async(d.host_pending.data(), d.ids_slice(0, static_cast<int64_t>(active.size())));
    be.upload_async(d.host_idx.data(), d.idx_slice(0, d.window_idx_at()));
    if (d.sampling) d.upload_sampling(be, 0, d.window_at());
    if (d.penalties()) {
      d.upload_penalty_lists(be);
      d.upload_penalty_rows(be, 0, d.window_at());
    }
  } else {
    const int64_t at = d.window_idx_at();
    be.upload_async(d.host_idx.data() + at, d.idx_slice(at, d.idx_size() - at));
    if (d.sampling) d.upload_sampling(be, d.window_at());
    if (d.penalties()) d.upload_penalty_rows(be, d.window_at(), d.sample_rows() - d.window_at());
  }
}

// Device rounds: step s runs the rows whose draft length exceeds s; each
// step's tokens come from `ids` (gathered when some rows' drafts ended
// before it), its drafts land there.
void Engine::State::draft_on_device(int round_k) {
  DeviceRounds& d = *dev;
  for (int s = 0; s < round_k; ++s) {
    draft_rows.clear();
    for (Row* r : active) {
      if (r->k_round <= s) continue;
      draft_rows.push_back({.sequence = static_cast<int>(r->slot),
                            .token = 0,  // on the device
                            .position = static_cast<int32_t>(r->kv->length()),
                            .target_kv = &*r->kv,
                            .target_hidden = nullptr,
                            .history = r->history});
    }
    if (draft_rows.empty()) break;
    const auto n = static_cast<int64_t>(draft_rows.size());
    const int64_t before =
        s == 0 ? static_cast<int64_t>(active.size()) : step_rows[static_cast<size_t>(s - 1)];
    DraftDeviceInputs in;
    if (n == before) {
      in.tokens = d.ids_slice(s == 0 ? 0 : d.draft_at(s - 1), n);
    } else {
      in.tokens = d.gathered_slice(d.verify_cap() + s * d.B, n);
      be.gather_rows(d.ids_slice(0, d.ids_size()), d.idx_slice(d.token_gather_at(s), n), in.tokens);
    }
    if (s == 0) {
      in.hidden = d.hidden.view(DType::kF32, {n, H});
      be.gather_rows(round_hidden_src, d.idx_slice(0, n), in.hidden);
    }
    const Tensor step_logits = drafter->step_on_device(s, draft_rows, in);
    if (d.sampling) {
      // q of this step, kept for the acceptance; the draft is a sample of it.
      if (d.penalties()) be.apply_penalties_rows(d.penalty_rows(step_logits, s * d.B));
      const Tensor q = d.q_all().slice_rows(s * d.B, s * d.B + n);
      be.process_logits_rows(step_logits, d.params_slice(s * d.B, n), q);
      be.sample_rows(q, d.uniforms_slice(s * d.B, n), d.ids_slice(d.draft_at(s), n));
    } else {
      be.argmax_rows(step_logits, d.ids_slice(d.draft_at(s), n));
    }
  }
}

// Host rounds: each draft step's logits come back and the host picks (or
// samples) the drafts, as the verifier will judge them.
void Engine::State::draft_on_host(const Modes& m) {
  for (int s = 0;; ++s) {
    draft_rows.clear();
    draft_owner.clear();
    for (Row* r : active) {
      if (r->k_round <= s) continue;
      draft_rows.push_back({.sequence = static_cast<int>(r->slot),
                            .token = s == 0 ? r->pending : r->drafts.back(),
                            .position = static_cast<int32_t>(r->kv->length()),
                            .target_kv = &*r->kv,
                            .target_hidden = s == 0 ? r->hidden.data() : nullptr,
                            .history = r->history});
      draft_owner.push_back(r);
    }
    if (draft_rows.empty()) break;
    const Tensor step_logits = drafter->step(s, draft_rows);
    const bool on_device = m.device_greedy && step_logits.device() == be.device();
    const int32_t* draft_ids = on_device ? device_argmax(step_logits) : nullptr;
    const float* draft_logits = on_device ? nullptr : on_host(step_logits, &draft_logits_host);
    for (size_t b = 0; b < draft_owner.size(); ++b) {
      Row& r = *draft_owner[b];
      if (on_device) {
        r.drafts.push_back(draft_ids[b]);
        continue;
      }
      std::span<const float> row_logits(draft_logits + b * V, static_cast<size_t>(V));
      // Drafts extend the history (which already ends with the pending token)
      // so penalties see them exactly as the target will.
      for (int32_t d : r.drafts) r.history.push_back(d);
      const TokenHistory hist = r.history_view();
      int32_t d;
      if (r.request.params.greedy()) {
        d = greedy_token(row_logits, hist, r.request.params, ws_draft);
      } else {
        std::span<const float> q = process_logits(row_logits, hist, r.request.params, ws_draft);
        std::copy(q.begin(), q.end(), r.q.begin() + static_cast<std::ptrdiff_t>(s) * V);
        d = sample_at(q, r.round_u[static_cast<size_t>(s)]);
      }
      r.history.resize(r.history.size() - r.drafts.size());
      r.drafts.push_back(d);
    }
  }
}

// Token proposers: each row's drafts straight from the drafter (up to its
// k_round, which becomes the count proposed). A sampled row's q is the point
// mass at each draft, so the acceptance min(1, p/q) tests p(draft) and the
// residual is p without the draft: exact speculative sampling.
void Engine::State::propose_drafts() {
  for (Row* r : active) {
    if (r->k_round == 0) continue;
    r->drafts.resize(static_cast<size_t>(r->k_round));
    const DraftRow row{.sequence = static_cast<int>(r->slot),
                       .token = r->pending,
                       .position = static_cast<int32_t>(r->kv->length()),
                       .target_kv = &*r->kv,
                       .target_hidden = nullptr,
                       .history = r->history};
    const int n = drafter->propose(row, r->drafts);
    SPECULA_CHECK(n >= 0 && n <= r->k_round, "the drafter proposed {} tokens, at most {} asked", n,
                  r->k_round);
    r->drafts.resize(static_cast<size_t>(n));
    r->k_round = n;
    for (int j = 0; j < n; ++j) {
      const int32_t d = r->drafts[static_cast<size_t>(j)];
      SPECULA_CHECK(d >= 0 && d < V, "the drafter proposed token {}, outside [0, {})", d, V);
      if (r->request.params.greedy()) continue;
      float* q = r->q.data() + static_cast<size_t>(j) * static_cast<size_t>(V);
      std::fill(q, q + V, 0.0f);
      q[d] = 1.0f;
    }
  }
}

void Engine::State::draw_round_uniforms(bool window) {
  for (Row* r : active) {
    if (r->request.params.greedy()) continue;
    if (!window) {
      r->round_u.clear();
      for (int j = 0; j < r->k_round; ++j) r->round_u.push_back(r->rng.uniform());
      continue;
    }
    // The uniforms of drafts cut by pruning were spent; the window's follow
    // the kept ones (accept() reads them at offset k_round).
    r->round_u.resize(static_cast<size_t>(r->k_round));
    for (int j = 0; j <= r->k_round; ++j) r->round_u.push_back(r->rng.uniform());
  }
}

void Engine::State::collect_drafting_rows(bool dev_round) {
  prune_rows.clear();
  prune_owner.clear();
  prune_drafted.clear();
  for (Row* r : active) {
    // Rows that ran step 0 (pruning keeps at least one draft of those, so a
    // scheduler after it sees the same rows).
    if (r->k_round == 0) continue;
    // As step 0 got the row.
    prune_rows.push_back({.sequence = static_cast<int>(r->slot),
                          .token = dev_round ? 0 : r->pending,
                          .position = static_cast<int32_t>(r->kv->length()),
                          .target_kv = &*r->kv,
                          .target_hidden = dev_round ? nullptr : r->hidden.data(),
                          .history = r->history});
    prune_owner.push_back(r);
    prune_drafted.push_back(r->k_round);
  }
}

void Engine::State::prune_drafts(bool dev_round) {
  collect_drafting_rows(dev_round);
  if (prune_rows.empty()) return;
  prune_keep.assign(prune_rows.size(), -1);
  drafter->draft_lengths(prune_rows, prune_drafted, prune_keep);
  for (size_t i = 0; i < prune_rows.size(); ++i) {
    const int drafted = prune_drafted[i], keep = prune_keep[i];
    if (keep < std::min(1, drafted) || keep > drafted) {
      fail(
          "Drafter::draft_lengths kept {} drafts of row {} (request {}), outside [{}, {}]: the "
          "row made {} drafts",
          keep, i, prune_owner[i]->id, std::min(1, drafted), drafted, drafted);
    }
  }
  for (size_t i = 0; i < prune_rows.size(); ++i) {
    Row& r = *prune_owner[i];
    const int keep = prune_keep[i];
    r.result.stats.pruned += r.k_round - keep;
    r.k_round = keep;
    // Host rounds hold the drafts; device rounds verify the first k_round of
    // what lies in `ids` (plan_window).
    if (r.drafts.size() > static_cast<size_t>(keep)) r.drafts.resize(static_cast<size_t>(keep));
  }
}

bool Engine::State::schedule_round(int round_k) const {
  if (!scheduling || round_k == 0) return false;
  const VerifySchedulerOptions& o = options.scheduler;
  return o.mode == SchedulerMode::kOn ||
         (o.mode == SchedulerMode::kAuto && static_cast<int>(active.size()) >= o.auto_min_rows);
}

void Engine::State::schedule_drafts(bool dev_round) {
  collect_drafting_rows(dev_round);
  if (prune_rows.empty()) return;
  const auto mk = static_cast<size_t>(max_k);
  sched_conf.assign(prune_rows.size() * mk, 0.0);
  drafter->draft_confidences(prune_rows, prune_drafted, max_k, sched_conf);
  // Every active row takes part: rows that drafted nothing still verify their
  // pending token (B counts it).
  sched_all_conf.assign(active.size() * mk, 0.0);
  sched_lengths.assign(active.size(), 0);
  for (size_t a = 0, i = 0; a < active.size(); ++a) {
    if (i < prune_owner.size() && prune_owner[i] == active[a]) {
      std::copy_n(sched_conf.begin() + static_cast<std::ptrdiff_t>(i * mk), prune_drafted[i],
                  sched_all_conf.begin() + static_cast<std::ptrdiff_t>(a * mk));
      sched_lengths[a] = prune_drafted[i];
      ++i;
    }
  }
  const PrefixSchedule& plan =
      scheduler.schedule(sched_all_conf, max_k, sched_lengths, *options.scheduler.sps);
  for (size_t a = 0; a < active.size(); ++a) {
    Row& r = *active[a];
    const int keep = plan.lengths[a];
    SPECULA_CHECK(keep >= 0 && keep <= r.k_round, "the scheduler kept {} of {} drafts", keep,
                  r.k_round);
    if (keep == r.k_round) continue;
    r.result.stats.scheduled_cut += r.k_round - keep;
    ++r.result.stats.scheduled_rounds;
    r.k_round = keep;
    // Host rounds hold the drafts; device rounds verify the first k_round of
    // what lies in `ids` (plan_window). A row may keep none: its window is
    // its pending token alone.
    if (r.drafts.size() > static_cast<size_t>(keep)) r.drafts.resize(static_cast<size_t>(keep));
  }
}

// Verifies every active row's [pending, d1..dk] in one target forward; on a
// device round also takes the target's argmaxes (or the acceptance) and reads
// the round back once.
const gemma4::ForwardOutput& Engine::State::verify(const Modes& m) {
  fwd.clear();
  verify_tokens.clear();
  size_t total = 0;
  for (Row* r : active) total += 1 + static_cast<size_t>(r->k_round);
  verify_tokens.reserve(total);
  for (Row* r : active) {
    const size_t begin = verify_tokens.size();
    verify_tokens.push_back(r->pending);
    if (m.use_dev) {
      // The drafts are on the device (ForwardOptions::token_ids); only the
      // window's length matters here.
      verify_tokens.insert(verify_tokens.end(), static_cast<size_t>(r->k_round), 0);
    } else {
      verify_tokens.insert(verify_tokens.end(), r->drafts.begin(), r->drafts.end());
    }
    fwd.push_back({.kv = &*r->kv,
                   .tokens = std::span<const int32_t>(verify_tokens.data() + begin,
                                                      verify_tokens.size() - begin),
                   .all_logits = true});
  }
  pos0.resize(active.size());
  for (size_t a = 0; a < active.size(); ++a) pos0[a] = active[a]->kv->length();
  if (!m.use_dev) spill_last_output();
  gemma4::ForwardOptions verify_options;
  const auto M = static_cast<int64_t>(verify_tokens.size());
  if (m.use_dev) {
    DeviceRounds& d = *dev;
    verify_options.token_ids = d.gathered_slice(0, M);
    be.gather_rows(d.ids_slice(0, d.ids_size()), d.idx_slice(d.window_idx_at(), M),
                   verify_options.token_ids);
  }
  add_taps(verify_options, M);
  const gemma4::ForwardOutput& out = target.forward(fwd, verify_options);
  last_hidden = out.hidden;
  verify_taps = verify_options.tap_out;
  last_hidden_valid = false;
  if (!m.use_dev) return out;
  DeviceRounds& d = *dev;
  const auto n_rows = static_cast<int64_t>(active.size());
  if (d.sampling) {
    for (size_t a = 0; a <= active.size(); ++a) {
      SPECULA_CHECK(out.row_out_begin[a] == d.host_idx[static_cast<size_t>(d.row_begin_at()) + a],
                    "verify rows of row {} are not where the round planned them", a);
    }
    if (any_logprobs(active)) {
      // device_accept processes the logits in place: keep the window rows of
      // the rows that asked for logprobs (lp_raw_at: where each row's begin).
      lp_rows.clear();
      lp_raw_at.assign(active.size(), -1);
      for (size_t a = 0; a < active.size(); ++a) {
        if (active[a]->request.logprobs < 0) continue;
        lp_raw_at[a] = static_cast<int64_t>(lp_rows.size());
        for (int64_t w = out.row_out_begin[a]; w < out.row_out_begin[a + 1]; ++w) {
          lp_rows.push_back(static_cast<int32_t>(w));
        }
      }
      lp_raw_src = keep_raw_rows(out.logits, lp_rows);
    }
    device_accept(out.logits, verify_options.token_ids, n_rows);
    // The round's one readback: every draft and each row's accepted count and
    // next token.
    be.download(d.ids_slice(d.B, d.ids_size() - d.B), d.host_ids.data());
  } else {
    const int64_t n_out = out.row_out_begin.back();
    be.argmax_rows(out.logits, d.ids_slice(d.verify_at(), n_out));
    // The round's one readback: every draft and the target's ids.
    be.download(d.ids_slice(d.B, d.verify_at() - d.B + n_out), d.host_ids.data());
  }
  for (size_t a = 0; a < active.size(); ++a) {
    Row& r = *active[a];
    r.drafts.clear();
    for (int j = 0; j < r.k_round; ++j) {
      const int64_t slot = row_slots[a * static_cast<size_t>(max_k) + static_cast<size_t>(j)];
      r.drafts.push_back(d.host_ids[static_cast<size_t>(d.draft_at(j) - d.B + slot)]);
    }
  }
  return out;
}

// Accepts per row (greedy: longest prefix equal to the target's choice;
// sampling: exact speculative sampling), emits the accepted drafts and the
// target's token, rolls the cache back and keeps the drafter's next input.
void Engine::State::accept(const gemma4::ForwardOutput& out, const Modes& m) {
  const int32_t* verify_ids = nullptr;
  const int32_t* sampled = nullptr;  // device sampling: {accepted, next} per active row
  if (m.use_dev) {
    DeviceRounds& d = *dev;
    verify_ids = d.host_ids.data() + (d.verify_at() - d.B);
    if (d.sampling) sampled = d.host_ids.data() + (d.accepted_at() - d.B);
  } else if (m.device_greedy) {
    verify_ids = device_argmax(out.logits);
  }
  const bool host_logits = !m.device_greedy && !m.device_sampling;
  const float* verify_logits = host_logits ? on_host(out.logits, &logits_host) : nullptr;
  const float* verify_hidden =
      needs_hidden && !m.use_dev ? on_host(out.hidden, &hidden_host) : nullptr;
  // Logprobs: from the raw rows verify() kept when device sampling processed
  // the logits in place, else from the logits themselves.
  const bool logprobs = any_logprobs(active);
  const bool lp_raw_rows_used = logprobs && m.use_dev && dev->sampling;
  if (logprobs) {
    lp_owner.clear();
    lp_rows.clear();
    lp_ids.clear();
  }

  committed.clear();
  int64_t window_at = 0;  // the row's first token in the forward
  for (size_t a = 0; a < active.size(); ++a) {
    Row& r = *active[a];
    DecodeStats& st = r.result.stats;
    ++st.target_forwards;
    ++st.rounds;
    const int k = r.k_round;
    const int64_t out0 = out.row_out_begin[a];
    const size_t emitted_before = r.result.tokens.size();
    auto target_logits = [&](int j) {
      return std::span<const float>(verify_logits + (out0 + j) * V, static_cast<size_t>(V));
    };
    // The pending token is now in the cache; the drafts are judged in order,
    // each against the target's distribution given everything before it.
    int n = 0;
    int32_t next = 0;
    const SamplingParams& params = r.request.params;
    if (sampled != nullptr) {
      // Judged on the device (speculative_accept_rows).
      n = sampled[2 * a];
      next = sampled[2 * a + 1];
      check_sampled(r, next);
      SPECULA_CHECK(n >= 0 && n <= k, "request {}: {} drafts accepted of {}", r.id, n, k);
    }
    const bool host_sampled = sampled == nullptr && verify_ids == nullptr && !params.greedy();
    if (host_sampled) {
      // Exact speculative sampling on the host (sampling/speculative.h). p at
      // window row j sees the history and the drafts before j (penalties).
      size_t pushed = 0;
      const WindowVerdict verdict = verify_window(
          std::span<const int32_t>(r.drafts.data(), static_cast<size_t>(k)),
          [&](int j) {
            for (; pushed < static_cast<size_t>(j); ++pushed) r.history.push_back(r.drafts[pushed]);
            return process_logits(target_logits(j), r.history_view(), params, ws);
          },
          [&](int j) {
            return std::span<const float>(r.q.data() + static_cast<size_t>(j) * V,
                                          static_cast<size_t>(V));
          },
          std::span<const double>(r.round_u.data() + k, static_cast<size_t>(k + 1)), residual);
      r.history.resize(r.history.size() - pushed);  // emit() appends what was kept
      n = verdict.accepted;
      next = verdict.next;
    }
    // Greedy: the longest prefix equal to the target's choice, then its token.
    for (; sampled == nullptr && !host_sampled && n < k; ++n) {
      if (verify_ids != nullptr) {
        next = verify_ids[out0 + n];
      } else {
        next = greedy_token(target_logits(n), r.history_view(), params, ws);
      }
      if (next != r.drafts[static_cast<size_t>(n)]) break;
      r.history.push_back(r.drafts[static_cast<size_t>(n)]);
    }
    if (sampled == nullptr && !host_sampled) {
      if (n == k) {
        next = verify_ids != nullptr ? verify_ids[out0 + k]
                                     : greedy_token(target_logits(k), r.history_view(), params, ws);
      }
      r.history.resize(r.history.size() - static_cast<size_t>(n));  // emit() re-appends
    }

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
    r.kv->truncate(pos0[a] + 1 + n);
    committed.push_back({.sequence = static_cast<int>(r.slot),
                         .position = pos0[a],
                         .count = 1 + n,
                         .tap_row = window_at});
    window_at += 1 + k;
    bool alive = true;
    for (int j = 0; j < n && alive; ++j) alive = emit(r, r.drafts[static_cast<size_t>(j)]);
    if (alive) {
      emit(r, next);
      r.pending = next;
      if (m.use_dev) {
        r.hidden_at = HiddenAt::kLastOutput;
        r.hidden_index = out0 + n;
      } else if (needs_hidden) {
        std::memcpy(r.hidden.data(), verify_hidden + (out0 + n) * H,
                    static_cast<size_t>(H) * sizeof(float));
        r.hidden_at = HiddenAt::kHost;
      }
    }
    if (r.request.logprobs >= 0) {
      // The round's j-th token came from window row j.
      const int64_t row0 = lp_raw_rows_used ? lp_raw_at[a] : out0;
      for (size_t t = emitted_before; t < r.result.tokens.size(); ++t) {
        lp_add(r, row0 + static_cast<int64_t>(t - emitted_before), r.result.tokens[t]);
      }
    }
    if (options.schedule.adaptive && k > 0) {
      r.k = n == k ? std::min(r.k + 2, options.schedule.max_draft_tokens) : std::max(1, r.k - 1);
    }
  }
  if (logprobs) lp_finish(lp_raw_rows_used ? lp_raw_src : out.logits, verify_logits);
  last_hidden_valid = m.use_dev && needs_hidden;
  if (drafter) drafter->on_committed(committed, verify_taps);
}

}  // namespace specula::speculative
