// SPDX-License-Identifier: Apache-2.0
// CudaBackend: every op of engine/ops/backend.h on one NVIDIA GPU (Hopper,
// sm_90a), exact to the CPU reference within the tolerances named in each
// tests/cuda/*_test.cpp. Internal to engine/backend/cuda: the rest of the engine
// reaches it through make_cuda_backend() and the Backend interface.
//
// Numerics: activations f32, weights f32|bf16|f16, f32 accumulation.
// Batch invariance (what lossless speculation needs): for every product of
// linear(), linear_multi() and linear_gelu_mul(), and for attention, a row's
// result depends only on its own inputs: the reduction order is fixed by the
// kernel, never by M or by a heuristic (bf16 products of more than
// kInvariantRows rows run in chunks of kInvariantRows). Only linear_prefill()
// past kPrefillGemmRows rows (prefill) goes through cuBLASLt on bf16 copies of
// the activations (and of f32|f16 weights).
//
// Streams: every op is queued on one stream (stream()); upload/download
// synchronise it, upload_async does not (it stages the bytes in pinned memory). Ops never allocate:
// scratch comes from reserve_scratch() and from buffers grown only when a call is larger than any
// before.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "engine/ops/backend.h"
#include "engine/ops/op_checks.h"

namespace specula::cuda {

// Throws an Error naming the call and CUDA's message when `status` is an error.
void check_cuda(cudaError_t status, const char* what);
void check_cublas(cublasStatus_t status, const char* what);

// Rows at or below which linear() uses the batch-invariant kernel (for bf16
// weights; f32|f16 weights use it at any M).
inline constexpr int64_t kInvariantRows = 256;
// Rows above which linear_prefill() uses cuBLASLt.
inline constexpr int64_t kPrefillGemmRows = 16;

// dst bf16 [n] = bf16(src) (round to nearest even), queued on `stream`; src is
// f32 or f16 (cuda_linear_lt.cu).
void convert_to_bf16(const void* src, DType dtype, void* dst, int64_t n, cudaStream_t stream);

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_index);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::cuda(device_index_); }
  const char* name() const override { return "cuda"; }

  // ---- memory (cuda_backend.cu) ----
  void* allocate(size_t bytes) override;
  void release(void* p) noexcept override;
  int64_t allocation_count() const override { return allocations_.load(); }
  MemoryInfo memory_info() const override;
  void upload(const void* host, const Tensor& dst) override;
  void download(const Tensor& src, void* host) override;
  void upload_async(const void* host, const Tensor& dst) override;
  int64_t readback_count() const override { return readbacks_.load(); }
  void synchronize() override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void convert(const Tensor& src, const Tensor& dst) override;
  void gather_rows(const Tensor& src, const Tensor& idx, const Tensor& out) override;
  void reserve_scratch(int64_t max_keys, int64_t max_width) override;

  // ---- products (cuda_linear.cu) ----
  void linear(const Tensor& x, const Tensor& w, const Tensor& y) override;
  // cuda_linear_residual.cu: one fused pass for bf16 w with K in {64, 128, 256, 512}.
  void linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual, const Tensor& rows,
                       const Tensor& y) override;
  void linear_prefill(const Tensor& x, const Tensor& w, const Tensor& y) override;
  // One launch for all outputs (same per-column arithmetic as linear()).
  void linear_multi(const Tensor& x, std::span<const LinearOut> outs) override;
  // gate and up columns computed by the same warps; gelu_tanh(gate) ⊙ up in the epilogue.
  void linear_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                       const Tensor& gate, const Tensor& up) override;
  // cuda_embedding.cu.
  void embedding(const Tensor& table, const Tensor& ids, float scale, const Tensor& out) override;

  // ---- attention (cuda_attention.cu) ----
  void attention(const AttentionParams& p) override;
  void attention_batch(std::span<const AttentionParams> entries) override;
  void attention_with_inputs(const AttentionInputsParams& inputs,
                             const AttentionParams& p) override;

  // ---- elementwise and reductions (cuda_elementwise.cu) ----
  void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) override;
  void rms_norm_add(const Tensor& x, const Tensor& weight, float eps, const Tensor& residual,
                    float post_scale) override;
  void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) override;

  // ---- fused steps of a layer (cuda_fused.cu) ----
  void rms_norm_add_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& residual,
                         float post_scale, const Tensor& next_weight,
                         const Tensor& next_out) override;
  void attention_inputs(const AttentionInputsParams& p) override;
  void store_kv(const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& cache_k,
                const Tensor& cache_v) override;
  void store_kv_batch(std::span<const StoreKvParams> entries) override;
  void gelu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void gelu(const Tensor& x, const Tensor& out) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void mul(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void scale(const Tensor& x, float s, const Tensor& out) override;
  void softcap(const Tensor& x, float cap, const Tensor& out) override;
  void argmax_rows(const Tensor& x, const Tensor& out) override;
  void softmax_rows(const Tensor& x, const Tensor& out) override;
  void top_k_rows(const Tensor& x, const Tensor& out) override;
  void fill_scatter_rows(const Tensor& values, const Tensor& ids, const Tensor& out) override;
  // One block per output row (cuda_elementwise.cu); see Backend::logprob_rows.
  void logprob_rows(const LogprobRowsParams& p) override;
  void transpose01(const Tensor& x, const Tensor& out) override;
  void fill_uniform(const Tensor& t, uint64_t seed, float lo, float hi) override;

  // ---- sampling on the device (cuda_sampling.cu): one block per row; invalid
  // rows give NaN probabilities and token -1 (see Backend) ----
  void process_logits_rows(const Tensor& logits, const Tensor& params,
                           const Tensor& probs) override;
  void sample_rows(const Tensor& probs, const Tensor& uniforms, const Tensor& out) override;
  void speculative_accept_rows(const SpeculativeAcceptParams& p) override;
  void apply_penalties_rows(const PenaltyRowsParams& p) override;

  // ---- mixture of experts (cuda_moe.cu) ----
  void moe_route(const MoeRouteParams& p) override;
  void moe_experts(const MoeExpertsParams& p) override;
  // moe_experts' prefill path (cuda_moe.cu): grouped tensor-core products.
  void moe_experts_grouped(const MoeExpertsParams& p, int64_t n, int64_t h, int64_t inter,
                           int64_t n_experts, int64_t top_k);

  // ---- per-op profile (cuda_backend.cu; see Backend::set_op_profile and OpTimer) ----
  void set_op_profile(bool on) override;
  bool op_profile() const { return op_profile_; }

  // ---- recorded steps (cuda_backend.cu): CUDA graphs captured on stream() ----
  // Not while the per-op profile is on (it synchronises around every op).
  bool supports_graphs() const override { return !op_profile_; }
  void begin_capture() override;
  std::unique_ptr<StepGraph> end_capture() override;
  // False when the graph is stale (see scratch_generation); throws for a graph
  // of another backend.
  bool replay(StepGraph& graph) override;
  // True between begin_capture() and end_capture(): ops that would synchronise
  // or allocate fail with a clear error instead of breaking the capture.
  bool capturing() const { return capturing_; }
  // Bumped whenever a scratch buffer moves: a graph recorded before points at
  // freed memory, so replay() refuses it.
  uint64_t scratch_generation() const { return scratch_generation_; }
  // Bumped whenever device memory is released: a graph recorded before may
  // point at it (a buffer its key did not name), so replay() refuses it and
  // the caller records the step again. Steady steps release nothing.
  uint64_t release_generation() const { return release_generation_.load(); }

  cudaStream_t stream() const { return stream_; }
  int device_index() const { return device_index_; }

  // Growable device scratch owned by the backend (for cuBLASLt workspace, bf16
  // activation copies, attention partials). grow() allocates only when `bytes`
  // exceeds every earlier request, so steady-state steps allocate nothing.
  struct Scratch {
    void* data = nullptr;
    size_t size = 0;
  };
  void* scratch(Scratch& s, size_t bytes);

  // Members the op files share.
  cublasLtHandle_t lt_handle() const { return lt_; }
  Scratch lt_workspace_;     // cuBLASLt workspace
  Scratch x_bf16_;           // bf16 copy of linear() activations for cuBLASLt
  Scratch w_bf16_;           // bf16 copy of non-bf16 weights for cuBLASLt (rare: f32 goldens)
  Scratch attn_partials_;    // split-sequence attention partial results
  Scratch moe_scratch_;      // grouped-expert bookkeeping
  Scratch attn_scores_;      // prefill attention scores [heads, query tile, keys]
  Scratch attn_kv_f32_;      // prefill attention: a bf16 cache's k and v widened to f32
  Scratch argmax_partials_;  // per-slice partials of argmax_rows
  Scratch x_split_;          // activations split into bf16 terms for the tensor-core products
  Scratch x_split_out_;      // the split a fused gelu product writes of its output (down_proj's x)
  int64_t reserved_keys_ = 0;

  // Ops queued so far (bumped by every op, upload and replay): lets a product
  // know its x was written by the op right before it.
  uint64_t op_seq_ = 0;
  // x_split as a producer left it: the split of `x` [m, k], written by op
  // number `op`. Only the very next op may use it (any op in between could
  // have changed x or x_split); taking it clears it.
  struct ReadySplit {
    const void* x = nullptr;
    int64_t m = 0, k = 0;
    uint64_t op = 0;
    void* split = nullptr;  // where it is: x_split_ or x_split_out_
  };
  ReadySplit ready_split_;
  // Called by a product of x [m, k] (after its OpTimer): the split of x its
  // producer left, or null (then the product splits x into x_split_ itself).
  void* take_ready_split(const Tensor& x, int64_t m, int64_t k) {
    const bool ready = ready_split_.x == x.data() && ready_split_.m == m && ready_split_.k == k &&
                       ready_split_.op + 1 == op_seq_;
    void* split = ready ? ready_split_.split : nullptr;
    ready_split_ = {};
    return split;
  }

 private:
  void linear_rows_above(const Tensor& x, const Tensor& w, const Tensor& y, int64_t gemm_rows);

  int device_index_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> readbacks_{0};
  // Pinned host slots that upload_async copies through, used in turn; a slot is
  // reused once the copy that last read it has run (its event), so the host
  // may run up to kStagingSlots uploads ahead of the device. Like the stream
  // itself, the ring serves one host thread at a time (the model's forwards).
  struct StagingSlot {
    void* host = nullptr;
    size_t size = 0;
    cudaEvent_t copied = nullptr;
  };
  static constexpr int kStagingSlots = 16;
  StagingSlot staging_[kStagingSlots];
  int next_staging_ = 0;
  bool capturing_ = false;
  uint64_t scratch_generation_ = 0;
  std::atomic<uint64_t> release_generation_{0};
  std::mutex scratch_mutex_;

  // The per-op profile: on/off, and calls and seconds per op name, printed by
  // the destructor when any op was timed.
  friend class OpTimer;
  struct ProfileEntry {
    int64_t calls = 0;
    double seconds = 0;
  };
  void print_op_profile();
  bool op_profile_ = false;
  std::mutex profile_mutex_;
  std::map<std::string, ProfileEntry> profile_;
};

// Prefill attention through cuBLASLt (TF32 tensor cores): scores = q·kᵀ per
// head, masked softmax, out = p·v. For AttentionParams with allow_fast_prefill
// and at least kFastPrefillQueries queries, contiguous (non-ring) keys; checked
// by CudaBackend::attention before the call. cuda_attention_prefill.cu.
inline constexpr int64_t kFastPrefillQueries = 64;
// A bf16 cache takes the path too: its keys and values are first widened into
// f32 scratch (attn_kv_f32_) of prefill_widen_bytes(p), which must be at most
// kPrefillWidenBudget (31B's full layers: 64K keys); past it, the partials path.
inline constexpr size_t kPrefillWidenBudget = size_t{1} << 30;
size_t prefill_widen_bytes(const AttentionParams& p);
void attention_prefill_gemm(CudaBackend& be, const AttentionParams& p);

// The first V row of a chunk that attention_with_inputs' fused kernel stages
// only after the scores, in the q rows' space, for a grid of `blocks` blocks of
// `pairs` (query, head) pairs of head dim `head_dim` on the current device; 32
// (the chunk) when every V row comes with K. cuda_attention.cu; for tests.
int attention_fused_late_v_rows(int head_dim, int pairs, int64_t blocks);

// Per-op wall-time profile, on after CudaBackend::set_op_profile(true) (the
// CLI's --cuda-profile): every op synchronizes before and after itself and adds
// its time to the backend's table, printed to stderr when the backend is
// destroyed. Serializes the stream: for finding where a step's time goes, never
// for measuring throughput. Bumps op_seq_ either way.
class OpTimer {
 public:
  OpTimer(CudaBackend& be, const char* op);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  CudaBackend* be_ = nullptr;  // null when profiling is off
  const char* op_;
  double start_ = 0;
};

// Shape/dtype/device checks shared by the op files; each throws an Error that
// names the op and the tensor (same wording as the CPU backend's).
void check_on(const CudaBackend& be, const char* op, const char* name, const Tensor& t);
// The device-independent checks (engine/ops/op_checks.h).
using ops::check_dtype;
using ops::check_exact_alias;
using ops::check_float;
using ops::check_no_alias;
using ops::check_rank;
using ops::check_same_shape;
using ops::check_weight;

// Launch geometry helper: blocks of `threads` covering n items (at least 1).
inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>(n <= 0 ? 1 : (n + threads - 1) / threads);
}

}  // namespace specula::cuda
