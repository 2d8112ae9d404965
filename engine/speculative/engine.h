// SPDX-License-Identifier: Apache-2.0
// Engine: continuous batching over speculative rows.
//
// The engine owns the rows of every request it accepted: their target caches,
// sampling streams, pending tokens and drafter inputs. `submit` queues a
// request (or refuses it, as a value), `cancel` ends one and frees its cache at
// once, and `step` does one unit of work and reports what each request got:
//
//   1. admit waiting requests, in arrival order, while the KV pool has a row;
//   2. one speculative round for every row that is decoding (running rows
//      come first): draft up to k tokens per row, verify all rows' windows in
//      ONE target forward, accept per row, roll every cache back;
//   3. prefill chunks of the admitted prompts, in arrival order, within what
//      is left of the step's token budget (`max_batch_tokens`), in one forward;
//      a row whose prompt is complete samples its first token and decodes from
//      the next step on.
//
// A request's tokens never depend on what else runs beside it: every row has
// its own sampling stream, its draft length depends only on its own history,
// and the kernels are batch invariant (a row's bits do not depend on the other
// rows of a forward), and prefill goes in pieces fixed in absolute position
// (EngineOptions::prefill_chunk), each its own forward.
//
// KV memory: every row holds one sequence cache of the target's max_context
// (sliding layers: a ring), so the pool is a number of rows. It is sized at
// construction from `kv_memory` (bytes, or a fraction of the device's free
// memory) and `max_rows`; a request waits in a bounded queue until a row is
// free, so the pool is never over-committed and never runs out mid-generation.
//
// Not thread-safe: one caller drives submit / cancel / step.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/draft/drafter.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/speculative/decoder.h"
#include "engine/speculative/verify_scheduler.h"

namespace specula::speculative {

// The verify scheduler (DSpark's Alg. 1, engine/speculative/verify_scheduler.h):
// after a round's drafts (and any confidence pruning), it verifies of each
// row only the prefix that maximizes the round's expected throughput
// τ·SPS(B), B the verified tokens of all rows, from the drafter's
// confidences and a profiled SPS table. It only ever shortens what is
// verified (the min with pruning), so greedy output cannot change and sampled
// rows stay exact in distribution (a stopping rule: see the early break in
// verify_scheduler.h). Unlike everything else in a round, its cuts depend on
// the other rows, so with it on a seeded sampled request's tokens may depend
// on what runs beside it (greedy ones never do).
enum class SchedulerMode {
  kOff,   // verify what was drafted (after pruning)
  kOn,    // schedule every round that drafted
  kAuto,  // schedule rounds of at least auto_min_rows decoding rows
};
struct VerifySchedulerOptions {
  SchedulerMode mode = SchedulerMode::kOff;
  // SPS(B): required (non-empty) unless mode is kOff.
  std::shared_ptr<const SpsTable> sps;
  // kAuto: the fewest decoding rows a scheduled round has (>= 1). At low
  // load verifying the whole block is as fast as anything (vLLM RFC #48202).
  int auto_min_rows = 16;
};

struct EngineOptions {
  // Draft length (k) per round for rows that do not set their own, and the
  // adaptive schedule. Ignored without a drafter.
  DraftSchedule schedule;
  // Most rows decoding or prefilling at once (vLLM's --max-num-seqs); the KV
  // budget may lower it. >= 1.
  int max_rows = 16;
  // Token budget of one step: the round's verify windows (Σ 1 + k_i) first,
  // then prefill chunks with what is left (vLLM's --max-num-batched-tokens).
  // 0: no limit (each prompt prefills in one chunk).
  int64_t max_batch_tokens = 0;
  // Prefill pieces end at multiples of this many positions, and each runs as
  // its own forward, so a prompt's prefill bits never depend on the budget or
  // on other prompts (the backend's fast prefill path may depend on a
  // forward's rows). 0: each step prefills every admitted prompt's chunk in
  // one forward (fewer forwards; a prefill's bits may then depend on the
  // other prompts, on CUDA).
  int64_t prefill_chunk = 512;
  // KV memory for the rows' caches: bytes when > 1, a fraction of the
  // device's free memory when in (0, 1], 0 for no budget (max_rows rows).
  double kv_memory = 0;
  // Requests that may wait for a row; a submit past it is refused.
  int max_waiting = 4096;
  // A/B switches of how rounds run (same tokens either way).
  RoundModes modes;
  // The verify scheduler (off by default). A drafter without confidences
  // (Drafter::has_confidences) is never scheduled: Engine::schedules() says so.
  VerifySchedulerOptions scheduler;
};

// What a submit returns: an id, or why the request was refused.
struct Submission {
  int64_t id = -1;
  std::string error;  // empty when accepted
  bool accepted() const { return id >= 0; }
};

// What one request got in one step. `tokens` are the tokens committed in this
// step (a stop token included); a finished request's last update carries its
// finish reason and stats. Views stay valid until the next step().
struct RequestUpdate {
  int64_t id = -1;
  std::span<const int32_t> tokens;
  // DecodeRequest::logprobs >= 0 only (else empty): one logprob per entry of
  // `tokens`, and top_logprobs (n) ids and logprobs per token, row-major
  // (tokens.size() · n each), each row descending by logprob (equal ones
  // lower id first). See DecodeRequest::logprobs.
  std::span<const float> token_logprobs;
  int top_logprobs = 0;
  std::span<const int32_t> top_ids;
  std::span<const float> top_values;
  bool finished = false;
  std::string finish_reason;           // "length", "stop", "cancelled" (finished only)
  const DecodeStats* stats = nullptr;  // finished only
};

// The KV pool: its size in bytes and rows, and what is in use.
struct KvPoolInfo {
  int64_t bytes_per_row = 0;
  int64_t capacity_bytes = 0;
  int max_rows = 0;
  int rows_in_use = 0;
  int64_t tokens_in_use = 0;  // positions held in the rows' caches
  int waiting = 0;            // requests queued for a row
  int64_t bytes_in_use() const { return rows_in_use * bytes_per_row; }
};

class Engine {
 public:
  // target and drafter (optional) must outlive the engine and run on one
  // backend. Throws an Error for bad options (naming the field and value) or
  // a drafter whose vocabulary differs from the target's.
  Engine(gemma4::Gemma4Model& target, Drafter* drafter, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. Refused (never thrown) when its prompt is empty or out
  // of the vocabulary, its sampling params are invalid, prompt + max_tokens
  // exceeds the context, its draft length exceeds the engine's maximum, its
  // logprobs lies outside [-1, 20], or the queue is full.
  Submission submit(DecodeRequest request);
  // Ends a waiting or running request now and frees its cache; its last
  // update ("cancelled") comes with the next step. False for unknown ids.
  bool cancel(int64_t id);
  // One step (see above). Returns an update for every request that got
  // tokens or finished; empty when there was nothing to do.
  std::span<const RequestUpdate> step();
  // Whether any request is waiting, running or has an update to report.
  bool has_work() const;

  KvPoolInfo kv_pool() const;
  int max_draft_tokens() const;
  // Whether the verify scheduler may cut rounds: its mode is not kOff and the
  // drafter gives confidences (a mode of on or auto with another drafter is
  // accepted and does nothing).
  bool schedules() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace specula::speculative
