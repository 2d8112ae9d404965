// SPDX-License-Identifier: Apache-2.0
// CpuBackend: the reference implementation of every op in engine/ops/backend.h
// (whose contract comments are the specification), with Hugging Face Gemma 4
// numerics (gemma4-architecture.md §2, §4, §6). Activations are f32; weights
// may be f32, bf16 or f16. Parallel over rows/heads with OpenMP; matrix
// products are our own fixed-order dot-product kernels (no BLAS).
//
// Determinism (batch invariance): every op computes each output row from its own
// input row(s) with a fixed summation order, so a row's result does not depend
// on how many rows share the call, nor on the thread count. Lossless speculation
// depends on it: decode (1 row), verify (k + 1 rows) and batched rows must agree
// bit for bit.
//
// Thread-safety: calls from several threads at once are safe; the only shared
// state is a reusable scratch buffer that a concurrent caller does without.
#pragma once

#include <atomic>

#include "engine/backend/cpu/cpu_internal.h"
#include "engine/ops/backend.h"

namespace specula {

class CpuBackend final : public Backend {
 public:
  CpuBackend();
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  Device device() const override { return Device::cpu(); }
  const char* name() const override { return "cpu"; }

  // Host memory (aligned), counted.
  void* allocate(size_t bytes) override;
  void release(void* p) noexcept override;
  int64_t allocation_count() const override { return allocations_.load(); }
  MemoryInfo memory_info() const override;
  void upload(const void* host, const Tensor& dst) override;
  void download(const Tensor& src, void* host) override;
  int64_t readback_count() const override { return readbacks_.load(); }
  void fill_uniform(const Tensor& t, uint64_t seed, float lo, float hi) override;
  void transpose01(const Tensor& x, const Tensor& out) override;

  void reserve_scratch(int64_t max_keys, int64_t max_width) override;
  void linear(const Tensor& x, const Tensor& w, const Tensor& y) override;
  void linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual, const Tensor& rows,
                       const Tensor& y) override;
  // The scale is applied in f32 after converting the table row; a caller that
  // wants HF's bf16 rounding of the scale (§2.3) passes the rounded value.
  void embedding(const Tensor& table, const Tensor& ids, float scale, const Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) override;
  void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) override;
  // A query that sees no key produces a zero row.
  void attention(const AttentionParams& p) override;
  void attention_batch(std::span<const AttentionParams> entries) override;
  void gelu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void gelu(const Tensor& x, const Tensor& out) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void mul(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void scale(const Tensor& x, float s, const Tensor& out) override;
  // cap must be positive.
  void softcap(const Tensor& x, float cap, const Tensor& out) override;
  // A NaN counts as the largest value (first NaN wins), as in torch.argmax.
  void argmax_rows(const Tensor& x, const Tensor& out) override;
  // A row that is entirely -inf produces zeros rather than NaN.
  void softmax_rows(const Tensor& x, const Tensor& out) override;
  void top_k_rows(const Tensor& x, const Tensor& out) override;
  // An id outside [0, V) throws (naming it).
  void fill_scatter_rows(const Tensor& values, const Tensor& ids, const Tensor& out) override;
  // Row by row through engine/sampling (cpu_sampling.cpp); invalid rows throw,
  // naming the row.
  void process_logits_rows(const Tensor& logits, const Tensor& params,
                           const Tensor& probs) override;
  void sample_rows(const Tensor& probs, const Tensor& uniforms, const Tensor& out) override;
  void speculative_accept_rows(const SpeculativeAcceptParams& p) override;
  void apply_penalties_rows(const PenaltyRowsParams& p) override;
  // Row by row through engine/sampling/logprobs.h; a row or id out of range throws.
  void logprob_rows(const LogprobRowsParams& p) override;
  void moe_route(const MoeRouteParams& p) override;
  void moe_experts(const MoeExpertsParams& p) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void convert(const Tensor& src, const Tensor& dst) override;
  // An index outside [0, R) throws (naming it).
  void gather_rows(const Tensor& src, const Tensor& idx, const Tensor& out) override;
  // A negative position throws (the CPU can check; see Backend::store_kv).
  void store_kv(const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& cache_k,
                const Tensor& cache_v) override;

 private:
  // Reused by linear / moe_experts for bf16/f16 weight blocks converted to f32.
  cpu::ScratchPool scratch_;
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> readbacks_{0};
};

}  // namespace specula
