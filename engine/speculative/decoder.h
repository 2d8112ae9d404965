// SPDX-License-Identifier: Apache-2.0
// The decoding loop for batched rows, with or without speculation: the
// request and result types the engine (engine.h) works with, and decode(),
// which runs a fixed set of requests to completion on an Engine.
//
// Without a drafter every round is one plain decode step per row. With one,
// a round drafts k tokens per row, verifies [pending, d1..dk] of every row in
// ONE target forward (one batched lm-head), accepts per row, emits the
// accepted drafts plus one target token (correction or bonus), and rolls every
// cache back to the accepted length. Greedy rows accept the longest prefix
// matching the target's argmax; sampled rows run exact speculative sampling
// (accept with min(1, p/q), else sample normalize(max(p - q, 0)); bonus from p
// when all are accepted), p and q processed by the same sampling pipeline.
// Either way the emitted tokens are distributed exactly as without speculation.
//
// Greedy rows without penalties take their argmaxes on the backend. With a
// drafter that takes device inputs (Drafter::takes_device_inputs) the whole
// round stays there: each draft step's ids feed the next step and the verify
// window without coming back, and the round ends in ONE readback of all drafts
// and the target's ids (uploads are queued without waiting).
// RoundModes::host_rounds reads the drafts back every step instead (A/B runs).
// A drafter that prunes (Drafter::draft_lengths) cuts each row's drafts after
// the last step; the verify window is planned after that, and the drafter's
// own readback (its confidences) is the round's second.
//
// Every other batch (rows sampled or with penalties, with no drafter or one
// that takes device inputs) samples on the backend too: the drafts' q and the
// target's p come out of Backend::process_logits_rows, drafts of sample_rows,
// and each row's accepted count and next token of speculative_accept_rows, so
// a round again reads back once (token ids, never [rows, V] logits). Greedy
// rows of such a batch run the same ops at temperature 0 and keep their greedy
// tokens. The uniforms are drawn on the host at the start of a round, in a
// fixed order per row (one per draft, then one per window row: the accept
// tests and, last, the replacement or bonus token), and the host path draws
// the same ones in the same order, so one seed gives the same tokens either
// way (up to an ulp of the device's p and q). Penalties run there first
// (Backend::apply_penalties_rows): each round uploads every row's distinct
// history tokens and generated counts, and each draft step's and window row's
// logits are penalised for that history plus the drafts before them (read
// where they lie on the device), as the host sampler would penalise them.
// RoundModes::host_sampling samples every row on the host (A/B runs).
//
// Each draft step and verify window of a device round is recorded (and then
// replayed) as its own graph, queued while the GPU runs the steps before it.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/draft/drafter.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/sampling/sampling_params.h"

namespace specula::speculative {

struct DecodeRequest {
  std::vector<int32_t> prompt;  // non-empty
  SamplingParams params;        // temperature 0 = greedy; max_tokens; stop_token_ids; seed
  // Speculation for this request: -1 follows the engine's schedule, 0 turns
  // it off, k in [1, the engine's maximum] drafts k tokens a round (adaptive
  // schedules start there).
  int draft_tokens = -1;
  // Log-probabilities of the emitted tokens (the API's logprobs /
  // top_logprobs): -1 none; 0 each token's logprob; n in [1, 20]
  // (kMaxTopLogprobs) also the n most likely tokens at its position. Raw
  // logprobs: log_softmax of the target's final (soft-capped) logits at the
  // position that produced the token, before temperature, penalties and
  // truncation, so the same with speculation on or off (a speculative
  // round's tokens all come from its verify window's rows).
  int logprobs = -1;
};

// A/B switches of how rounds run; the tokens are the same either way.
struct RoundModes {
  bool host_rounds = false;    // read the drafts back every draft step
  bool host_sampling = false;  // sample every row on the host (logits read back)
};

struct DraftSchedule {
  int draft_tokens = 4;  // k per round (the starting k when adaptive)
  bool adaptive =
      false;  // +2 after a fully accepted round, -1 otherwise (min 1, max max_draft_tokens)
  int max_draft_tokens = 8;
};

// Counters of one request (or, merged, of many).
struct DecodeStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t target_forwards = 0;  // prefill + one per round
  int64_t rounds = 0;           // verify rounds (plain decode steps count as rounds with k = 0)
  // Drafts verified and accepted; drafted_at / accepted_at and the round
  // counts below count verified drafts too.
  int64_t drafted = 0;
  int64_t accepted = 0;
  int64_t pruned = 0;  // drafts the drafter cut before verification (Drafter::draft_lengths)
  // Drafts the verify scheduler cut (EngineOptions::scheduler), after pruning,
  // and the rounds it cut at least one of this request's drafts in.
  int64_t scheduled_cut = 0;
  int64_t scheduled_rounds = 0;
  std::vector<int64_t> drafted_at, accepted_at;  // per draft position (0 = first draft)
  std::vector<int32_t> round_drafted,
      round_accepted;  // per verify round, in order (one request only)
  double prefill_seconds = 0;
  double decode_seconds = 0;

  double acceptance_rate() const { return drafted ? static_cast<double>(accepted) / drafted : 0.0; }
  // τ: tokens committed per verify round (accepted drafts + the target's token).
  double mean_accepted_length() const {
    return rounds ? static_cast<double>(accepted + rounds) / rounds : 0.0;
  }
  double prefill_tokens_per_second() const {
    return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0;
  }
  // Tokens after the first (which comes with the prefill) per second of decoding.
  double decode_tokens_per_second() const {
    return decode_seconds > 0 && generated_tokens > 1 ? (generated_tokens - 1) / decode_seconds : 0;
  }
  void merge(const DecodeStats& other);
};

struct DecodeResult {
  std::vector<int32_t> tokens;  // generated tokens (a stop token is included)
  std::string finish_reason;    // "length", "stop", "context" or "cancelled"
  DecodeStats stats;
  // DecodeRequest::logprobs >= 0 only (else empty): one logprob per token,
  // and top_logprobs (n) ids and logprobs per token, row-major, each row
  // descending by logprob (equal ones lower id first).
  std::vector<float> token_logprobs;
  std::vector<int32_t> top_ids;
  std::vector<float> top_values;
  int top_logprobs = 0;
};

// Called whenever a request's tokens are committed; return false to cancel it.
using TokenCallback = std::function<bool(int request, std::span<const int32_t> new_tokens)>;

// Decodes every request to completion, batching all unfinished rows in each
// target forward (an Engine with one row per request). `drafter` may be null
// (plain decoding). Throws an Error naming the request for invalid requests
// (empty prompt, prompt + max_tokens beyond the context, invalid sampling
// params) before any work starts.
std::vector<DecodeResult> decode(gemma4::Gemma4Model& target, Drafter* drafter,
                                 std::span<const DecodeRequest> requests,
                                 const DraftSchedule& schedule, const TokenCallback& on_tokens = {},
                                 const RoundModes& modes = {});

class Engine;
// The same on a caller's engine (which keeps its buffers and recorded steps
// from one call to the next): submits every request, then steps until all
// have finished. The engine must have no other requests.
std::vector<DecodeResult> decode(Engine& engine, std::span<const DecodeRequest> requests,
                                 const TokenCallback& on_tokens = {});

}  // namespace specula::speculative
