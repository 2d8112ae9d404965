// SPDX-License-Identifier: Apache-2.0
// Argument checks every backend's ops share (device checks stay per backend).
// Each throws an Error naming the op and the tensor(s), so a bad call reads the
// same on every device.
#pragma once

#include <array>
#include <cstddef>

#include "engine/core/tensor.h"
#include "engine/ops/backend.h"

namespace specula::ops {

void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype);
// A KV cache tensor: f32, bf16, or f8e4m3 carrying its scales (what SequenceKv
// stores), else an Error naming it.
void check_kv_dtype(const char* op, const char* name, const Tensor& t);
// f32, bf16 or f16.
void check_float(const char* op, const char* name, const Tensor& t);
// A weight matrix of linear or embedding: f32, bf16, f16, or a quantized
// dtype (i8, f8e4m3) of rank 2 that carries its per-row scales.
void check_weight(const char* op, const char* name, const Tensor& t);
void check_rank(const char* op, const char* name, const Tensor& t, int rank);
// Same shape; the message names both tensors and both shapes.
void check_same_shape(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                      const Tensor& b);
// Whether two views share any byte.
bool bytes_overlap(const Tensor& a, const Tensor& b);
// `out` must not share any byte with `in`.
void check_no_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                    const Tensor& in);
// `out` may be `in` itself (same first byte) but must not partially overlap it.
void check_exact_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                       const Tensor& in);

// The dimensions of a checked attention call.
struct AttentionDims {
  int64_t queries = 0;  // S
  int64_t heads = 0;    // query heads
  int64_t head_dim = 0;
  int64_t keys = 0;  // T: ring_keys for a ring, else k.dim(0)
  int64_t kv_heads = 0;
  bool ring = false;
};
// Every dtype, rank, shape and aliasing rule of AttentionParams (device checks
// are the caller's). Throws an Error naming the tensors otherwise.
AttentionDims check_attention(const AttentionParams& p);

// The dimensions of a checked moe_experts call.
// Checks store_kv's arguments (op names the caller); returns the rows written.
struct StoreKvDims {
  int64_t rows = 0;        // n
  int64_t row_floats = 0;  // KV · D
  int64_t cache_rows = 0;  // R
};
StoreKvDims check_store_kv(const char* op, const Tensor& k, const Tensor& v,
                           const Tensor& positions, const Tensor& cache_k, const Tensor& cache_v);

// Checks AttentionInputsParams (shapes, dtypes, the optional cache).
struct AttentionInputsDims {
  int64_t tokens = 0;    // M
  int64_t heads = 0;     // Nh
  int64_t kv_heads = 0;  // KV (0 without k)
  int64_t head_dim = 0;  // D
  bool has_k = false;
  bool has_cache = false;
};
AttentionInputsDims check_attention_inputs(const AttentionInputsParams& p);

// Checks gather_rows' arguments; returns the 4-byte words per row.
struct GatherRowsDims {
  int64_t src_rows = 0;  // R
  int64_t rows = 0;      // N
  int64_t row_words = 0;
};
GatherRowsDims check_gather_rows(const char* op, const Tensor& src, const Tensor& idx,
                                 const Tensor& out);

// Checks linear_residual's arguments other than w's dtype (each backend checks the
// weights it takes); returns {M, N, K, R}.
struct LinearResidualDims {
  int64_t rows = 0, n = 0, k = 0, residual_rows = 0;
};
LinearResidualDims check_linear_residual(const char* op, const Tensor& x, const Tensor& w,
                                         const Tensor& residual, const Tensor& rows,
                                         const Tensor& y);

// Checks top_k_rows' arguments; returns {M, N, k}.
struct TopKDims {
  int64_t rows = 0, n = 0, k = 0;
};
TopKDims check_top_k_rows(const char* op, const Tensor& x, const Tensor& out);
// Checks fill_scatter_rows' arguments; returns {M, n, V}.
struct FillScatterDims {
  int64_t rows = 0, n = 0, width = 0;
};
FillScatterDims check_fill_scatter_rows(const char* op, const Tensor& values, const Tensor& ids,
                                        const Tensor& out);

// Checks process_logits_rows' arguments (the parameter values are data,
// checked where they are read); returns {M, V}.
struct SamplingRowsDims {
  int64_t rows = 0, vocab = 0;
};
SamplingRowsDims check_process_logits_rows(const char* op, const Tensor& logits,
                                           const Tensor& params, const Tensor& probs);
// Checks sample_rows' arguments; returns {M, V}.
SamplingRowsDims check_sample_rows(const char* op, const Tensor& probs, const Tensor& uniforms,
                                   const Tensor& out);
// Checks SpeculativeAcceptParams' dtypes and shapes (offsets and rows are
// data, checked where they are read).
struct SpeculativeAcceptDims {
  int64_t window_rows = 0;  // M
  int64_t q_rows = 0;       // Q
  int64_t rows = 0;         // R
  int64_t vocab = 0;        // V
};
SpeculativeAcceptDims check_speculative_accept(const char* op, const SpeculativeAcceptParams& p);

// Checks LogprobRowsParams' dtypes, shapes and aliasing (rows and ids are
// data, checked where they are read).
struct LogprobRowsDims {
  int64_t rows = 0;        // M
  int64_t logit_rows = 0;  // R
  int64_t vocab = 0;       // V
  int64_t ids = 0;         // C
  int64_t top = 0;         // n
};
LogprobRowsDims check_logprob_rows(const char* op, const LogprobRowsParams& p);

// Checks PenaltyRowsParams' dtypes and shapes (the lists and indices are
// data, checked where they are read).
struct PenaltyRowsDims {
  int64_t rows = 0;    // M
  int64_t vocab = 0;   // V
  int64_t lists = 0;   // L
  int64_t extras = 0;  // E (0: no extras)
};
PenaltyRowsDims check_penalty_rows(const char* op, const PenaltyRowsParams& p);
// PenaltyRowsParams' tensors that are given (logits always, the optional ones
// when not empty) with their field names, for the backends' placement checks
// and the aliasing check (a fixed array: no allocation per call).
struct NamedTensor {
  const char* name = nullptr;
  const Tensor* tensor = nullptr;
};
struct NamedTensors {
  std::array<NamedTensor, 8> items;
  size_t size = 0;
  const NamedTensor* begin() const { return items.data(); }
  const NamedTensor* end() const { return items.data() + size; }
};
NamedTensors penalty_rows_tensors(const PenaltyRowsParams& p);

struct MoeExpertsDims {
  int64_t tokens = 0, hidden = 0, top_k = 0, experts = 0, inter = 0;
};
// Every dtype, rank, shape and aliasing rule of MoeExpertsParams (expert ids
// are data, checked by the backend where it can read them).
MoeExpertsDims check_moe_experts(const MoeExpertsParams& p);

}  // namespace specula::ops
