// SPDX-License-Identifier: Apache-2.0
// The op contracts live in backend.h; this file holds the argument checks
// every backend shares (op_checks.h).
#include "engine/ops/op_checks.h"

#include <limits>
#include <utility>

#include "engine/ops/backend.h"

namespace specula::ops {

void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  if (t.dtype() != dtype)
    fail("{}: {} must be {}, got {}", op, name, dtype_name(dtype), t.describe());
}

void check_float(const char* op, const char* name, const Tensor& t) {
  const DType d = t.dtype();
  if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16) {
    fail("{}: {} must be f32, bf16 or f16, got {}", op, name, t.describe());
  }
}

void check_weight(const char* op, const char* name, const Tensor& t) {
  if (!is_quantized(t.dtype())) {
    const DType d = t.dtype();
    if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16) {
      fail("{}: {} must be f32, bf16, f16, i8 or f8e4m3, got {}", op, name, t.describe());
    }
    return;
  }
  if (t.rank() != 2) fail("{}: quantized {} must have rank 2, got {}", op, name, t.describe());
  if (t.scale_data() == nullptr)
    fail("{}: quantized {} {} has no per-row scales", op, name, t.describe());
}

void check_rank(const char* op, const char* name, const Tensor& t, int rank) {
  if (t.rank() != rank) fail("{}: {} must have rank {}, got {}", op, name, rank, t.describe());
}

void check_same_shape(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                      const Tensor& b) {
  if (a.shape() != b.shape()) {
    fail("{}: {} {} and {} {} must have the same shape", op, a_name, a.describe(), b_name,
         b.describe());
  }
}

bool bytes_overlap(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data());
  const auto* b0 = static_cast<const char*>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void check_no_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                    const Tensor& in) {
  if (bytes_overlap(out, in)) {
    fail("{}: output {} {} overlaps input {} {}; this op needs a separate output buffer", op,
         out_name, out.describe(), in_name, in.describe());
  }
}

GatherRowsDims check_gather_rows(const char* op, const Tensor& src, const Tensor& idx,
                                 const Tensor& out) {
  check_dtype(op, "idx", idx, DType::kI32);
  check_rank(op, "idx", idx, 1);
  if (src.dtype() != out.dtype() || dtype_size(src.dtype()) != 4) {
    fail("{}: src {} and out {} must share one 4-byte dtype (f32 or i32)", op, src.describe(),
         out.describe());
  }
  if (src.rank() < 1 || out.rank() < 1) {
    fail("{}: src {} and out {} need a row dimension", op, src.describe(), out.describe());
  }
  GatherRowsDims d;
  d.src_rows = src.dim(0);
  d.rows = idx.dim(0);
  d.row_words = d.src_rows > 0 ? src.numel() / d.src_rows : 0;
  const int64_t out_row_words = out.dim(0) > 0 ? out.numel() / out.dim(0) : 0;
  if (out.dim(0) != d.rows || (d.rows > 0 && out_row_words != d.row_words)) {
    fail("{}: out {} must have idx's {} rows of src {}'s row size", op, out.describe(), d.rows,
         src.describe());
  }
  check_no_alias(op, "out", out, "src", src);
  return d;
}

LinearResidualDims check_linear_residual(const char* op, const Tensor& x, const Tensor& w,
                                         const Tensor& residual, const Tensor& rows,
                                         const Tensor& y) {
  check_dtype(op, "x", x, DType::kF32);
  check_dtype(op, "residual", residual, DType::kF32);
  check_dtype(op, "y", y, DType::kF32);
  check_rank(op, "x", x, 2);
  check_rank(op, "w", w, 2);
  check_rank(op, "residual", residual, 2);
  check_rank(op, "y", y, 2);
  const LinearResidualDims d{
      .rows = x.dim(0), .n = w.dim(0), .k = x.dim(1), .residual_rows = residual.dim(0)};
  if (w.dim(1) != d.k) {
    fail("{}: x {} and w {} disagree on K ({} vs {})", op, x.describe(), w.describe(), d.k,
         w.dim(1));
  }
  if (y.dim(0) != d.rows || y.dim(1) != d.n) {
    fail("{}: y {} must be f32[{}, {}] for x {} and w {}", op, y.describe(), d.rows, d.n,
         x.describe(), w.describe());
  }
  if (residual.dim(1) != d.n) {
    fail("{}: residual {} must have w {}'s {} columns", op, residual.describe(), w.describe(), d.n);
  }
  if (rows.empty()) {
    if (d.residual_rows != d.rows) {
      fail("{}: without rows, residual {} must have x {}'s {} rows", op, residual.describe(),
           x.describe(), d.rows);
    }
  } else {
    check_dtype(op, "rows", rows, DType::kI32);
    check_rank(op, "rows", rows, 1);
    if (rows.dim(0) != d.rows) {
      fail("{}: rows {} must have x {}'s {} rows", op, rows.describe(), x.describe(), d.rows);
    }
  }
  check_no_alias(op, "y", y, "x", x);
  check_no_alias(op, "y", y, "w", w);
  check_no_alias(op, "y", y, "residual", residual);
  return d;
}

TopKDims check_top_k_rows(const char* op, const Tensor& x, const Tensor& out) {
  check_dtype(op, "x", x, DType::kF32);
  check_rank(op, "x", x, 2);
  check_dtype(op, "out", out, DType::kI32);
  check_rank(op, "out", out, 2);
  const TopKDims d{.rows = x.dim(0), .n = x.dim(1), .k = out.dim(1)};
  if (out.dim(0) != d.rows || d.k < 1 || d.k > d.n) {
    fail("{}: out {} must be i32 [{}, k] with 1 <= k <= {} for x {}", op, out.describe(), d.rows,
         d.n, x.describe());
  }
  if (d.n > std::numeric_limits<int32_t>::max()) {
    fail("{}: x {} rows are too long for i32 indices", op, x.describe());
  }
  check_no_alias(op, "out", out, "x", x);
  return d;
}

FillScatterDims check_fill_scatter_rows(const char* op, const Tensor& values, const Tensor& ids,
                                        const Tensor& out) {
  check_dtype(op, "values", values, DType::kF32);
  check_rank(op, "values", values, 2);
  check_dtype(op, "ids", ids, DType::kI32);
  check_same_shape(op, "ids", ids, "values", values);
  check_dtype(op, "out", out, DType::kF32);
  check_rank(op, "out", out, 2);
  const FillScatterDims d{.rows = values.dim(0), .n = values.dim(1), .width = out.dim(1)};
  if (out.dim(0) != d.rows || d.n < 1 || d.n > d.width) {
    fail("{}: out {} must have the {} rows of values {}, each at least {} wide", op, out.describe(),
         d.rows, values.describe(), d.n);
  }
  check_no_alias(op, "out", out, "values", values);
  check_no_alias(op, "out", out, "ids", ids);
  return d;
}

SamplingRowsDims check_process_logits_rows(const char* op, const Tensor& logits,
                                           const Tensor& params, const Tensor& probs) {
  check_dtype(op, "logits", logits, DType::kF32);
  check_rank(op, "logits", logits, 2);
  check_dtype(op, "probs", probs, DType::kF32);
  check_same_shape(op, "logits", logits, "probs", probs);
  check_exact_alias(op, "probs", probs, "logits", logits);
  check_dtype(op, "params", params, DType::kI32);
  const SamplingRowsDims d{.rows = logits.dim(0), .vocab = logits.dim(1)};
  if (params.shape() != Shape{d.rows, 4}) {
    fail("{}: params {} must be i32 [{}, 4] (one RowSampling per row of logits {})", op,
         params.describe(), d.rows, logits.describe());
  }
  if (d.rows > 0 && d.vocab == 0) fail("{}: logits {} have empty rows", op, logits.describe());
  if (d.vocab > std::numeric_limits<int32_t>::max()) {
    fail("{}: logits {} rows are too long for i32 token ids", op, logits.describe());
  }
  check_no_alias(op, "probs", probs, "params", params);
  return d;
}

NamedTensors penalty_rows_tensors(const PenaltyRowsParams& p) {
  NamedTensors out;
  for (const NamedTensor& t :
       {NamedTensor{"logits", &p.logits}, NamedTensor{"list_begin", &p.list_begin},
        NamedTensor{"tokens", &p.tokens}, NamedTensor{"counts", &p.counts},
        NamedTensor{"penalties", &p.penalties}, NamedTensor{"row_list", &p.row_list},
        NamedTensor{"extra_source", &p.extra_source}, NamedTensor{"extra_index", &p.extra_index}}) {
    if (t.tensor == &p.logits || !t.tensor->empty()) out.items[out.size++] = t;
  }
  return out;
}

PenaltyRowsDims check_penalty_rows(const char* op, const PenaltyRowsParams& p) {
  check_dtype(op, "logits", p.logits, DType::kF32);
  check_rank(op, "logits", p.logits, 2);
  check_dtype(op, "list_begin", p.list_begin, DType::kI32);
  check_rank(op, "list_begin", p.list_begin, 1);
  check_dtype(op, "tokens", p.tokens, DType::kI32);
  check_dtype(op, "counts", p.counts, DType::kI32);
  check_dtype(op, "penalties", p.penalties, DType::kF32);
  PenaltyRowsDims d{.rows = p.logits.dim(0), .vocab = p.logits.dim(1)};
  if (p.list_begin.numel() < 1) {
    fail("{}: list_begin {} must hold at least one entry (L + 1)", op, p.list_begin.describe());
  }
  d.lists = p.list_begin.dim(0) - 1;
  if (!p.row_list.empty()) {
    check_dtype(op, "row_list", p.row_list, DType::kI32);
    if (p.row_list.shape() != Shape{d.rows}) {
      fail("{}: row_list {} must be i32 [{}] (one list per row of logits {})", op,
           p.row_list.describe(), d.rows, p.logits.describe());
    }
  } else if (d.lists != d.rows) {
    fail("{}: list_begin {} must be i32 [{}] without a row_list (one list per row of logits {})",
         op, p.list_begin.describe(), d.rows + 1, p.logits.describe());
  }
  check_rank(op, "tokens", p.tokens, 1);
  check_same_shape(op, "tokens", p.tokens, "counts", p.counts);
  if (p.penalties.shape() != Shape{d.rows, 3}) {
    fail(
        "{}: penalties {} must be f32 [{}, 3] (repetition, presence, frequency per row of logits "
        "{})",
        op, p.penalties.describe(), d.rows, p.logits.describe());
  }
  if (!p.extra_index.empty()) {
    check_dtype(op, "extra_index", p.extra_index, DType::kI32);
    check_rank(op, "extra_index", p.extra_index, 2);
    if (p.extra_index.dim(0) != d.rows) {
      fail("{}: extra_index {} must have one row per row of logits {}", op,
           p.extra_index.describe(), p.logits.describe());
    }
    d.extras = p.extra_index.dim(1);
    if (d.extras > kMaxPenaltyExtras) {
      fail("{}: extra_index {} names {} extras a row, at most {}", op, p.extra_index.describe(),
           d.extras, kMaxPenaltyExtras);
    }
    if (p.extra_source.empty()) fail("{}: extra_index given without an extra_source", op);
    check_dtype(op, "extra_source", p.extra_source, DType::kI32);
    check_rank(op, "extra_source", p.extra_source, 1);
  }
  if (d.vocab > std::numeric_limits<int32_t>::max()) {
    fail("{}: logits {} rows are too long for i32 token ids", op, p.logits.describe());
  }
  for (const NamedTensor& t : penalty_rows_tensors(p)) {
    if (t.tensor != &p.logits) check_no_alias(op, "logits", p.logits, t.name, *t.tensor);
  }
  return d;
}

SamplingRowsDims check_sample_rows(const char* op, const Tensor& probs, const Tensor& uniforms,
                                   const Tensor& out) {
  check_dtype(op, "probs", probs, DType::kF32);
  check_rank(op, "probs", probs, 2);
  check_dtype(op, "uniforms", uniforms, DType::kI64);
  check_dtype(op, "out", out, DType::kI32);
  const SamplingRowsDims d{.rows = probs.dim(0), .vocab = probs.dim(1)};
  if (uniforms.shape() != Shape{d.rows} || out.shape() != Shape{d.rows}) {
    fail("{}: uniforms {} and out {} must have one entry per row of probs {}", op,
         uniforms.describe(), out.describe(), probs.describe());
  }
  if (d.rows > 0 && d.vocab == 0) fail("{}: probs {} have empty rows", op, probs.describe());
  if (d.vocab > std::numeric_limits<int32_t>::max()) {
    fail("{}: probs {} rows are too long for i32 token ids", op, probs.describe());
  }
  check_no_alias(op, "out", out, "probs", probs);
  check_no_alias(op, "out", out, "uniforms", uniforms);
  return d;
}

LogprobRowsDims check_logprob_rows(const char* op, const LogprobRowsParams& p) {
  check_dtype(op, "logits", p.logits, DType::kF32);
  check_rank(op, "logits", p.logits, 2);
  check_dtype(op, "rows", p.rows, DType::kI32);
  check_rank(op, "rows", p.rows, 1);
  LogprobRowsDims d{.rows = p.rows.dim(0), .logit_rows = p.logits.dim(0), .vocab = p.logits.dim(1)};
  if (d.vocab == 0 || d.vocab > std::numeric_limits<int32_t>::max()) {
    fail("{}: logits {} must have rows of 1 .. 2^31-1 tokens", op, p.logits.describe());
  }
  if (!p.ids.empty() || !p.logprobs.empty()) {
    check_dtype(op, "ids", p.ids, DType::kI32);
    check_rank(op, "ids", p.ids, 2);
    check_dtype(op, "logprobs", p.logprobs, DType::kF32);
    if (p.ids.dim(0) != d.rows || p.logprobs.shape() != p.ids.shape()) {
      fail("{}: ids {} and logprobs {} must both be [{}, C] for rows {}", op, p.ids.describe(),
           p.logprobs.describe(), d.rows, p.rows.describe());
    }
    d.ids = p.ids.dim(1);
  }
  if (!p.top_ids.empty() || !p.top_values.empty()) {
    check_dtype(op, "top_ids", p.top_ids, DType::kI32);
    check_rank(op, "top_ids", p.top_ids, 2);
    check_dtype(op, "top_values", p.top_values, DType::kF32);
    d.top = p.top_ids.dim(1);
    if (p.top_ids.dim(0) != d.rows || p.top_values.shape() != p.top_ids.shape() ||
        d.top > kMaxTopLogprobs || d.top > d.vocab) {
      fail("{}: top_ids {} and top_values {} must both be [{}, n] with n <= {} and n <= V = {}", op,
           p.top_ids.describe(), p.top_values.describe(), d.rows, kMaxTopLogprobs, d.vocab);
    }
  }
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"logprobs", &p.logprobs},
                                {"top_ids", &p.top_ids},
                                {"top_values", &p.top_values}}) {
    if (t->empty()) continue;
    check_no_alias(op, name, *t, "logits", p.logits);
    check_no_alias(op, name, *t, "rows", p.rows);
    if (!p.ids.empty()) check_no_alias(op, name, *t, "ids", p.ids);
  }
  if (!p.logprobs.empty() && !p.top_ids.empty()) {
    check_no_alias(op, "top_ids", p.top_ids, "logprobs", p.logprobs);
    check_no_alias(op, "top_values", p.top_values, "logprobs", p.logprobs);
  }
  if (!p.top_ids.empty()) check_no_alias(op, "top_values", p.top_values, "top_ids", p.top_ids);
  return d;
}

SpeculativeAcceptDims check_speculative_accept(const char* op, const SpeculativeAcceptParams& p) {
  check_dtype(op, "p", p.p, DType::kF32);
  check_rank(op, "p", p.p, 2);
  check_dtype(op, "q", p.q, DType::kF32);
  check_rank(op, "q", p.q, 2);
  const SpeculativeAcceptDims d{
      .window_rows = p.p.dim(0), .q_rows = p.q.dim(0), .rows = p.out.dim(0), .vocab = p.p.dim(1)};
  if (p.q.dim(1) != d.vocab) {
    fail("{}: q {} and p {} must have rows of one vocabulary", op, p.q.describe(), p.p.describe());
  }
  if (d.vocab == 0 || d.vocab > std::numeric_limits<int32_t>::max()) {
    fail("{}: p {} must have rows of 1 .. 2^31-1 tokens", op, p.p.describe());
  }
  check_dtype(op, "tokens", p.tokens, DType::kI32);
  check_dtype(op, "q_rows", p.q_rows, DType::kI32);
  check_dtype(op, "uniforms", p.uniforms, DType::kI64);
  const Shape window{d.window_rows};
  if (p.tokens.shape() != window || p.q_rows.shape() != window || p.uniforms.shape() != window) {
    fail("{}: tokens {}, q_rows {} and uniforms {} must have one entry per row of p {}", op,
         p.tokens.describe(), p.q_rows.describe(), p.uniforms.describe(), p.p.describe());
  }
  check_dtype(op, "row_begin", p.row_begin, DType::kI32);
  check_dtype(op, "out", p.out, DType::kI32);
  check_rank(op, "out", p.out, 2);
  if (p.out.dim(1) != 2 || p.row_begin.shape() != Shape{d.rows + 1}) {
    fail("{}: out {} must be i32 [R, 2] and row_begin {} i32 [R + 1]", op, p.out.describe(),
         p.row_begin.describe());
  }
  if (d.rows > d.window_rows) {
    fail("{}: {} rows cannot share {} window rows (each needs one)", op, d.rows, d.window_rows);
  }
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"p", &p.p},
                                {"q", &p.q},
                                {"tokens", &p.tokens},
                                {"q_rows", &p.q_rows},
                                {"uniforms", &p.uniforms},
                                {"row_begin", &p.row_begin}}) {
    check_no_alias(op, "out", p.out, name, *t);
  }
  return d;
}

void check_exact_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                       const Tensor& in) {
  if (out.data() != in.data() && bytes_overlap(out, in)) {
    fail("{}: output {} {} partially overlaps input {} {}; it may only be the same buffer", op,
         out_name, out.describe(), in_name, in.describe());
  }
}

void check_kv_dtype(const char* op, const char* name, const Tensor& t) {
  if (t.dtype() == DType::kF8E4M3) {
    if (t.scale_data() == nullptr) {
      fail("{}: {} {} is an fp8 KV cache without its per-(token, head) scales", op, name,
           t.describe());
    }
    return;
  }
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16) {
    fail("{}: {} {} must be f32, bf16 or f8e4m3 (a KV cache dtype)", op, name, t.describe());
  }
}

AttentionDims check_attention(const AttentionParams& p) {
  constexpr const char* kOp = "attention";
  check_dtype(kOp, "q", p.q, DType::kF32);
  check_kv_dtype(kOp, "k", p.k);
  check_dtype(kOp, "v", p.v, p.k.dtype());
  check_dtype(kOp, "out", p.out, DType::kF32);
  check_dtype(kOp, "q_positions", p.q_positions, DType::kI32);
  check_rank(kOp, "q", p.q, 3);
  check_rank(kOp, "k", p.k, 3);
  check_same_shape(kOp, "k", p.k, "v", p.v);
  check_same_shape(kOp, "q", p.q, "out", p.out);
  AttentionDims dims;
  dims.queries = p.q.dim(0);
  dims.heads = p.q.dim(1);
  dims.head_dim = p.q.dim(2);
  dims.ring = p.ring_keys >= 0;
  if (dims.ring && (p.ring_keys > p.k.dim(0) || p.k_pos0 < 0)) {
    fail("attention: ring_keys {} at k_pos0 {} do not fit the ring k {}", p.ring_keys, p.k_pos0,
         p.k.describe());
  }
  dims.keys = dims.ring ? p.ring_keys : p.k.dim(0);
  dims.kv_heads = p.k.dim(1);
  if (p.k.dim(2) != dims.head_dim) {
    fail("attention: q {} and k {} disagree on the head dimension ({} vs {})", p.q.describe(),
         p.k.describe(), dims.head_dim, p.k.dim(2));
  }
  if (dims.kv_heads == 0 || dims.heads % dims.kv_heads != 0) {
    fail("attention: q {} has {} heads, which is not a multiple of the {} kv heads of k {}",
         p.q.describe(), dims.heads, dims.kv_heads, p.k.describe());
  }
  if (p.q_positions.shape() != Shape({dims.queries})) {
    fail("attention: q_positions {} must be i32[{}] for q {}", p.q_positions.describe(),
         dims.queries, p.q.describe());
  }
  if (p.window < 0) fail("attention: window must be >= 0 (0 = no window), got {}", p.window);
  if (p.positions_bound < 0 || (p.positions_bound > 0 && !dims.ring && p.k_pos0 != 0)) {
    fail(
        "attention: positions_bound {} needs keys from position 0 or a ring read in place "
        "(k_pos0 {}, ring_keys {})",
        p.positions_bound, p.k_pos0, p.ring_keys);
  }
  check_no_alias(kOp, "out", p.out, "q", p.q);
  check_no_alias(kOp, "out", p.out, "k", p.k);
  check_no_alias(kOp, "out", p.out, "v", p.v);
  check_no_alias(kOp, "out", p.out, "q_positions", p.q_positions);
  return dims;
}

StoreKvDims check_store_kv(const char* op, const Tensor& k, const Tensor& v,
                           const Tensor& positions, const Tensor& cache_k, const Tensor& cache_v) {
  check_dtype(op, "k", k, DType::kF32);
  check_dtype(op, "v", v, DType::kF32);
  check_kv_dtype(op, "cache_k", cache_k);
  check_dtype(op, "cache_v", cache_v, cache_k.dtype());
  check_dtype(op, "positions", positions, DType::kI32);
  check_rank(op, "k", k, 3);
  check_rank(op, "cache_k", cache_k, 3);
  check_same_shape(op, "k", k, "v", v);
  check_same_shape(op, "cache_k", cache_k, "cache_v", cache_v);
  if (k.dim(1) != cache_k.dim(1) || k.dim(2) != cache_k.dim(2)) {
    fail("{}: rows of k {} do not match the rows of cache_k {}", op, k.describe(),
         cache_k.describe());
  }
  if (positions.shape() != Shape({k.dim(0)})) {
    fail("{}: positions {} must be i32[{}] for k {}", op, positions.describe(), k.dim(0),
         k.describe());
  }
  if (k.dim(0) > cache_k.dim(0)) {
    fail("{}: {} rows of k {} cannot land on distinct rows of cache_k {}", op, k.dim(0),
         k.describe(), cache_k.describe());
  }
  check_no_alias(op, "cache_k", cache_k, "k", k);
  check_no_alias(op, "cache_v", cache_v, "v", v);
  check_no_alias(op, "cache_k", cache_k, "cache_v", cache_v);
  return {k.dim(0), k.dim(1) * k.dim(2), cache_k.dim(0)};
}

AttentionInputsDims check_attention_inputs(const AttentionInputsParams& p) {
  constexpr const char* kOp = "attention_inputs";
  check_dtype(kOp, "q", p.q, DType::kF32);
  check_rank(kOp, "q", p.q, 3);
  check_float(kOp, "q_norm", p.q_norm);
  check_dtype(kOp, "positions", p.positions, DType::kI32);
  check_dtype(kOp, "inv_freq", p.inv_freq, DType::kF32);
  AttentionInputsDims d;
  d.tokens = p.q.dim(0);
  d.heads = p.q.dim(1);
  d.head_dim = p.q.dim(2);
  if (d.head_dim % 2 != 0) fail("{}: head dimension of q {} must be even", kOp, p.q.describe());
  if (p.q_norm.shape() != Shape({d.head_dim})) {
    fail("{}: q_norm {} must be [{}] for q {}", kOp, p.q_norm.describe(), d.head_dim,
         p.q.describe());
  }
  if (p.positions.shape() != Shape({d.tokens})) {
    fail("{}: positions {} must be i32[{}] for q {}", kOp, p.positions.describe(), d.tokens,
         p.q.describe());
  }
  if (p.inv_freq.shape() != Shape({d.head_dim / 2})) {
    fail("{}: inv_freq {} must be f32[{}] for q {}", kOp, p.inv_freq.describe(), d.head_dim / 2,
         p.q.describe());
  }
  d.has_k = !p.k.empty();
  if (!d.has_k) {
    if (!p.cache_k.empty()) fail("{}: a cache store needs k (got only q)", kOp);
    return d;
  }
  check_dtype(kOp, "k", p.k, DType::kF32);
  check_dtype(kOp, "v", p.v, DType::kF32);
  check_rank(kOp, "k", p.k, 3);
  check_same_shape(kOp, "k", p.k, "v", p.v);
  check_float(kOp, "k_norm", p.k_norm);
  if (p.k.dim(0) != d.tokens || p.k.dim(2) != d.head_dim) {
    fail("{}: k {} does not match q {} (tokens and head dimension)", kOp, p.k.describe(),
         p.q.describe());
  }
  if (p.k_norm.shape() != Shape({d.head_dim})) {
    fail("{}: k_norm {} must be [{}] for k {}", kOp, p.k_norm.describe(), d.head_dim,
         p.k.describe());
  }
  d.kv_heads = p.k.dim(1);
  check_no_alias(kOp, "k", p.k, "q", p.q);
  check_no_alias(kOp, "v", p.v, "q", p.q);
  check_no_alias(kOp, "v", p.v, "k", p.k);
  d.has_cache = !p.cache_k.empty();
  if (d.has_cache) check_store_kv(kOp, p.k, p.v, p.positions, p.cache_k, p.cache_v);
  return d;
}

MoeExpertsDims check_moe_experts(const MoeExpertsParams& p) {
  constexpr const char* kOp = "moe_experts";
  check_dtype(kOp, "x", p.x, DType::kF32);
  check_rank(kOp, "x", p.x, 2);
  check_dtype(kOp, "expert_ids", p.expert_ids, DType::kI32);
  check_rank(kOp, "expert_ids", p.expert_ids, 2);
  check_dtype(kOp, "expert_weights", p.expert_weights, DType::kF32);
  check_same_shape(kOp, "expert_ids", p.expert_ids, "expert_weights", p.expert_weights);
  check_float(kOp, "gate_up", p.gate_up);
  check_rank(kOp, "gate_up", p.gate_up, 3);
  check_float(kOp, "down", p.down);
  check_rank(kOp, "down", p.down, 3);
  check_dtype(kOp, "out", p.out, DType::kF32);
  check_same_shape(kOp, "x", p.x, "out", p.out);
  MoeExpertsDims dims;
  dims.tokens = p.x.dim(0);
  dims.hidden = p.x.dim(1);
  dims.top_k = p.expert_ids.dim(1);
  dims.experts = p.gate_up.dim(0);
  const int64_t two_i = p.gate_up.dim(1);
  dims.inter = two_i / 2;
  if (p.expert_ids.dim(0) != dims.tokens) {
    fail("moe_experts: expert_ids {} must have one row per token of x {}", p.expert_ids.describe(),
         p.x.describe());
  }
  if (two_i % 2 != 0 || p.gate_up.dim(2) != dims.hidden) {
    fail("moe_experts: gate_up {} must be [E, 2·I, {}] (gate rows then up rows) for x {}",
         p.gate_up.describe(), dims.hidden, p.x.describe());
  }
  if (p.down.shape() != Shape({dims.experts, dims.hidden, dims.inter})) {
    fail("moe_experts: down {} must be [{}, {}, {}] to match gate_up {} and x {}",
         p.down.describe(), dims.experts, dims.hidden, dims.inter, p.gate_up.describe(),
         p.x.describe());
  }
  check_no_alias(kOp, "out", p.out, "x", p.x);
  check_no_alias(kOp, "out", p.out, "expert_ids", p.expert_ids);
  check_no_alias(kOp, "out", p.out, "expert_weights", p.expert_weights);
  check_no_alias(kOp, "out", p.out, "gate_up", p.gate_up);
  check_no_alias(kOp, "out", p.out, "down", p.down);
  return dims;
}

}  // namespace specula::ops

namespace specula {

void Backend::attention_batch(std::span<const AttentionParams> entries) {
  for (const AttentionParams& p : entries) attention(p);
}

void Backend::store_kv_batch(std::span<const StoreKvParams> entries) {
  for (const StoreKvParams& e : entries) store_kv(e.k, e.v, e.positions, e.cache_k, e.cache_v);
}

void Backend::attention_inputs(const AttentionInputsParams& p) {
  const ops::AttentionInputsDims d = ops::check_attention_inputs(p);
  const float eps = p.eps;
  rms_norm(p.q, p.q_norm, eps, p.q);
  rope(p.q, p.positions, p.inv_freq);
  if (!d.has_k) return;
  if (p.v_from_k) copy(p.k, p.v);  // V derives from the raw K projection
  rms_norm(p.k, p.k_norm, eps, p.k);
  rope(p.k, p.positions, p.inv_freq);
  rms_norm(p.v, Tensor(), eps, p.v);
  if (d.has_cache) store_kv(p.k, p.v, p.positions, p.cache_k, p.cache_v);
}

void Backend::set_op_profile(bool on) {
  if (on) fail("{}: this backend has no per-op profile", name());
}

void Backend::begin_capture() {
  fail("{}: this backend cannot record steps (supports_graphs() is false)", name());
}

std::unique_ptr<StepGraph> Backend::end_capture() {
  fail("{}: this backend cannot record steps (supports_graphs() is false)", name());
}

bool Backend::replay(StepGraph&) {
  fail("{}: this backend cannot replay recorded steps", name());
}

}  // namespace specula
