// SPDX-License-Identifier: Apache-2.0
// Backend: the op set every device implements. The CPU backend
// (engine/backend/cpu) is the plain reference every other backend is tested
// against. Models call ops only through a Backend&, so the forward pass is the
// same code on every device.
//
// Conventions for every op:
// - Activations are f32 on the CPU backend; weights may be f32, bf16 or f16,
//   and the weights of linear (and linear_multi, linear_gelu_mul) and the
//   tables of embedding may also be quantized (i8, f8e4m3 [N, K] carrying
//   per-row f32 scales, Tensor::scales): they compute with decode(q) · scale
//   rounded to f32, as if given that dequantized f32 matrix.
// - All tensors are contiguous row-major views on the backend's device; outputs
//   are caller-provided (ops never allocate).
// - Shapes are checked and a mismatch throws an Error naming the op and both shapes.
// - An output may alias an input only where the op says so.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "engine/core/tensor.h"
#include "engine/memory/memory_resource.h"

namespace specula {

// Causal (optionally sliding-window) grouped-query attention of S queries over T
// keys whose absolute positions are k_pos0 .. k_pos0 + T - 1.
struct AttentionParams {
  Tensor q;            // f32 [S, n_heads, D]
  Tensor k;            // f32|bf16|f8e4m3 [T, n_kv_heads, D] (a KV cache's dtype; read as f32;
                       // fp8 carries its scales, one per (row, kv head): Tensor::scales)
  Tensor v;            // [T, n_kv_heads, D], the dtype of k
  Tensor out;          // f32 [S, n_heads, D]; must not alias q, k or v
  Tensor q_positions;  // i32 [S]: absolute position of each query
  int64_t k_pos0 = 0;  // absolute position of key 0
  // Key j (absolute position kp) is visible to query i (position qp) iff
  // (!causal || kp <= qp) && (window == 0 || kp > qp - window).
  bool causal = true;
  int window = 0;
  float scale = 1.0f;  // scores = scale * q·k (Gemma 4 uses 1.0)
  // Ring layout, for sliding caches read in place: when ring_keys >= 0, k and v
  // hold a ring of R = k.dim(0) rows with absolute position kp at row kp % R,
  // and the keys are positions k_pos0 .. k_pos0 + ring_keys - 1 (ring_keys ≤ R).
  // Results are identical to the same keys laid out contiguously.
  int64_t ring_keys = -1;
  // Prefill chunks may use a faster path that is deterministic but not batch
  // invariant (CUDA: TF32 tensor-core products for 64+ queries). Never set it
  // where results must match a decode step bit for bit; the CPU ignores it.
  bool allow_fast_prefill = false;
  // Step-invariant launch (for CUDA graphs): when > 0, the caller promises that
  // the queries sit at consecutive positions (window 0: non-decreasing ones, as
  // DSpark's block, whose queries all sit at its last position), all below
  // positions_bound, and that
  // k/v hold every key each query can see (causal; a full cache read from
  // position 0 (k_pos0 == 0), or a ring read in place). A backend may then derive
  // each query's keys from q_positions alone and size its work by
  // positions_bound, so one recorded launch serves every step below the bound.
  // Results are identical either way; the CPU ignores it.
  int64_t positions_bound = 0;
  // Scheduling hint: the op after this one is a product that touches only its
  // weights before waiting for its inputs. A backend may let it start while this
  // op finishes (CUDA: its weight loads overlap the combine). Set it only on the
  // last attention call before the product, and where it was measured to pay
  // (see gemma4.cpp); results are identical either way, and the CPU ignores it.
  bool product_follows = false;
};

// The positions_bound bucket of keys up to position end - 1: the smallest power
// of two from 64 up that is at least `end`. Callers that key recorded steps on
// it must all use this one rule.
inline int64_t positions_bound_for(int64_t end) {
  int64_t bound = 64;
  while (bound < end) bound *= 2;
  return bound;
}

// Inputs of one attention layer for M new tokens (gemma4-architecture.md §4.2),
// finished in place:
//   q = rope(rms_norm(q) · q_norm)
//   k = rope(rms_norm(k_raw) · k_norm)            (skipped when k is empty)
//   v = rms_norm(v_raw), no weight; v_raw = k_raw when v_from_k, else v
// and, when cache_k is set, row i of the finished k and v is stored at row
// positions[i] mod R of cache_k / cache_v (see store_kv). Results are those of
// rms_norm, rope, copy and store_kv in that order, bit for bit.
struct AttentionInputsParams {
  Tensor q;       // f32 [M, Nh, D]
  Tensor q_norm;  // [D] any float
  Tensor k;       // f32 [M, KV, D], or empty (a KV-shared layer: q only)
  Tensor k_norm;  // [D] any float
  Tensor v;       // f32 [M, KV, D] (written from k when v_from_k)
  bool v_from_k = false;
  Tensor positions;  // i32 [M]
  Tensor inv_freq;   // f32 [D/2]
  float eps = 1e-6f;
  Tensor cache_k;  // optional f32|bf16|f8e4m3 [R, KV, D] (rows rounded as store_kv does)
  Tensor cache_v;  // [R, KV, D] of cache_k's dtype when cache_k is set
};

// One cache store of store_kv_batch: the arguments of a store_kv call.
struct StoreKvParams {
  Tensor k;          // f32 [n, KV, D]
  Tensor v;          // f32 [n, KV, D]
  Tensor positions;  // i32 [n]
  Tensor cache_k;    // f32|bf16|f8e4m3 [R, KV, D]
  Tensor cache_v;    // [R, KV, D] of cache_k's dtype
};

// One output of linear_multi: y = x · wᵀ.
struct LinearOut {
  Tensor w;  // [N, K] f32|bf16|f16
  Tensor y;  // f32 [M, N]
};

// Mixture-of-experts routing of N tokens over E experts (gemma4-architecture.md §6).
struct MoeRouteParams {
  Tensor logits;            // f32 [N, E] router scores
  Tensor per_expert_scale;  // [E] (any float dtype)
  Tensor expert_ids;        // i32 [N, k] out: chosen experts, by descending probability
  Tensor expert_weights;  // f32 [N, k] out: renormalised top-k softmax weights × per-expert scale
};

// Routed expert FFN: out[n] = Σ_j w[n,j] · down_e(gelu_tanh(gate_e(x[n])) ⊙ up_e(x[n]))
// with e = expert_ids[n,j]; experts are accumulated in ascending expert id.
struct MoeExpertsParams {
  Tensor x;               // f32 [N, H]
  Tensor expert_ids;      // i32 [N, k]
  Tensor expert_weights;  // f32 [N, k]
  Tensor gate_up;         // [E, 2·I, H]: rows [0, I) gate, [I, 2I) up
  Tensor down;            // [E, H, I]
  Tensor out;             // f32 [N, H]; must not alias x
  // Every token is a prompt prefill: the backend may take a faster path that
  // is not batch-invariant (the CUDA backend rounds activations to bf16 for
  // grouped tensor-core products), as linear_prefill may. Set it only where
  // every run of a request prefills the same way.
  bool prefill = false;
};

// How one row of logits becomes a distribution on the device: steps 2-6 of
// the sampling pipeline (engine/sampling/sampler.h: temperature, top-k, top-p,
// min-p, renormalisation); penalties are not part of it (they need the row's
// history, which stays on the host). Rows of one call may differ, so the
// parameters travel as a tensor: i32 [M, 4], each row one RowSampling stored
// bit for bit (the float fields as their IEEE bits).
struct RowSampling {
  float temperature = 1.0f;  // 0: greedy (one-hot at the argmax, lowest index on ties)
  int32_t top_k = 0;         // <= 0, or >= V: off
  float top_p = 1.0f;        // (0, 1]; 1: off
  float min_p = 0.0f;        // [0, 1]; 0: off
};
static_assert(sizeof(RowSampling) == 4 * sizeof(int32_t));

// A uniform in [0, 1) as the sampling ops take it: u = bits · 2^-53 with bits
// in [0, 2^53) (Rng::uniform_bits), stored as i64 so every 53-bit value is exact.
inline constexpr double kUniformScale = 1.0 / 9007199254740992.0;  // 2^-53

// Exact speculative acceptance for R rows at once (Leviathan et al.; the
// device form of engine/sampling/speculative.h). Row r owns the window rows
// [b, e) = [row_begin[r], row_begin[r+1]): tokens[b] is its pending token and
// tokens[b+1 .. e-1] its k = e - b - 1 drafts; p[b + j] is the target's
// distribution for draft j (and p[e-1] the bonus distribution), q[q_rows[b+1+j]]
// the drafter's. Draft j is accepted iff accept_draft(p[b+j], q[..], d_j,
// u_j) with u_j = uniforms[b + j] (as bits, see kUniformScale), in order until
// the first rejection; then out[r] = {n, t}: n drafts accepted and t drawn by
// sample() with u = uniforms[e - 1] from residual_distribution(p[b+n], q[..])
// on a rejection, or from p[e-1] when all k were accepted (k = 0: plain
// sampling from p[b]). A row whose distributions hold a NaN or no mass gives
// t = -1 on device backends (the CPU throws).
struct SpeculativeAcceptParams {
  Tensor p;          // f32 [M, V] (process_logits_rows)
  Tensor q;          // f32 [Q, V] (may have 0 rows when no row drafts)
  Tensor tokens;     // i32 [M]
  Tensor q_rows;     // i32 [M]: entries at draft rows in [0, Q); the others unread
  Tensor uniforms;   // i64 [M]
  Tensor row_begin;  // i32 [R + 1]: 0 = row_begin[0] < ... < row_begin[R] = M
  Tensor out;        // i32 [R, 2]
};

// Step 1 of the sampling pipeline (engine/sampling/sampler.h: repetition,
// presence and frequency penalties) on M rows of logits in place, from token
// histories as lists the caller keeps. List l's entries are
// [list_begin[l], list_begin[l + 1]), one per distinct token of a history
// (prompt and generated tokens), with its count among the generated ones (0:
// prompt only). Row m reads list row_list[m] (empty row_list: list m, L = M),
// so that rows of one sequence (its draft steps and verify window) share one
// list, and then its extras: tokens generated after the list was made, still
// on the device (a round's drafts), extra_source[extra_index[m, e]] for the
// e < E with an index >= 0 (empty extra_index: none). A token's count is its
// list count plus its occurrences among the row's extras; each token of the
// list or the extras has its logit x become penalised_logit(x, count, ...)
// (sampler.h) once, bit for bit as the host sampler computes it over the whole
// history; others are left alone. Token ids must lie in [0, V) and be distinct
// within a list, list and extra indices in range (the CPU checks; device
// backends skip an id or index out of range). E <= kMaxPenaltyExtras.
inline constexpr int64_t kMaxPenaltyExtras = 64;
struct PenaltyRowsParams {
  Tensor logits;        // f32 [M, V], changed in place
  Tensor list_begin;    // i32 [L + 1]: 0 = list_begin[0] <= ... <= list_begin[L] <= N
  Tensor tokens;        // i32 [N]
  Tensor counts;        // i32 [N], >= 0
  Tensor penalties;     // f32 [M, 3]: repetition, presence, frequency per row
  Tensor row_list;      // i32 [M], values in [0, L); empty: row m reads list m
  Tensor extra_source;  // i32 [S]: token ids the extras index (with extra_index)
  Tensor extra_index;   // i32 [M, E]: indices into extra_source, -1 = none; empty: no extras
};

// Log-probabilities of raw logits, for the API's logprobs / top_logprobs
// (log_softmax before any sampling step). Output row m reads x = logits[rows[m], :]
// and, with mx = max(x) (in f32, NaNs skipped) and log_sum = log Σ exp(x - mx)
// (each term in f32, the sum in double, rounded to f32), a token t's logprob
// is (x[t] - mx) - log_sum (engine/sampling/logprobs.h):
//   logprobs[m, c] = that of ids[m, c], for C candidate ids per row (C >= 0);
//   top_ids[m, j] = the j-th of the row's n largest entries in torch.topk
//   order (larger first, equal values lower id first, a NaN above any number),
//   top_values[m, j] its logprob.
// Rows must have a finite max (the model's soft-capped logits do). rows and
// ids are data: the CPU throws on a value out of range; device backends skip a
// row out of range and write NaN for an id out of range.
inline constexpr int kMaxTopLogprobs = 20;
struct LogprobRowsParams {
  Tensor logits;      // f32 [R, V]
  Tensor rows;        // i32 [M], values in [0, R)
  Tensor ids;         // i32 [M, C], values in [0, V)
  Tensor logprobs;    // f32 [M, C] out
  Tensor top_ids;     // i32 [M, n] out, 0 <= n <= kMaxTopLogprobs (n = 0: may be empty)
  Tensor top_values;  // f32 [M, n] out (empty when top_ids is)
};

// A recorded sequence of ops (Backend::begin_capture); owned by the caller, used
// only with the backend that recorded it.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
};

// Memory of a backend's device, in bytes.
struct MemoryInfo {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};

// A Backend is also the MemoryResource of its device: allocate()/release()
// give device memory (host memory on the CPU backend).
class Backend : public MemoryResource {
 public:
  ~Backend() override = default;
  Device device() const override = 0;
  virtual const char* name() const = 0;

  // ---- Memory and transfers ----
  // Calls to allocate() (and growths of pinned staging memory) so far: tests
  // assert steady-state steps make none.
  virtual int64_t allocation_count() const = 0;
  // Free and total memory of the device now (the host's available and total
  // memory on the CPU backend), for budgets given as a fraction.
  virtual MemoryInfo memory_info() const = 0;
  // Copies dst.nbytes() bytes from host memory into dst (on this device), and
  // src.nbytes() bytes from src into host memory. Both complete before returning.
  virtual void upload(const void* host, const Tensor& dst) = 0;
  virtual void download(const Tensor& src, void* host) = 0;
  // Queues a copy of dst.nbytes() host bytes into dst behind the work already
  // queued, without waiting for the device: the bytes are taken before it
  // returns (the caller may reuse `host` at once), and later ops see them. For
  // the inputs of decode steps, which must not stall the queue. Default: upload().
  virtual void upload_async(const void* host, const Tensor& dst) { upload(host, dst); }
  // Calls to download() so far (device-to-host readbacks, each a wait for the
  // queue): tests assert what a speculative round reads back.
  virtual int64_t readback_count() const = 0;
  // Waits for all queued work (a no-op on synchronous backends).
  virtual void synchronize() {}
  // Fills t (f32, bf16 or f16) with values uniform in [lo, hi) drawn from a
  // counter-based hash of (seed, element index), rounded to t's dtype: every
  // backend produces the same values (random-weight models, cross-backend tests).
  virtual void fill_uniform(const Tensor& t, uint64_t seed, float lo, float hi) = 0;

  // y[M, N] = x[M, K] · w[N, K]ᵀ. x, y f32; w f32|bf16|f16|i8|f8e4m3 (quantized:
  // with scales). y must not alias x.
  virtual void linear(const Tensor& x, const Tensor& w, const Tensor& y) = 0;
  // y[m, :] = residual[rows[m], :] + x[m, :] · wᵀ, or residual[m, :] + … when rows is
  // empty: a product added to rows picked from a table (DSpark's head steps: base
  // logits plus the Markov term). x f32 [M, K]; w [N, K] as linear() takes it;
  // residual f32 [R, N]; rows i32 [M] on this device, every value in [0, R) (the CPU
  // checks; device backends trust the caller), or empty (then R == M); y f32 [M, N],
  // aliasing none of x, w, residual. Batch invariant: y[m, :] does not depend on M or
  // on the other rows. A backend may fuse the sum into the product (CUDA, bf16 w), so
  // the bits may differ from linear() then add().
  virtual void linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual,
                               const Tensor& rows, const Tensor& y) = 0;
  // Several products of one x (q/k/v, gate/up): each y = x · wᵀ exactly as
  // linear() computes it; a backend may run them as one launch. No y may alias x.
  virtual void linear_multi(const Tensor& x, std::span<const LinearOut> outs) {
    for (const LinearOut& o : outs) linear(x, o.w, o.y);
  }
  // The gated MLP's first half: gate = gelu_tanh(x · w_gateᵀ) ⊙ (x · w_upᵀ), with
  // `up` f32 [M, I] as scratch (its contents afterwards are unspecified). Same
  // results as linear_multi then gelu_mul (the default); a backend may fuse them.
  virtual void linear_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                               const Tensor& gate, const Tensor& up) {
    const LinearOut outs[2] = {{w_gate, gate}, {w_up, up}};
    linear_multi(x, outs);
    gelu_mul(gate, up, gate);
  }
  // linear() for prompt prefill: a backend may use a faster path that is
  // deterministic but not batch invariant (CUDA: cuBLASLt from 17 rows). Never
  // for products whose rows must match a decode step bit for bit.
  virtual void linear_prefill(const Tensor& x, const Tensor& w, const Tensor& y) {
    linear(x, w, y);
  }
  // out[n, :] = table[ids[n], :] · scale. table [V, H] any float, or quantized
  // (row ids[n] dequantized first); ids i32 [N]; out f32 [N, H].
  // An id outside [0, V) throws naming the id.
  virtual void embedding(const Tensor& table, const Tensor& ids, float scale,
                         const Tensor& out) = 0;
  // RMSNorm over the last dimension, in f32: out = x · (mean(x²) + eps)^-½ [· weight].
  // x, out f32 [..., D]; weight [D] any float, or empty for the weightless variant.
  // out may alias x.
  virtual void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) = 0;
  // The post-norm residual update: residual = (residual + rms_norm(x)·weight) · post_scale
  // (post_scale 1 skips the product). x, residual f32 [..., D]; weight [D]. x may be
  // overwritten (with its normalised value). The default composes rms_norm, add and
  // scale; backends may fuse it, computing the same operations in the same order.
  virtual void rms_norm_add(const Tensor& x, const Tensor& weight, float eps,
                            const Tensor& residual, float post_scale = 1.0f) {
    rms_norm(x, weight, eps, x);
    add(residual, x, residual);
    if (post_scale != 1.0f) scale(residual, post_scale, residual);
  }
  // The residual update followed by the next block's input norm:
  // rms_norm_add(x, weight, eps, residual, post_scale), then
  // next_out = rms_norm(residual) · next_weight. Same results as the two calls
  // (the default); next_out f32 like residual, must not alias x or residual.
  virtual void rms_norm_add_norm(const Tensor& x, const Tensor& weight, float eps,
                                 const Tensor& residual, float post_scale,
                                 const Tensor& next_weight, const Tensor& next_out) {
    rms_norm_add(x, weight, eps, residual, post_scale);
    rms_norm(residual, next_weight, eps, next_out);
  }
  // Rotate-half RoPE in place: for each row m and head, pairs (j, j + D/2) rotate by
  // angle positions[m] · inv_freq[j]. x f32 [M, heads, D]; positions i32 [M];
  // inv_freq f32 [D/2] (zeros leave a pair unrotated).
  virtual void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) = 0;
  virtual void attention(const AttentionParams& p) = 0;
  // attention(p) for every entry, in order, with the results of those calls bit
  // for bit: the attention of the sequences of a batched step (one entry a
  // sequence, each over its own cache). No entry's out may alias another's q,
  // k, v or q_positions. The default makes the calls; a backend may serve
  // entries of one geometry with one launch (CUDA: see cuda_attention.cu).
  virtual void attention_batch(std::span<const AttentionParams> entries);
  // See AttentionInputsParams. The default composes rms_norm, rope, copy and store_kv.
  virtual void attention_inputs(const AttentionInputsParams& p);
  // attention_inputs(inputs), then attention(p), as one op: p.q is inputs.q,
  // p.q_positions inputs.positions, and when inputs.k is set, p.k / p.v are the
  // caches inputs.cache_k / cache_v read in place (the new rows are among their
  // keys). out and the cache rows are those of the two calls, bit for bit;
  // inputs.q, k and v hold unspecified values afterwards (a backend may attend
  // without finishing them in place). Ordering promise, which lets a backend
  // read the old keys while the ops before it still run (CUDA: before its
  // inputs are ready): the rows of p.k / p.v at positions below
  // q_positions[0], and q_positions itself, are not written by any op queued
  // since the last embedding() (the start of a forward), which waits for
  // everything queued before it. The default runs the two ops.
  virtual void attention_with_inputs(const AttentionInputsParams& inputs,
                                     const AttentionParams& p) {
    attention_inputs(inputs);
    attention(p);
  }
  // Cache store by device positions: row i of k and v f32 [n, KV, D] goes to row
  // positions[i] mod R of cache_k / cache_v f32|bf16|f8e4m3 [R, KV, D] (one
  // dtype; bf16 rounds to nearest even, as convert does; fp8 quantizes each
  // (row, kv head) vector with its scale by kv_e4m3_quantize_row's rules,
  // engine/core/dtype.h); positions i32 [n] >= 0 and
  // pairwise distinct mod R. Reading positions on the device (not a host offset)
  // is what lets a recorded step write each step's rows where they belong.
  virtual void store_kv(const Tensor& k, const Tensor& v, const Tensor& positions,
                        const Tensor& cache_k, const Tensor& cache_v) = 0;
  // store_kv for every entry, in order (the same cache bytes): the new rows of
  // the sequences of a batched step, each into its own cache. No entry's cache
  // may overlap another entry's inputs. The default makes the calls; a backend
  // may serve them with one launch.
  virtual void store_kv_batch(std::span<const StoreKvParams> entries);
  // out = gelu_tanh(gate) ⊙ up; f32, same shapes; out may alias gate or up.
  virtual void gelu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) = 0;
  // out = gelu_tanh(x); out may alias x.
  virtual void gelu(const Tensor& x, const Tensor& out) = 0;
  // out = a + b (same shapes, f32); out may alias a or b.
  virtual void add(const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  // out = a ⊙ b (same shapes, f32); out may alias a or b.
  virtual void mul(const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  // out = x · s; out may alias x.
  virtual void scale(const Tensor& x, float s, const Tensor& out) = 0;
  // out = cap · tanh(x / cap); out may alias x.
  virtual void softcap(const Tensor& x, float cap, const Tensor& out) = 0;
  // out[m] = index of the largest x[m, :] (lowest index on ties). x f32 [M, N]; out i32 [M].
  virtual void argmax_rows(const Tensor& x, const Tensor& out) = 0;
  // Row-wise softmax in f32; out may alias x.
  virtual void softmax_rows(const Tensor& x, const Tensor& out) = 0;
  // out[m, :] = the indices of the k largest x[m, :], largest first, in
  // torch.topk order: a NaN counts as larger than any number, and equal values
  // keep the lower index first. x f32 [M, N], out i32 [M, k] with 1 <= k <= N.
  virtual void top_k_rows(const Tensor& x, const Tensor& out) = 0;
  // Spreads n candidate scores over rows of V (the assistant's centroid head):
  // out[m, :] = fill_m, then out[m, ids[m, j]] = values[m, j], where fill_m is
  // the smallest non-NaN values[m, :] minus 1 (+inf minus 1 when there is none).
  // values f32 [M, n], ids i32 [M, n] with distinct values in [0, V) per row (the
  // CPU checks the range), out f32 [M, V]; no aliasing.
  virtual void fill_scatter_rows(const Tensor& values, const Tensor& ids, const Tensor& out) = 0;
  // ---- sampling on the device (see RowSampling) ----
  // probs[m, :] = process_logits(logits[m, :]) under params[m] without
  // penalties (engine/sampling/sampler.h), so that a target's p and a drafter's q
  // come out of one pipeline on the device as on the host. logits, probs f32
  // [M, V]; probs may be logits itself (in place); params i32 [M, 4]. A row with
  // a NaN or +inf logit, or only -inf ones: the CPU throws naming the row; device
  // backends fill its probs with NaN, which sample_rows and
  // speculative_accept_rows turn into token -1.
  virtual void process_logits_rows(const Tensor& logits, const Tensor& params,
                                   const Tensor& probs) = 0;
  // out[m] = sample(probs[m, :]) (sampler.h) with u = uniforms[m] · 2^-53: the
  // first token of non-zero probability whose running sum exceeds u · Σ probs[m].
  // probs f32 [M, V] (non-negative), uniforms i64 [M] in [0, 2^53), out i32 [M].
  // A row with a NaN, an infinity or no mass: -1 on device backends (the CPU throws).
  virtual void sample_rows(const Tensor& probs, const Tensor& uniforms, const Tensor& out) = 0;
  // See SpeculativeAcceptParams.
  virtual void speculative_accept_rows(const SpeculativeAcceptParams& p) = 0;
  // See PenaltyRowsParams.
  virtual void apply_penalties_rows(const PenaltyRowsParams& p) = 0;
  // See LogprobRowsParams. No output may alias an input.
  virtual void logprob_rows(const LogprobRowsParams& p) = 0;
  virtual void moe_route(const MoeRouteParams& p) = 0;
  virtual void moe_experts(const MoeExpertsParams& p) = 0;
  // Sizes the backend's own scratch for a model once, so that steady-state steps
  // allocate nothing: attention over up to `max_keys` keys, products whose
  // reduction (K) dimension is at most `max_width`. Calls only ever grow it.
  virtual void reserve_scratch(int64_t max_keys, int64_t max_width) {}
  // Byte copy between same-shaped tensors of the same dtype on this device.
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;
  // dst = src converted element by element, same shape on this device: f32 to
  // bf16 rounds to nearest even (NaN stays NaN; f32_to_bf16, the one rule for a
  // KV cache's rows on every backend), bf16 to f32 is exact; f32 to f8e4m3
  // quantizes each row of the last dimension into dst's scales
  // (kv_e4m3_quantize_row), f8e4m3 to f32 dequantizes (e4m3 value · scale);
  // equal dtypes copy (f8e4m3: the scales too).
  // No aliasing unless src is dst.
  virtual void convert(const Tensor& src, const Tensor& dst) = 0;
  // out[i, ...] = src[idx[i], ...]: whole rows (dim 0) gathered by index. src
  // [R, ...] and out [N, ...] of one 4-byte dtype (f32, i32) with the same row
  // size; idx i32 [N] on this device, every value in [0, R) (the CPU checks;
  // device backends trust the caller). out must not alias src.
  virtual void gather_rows(const Tensor& src, const Tensor& idx, const Tensor& out) = 0;
  // out[b, a, :] = x[a, b, :]. x f32 [A, B, C], out f32 [B, A, C]; no aliasing.
  virtual void transpose01(const Tensor& x, const Tensor& out) = 0;

  // ---- per-op profile (the CLI's --cuda-profile) ----
  // On: every op waits for the device before and after itself and adds its wall
  // time to a table the backend prints to stderr when it is destroyed (at exit
  // for backend_for's backends); no step is recorded meanwhile (supports_graphs()
  // false). For finding where a step's time goes, never for measuring
  // throughput. Not while a step is being recorded. Default: throws for on (the
  // CPU backend has no profile).
  virtual void set_op_profile(bool on);

  // ---- recorded steps (CUDA graphs) ----
  // A backend that supports it records the ops queued between begin_capture()
  // and end_capture() (without running them) and queues them again, with the
  // same arguments, on replay(). Every pointer and scalar is frozen at capture:
  // what changes from step to step must be read from device memory (token ids,
  // positions; see AttentionParams::positions_bound). Between begin and end no
  // upload, download, synchronize or scratch growth may happen (run the same
  // step once unrecorded first). The CPU backend has none (supports_graphs()
  // false; the other calls throw).
  virtual bool supports_graphs() const { return false; }
  virtual void begin_capture();
  virtual std::unique_ptr<StepGraph> end_capture();
  // Queues a recorded step again. Returns false, queuing nothing, when the graph
  // is stale (the backend's scratch moved since it was recorded): record anew.
  virtual bool replay(StepGraph& graph);
};

}  // namespace specula
