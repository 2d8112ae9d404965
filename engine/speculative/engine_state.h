// SPDX-License-Identifier: Apache-2.0
// The engine's state (internal to engine.cpp and engine_round.cpp): the rows
// it owns, the device round buffers, the drafter inputs kept across forwards,
// and the scratch reused by every step.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "engine/sampling/penalty_list.h"
#include "engine/sampling/rng.h"
#include "engine/sampling/sampler.h"
#include "engine/speculative/device_rounds.h"
#include "engine/speculative/engine.h"

namespace specula::speculative {

using Clock = std::chrono::steady_clock;
inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Where a decoding row's drafter input (the target's post-norm hidden that
// produced its pending token) is: a row of the last target forward's output
// (valid until the next forward), a row of the engine's hidden store, or the
// row's own host copy.
enum class HiddenAt { kNone, kLastOutput, kStore, kHost };

// Everything the engine keeps per request.
struct Row {
  int64_t id = -1;
  size_t slot = 0;  // index in State::slots; DraftRow::request
  DecodeRequest request;
  std::optional<SequenceKv> kv;  // reset when the row finishes: the pool gets it back at once
  Rng rng;
  // prompt + generated (+ the drafts of the current round on the host path, popped after)
  std::vector<int32_t> history;
  int64_t prefilled = 0;  // prompt tokens in the cache
  bool decoding = false;  // prompt prefilled and first token emitted
  int32_t pending = 0;    // emitted, not yet in the target cache
  HiddenAt hidden_at = HiddenAt::kNone;
  int64_t hidden_index = 0;     // row of the last output or of the store
  std::vector<float> hidden;    // HiddenAt::kHost: f32 [H]
  int k = 0;                    // draft length of the next round
  int k_round = 0;              // draft length of the current round
  std::vector<int32_t> drafts;  // [k_round]
  std::vector<float> q;         // [max_k, V] processed proposals (host-sampled rows)
  // Host sampling: the round's uniforms, drawn at its start in the order device
  // rounds draw them (one per draft, then one per window row), so that both
  // paths turn one seed into the same tokens.
  std::vector<double> round_u;
  PenaltyList penalty_list;  // device penalties only
  bool done = false;
  DecodeResult result;
  size_t reported = 0;  // tokens already reported in updates
  Clock::time_point t_admitted, t_first_token;

  TokenHistory history_view() const {
    return TokenHistory{.tokens = history, .num_prompt = request.prompt.size()};
  }
};

// How one forward's rows choose their tokens (see decoder.h).
struct Modes {
  bool device_greedy = false;    // argmax on the backend, ids read back
  bool device_sampling = false;  // the whole sampling pipeline on the backend
  bool use_dev = false;          // through DeviceRounds
};

struct Engine::State {
  State(gemma4::Gemma4Model& t, Drafter* d, const EngineOptions& o)
      : target(t),
        drafter(d),
        options(o),
        be(t.backend()),
        V(t.config().vocab_size),
        H(t.config().hidden_size),
        ws(V),
        ws_draft(V),
        residual(static_cast<size_t>(V)) {}

  gemma4::Gemma4Model& target;
  Drafter* drafter;
  EngineOptions options;
  Backend& be;
  const int64_t V, H;
  int max_k = 0;
  int max_rows = 0;
  int64_t row_bytes = 0;
  // Whether rounds may keep their tokens on the device (no drafter, or one
  // that takes device inputs, unless host rounds are asked for).
  bool device_drafter = true;
  // Whether the drafter reads the target's hiddens (model drafters do;
  // token proposers do not).
  bool needs_hidden = false;

  int64_t next_id = 0;
  std::deque<std::pair<int64_t, DecodeRequest>> waiting;
  std::vector<std::unique_ptr<Row>> slots;  // [max_rows]; null = free
  std::vector<Row*> running;                // admitted rows, in admission order
  // Rows that finished or were cancelled in the last step: their updates'
  // views point into them until the next step.
  std::vector<std::unique_ptr<Row>> ended;
  std::vector<std::unique_ptr<Row>> cancelled_waiting;  // reported with the next step
  std::vector<RequestUpdate> updates;

  std::optional<DeviceRounds> dev;
  // Drafter inputs kept across forwards, f32 [3·max_rows, H]: rows spilled
  // from the last output before another forward, rows of finished prefills,
  // host copies uploaded for a device round (a region of max_rows each).
  DeviceBuffer hidden_store;
  DeviceBuffer hidden_idx;  // i32 [3·max_rows]
  std::vector<int32_t> hidden_idx_host;
  Tensor last_hidden;  // the last target forward's hidden output
  bool last_hidden_valid = false;
  int64_t fresh_hiddens = 0;  // rows of the store's region 1 taken this step
  // The drafter's taps of every target forward (Drafter::taps), f32
  // [taps, M, H]; sized for the largest forward so far.
  std::vector<int> tap_layers;
  DeviceBuffer tap_buf;
  int64_t tap_tokens = 0;  // M the buffer holds
  std::vector<CommittedRow> committed;
  Tensor verify_taps;         // the round's taps (empty without)
  DeviceBuffer first_logits;  // f32 [max_rows, V]: last logits of the step's finished prompts
  Tensor round_hidden_src;    // where this round's step 0 gathers its hiddens from

  SamplingWorkspace ws, ws_draft;
  std::vector<float> residual;
  std::vector<float> logits_host, hidden_host, draft_logits_host;
  DeviceBuffer argmax_buffer;
  std::vector<int32_t> argmax_host;

  // Round scratch, reused.
  std::vector<Row*> active;
  std::vector<DraftRow> draft_rows;
  std::vector<Row*> draft_owner;
  std::vector<int32_t> verify_tokens;
  std::vector<gemma4::ForwardRow> fwd;
  std::vector<int64_t> pos0;
  std::vector<int64_t> row_slots;     // device rounds: [active, max_k] row index within step s
  std::vector<int64_t> step_rows;     // device rounds: rows of step s
  std::vector<int32_t> draft_at_ids;  // device penalties: a row's drafts so far, in `ids`
  std::vector<int32_t> row_pen_list;  // device penalties: [active] each row's penalty list
  // Pruning: the round's step-0 rows and their owners, drafts made and kept.
  std::vector<DraftRow> prune_rows;
  std::vector<Row*> prune_owner;
  std::vector<int> prune_drafted, prune_keep;
  // Verify scheduler (EngineOptions::scheduler): whether it may run
  // (configure), and its scratch: the drafting rows' confidences, every
  // active row's draft count, stride max_k.
  bool scheduling = false;
  VerifyScheduler scheduler;
  std::vector<double> sched_conf, sched_all_conf;
  std::vector<int> sched_lengths;
  std::vector<uint8_t> step_gathered;
  std::vector<Row*> prefill_rows;
  std::vector<int64_t> prefill_take;
  std::vector<Row*> spill_rows, final_rows;
  std::vector<int64_t> spill_src;

  // Logprobs (DecodeRequest::logprobs), touched only when a row of the
  // forward asked. One entry per emitted token of such a row, in emission
  // order: the row of the logits that produced it and the token. lp_finish
  // computes them on the host when the logits are there already (host
  // paths), else with Backend::logprob_rows and one readback of its own.
  std::vector<Row*> lp_owner;
  std::vector<int32_t> lp_rows, lp_ids;
  DeviceBuffer lp_in;                 // i32 [2 · lp_cap]: rows | ids
  DeviceBuffer lp_out;                // 4-byte words [lp_cap · (1 + 2 · kMaxTopLogprobs)]
  std::vector<int32_t> lp_in_host;    // staging of lp_in
  std::vector<uint32_t> lp_out_host;  // the readback of lp_out
  // Raw logits of the rows that asked, kept before device sampling
  // processes a forward's logits in place: f32 [lp_raw_rows, V].
  DeviceBuffer lp_raw, lp_raw_idx;
  int64_t lp_raw_rows = 0;
  std::vector<int32_t> lp_raw_idx_host;
  std::vector<int64_t> lp_raw_at;  // per row of the forward: its first row in lp_raw (-1: none)
  Tensor lp_raw_src;               // the round's kept rows (verify -> accept)

  // ---- setup and bookkeeping ----
  void configure();
  std::string check_request(const DecodeRequest& r) const;
  void admit();
  Row& admit_one(int64_t id, DecodeRequest&& request);
  void finish_step();
  Modes modes_for(std::span<Row* const> rows) const;
  DeviceRounds& device_rounds(const Modes& m, std::span<Row* const> rows);
  bool emit(Row& r, int32_t token);
  void check_sampled(const Row& r, int32_t token) const;
  const float* on_host(const Tensor& t, std::vector<float>* staging);
  const int32_t* device_argmax(const Tensor& logits);
  void device_accept(const Tensor& logits, const Tensor& tokens, int64_t n_rows);

  // ---- logprobs ----
  static bool any_logprobs(std::span<Row* const> rows);
  int64_t lp_cap() const { return static_cast<int64_t>(max_rows) * (max_k + 1); }
  // Copies rows `src_rows` of `logits` into lp_raw (in order); returns them, f32 [n, V].
  Tensor keep_raw_rows(const Tensor& logits, std::span<const int32_t> src_rows);
  void lp_add(Row& r, int64_t logits_row, int32_t token);
  // The entries' logprobs from `logits` (on the device) or `host` (the same
  // logits on the host, or null), appended to their rows' results.
  void lp_finish(const Tensor& logits, const float* host);

  // ---- drafter inputs ----
  void spill_last_output();
  void store_hiddens(const Tensor& src, std::span<Row* const> rows,
                     std::span<const int64_t> src_rows, int64_t at);
  void prepare_round_hiddens(bool dev_round);

  // ---- prefill ----
  int64_t prefill(int64_t budget);
  void prefill_forward(std::span<Row* const> rows, std::span<const int64_t> take);
  void first_tokens();

  // ---- rounds ----
  int64_t round_tokens() const;
  void run_round();
  // Device rounds' plan, in two parts: what the draft steps read, and the
  // verify window (planned after pruning in a pruning round).
  void plan_draft_steps(int round_k);
  void plan_window();
  enum class PlanPart { kWhole, kDraftSteps, kWindow };
  void upload_plan(PlanPart part);
  void draft_on_device(int round_k);
  void draft_on_host(const Modes& m);
  void propose_drafts();
  // Host rounds: each sampled row's uniforms, drawn from its stream in the
  // order device rounds draw them: one per draft (window = false, at the
  // round's start), then one per window row (window = true, after pruning).
  void draw_round_uniforms(bool window);
  // Pruning drafters: asks Drafter::draft_lengths how many of each row's
  // drafts to verify, checks the answer, and cuts k_round (and, on the host,
  // the drafts) to it.
  void prune_drafts(bool dev_round);
  // prune_rows / prune_owner / prune_drafted: the round's step-0 rows (those
  // that drafted), as step 0 got them, and their current draft counts.
  void collect_drafting_rows(bool dev_round);
  // Whether this round is scheduled (scheduling, something drafted, and in
  // auto mode enough rows).
  bool schedule_round(int round_k) const;
  // The verify scheduler: asks the drafter for the drafting rows'
  // confidences, runs Alg. 1 over every active row and cuts k_round (and,
  // on the host, the drafts) to its lengths.
  void schedule_drafts(bool dev_round);
  // Options of a target forward of M tokens with the drafter's taps.
  void add_taps(gemma4::ForwardOptions& options, int64_t M);
  // Tells the drafter what a prefill forward committed (State::committed).
  void report_committed(const gemma4::ForwardOptions& options);
  const gemma4::ForwardOutput& verify(const Modes& m);
  void accept(const gemma4::ForwardOutput& out, const Modes& m);
};

}  // namespace specula::speculative
