// SPDX-License-Identifier: Apache-2.0
// rope and attention (gemma4-architecture.md §2.4-§2.6).

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/backend/cpu/cpu_backend.h"

namespace specula {

void CpuBackend::rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) {
  constexpr const char* kOp = "rope";
  cpu::check_host(kOp, "x", x);
  cpu::check_host(kOp, "positions", positions);
  cpu::check_host(kOp, "inv_freq", inv_freq);
  cpu::check_dtype(kOp, "x", x, DType::kF32);
  cpu::check_rank(kOp, "x", x, 3);
  cpu::check_dtype(kOp, "positions", positions, DType::kI32);
  cpu::check_dtype(kOp, "inv_freq", inv_freq, DType::kF32);
  const int64_t m_rows = x.dim(0);
  const int64_t heads = x.dim(1);
  const int64_t d = x.dim(2);
  if (d % 2 != 0) fail("rope: head dimension of x {} must be even", x.describe());
  const int64_t half = d / 2;
  if (positions.shape() != Shape({m_rows})) {
    fail("rope: positions {} must be i32[{}] for x {}", positions.describe(), m_rows, x.describe());
  }
  if (inv_freq.shape() != Shape({half})) {
    fail("rope: inv_freq {} must be f32[{}] (half the head dimension) for x {}",
         inv_freq.describe(), half, x.describe());
  }
  cpu::check_no_alias(kOp, "x", x, "positions", positions);
  cpu::check_no_alias(kOp, "x", x, "inv_freq", inv_freq);
  // The per-row cos/sin tables live on the stack (no allocation per step).
  constexpr int64_t kMaxHalf = 1024;
  if (half > kMaxHalf) fail("rope: head dimension {} exceeds the supported {}", d, 2 * kMaxHalf);
  if (x.numel() == 0) return;
  const int32_t* pos = positions.data_as<const int32_t>();
  const float* freq = inv_freq.data_as<const float>();
  float* data = x.data_as<float>();
  cpu::parallel_for(m_rows, cpu::worth_parallel(m_rows * heads * d * 4),
                    [&](int64_t m0, int64_t m1, int) {
                      float cos_t[kMaxHalf];
                      float sin_t[kMaxHalf];
                      for (int64_t m = m0; m < m1; ++m) {
                        // As HF: angle = float(position) * inv_freq in f32, then f32 cos/sin.
                        const auto p = static_cast<float>(pos[m]);
                        for (int64_t j = 0; j < half; ++j) {
                          const float angle = p * freq[j];
                          cos_t[static_cast<size_t>(j)] = std::cos(angle);
                          sin_t[static_cast<size_t>(j)] = std::sin(angle);
                        }
                        for (int64_t h = 0; h < heads; ++h) {
                          float* row = data + (m * heads + h) * d;
                          for (int64_t j = 0; j < half; ++j) {
                            const float x1 = row[j];
                            const float x2 = row[j + half];
                            const float c = cos_t[static_cast<size_t>(j)];
                            const float s = sin_t[static_cast<size_t>(j)];
                            row[j] = x1 * c - x2 * s;
                            row[j + half] = x2 * c + x1 * s;
                          }
                        }
                      }
                    });
}

namespace {

// One checked attention call, resolved to what each of its (query, head)
// items reads and writes. run() is the whole arithmetic of one item, so a
// batch of calls (attention_batch) gives each item the bits of its own call.
struct AttentionJob {
  const float* q = nullptr;
  const char* k = nullptr;
  const char* v = nullptr;
  const float* k_scales = nullptr;  // fp8 only
  const float* v_scales = nullptr;
  size_t elem = 0;  // bytes of a cache element
  const int32_t* q_pos = nullptr;
  float* out = nullptr;
  int64_t s_len = 0, n_heads = 0, n_kv = 0, group = 1, d = 0, t_len = 0;
  int64_t k_pos0 = 0, window = 0, ring_rows = 0;
  bool causal = true, ring = false, bf16 = false, fp8 = false;
  float scale = 1.0f;

  // Widened bf16 / dequantized fp8 rows are staged on the stack.
  static constexpr int64_t kMaxRow = 1024;

  int64_t items() const { return s_len * n_heads; }
  int64_t score_len() const { return std::max<int64_t>(t_len, 1); }

  // Output row (query i, head h) for item ih = i · n_heads + h; `scores` holds
  // score_len() floats of the calling thread.
  void run(int64_t ih, float* scores) const {
    const int64_t i = ih / n_heads;
    const int64_t h = ih % n_heads;
    float* o = out + (i * n_heads + h) * d;
    // Key j (absolute position k_pos0 + j) is visible iff
    // (!causal || kp <= qp) && (window == 0 || kp > qp - window).
    const int64_t qp = q_pos[i];
    int64_t lo = 0;
    int64_t hi = t_len - 1;
    if (causal) hi = std::min(hi, qp - k_pos0);
    if (window > 0) lo = std::max(lo, qp - window + 1 - k_pos0);
    if (lo > hi) {
      std::fill(o, o + d, 0.0f);  // nothing visible: zeros, not 0/0
      return;
    }
    const float* qr = q + (i * n_heads + h) * d;
    const int64_t kvh = h / group;
    float widened[kMaxRow];
    // Row kr of kv head kvh of `base` (k or v, with its scales when fp8), as f32.
    auto row = [&](const char* base, const float* scales, int64_t kr) -> const float* {
      const int64_t at = kr * n_kv + kvh;  // (token, kv head) row
      const char* r = base + static_cast<size_t>(at) * static_cast<size_t>(d) * elem;
      if (fp8) {
        cpu::dequantize_to_f32(r, DType::kF8E4M3, scales[at], widened, d);
        return widened;
      }
      if (!bf16) return reinterpret_cast<const float*>(r);
      const auto* b = reinterpret_cast<const uint16_t*>(r);
      for (int64_t e = 0; e < d; ++e) widened[e] = bf16_to_f32(b[e]);
      return widened;
    };
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t j = lo; j <= hi; ++j) {
      const int64_t kr = ring ? (k_pos0 + j) % ring_rows : j;
      const float sc = scale * cpu::dot(qr, row(k, k_scales, kr), d);
      scores[j - lo] = sc;
      max_score = std::max(max_score, sc);
    }
    double sum = 0.0;
    for (int64_t j = lo; j <= hi; ++j) {
      float& e = scores[j - lo];
      e = std::exp(e - max_score);
      sum += e;
    }
    const auto denom = static_cast<float>(sum);
    std::fill(o, o + d, 0.0f);
    for (int64_t j = lo; j <= hi; ++j) {
      const float prob = scores[j - lo] / denom;
      const int64_t kr = ring ? (k_pos0 + j) % ring_rows : j;
      cpu::axpy(prob, row(v, v_scales, kr), o, d);
    }
  }
};

// Checks p (an Error names the tensor otherwise) and resolves it.
AttentionJob prepare_attention(const AttentionParams& p) {
  constexpr const char* kOp = "attention";
  cpu::check_host(kOp, "q", p.q);
  cpu::check_host(kOp, "k", p.k);
  cpu::check_host(kOp, "v", p.v);
  cpu::check_host(kOp, "out", p.out);
  cpu::check_host(kOp, "q_positions", p.q_positions);
  const ops::AttentionDims dims = ops::check_attention(p);
  AttentionJob job;
  job.s_len = dims.queries;
  job.n_heads = dims.heads;
  job.d = dims.head_dim;
  job.ring = dims.ring;
  job.ring_rows = p.k.dim(0);
  job.t_len = dims.keys;
  job.n_kv = dims.kv_heads;
  if (p.out.numel() == 0) {
    job.s_len = 0;  // nothing to do
    return job;
  }
  job.group = job.n_heads / job.n_kv;
  job.q = p.q.data_as<const float>();
  // A bf16 cache's rows are widened to f32 (exact) one at a time, an fp8
  // cache's rows dequantized (e4m3_to_f32(q) · scale, one f32 product, as
  // Tensor::scales defines), and go through the same dot / axpy as f32 rows:
  // results equal those of an f32 cache holding the same (rounded) values.
  job.bf16 = p.k.dtype() == DType::kBF16;
  job.fp8 = p.k.dtype() == DType::kF8E4M3;
  if ((job.bf16 || job.fp8) && job.d > AttentionJob::kMaxRow)
    fail("attention: head dimension {} of a {} k {} exceeds {}", job.d, p.k.dtype(), p.k.describe(),
         AttentionJob::kMaxRow);
  job.k_scales = p.k.scale_data();
  job.v_scales = p.v.scale_data();
  job.k = static_cast<const char*>(p.k.data());
  job.v = static_cast<const char*>(p.v.data());
  job.elem = dtype_size(p.k.dtype());
  job.q_pos = p.q_positions.data_as<const int32_t>();
  job.out = p.out.data_as<float>();
  job.k_pos0 = p.k_pos0;
  job.causal = p.causal;
  job.window = p.window;
  job.scale = p.scale;
  return job;
}

}  // namespace

// Each (query, head) is independent and its visible keys form one contiguous
// range, computed directly rather than by testing every key. One score row per
// thread, borrowed from the backend's scratch (no allocation per step).
void CpuBackend::attention(const AttentionParams& p) {
  const AttentionJob job = prepare_attention(p);
  if (job.items() == 0) return;
  const int team = cpu::team_size();
  cpu::ScratchPool::Lease lease(scratch_,
                                static_cast<size_t>(team) * static_cast<size_t>(job.score_len()));
  float* score_rows = lease.data();
  cpu::parallel_for_each(job.items(), cpu::worth_parallel(job.items() * job.score_len() * job.d),
                         [&](int64_t ih, int slot) {
                           job.run(ih, score_rows + static_cast<int64_t>(slot) * job.score_len());
                         });
}

// The items of every entry in one parallel pass (a batched step's sequences
// share the thread team's wake-ups instead of taking one each); every item is
// computed by its own call's arithmetic, so the bits are those of the
// separate calls. The jobs live in a per-thread list that keeps its capacity
// (no allocation in steady state; concurrent callers do not share it).
void CpuBackend::attention_batch(std::span<const AttentionParams> entries) {
  // References to this thread's lists: the worker threads read them through the
  // references (a thread_local named inside the loop body would be theirs).
  thread_local std::vector<AttentionJob> tls_jobs;
  thread_local std::vector<int64_t> tls_first_item;
  std::vector<AttentionJob>& jobs = tls_jobs;
  std::vector<int64_t>& first_item = tls_first_item;  // jobs[j]'s first item in the pass
  jobs.clear();
  first_item.clear();
  int64_t items = 0, score_len = 1, work = 0;
  for (const AttentionParams& p : entries) {
    const AttentionJob job = prepare_attention(p);
    if (job.items() == 0) continue;
    jobs.push_back(job);
    first_item.push_back(items);
    items += job.items();
    score_len = std::max(score_len, job.score_len());
    work += job.items() * job.score_len() * job.d;
  }
  if (items == 0) return;
  const int team = cpu::team_size();
  cpu::ScratchPool::Lease lease(scratch_,
                                static_cast<size_t>(team) * static_cast<size_t>(score_len));
  float* score_rows = lease.data();
  cpu::parallel_for(items, cpu::worth_parallel(work), [&](int64_t begin, int64_t end, int slot) {
    float* scores = score_rows + static_cast<int64_t>(slot) * score_len;
    // The job of item `begin`, then forward through the range.
    size_t j = static_cast<size_t>(std::upper_bound(first_item.begin(), first_item.end(), begin) -
                                   first_item.begin() - 1);
    for (int64_t it = begin; it < end; ++it) {
      while (j + 1 < jobs.size() && it >= first_item[j + 1]) ++j;
      jobs[j].run(it - first_item[j], scores);
    }
  });
}

}  // namespace specula
