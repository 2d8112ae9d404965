// SPDX-License-Identifier: Apache-2.0
#include "engine/spec/decoder.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>

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
// A row's penalty list kept up to date as its history grows (device
// penalties): its history's distinct tokens in first-occurrence order, each
// with its count past the prompt, so that a round adds only the tokens emitted
// since the last one instead of walking the whole history. The token -> entry
// map is an open-addressing table sized once for the row's longest history, so
// steady-state rounds allocate nothing.
class PenaltyList {
 public:
  // Room for histories of up to `max_history` tokens.
  void reserve(size_t max_history) {
    size_t cap = 16;
    shift_ = 60;
    while (cap < 2 * max_history) cap *= 2, --shift_;
    keys_.assign(cap, -1);
    entries_.assign(cap, 0);
    tokens_.reserve(max_history);
    counts_.reserve(max_history);
  }
  // Takes in history[absorbed ..]; the history only grows (drafts never enter
  // it on the device path) and its first num_prompt tokens are the prompt.
  void update(std::span<const int32_t> history, size_t num_prompt) {
    SPECULA_CHECK(history.size() >= absorbed_, "a penalty list saw {} tokens, the history has {}",
                  absorbed_, history.size());
    for (; absorbed_ < history.size(); ++absorbed_) {
      const int32_t t = history[absorbed_];
      const size_t mask = keys_.size() - 1;
      // Fibonacci hashing: the product's top bits pick the slot.
      size_t at = static_cast<size_t>((static_cast<uint64_t>(t) * 0x9E3779B97F4A7C15ull) >> shift_);
      while (keys_[at] != t && keys_[at] != -1) at = (at + 1) & mask;
      if (keys_[at] == -1) {
        SPECULA_CHECK(tokens_.size() < tokens_.capacity(), "penalty list outgrew its {} entries",
                      tokens_.capacity());
        keys_[at] = t;
        entries_[at] = static_cast<int32_t>(tokens_.size());
        tokens_.push_back(t);
        counts_.push_back(0);
      }
      if (absorbed_ >= num_prompt) ++counts_[static_cast<size_t>(entries_[at])];
    }
  }
  std::span<const int32_t> tokens() const { return tokens_; }
  std::span<const int32_t> counts() const { return counts_; }

 private:
  std::vector<int32_t> keys_;     // token ids, -1 = empty slot
  std::vector<int32_t> entries_;  // each key's index in tokens_ / counts_
  std::vector<int32_t> tokens_, counts_;
  int shift_ = 60;       // 64 - log2(table size)
  size_t absorbed_ = 0;  // history tokens taken in
};

struct Row {
  const DecodeRequest* request = nullptr;
  SequenceKv kv;
  Rng rng;
  std::vector<int32_t>
      history;          // prompt + generated (+ the drafts of the current round, popped after)
  int32_t pending = 0;  // emitted, not yet in the target cache
  std::vector<float> hidden;    // target post-norm hidden that produced `pending`
  int64_t hidden_row = 0;       // device rounds: that hidden's row in the last target output
  int k = 0;                    // draft length of the next round
  int k_round = 0;              // draft length of the current round
  std::vector<int32_t> drafts;  // [k_round]
  std::vector<float> q;         // [k_round, V] processed proposals (sampling rows)
  // Host sampling: the round's uniforms, drawn at its start in the order device
  // rounds draw them (one per draft, then one per window row), so that both
  // paths turn one seed into the same tokens.
  std::vector<double> round_u;
  PenaltyList penalty_list;  // device penalties only
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

// The device side of rounds whose tokens never leave the device between
// steps: greedy rows without penalties with a drafter that takes device
// inputs, or (device sampling) rows of any temperature and penalties, with or
// without such a drafter. Each draft step's token lands in `ids` (its
// argmax, or a sample of its processed distribution q, kept in `q`), the next
// step's tokens and the verify window's tokens are gathered from there, and
// ONE download per round brings back every draft and the target's choices
// (greedy: its argmaxes; sampling: each row's accepted count and next token
// from speculative_accept_rows). Sized for B rows and drafts of up to max_k
// tokens; kept by the DecodeSession for the next call of the same sizes.
struct DeviceRounds {
  int64_t B = 0, max_k = 0, V = 0, H = 0;
  bool sampling = false;
  // i32 [pending: B | draft step s: B each, max_k of them | verify ids: B·(max_k+1) |
  //      accepted (sampling): B × {n, next}]
  DeviceBuffer ids;
  // i32 [hidden rows: B | verify gather: B·(max_k+1) | step s token gather: B each |
  //      q rows of the window (sampling): B·(max_k+1) | window row offsets: B + 1]
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

  DeviceRounds(Backend& be, int64_t rows, int64_t k, int64_t hidden_size, int64_t vocab,
               bool sample)
      : B(rows), max_k(k), V(vocab), H(hidden_size), sampling(sample) {
    ids = DeviceBuffer(be, static_cast<size_t>(ids_size()) * sizeof(int32_t));
    idx = DeviceBuffer(be, static_cast<size_t>(idx_size()) * sizeof(int32_t));
    gathered = DeviceBuffer(be, static_cast<size_t>(verify_cap() + max_k * B) * sizeof(int32_t));
    hidden = DeviceBuffer(be, static_cast<size_t>(B * H) * sizeof(float));
    host_idx.resize(static_cast<size_t>(idx_size()));
    host_pending.resize(static_cast<size_t>(B));
    host_ids.resize(static_cast<size_t>(ids_size() - B));
    if (sampling) {
      uniforms = DeviceBuffer(be, static_cast<size_t>(sample_rows()) * sizeof(int64_t));
      params = DeviceBuffer(be, static_cast<size_t>(sample_rows()) * sizeof(RowSampling));
      if (max_k > 0) q = DeviceBuffer(be, static_cast<size_t>(max_k * B * V) * sizeof(float));
      host_uniforms.resize(static_cast<size_t>(sample_rows()));
      host_params.resize(static_cast<size_t>(sample_rows()));
    }
  }
  int64_t verify_cap() const { return B * (max_k + 1); }
  int64_t ids_size() const { return B + max_k * B + verify_cap() + (sampling ? 2 * B : 0); }
  int64_t idx_size() const { return B + verify_cap() + max_k * B + verify_cap() + B + 1; }
  int64_t sample_rows() const { return max_k * B + verify_cap(); }
  int64_t draft_at(int64_t s) const { return B + s * B; }              // in ids
  int64_t verify_at() const { return B + max_k * B; }                  // in ids
  int64_t accepted_at() const { return verify_at() + verify_cap(); }   // in ids
  int64_t q_rows_at() const { return B + verify_cap() + max_k * B; }   // in idx
  int64_t row_begin_at() const { return q_rows_at() + verify_cap(); }  // in idx
  int64_t window_at() const { return max_k * B; }                      // in uniforms / params
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
  // Uploads the round's uniforms and row parameters (sampling).
  void upload_sampling(Backend& be) const {
    be.upload_async(host_uniforms.data(), uniforms_slice(0, sample_rows()));
    be.upload_async(host_params.data(), params_slice(0, sample_rows()));
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
  bool pen_on = false;
  int64_t pen_lists = 0;
  void enable_penalties(Backend& be, int64_t entries) {
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
    pen_on = true;
  }
  bool penalties() const { return pen_on; }
  // The buffers a recorded round reads and writes (they move when reallocated).
  void append_key(std::vector<int64_t>& key) const {
    key.push_back(B);
    key.push_back(max_k);
    key.push_back(sampling);
    for (const DeviceBuffer* b : {&ids, &idx, &gathered, &hidden, &uniforms, &params, &q})
      key.push_back(reinterpret_cast<intptr_t>(b->data()));
  }
  // A kept DeviceRounds serving a new decode() call starts without penalties.
  void disable_penalties() { pen_on = false; }
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
    const int64_t entries = host_pen_begin[static_cast<size_t>(pen_lists)];
    be.upload_async(host_pen_begin.data(), pen_begin.view(DType::kI32, {pen_lists + 1}));
    if (entries > 0) {
      be.upload_async(host_pen_tokens.data(), pen_tokens.view(DType::kI32, {entries}));
      be.upload_async(host_pen_counts.data(), pen_counts.view(DType::kI32, {entries}));
    }
    be.upload_async(host_pen_params.data(), pen_params.view(DType::kF32, {sample_rows(), 3}));
    be.upload_async(host_pen_row_list.data(), pen_row_list.view(DType::kI32, {sample_rows()}));
    if (max_k > 0) {
      be.upload_async(host_pen_extras.data(), pen_extras.view(DType::kI32, {sample_rows(), max_k}));
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

RowSampling row_sampling_of(const SamplingParams& p) {
  return RowSampling{
      .temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p, .min_p = p.min_p};
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

struct DecodeSession::State {
  const gemma4::Gemma4Model* target = nullptr;
  const Drafter* drafter = nullptr;
  std::optional<DeviceRounds> rounds;
  // Whole speculative rounds (draft steps and verify window) recorded by shape.
  StepGraphCache round_graphs;
  std::vector<int64_t> round_key;
};

DecodeSession::DecodeSession() : state_(std::make_unique<State>()) {}
DecodeSession::~DecodeSession() = default;
int64_t DecodeSession::round_replays() const {
  return state_->round_graphs.replays();
}

std::vector<DecodeResult> decode(gemma4::Gemma4Model& target, Drafter* drafter,
                                 std::span<const DecodeRequest> requests,
                                 const DraftSchedule& schedule, const TokenCallback& on_tokens,
                                 DecodeSession* session) {
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
    r.round_u.reserve(static_cast<size_t>(2 * max_k + 1));
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
  // Greedy rows without penalties: the argmax runs on the backend and only
  // token ids come back (not [rows, V] logits). With a drafter that takes
  // device inputs, a whole round's tokens stay on the device (DeviceRounds).
  const bool device_greedy = std::all_of(
      requests.begin(), requests.end(),
      [](const DecodeRequest& r) { return r.params.greedy() && !r.params.has_penalties(); });
  // SPECULA_HOST_ROUNDS=1 keeps the host rounds (drafts read back every step),
  // for A/B measurements; the outputs are the same either way.
  // SPECULA_HOST_SAMPLING=1 samples on the host (logits read back every step).
  auto env_on = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && std::string(v) == "1";
  };
  const bool host_rounds = env_on("SPECULA_HOST_ROUNDS");
  const bool device_drafter =
      drafter == nullptr || (drafter->takes_device_inputs() && !host_rounds);
  // Otherwise (rows sampled or with penalties) the whole pipeline (penalties,
  // p, q, sampling, acceptance) runs on the backend, and a round reads back
  // its token ids once.
  const bool any_penalties =
      std::any_of(requests.begin(), requests.end(),
                  [](const DecodeRequest& r) { return r.params.has_penalties(); });
  const bool device_sampling = !device_greedy && device_drafter && !env_on("SPECULA_HOST_SAMPLING");
  DecodeSession local_session;
  DecodeSession::State& sess = *(session ? session : &local_session)->state_;
  if (sess.target != &target || sess.drafter != drafter) {
    // Recorded rounds point into this target's and drafter's buffers, and the
    // round buffers live on the target's device.
    sess.round_graphs.clear();
    sess.rounds.reset();
    sess.target = &target;
    sess.drafter = drafter;
  }
  DeviceRounds* dev = nullptr;
  if ((device_greedy && drafter && device_drafter) || device_sampling) {
    const auto B = static_cast<int64_t>(rows.size());
    std::optional<DeviceRounds>& kept = sess.rounds;
    if (!kept || kept->B != B || kept->max_k != max_k || kept->V != V || kept->H != H ||
        kept->sampling != device_sampling) {
      kept.reset();  // frees the old buffers first
      kept.emplace(be, B, max_k, H, V, device_sampling);
      sess.round_graphs.clear();  // they point into the old buffers
    }
    dev = &*kept;
    dev->disable_penalties();
  }
  if (device_sampling && any_penalties) {
    int64_t entries = 0;
    for (const Row& r : rows) entries += static_cast<int64_t>(r.history.capacity());
    dev->enable_penalties(be, entries);
    for (Row& r : rows) {
      if (r.request->params.has_penalties()) r.penalty_list.reserve(r.history.capacity());
    }
  }
  // Host sampling keeps each sampled row's draft distributions q.
  for (Row& r : rows) {
    if (drafter && !device_sampling && !r.request->params.greedy())
      r.q.resize(static_cast<size_t>(max_k) * static_cast<size_t>(V));
  }
  // Device sampling: process the window rows' logits in place into p (params
  // from the window section), then accept per row; `rows` rows of windows
  // given by idx's row offsets; results in `accepted`. `tokens`: i32 [window].
  auto device_accept = [&](const Tensor& logits, const Tensor& tokens, int64_t n_rows) {
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
  };
  // A token the device could not sample (its distribution held a NaN or no mass).
  auto check_sampled = [&](size_t i, int32_t token) {
    if (token < 0 || token >= V) {
      fail(
          "request {}: sampling on {} failed: the distribution has a NaN, an infinity or no mass "
          "(non-finite logits?)",
          i, be.name());
    }
  };
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

  // The target hiddens the next round's step 0 reads (device rounds): the
  // last target forward's output, which stays valid until the next forward.
  Tensor last_hidden;

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
    const int32_t* prefill_ids = nullptr;
    const int32_t* prefill_sampled = nullptr;
    if (device_greedy) {
      prefill_ids = device_argmax(out.logits);
    } else if (device_sampling) {
      // One window row per prompt (its last), k = 0: plain sampling from p.
      DeviceRounds& d = *dev;
      const int64_t n = static_cast<int64_t>(rows.size());
      int32_t* row_begin = d.host_idx.data() + d.row_begin_at();
      for (int64_t i = 0; i <= n; ++i) row_begin[i] = static_cast<int32_t>(i);
      d.pen_lists = 0;
      for (int64_t i = 0; i < n; ++i) {
        Row& r = rows[static_cast<size_t>(i)];
        d.stage_sample(d.window_at() + i, r.rng, row_sampling_of(r.request->params));
        if (d.penalties()) {
          const int32_t list =
              d.stage_list(r.penalty_list, r.history, r.request->prompt.size(), r.request->params);
          d.stage_penalty_row(d.window_at() + i, list, r.request->params, {});
        }
      }
      be.upload_async(d.host_idx.data(), d.idx_slice(0, d.idx_size()));
      d.upload_sampling(be);
      if (d.penalties()) d.upload_penalties(be);
      device_accept(out.logits, d.ids_slice(0, n), n);
      be.download(d.accepted(n), d.host_ids.data());
      prefill_sampled = d.host_ids.data();  // {accepted = 0, token} per prompt
    }
    const float* prefill_logits =
        device_greedy || device_sampling ? nullptr : on_host(out.logits, &logits_host);
    const float* prefill_hidden = drafter && !dev ? on_host(out.hidden, &hidden_host) : nullptr;
    const double prefill_s = seconds_since(t_prefill);
    for (size_t i = 0; i < rows.size(); ++i) {
      Row& r = rows[i];
      r.result.stats.prefill_seconds = prefill_s;
      r.result.stats.target_forwards = 1;
      if (device_greedy) {
        r.pending = prefill_ids[i];
      } else if (device_sampling) {
        r.pending = prefill_sampled[2 * i + 1];
        check_sampled(i, r.pending);
      } else {
        std::span<const float> logits(prefill_logits + i * V, static_cast<size_t>(V));
        r.pending = sample_token(logits, history_of(r), r.request->params, ws, r.rng);
      }
      if (dev) {
        r.hidden_row = static_cast<int64_t>(i);
      } else if (drafter) {
        std::memcpy(r.hidden.data(), prefill_hidden + i * H,
                    static_cast<size_t>(H) * sizeof(float));
      }
      emit(i, r.pending);
      notify(i, 0);
    }
    last_hidden = out.hidden;
  }

  const auto t_decode = Clock::now();
  std::vector<size_t> active;
  std::vector<DraftRow> draft_rows;
  std::vector<size_t> draft_owner;
  std::vector<int32_t> verify_tokens;
  std::vector<int64_t> pos0;
  std::vector<int64_t> row_slots;      // device rounds: [active, max_k] row index within step s
  std::vector<int64_t> step_rows;      // device rounds: rows of step s
  std::vector<int32_t> draft_at_ids;   // device penalties: a row's drafts so far, in `ids`
  std::vector<uint8_t> step_gathered;  // device rounds: step s gathers its rows' tokens
  // SPECULA_ROUND_GRAPHS=1 records each round whole instead of its draft
  // steps and verify window one by one (which measured faster on one H200:
  // the per-step graphs queue while the GPU runs the steps before them).
  const bool staged_rounds =
      drafter && dev && drafter->stages_steps() && env_on("SPECULA_ROUND_GRAPHS");
  // Device rounds: step s's tokens gathered from `ids` when some rows' drafts
  // ended before it (else they are a contiguous run there already).
  auto gather_step_tokens = [&](int s, int64_t n) {
    DeviceRounds& d = *dev;
    be.gather_rows(d.ids_slice(0, d.ids_size()), d.idx_slice(d.B + d.verify_cap() + s * d.B, n),
                   d.gathered_slice(d.verify_cap() + s * d.B, n));
  };
  // Device rounds: step s's drafts from its logits (n rows), into `ids`.
  auto draft_tail = [&](int s, const Tensor& step_logits, int64_t n) {
    DeviceRounds& d = *dev;
    if (d.sampling) {
      // q of this step, kept for the acceptance; the draft is a sample of it.
      if (d.penalties()) be.apply_penalties_rows(d.penalty_rows(step_logits, s * d.B));
      const Tensor q = d.q_all().slice_rows(s * d.B, s * d.B + n);
      be.process_logits_rows(step_logits, d.params_slice(s * d.B, n), q);
      be.sample_rows(q, d.uniforms_slice(s * d.B, n), d.ids_slice(d.draft_at(s), n));
    } else {
      be.argmax_rows(step_logits, d.ids_slice(d.draft_at(s), n));
    }
  };
  active.reserve(rows.size());
  draft_at_ids.reserve(static_cast<size_t>(max_k));
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

    if (!dev) {
      for (size_t i : active) {
        Row& r = rows[i];
        if (r.request->params.greedy()) continue;
        r.round_u.clear();
        for (int j = 0; j < 2 * r.k_round + 1; ++j) r.round_u.push_back(r.rng.uniform());
      }
    }

    // Device rounds: plan where every step's tokens come from (uploaded once).
    int round_k = 0;  // the longest draft of this round
    for (size_t i : active) round_k = std::max(round_k, rows[i].k_round);
    if (dev) {
      DeviceRounds& d = *dev;
      int32_t* hidden_idx = d.host_idx.data();           // [B]
      int32_t* verify_idx = hidden_idx + d.B;            // [B·(max_k+1)]
      int32_t* token_idx = verify_idx + d.verify_cap();  // [max_k, B]
      row_slots.assign(active.size() * static_cast<size_t>(max_k), -1);
      step_rows.assign(static_cast<size_t>(round_k), 0);
      d.pen_lists = 0;
      for (int s = 0; s < round_k; ++s) {
        int32_t n = 0;
        for (size_t a = 0; a < active.size(); ++a) {
          const Row& r = rows[active[a]];
          if (r.k_round <= s) continue;
          // Where this row's step-s token sits in `ids`: its pending token, or
          // its step s-1 draft.
          const size_t at = a * static_cast<size_t>(max_k);
          token_idx[s * d.B + n] = static_cast<int32_t>(
              s == 0 ? static_cast<int64_t>(a) : d.draft_at(s - 1) + row_slots[at + s - 1]);
          if (s == 0) hidden_idx[n] = static_cast<int32_t>(r.hidden_row);
          row_slots[at + static_cast<size_t>(s)] = n++;
        }
        step_rows[static_cast<size_t>(s)] = n;
      }
      int32_t* q_rows = d.host_idx.data() + d.q_rows_at();        // [B·(max_k+1)]
      int32_t* row_begin = d.host_idx.data() + d.row_begin_at();  // [B + 1]
      int64_t m = 0;
      for (size_t a = 0; a < active.size(); ++a) {
        Row& r = rows[active[a]];
        d.host_pending[a] = r.pending;
        row_begin[a] = static_cast<int32_t>(m);
        q_rows[m] = 0;  // the pending token is no draft
        verify_idx[m++] = static_cast<int32_t>(a);
        for (int j = 0; j < r.k_round; ++j) {
          verify_idx[m] = static_cast<int32_t>(
              d.draft_at(j) + row_slots[a * static_cast<size_t>(max_k) + static_cast<size_t>(j)]);
          q_rows[m] = static_cast<int32_t>(verify_idx[m] - d.B);  // step j's q row
          ++m;
        }
        if (d.sampling) {
          // The round's uniforms, drawn from the row's stream in a fixed order:
          // one per draft, then one per window row (accept tests, and the last
          // for the replacement or bonus token).
          const RowSampling rs = row_sampling_of(r.request->params);
          for (int j = 0; j < r.k_round; ++j) {
            d.stage_sample(
                j * d.B + row_slots[a * static_cast<size_t>(max_k) + static_cast<size_t>(j)], r.rng,
                rs);
          }
          for (int64_t w = row_begin[a]; w < m; ++w) d.stage_sample(d.window_at() + w, r.rng, rs);
          if (d.penalties()) {
            // Draft step j and window row j see the history and d1..dj.
            const int32_t list = d.stage_list(r.penalty_list, r.history, r.request->prompt.size(),
                                              r.request->params);
            draft_at_ids.clear();
            for (int j = 0; j <= r.k_round; ++j) {
              const int64_t slot =
                  j < r.k_round ? row_slots[a * static_cast<size_t>(max_k) + static_cast<size_t>(j)]
                                : 0;
              if (j < r.k_round) {
                d.stage_penalty_row(j * d.B + slot, list, r.request->params, draft_at_ids);
              }
              d.stage_penalty_row(d.window_at() + row_begin[a] + j, list, r.request->params,
                                  draft_at_ids);
              if (j < r.k_round) draft_at_ids.push_back(static_cast<int32_t>(d.draft_at(j) + slot));
            }
          }
        }
      }
      row_begin[active.size()] = static_cast<int32_t>(m);
      be.upload_async(d.host_pending.data(), d.ids_slice(0, static_cast<int64_t>(active.size())));
      be.upload_async(d.host_idx.data(), d.idx_slice(0, d.idx_size()));
      if (d.sampling) d.upload_sampling(be);
      if (d.penalties()) d.upload_penalties(be);
    }

    // Draft: step s runs the rows whose draft length exceeds s. A drafter that
    // stages its steps (Drafter::stages_steps) gets all of them staged here
    // and run after the verify window is staged too, so that the round's
    // device work can be recorded as one graph (below); others run each step
    // as it comes.
    step_gathered.assign(static_cast<size_t>(round_k), 0);
    for (int s = 0; drafter && dev; ++s) {
      draft_rows.clear();
      for (size_t i : active) {
        Row& r = rows[i];
        if (r.k_round <= s) continue;
        draft_rows.push_back({.request = static_cast<int>(i),
                              .token = 0,  // on the device
                              .position = static_cast<int32_t>(r.kv.length()),
                              .target_kv = &r.kv,
                              .target_hidden = nullptr});
      }
      if (draft_rows.empty()) break;
      DeviceRounds& d = *dev;
      const int64_t n = static_cast<int64_t>(draft_rows.size());
      // The rows of a step are those of the step before (or the active rows)
      // minus the ones whose drafts ended: when none ended, their tokens are a
      // contiguous run of `ids` already; else they are gathered.
      const int64_t before =
          s == 0 ? static_cast<int64_t>(active.size()) : step_rows[static_cast<size_t>(s - 1)];
      step_gathered[static_cast<size_t>(s)] = n != before;
      DraftDeviceInputs in;
      in.tokens = n == before ? d.ids_slice(s == 0 ? 0 : d.draft_at(s - 1), n)
                              : d.gathered_slice(d.verify_cap() + s * d.B, n);
      if (s == 0) {
        // Queued now, outside any recording: last_hidden points into the last
        // forward's scratch, which staging the verify window may move.
        in.hidden = d.hidden.view(DType::kF32, {n, H});
        be.gather_rows(last_hidden, d.idx_slice(0, n), in.hidden);
      }
      if (staged_rounds) {
        drafter->stage_step(s, draft_rows, in);
      } else {
        if (n != before) gather_step_tokens(s, n);
        draft_tail(s, drafter->step_on_device(s, draft_rows, in), n);
      }
    }
    for (int s = 0; drafter && !dev; ++s) {
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
          d = sample_at(q, r.round_u[static_cast<size_t>(s)]);
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
      if (dev) {
        // The drafts are on the device (ForwardOptions::token_ids); only the
        // window's length matters here.
        verify_tokens.insert(verify_tokens.end(), static_cast<size_t>(r.k_round), 0);
      } else {
        verify_tokens.insert(verify_tokens.end(), r.drafts.begin(), r.drafts.end());
      }
      fwd.push_back({.kv = &r.kv,
                     .tokens = std::span<const int32_t>(verify_tokens.data() + begin,
                                                        verify_tokens.size() - begin),
                     .all_logits = true});
    }
    pos0.resize(active.size());
    for (size_t a = 0; a < active.size(); ++a) pos0[a] = rows[active[a]].kv.length();
    gemma4::ForwardOptions verify_options;
    const int64_t M = static_cast<int64_t>(verify_tokens.size());
    if (dev) verify_options.token_ids = dev->gathered_slice(0, M);
    // The verify window's ids gathered from the round's drafts.
    auto gather_verify_ids = [&] {
      be.gather_rows(dev->ids_slice(0, dev->ids_size()), dev->idx_slice(dev->B, M),
                     verify_options.token_ids);
    };
    // Device rounds: what the target's ids or the acceptance leave in `ids`.
    auto verify_tail = [&](const gemma4::ForwardOutput& o) {
      DeviceRounds& d = *dev;
      if (d.sampling) {
        for (size_t a = 0; a <= active.size(); ++a) {
          SPECULA_CHECK(o.row_out_begin[a] == d.host_idx[static_cast<size_t>(d.row_begin_at()) + a],
                        "verify rows of request {} are not where the round planned them", a);
        }
        device_accept(o.logits, verify_options.token_ids, static_cast<int64_t>(active.size()));
      } else {
        be.argmax_rows(o.logits, d.ids_slice(d.verify_at(), o.row_out_begin.back()));
      }
    };
    const gemma4::ForwardOutput* verified = nullptr;
    if (staged_rounds) {
      // Every draft step is staged; stage the window, then queue the round's
      // device work: recorded as one graph the second time its shape is seen
      // and replayed after (penalty rounds, whose list sizes vary, run it
      // directly).
      const gemma4::ForwardOutput& staged = target.stage(fwd, verify_options);
      auto device_half = [&] {
        for (int s = 0; s < round_k; ++s) {
          const int64_t n = step_rows[static_cast<size_t>(s)];
          if (step_gathered[static_cast<size_t>(s)]) gather_step_tokens(s, n);
          draft_tail(s, drafter->run_staged_step(s), n);
        }
        gather_verify_ids();
        target.run_staged();
        verify_tail(staged);
        return Tensor();
      };
      if (be.supports_graphs() && target.graphs_enabled() && target.staged_recordable() &&
          !dev->penalties()) {
        std::vector<int64_t>& key = sess.round_key;
        key.clear();
        dev->append_key(key);
        key.push_back(static_cast<int64_t>(active.size()));
        key.push_back(round_k);
        for (int s = 0; s < round_k; ++s) {
          key.push_back(step_rows[static_cast<size_t>(s)]);
          key.push_back(step_gathered[static_cast<size_t>(s)]);
          drafter->append_step_key(s, key);
        }
        target.append_staged_key(key);
        sess.round_graphs.run(be, key, device_half);
      } else {
        device_half();
      }
      verified = &target.finish_staged();
    } else {
      if (dev) gather_verify_ids();
      verified = &target.forward(fwd, verify_options);
      if (dev) verify_tail(*verified);
    }
    const gemma4::ForwardOutput& out = *verified;
    const int32_t* verify_ids = nullptr;
    const int32_t* sampled = nullptr;  // device sampling: {accepted, next} per active row
    if (dev) {
      // The round's one readback: every draft and the target's ids (greedy), or
      // every draft and each row's accepted count and next token (sampling).
      DeviceRounds& d = *dev;
      const int64_t n_out = out.row_out_begin.back();
      if (d.sampling) {
        be.download(d.ids_slice(d.B, d.ids_size() - d.B), d.host_ids.data());
        sampled = d.host_ids.data() + (d.accepted_at() - d.B);
      } else {
        be.download(d.ids_slice(d.B, d.verify_at() - d.B + n_out), d.host_ids.data());
      }
      verify_ids = d.host_ids.data() + (d.verify_at() - d.B);
      for (size_t a = 0; a < active.size(); ++a) {
        Row& r = rows[active[a]];
        r.drafts.clear();
        for (int j = 0; j < r.k_round; ++j) {
          const int64_t slot = row_slots[a * static_cast<size_t>(max_k) + static_cast<size_t>(j)];
          r.drafts.push_back(d.host_ids[static_cast<size_t>(d.draft_at(j) - d.B + slot)]);
        }
      }
    } else if (device_greedy) {
      verify_ids = device_argmax(out.logits);
    }
    const float* verify_logits =
        device_greedy || device_sampling ? nullptr : on_host(out.logits, &logits_host);
    const float* verify_hidden = drafter && !dev ? on_host(out.hidden, &hidden_host) : nullptr;

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
      if (sampled != nullptr) {
        // Judged on the device (speculative_accept_rows).
        n = sampled[2 * a];
        next = sampled[2 * a + 1];
        check_sampled(i, next);
        SPECULA_CHECK(n >= 0 && n <= k, "request {}: {} drafts accepted of {}", i, n, k);
      }
      for (; sampled == nullptr && n < k; ++n) {
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
          if (!accept_draft(p, q, r.drafts[static_cast<size_t>(n)],
                            r.round_u[static_cast<size_t>(k + n)])) {
            residual_distribution(p, q, residual);
            next = sample_at(residual, r.round_u[static_cast<size_t>(2 * k)]);
            break;
          }
        }
        r.history.push_back(r.drafts[static_cast<size_t>(n)]);
      }
      if (sampled == nullptr && n == k) {
        if (device_greedy) {
          next = verify_ids[out0 + k];
        } else if (params.greedy()) {
          next = greedy_token(target_logits(k), history_of(r), params, ws);
        } else {
          next = sample_at(process_logits(target_logits(k), history_of(r), params, ws),
                           r.round_u[static_cast<size_t>(2 * k)]);
        }
      }
      if (sampled == nullptr)
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
        if (dev) {
          r.hidden_row = out0 + n;
        } else if (drafter) {
          std::memcpy(r.hidden.data(), verify_hidden + (out0 + n) * H,
                      static_cast<size_t>(H) * sizeof(float));
        }
      }
      notify(i, first_new);
      if (schedule.adaptive && k > 0) {
        r.k = n == k ? std::min(r.k + 2, schedule.max_draft_tokens) : std::max(1, r.k - 1);
      }
    }
    last_hidden = out.hidden;
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
