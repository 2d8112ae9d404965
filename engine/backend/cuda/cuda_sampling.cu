// SPDX-License-Identifier: Apache-2.0
// The device sampling ops: process_logits_rows, sample_rows and
// speculative_accept_rows (contracts in engine/ops/backend.h; the CPU backend
// runs engine/sampling itself, and tests/cuda/sampling_test.cpp holds these
// kernels to it).
//
// 1,024-thread blocks: a cluster of eight per row for process_logits_rows (the
// radix passes of top-k and top-p would keep one SM busy for ~0.6 ms at
// V = 262,144), one per row for the others; a vocabulary row (262,144 floats)
// is read a few times from L2. Numerics follow the host pipeline operation for
// operation: weights exp((l - max) / T) in f32 (exp_f32: a double exp rounded
// once, as close to glibc's expf as f32 gets), sums in double, probabilities
// float(w · (1 / Σw)). Only the order of the double sums differs from the
// CPU's, which shows in the f32 results at most as an ulp, and in a choice only
// when a uniform falls within ~1e-15 of a boundary of the CDF.
//
// Selections are exact and deterministic: the top-k threshold is the k-th
// largest logit found by a radix select (integer histograms), and the top-p
// threshold w* by a radix select over the weights' bits whose histogram masses
// are fixed-point integers (2^-43 units at V = 262,144, so the sums do not
// depend on the order they are added in). Which tokens survive is then
// settled by exact double sums: every token above w*, plus the lowest-id tokens
// tied with w* that the nucleus needs, as the CPU's sort by (weight desc, id
// asc) keeps them. The fixed-point error (at most V · 2^-43 ≈ 3e-8 of the
// mass) can move w* only when top_p · Σw lies that close to a partial sum.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_device_common.cuh"
#include "engine/backend/cuda/cuda_launch.cuh"

namespace specula::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr float kInf = std::numeric_limits<float>::infinity();

__device__ __forceinline__ int lane_id() {
  return static_cast<int>(threadIdx.x % 32);
}
__device__ __forceinline__ int warp_id() {
  return static_cast<int>(threadIdx.x / 32);
}

// ---- block reductions: every thread calls, every thread gets the result ----

__device__ __forceinline__ double block_sum(double v, double* partials) {
  return fixed_block_sum<kThreads>(v, partials);
}

__device__ __forceinline__ long long block_sum(long long v, long long* partials) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (lane_id() == 0) partials[warp_id()] = v;
  __syncthreads();
  long long total = 0;
  for (int w = 0; w < kWarps; ++w) total += partials[w];
  __syncthreads();
  return total;
}

// Loads this many row elements per thread before using any: one load in
// flight per thread left a pass over a 1 MB row latency bound (~85 us on an
// H200 SM instead of ~10).
constexpr int kBatch = 8;

// f(j, x, valid) for this thread's elements j = lo + tid, lo + tid + kThreads,
// ... of [lo, hi), in increasing j (the order of the plain strided loop, so
// sums keep their bits), with x = load(j); kBatch loads are issued together. f
// is also called past the end (valid false, x = 0) so that every lane of a warp
// calls it equally often (for warp-collective work inside f).
template <typename Load, typename F>
__device__ __forceinline__ void stream_range(long long lo, long long hi, Load load, F f) {
  for (long long base = lo; base < hi; base += static_cast<long long>(kThreads) * kBatch) {
    float x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const long long j = base + u * kThreads + threadIdx.x;
      x[u] = j < hi ? load(j) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const long long j = base + u * kThreads + threadIdx.x;
      f(j, x[u], j < hi);
    }
  }
}
// stream_range over a whole row of n.
template <typename Load, typename F>
__device__ __forceinline__ void stream_row(long long n, Load load, F f) {
  stream_range(0, n, load, f);
}

// The largest value with the lowest index on ties (idx == n: none yet).
struct Best {
  float value;
  long long idx;
};
__device__ __forceinline__ Best better_of(Best a, Best b) {
  return (b.value > a.value || (b.value == a.value && b.idx < a.idx)) ? b : a;
}
__device__ Best block_best(Best v, float* values, long long* ids) {
  for (int m = 16; m > 0; m >>= 1) {
    const Best o{__shfl_xor_sync(0xffffffffu, v.value, m), __shfl_xor_sync(0xffffffffu, v.idx, m)};
    v = better_of(v, o);
  }
  if (lane_id() == 0) values[warp_id()] = v.value, ids[warp_id()] = v.idx;
  __syncthreads();
  Best total{values[0], ids[0]};
  for (int w = 1; w < kWarps; ++w) total = better_of(total, Best{values[w], ids[w]});
  __syncthreads();
  return total;
}

// A float as a 32-bit key in value order (-0 taken as +0), and back.
__device__ __forceinline__ uint32_t ordered_key(float x) {
  const uint32_t bits = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

struct SampleShared {
  double sums[kWarps];
  long long last[kWarps];
  int bad[kWarps];
  double base, target;
  int chunk, sub;
  int result;
};

// Sum over this warp's lanes of value(j) > 0 for j in [lo, hi) read
// coalesced (lane l takes lo + l, lo + l + 32, ...); every lane gets it, and
// (last) the highest such j. Flags a NaN, infinite or negative value in *bad.
template <typename Value>
__device__ __forceinline__ double warp_range_sum(Value value, long long lo, long long hi, int* bad,
                                                 long long* last) {
  double sum = 0.0;
  int b = 0;
  long long l = -1;
  for (long long j0 = lo + lane_id(); j0 < hi; j0 += 32 * kBatch) {
    float x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) x[u] = j0 + 32 * u < hi ? value(j0 + 32 * u) : 0.0f;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (!(x[u] >= 0.0f) || x[u] == kInf) {
        b = 1;
      } else if (x[u] > 0.0f) {
        sum += x[u];
        l = j0 + 32 * u;
      }
    }
  }
  *bad = __any_sync(0xffffffffu, b);
  for (int m = 16; m > 0; m >>= 1) l = max(l, __shfl_xor_sync(0xffffffffu, l, m));
  *last = l;
  return warp_sum(sum);
}

// Thread 0: the first of `count` partial sums (sh.sums) whose running total
// from sh.base passes sh.target; sh.base becomes the total before it. With
// none (rounding at the end of the CDF), the last one with mass.
__device__ __forceinline__ int find_crossing(SampleShared& sh, int count) {
  double cum = sh.base;
  int last_with_mass = -1;
  for (int w = 0; w < count; ++w) {
    if (sh.sums[w] > 0.0) {
      if (cum + sh.sums[w] > sh.target) {
        sh.base = cum;
        return w;
      }
      last_with_mass = w;
    }
    cum += sh.sums[w];
  }
  if (last_with_mass >= 0) {
    cum = sh.base;
    for (int w = 0; w < last_with_mass; ++w) cum += sh.sums[w];
    sh.base = cum;
  }
  return last_with_mass;
}

// sample_at() over value(0 .. n-1) with uniform u, by the whole block: the
// first j with value(j) > 0 whose running sum exceeds u · Σ value. Three
// levels, each read coalesced: the block's 32 chunks (one per warp) give the
// chunk where the CDF passes u · Σ, that chunk's 32 sub-chunks (one per warp)
// the sub-chunk, and one warp scans the sub-chunk 32 values at a time. -1 when
// a value is NaN, infinite or negative, or nothing has mass.
template <typename Value>
__device__ int block_sample(Value value, long long n, double u, SampleShared& sh) {
  const int lane = lane_id(), warp = warp_id();
  // Chunks of a multiple of 32 · 32 values, so sub-chunks are whole warps' loads.
  const long long chunk = ((n + kWarps - 1) / kWarps + 1023) / 1024 * 1024;
  const long long sub = chunk / kWarps;
  int bad = 0;
  long long last = -1;
  const long long lo = warp * chunk;
  const double sum = warp_range_sum(value, lo, min(n, lo + chunk), &bad, &last);
  if (lane == 0) sh.sums[warp] = sum, sh.bad[warp] = bad, sh.last[warp] = last;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    int any_bad = 0;
    for (int w = 0; w < kWarps; ++w) total += sh.sums[w], any_bad |= sh.bad[w];
    sh.chunk = -1;
    sh.result = -1;
    if (!any_bad && total > 0.0) {
      sh.base = 0.0;
      sh.target = u * total;
      sh.chunk = find_crossing(sh, kWarps);
    }
  }
  __syncthreads();
  if (sh.chunk < 0) return sh.result;
  // Level 2: the chunk's sub-chunks.
  const long long sub_lo = sh.chunk * chunk + warp * sub;
  const double sub_sum = warp_range_sum(value, sub_lo, min(n, sub_lo + sub), &bad, &last);
  __syncthreads();  // every thread has read sh.chunk
  if (lane == 0) sh.sums[warp] = sub_sum, sh.last[warp] = last;
  __syncthreads();
  if (threadIdx.x == 0) sh.sub = find_crossing(sh, kWarps);
  __syncthreads();
  // Level 3: warp 0 scans the sub-chunk.
  if (warp == 0) {
    const long long s_lo = sh.chunk * chunk + sh.sub * sub, s_hi = min(n, s_lo + sub);
    double running = sh.base;
    long long found = -1;
    for (long long j0 = s_lo; j0 < s_hi && found < 0; j0 += 32) {
      const long long j = j0 + lane;
      const float x = j < s_hi ? value(j) : 0.0f;
      double incl = x > 0.0f ? static_cast<double>(x) : 0.0;
      for (int o = 1; o < 32; o <<= 1) {
        const double t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      const unsigned crossing = __ballot_sync(0xffffffffu, x > 0.0f && running + incl > sh.target);
      if (crossing) found = j0 + __ffs(crossing) - 1;
      running += __shfl_sync(0xffffffffu, incl, 31);
    }
    // No crossing (rounding): the sub-chunk's last token with mass ends the CDF.
    if (lane == 0) sh.result = static_cast<int>(found >= 0 ? found : sh.last[sh.sub]);
  }
  __syncthreads();
  return sh.result;
}

// ---- radix histograms ----
// Warp-private histograms in dynamic shared memory: warp w counts into
// count[w][bin] (and mass[w][bin]). Lanes of a warp that fall into one bin are
// merged first (__match_any_sync), and that group's leader alone adds, so no
// address is ever contended and no atomics are needed; the warps' histograms
// are then summed per bin in warp order. Logits that share a bin by the
// hundred thousand (the centroid head's filler, near-uniform rows) cost no more
// than spread ones.
constexpr unsigned kNoBin = 0xffffffffu;
constexpr size_t kHistBytes =
    size_t{kWarps} * kBins * (sizeof(unsigned) + sizeof(unsigned long long));

struct RadixHist {
  unsigned* count;           // [kWarps][kBins]
  unsigned long long* mass;  // [kWarps][kBins]
  unsigned* total_count;     // [kBins] (shared, static)
  unsigned long long* total_mass;
};

__device__ __forceinline__ void hist_clear(const RadixHist& h, bool with_mass) {
  for (int i = threadIdx.x; i < kWarps * kBins; i += kThreads) {
    h.count[i] = 0;
    if (with_mass) h.mass[i] = 0;
  }
}

// Adds this lane's element to its warp's histogram (bin kNoBin: none). Every
// lane of the warp calls it together. A warp whose lanes all share one bin
// (near-uniform rows, the centroid filler) sums its fixed-point masses (fx <
// 2^44) with one full-warp reduction in two 22-bit halves, which 32 lanes
// cannot overflow; otherwise each lane adds its mass with a shared atomic
// (integer: the order does not show), contended only within its bin's group.
// (Reductions over each group's own mask were measured ~8x slower: the groups
// ran one after another.)
__device__ __forceinline__ void hist_add(const RadixHist& h, unsigned bin, unsigned long long fx,
                                         bool with_mass) {
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (bin == kNoBin) return;
  const int at = warp_id() * kBins + static_cast<int>(bin);
  const bool leader = lane_id() == __ffs(peers) - 1;
  if (peers == 0xffffffffu) {  // the same for every lane of the warp
    unsigned long long sum = 0;
    if (with_mass) {
      const unsigned lo = __reduce_add_sync(0xffffffffu, static_cast<unsigned>(fx & 0x3fffffu));
      const unsigned hi = __reduce_add_sync(0xffffffffu, static_cast<unsigned>(fx >> 22));
      sum = (static_cast<unsigned long long>(hi) << 22) + lo;
    }
    if (leader) {
      h.count[at] += 32;
      if (with_mass) h.mass[at] += sum;
    }
    return;
  }
  if (leader) h.count[at] += __popc(peers);
  if (with_mass) atomicAdd(&h.mass[at], fx);
}

// After a __syncthreads: total[bin] = Σ over warps, in warp order.
__device__ __forceinline__ void hist_merge(const RadixHist& h, bool with_mass) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    unsigned c = 0;
    unsigned long long m = 0;
    for (int w = 0; w < kWarps; ++w) {
      c += h.count[w * kBins + b];
      if (with_mass) m += h.mass[w * kBins + b];
    }
    h.total_count[b] = c;
    if (with_mass) h.total_mass[b] = m;
  }
}

// ---- process_logits_rows ----
//
// A row is processed by a cluster of kRowBlocks blocks (one SM each), block r
// taking the slice [r · span, (r + 1) · span) of the vocabulary: a batch-1 call
// then streams its row with 8 SMs instead of one. Everything the pipeline
// decides for the whole row (the argmax, the top-k key, the weights' sum, the
// top-p threshold and its ties, the kept mass) comes from per-block partials
// combined through distributed shared memory in rank order after a cluster
// barrier: every block combines the same partials in the same order, so all of
// them take the same decisions, and a row's bits do not depend on the other
// rows of the call.
constexpr int kRowBlocks = 8;

// One block's partials for a cluster exchange (thread 0 fills them).
struct RowPartials {
  double d;
  long long i[3];
  float f;
};

// Every thread of the row's blocks calls it together after thread 0 of each
// block filled `mine`; visit(r, partials of block r) runs in every thread for
// r = 0 .. kRowBlocks - 1 in order. The barriers on both sides order the
// writes before the reads and the reads before anyone's next write (or exit).
template <typename Visit>
__device__ __forceinline__ void row_exchange(RowPartials& mine, Visit visit) {
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  for (int r = 0; r < kRowBlocks; ++r) visit(r, *cluster.map_shared_rank(&mine, r));
  cluster.sync();
}

// The row's histogram: row_count[b] (and row_mass[b]) = Σ over the blocks, in
// rank order, of their hist_merge totals.
__device__ __forceinline__ void row_hist_total(unsigned* block_count,
                                               unsigned long long* block_mass, unsigned* row_count,
                                               unsigned long long* row_mass, bool with_mass) {
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    unsigned c = 0;
    unsigned long long m = 0;
    for (int r = 0; r < kRowBlocks; ++r) {
      c += cluster.map_shared_rank(block_count, r)[b];
      if (with_mass) m += cluster.map_shared_rank(block_mass, r)[b];
    }
    row_count[b] = c;
    if (with_mass) row_mass[b] = m;
  }
  cluster.sync();
}

__global__ void __cluster_dims__(kRowBlocks, 1, 1) __launch_bounds__(kThreads)
    process_logits_kernel(const float* logits, const RowSampling* params, float* probs,
                          long long n) {
  __shared__ double sum_partials[kWarps];
  __shared__ long long int_partials[kWarps];
  __shared__ float best_values[kWarps];
  __shared__ long long best_ids[kWarps];
  __shared__ unsigned hist_count[kBins];
  __shared__ unsigned long long hist_mass[kBins];
  __shared__ unsigned row_count[kBins];
  __shared__ unsigned long long row_mass[kBins];
  __shared__ RowPartials partials;
  extern __shared__ unsigned long long warp_hist[];  // kHistBytes
  const RadixHist hist{reinterpret_cast<unsigned*>(warp_hist + kWarps * kBins), warp_hist,
                       hist_count, hist_mass};
  __shared__ unsigned chosen_digit;
  __shared__ long long chosen_rest;
  __shared__ unsigned long long chosen_above;
  __shared__ unsigned tile_counts[kWarps];

  const long long row = blockIdx.x / kRowBlocks;
  const auto rank = static_cast<int>(cg::this_cluster().block_rank());
  const long long span = ((n + kRowBlocks - 1) / kRowBlocks + 31) / 32 * 32;
  const long long lo = min(n, rank * span), hi = min(n, lo + span);
  const float* l = logits + row * n;
  float* out = probs + row * n;  // may be l itself: see the pass order below
  const RowSampling ps = params[row];
  const int tid = static_cast<int>(threadIdx.x);

  // Pass 1 (reads l): validity and the argmax, lowest index on ties.
  Best best{-kInf, n};
  long long invalid = 0;
  stream_range(
      lo, hi, [l](long long j) { return l[j]; },
      [&](long long j, float x, bool valid) {
        if (!valid) return;
        if (isnan(x) || x == kInf) {
          ++invalid;
        } else if (x > best.value) {
          best = Best{x, j};
        }
      });
  best = block_best(best, best_values, best_ids);
  invalid = block_sum(invalid, int_partials);
  if (tid == 0) partials.f = best.value, partials.i[0] = best.idx, partials.i[1] = invalid;
  best = Best{-kInf, n};
  invalid = 0;
  row_exchange(partials, [&](int, const RowPartials& p) {
    best = better_of(best, Best{p.f, p.i[0]});
    invalid += p.i[1];
  });
  if (invalid > 0 || best.value == -kInf) {
    for (long long j = lo + tid; j < hi; j += kThreads) out[j] = __int_as_float(0x7fc00000);
    return;
  }
  if (ps.temperature == 0.0f) {
    for (long long j = lo + tid; j < hi; j += kThreads) out[j] = j == best.idx ? 1.0f : 0.0f;
    return;
  }

  // Pass 2 (reads l): the top-k threshold, the k-th largest logit.
  float kth = -kInf;
  if (ps.top_k > 0 && ps.top_k < n) {
    uint32_t prefix = 0, mask = 0;
    long long rest = ps.top_k;  // rank of the wanted key among those matching prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist_clear(hist, false);
      __syncthreads();
      stream_range(
          lo, hi, [l](long long j) { return l[j]; },
          [&](long long, float x, bool valid) {
            const uint32_t key = ordered_key(x);
            hist_add(hist, valid && (key & mask) == prefix ? (key >> shift) & 0xffu : kNoBin, 0,
                     false);
          });
      __syncthreads();
      hist_merge(hist, false);
      row_hist_total(hist_count, hist_mass, row_count, row_mass, false);
      if (tid == 0) {
        long long above = 0;
        int digit = 0;
        for (int b = kBins - 1; b >= 0; --b) {
          if (above + row_count[b] >= rest) {
            digit = b;
            break;
          }
          above += row_count[b];
        }
        chosen_digit = static_cast<unsigned>(digit);
        chosen_rest = rest - above;
      }
      __syncthreads();
      prefix |= chosen_digit << shift;
      mask |= 0xffu << shift;
      rest = chosen_rest;
    }
    kth = key_value(prefix);
  }

  // Pass 3 (reads l[j], then writes out[j], by the same thread): the weights.
  // From here on only out is read, so out may be l.
  double total = 0.0;
  stream_range(
      lo, hi, [l](long long j) { return l[j]; },
      [&](long long j, float x, bool valid) {
        if (!valid) return;
        float w = 0.0f;
        if (x >= kth && x != -kInf)
          w = exp_f32(__fdiv_rn(__fsub_rn(x, best.value), ps.temperature));
        out[j] = w;
        total += w;
      });
  total = block_sum(total, sum_partials);
  if (tid == 0) partials.d = total;
  total = 0.0;
  row_exchange(partials, [&](int, const RowPartials& p) { total += p.d; });

  // Top-p: keep every weight above w*, and of those equal to it the lowest ids
  // the nucleus needs; `floor` is the smallest weight kept.
  float floor = 0.0f;
  if (ps.top_p < 1.0f) {
    const double target = static_cast<double>(ps.top_p) * total;
    // Fixed-point mass units: every weight is at most 1, so one is below 2^44
    // (hist_add's bound) and all n of them below 2^63.
    const double scale = ldexp(1.0, min(43, 62 - (64 - __clzll(n))));
    const auto target_fx = static_cast<unsigned long long>(target * scale);
    uint32_t prefix = 0, mask = 0;
    unsigned long long above_fx = 0;  // mass of the weights above the current prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist_clear(hist, true);
      __syncthreads();
      stream_range(
          lo, hi, [out](long long j) { return out[j]; },
          [&](long long, float w, bool) {
            const uint32_t key =
                __float_as_uint(w);  // w >= 0: bits in value order (0 past the end)
            const bool in = w > 0.0f && (key & mask) == prefix;
            hist_add(hist, in ? (key >> shift) & 0xffu : kNoBin,
                     in ? static_cast<unsigned long long>(w * scale) : 0, true);
          });
      __syncthreads();
      hist_merge(hist, true);
      row_hist_total(hist_count, hist_mass, row_count, row_mass, true);
      if (tid == 0) {
        unsigned long long cum = above_fx;
        int digit = -1, lowest = 0;
        for (int b = kBins - 1; b >= 0; --b) {
          if (row_count[b] == 0) continue;
          lowest = b;
          if (cum + row_mass[b] >= target_fx) {
            digit = b;
            break;
          }
          cum += row_mass[b];
        }
        if (digit < 0) {  // the target is past the whole mass (rounding): the smallest weight
          digit = lowest;
          cum -= row_mass[lowest];
        }
        chosen_digit = static_cast<unsigned>(digit);
        chosen_above = cum;
      }
      __syncthreads();
      prefix |= chosen_digit << shift;
      mask |= 0xffu << shift;
      above_fx = chosen_above;
    }
    const float w_star = __uint_as_float(prefix);
    // Exact double sums settle the ties.
    double mass_above = 0.0;
    long long ties = 0, n_above = 0;
    stream_range(
        lo, hi, [out](long long j) { return out[j]; },
        [&](long long, float w, bool valid) {
          if (!valid) return;
          if (w > w_star) {
            mass_above += w;
            ++n_above;
          } else if (w == w_star) {
            ++ties;
          }
        });
    mass_above = block_sum(mass_above, sum_partials);
    ties = block_sum(ties, int_partials);
    n_above = block_sum(n_above, int_partials);
    if (tid == 0) partials.d = mass_above, partials.i[0] = ties, partials.i[1] = n_above;
    const long long block_ties = ties;
    long long ties_before = 0;  // in the blocks before this one: their ids are lower
    mass_above = 0.0;
    ties = n_above = 0;
    row_exchange(partials, [&](int r, const RowPartials& p) {
      mass_above += p.d;
      if (r < rank) ties_before += p.i[0];
      ties += p.i[0];
      n_above += p.i[1];
    });
    // The CPU keeps a token while the mass before it is below the target.
    long long keep_ties;
    if (mass_above >= target) {
      keep_ties = n_above > 0 ? 0 : 1;
    } else {
      const double need = ceil((target - mass_above) / static_cast<double>(w_star));
      keep_ties = need < 1.0
                      ? 1
                      : (need >= static_cast<double>(ties) ? ties : static_cast<long long>(need));
    }
    if (keep_ties < ties && ties_before + block_ties > keep_ties) {
      // Drop the ties past the first keep_ties in id order (tiles of kThreads).
      long long seen = ties_before;
      const long long end = ties_before + block_ties;
      for (long long base = lo; base < hi && seen < end; base += kThreads) {
        const long long j = base + tid;
        const bool tie = j < hi && out[j] == w_star;
        const unsigned ballot = __ballot_sync(0xffffffffu, tie);
        if (lane_id() == 0) tile_counts[warp_id()] = __popc(ballot);
        __syncthreads();
        long long before = seen, tile_total = 0;
        for (int w = 0; w < kWarps; ++w) {
          if (w < warp_id()) before += tile_counts[w];
          tile_total += tile_counts[w];
        }
        before += __popc(ballot & ((1u << lane_id()) - 1u));
        if (tie && before >= keep_ties) out[j] = 0.0f;
        seen += tile_total;
        __syncthreads();
      }
    }
    floor = keep_ties > 0 ? w_star : __uint_as_float(__float_as_uint(w_star) + 1u);
  }
  // Min-p: p >= min_p · p_max, i.e. w >= min_p (the largest weight is exactly 1).
  if (ps.min_p > 0.0f && ps.min_p > floor) floor = ps.min_p;

  double kept = total;
  if (floor > 0.0f) {
    kept = 0.0;
    stream_range(
        lo, hi, [out](long long j) { return out[j]; },
        [&](long long, float w, bool) {
          if (w > 0.0f && w >= floor) kept += w;  // 0 past the end
        });
    kept = block_sum(kept, sum_partials);
    if (tid == 0) partials.d = kept;
    kept = 0.0;
    row_exchange(partials, [&](int, const RowPartials& p) { kept += p.d; });
  }
  const double inv = 1.0 / kept;
  stream_range(
      lo, hi, [out](long long j) { return out[j]; },
      [&](long long j, float w, bool valid) {
        if (valid) out[j] = (w > 0.0f && w >= floor) ? static_cast<float>(w * inv) : 0.0f;
      });
}

// ---- sample_rows ----

__device__ __forceinline__ bool uniform_from_bits(long long bits, double* u) {
  if (bits < 0 || bits >= (1ll << 53)) return false;
  *u = static_cast<double>(bits) * kUniformScale;
  return true;
}

__global__ void __launch_bounds__(kThreads)
    sample_rows_kernel(const float* probs, const long long* uniforms, int32_t* out, long long n) {
  __shared__ SampleShared sh;
  const long long row = blockIdx.x;
  const float* p = probs + row * n;
  double u = 0.0;
  const bool ok = uniform_from_bits(uniforms[row], &u);
  const int t = block_sample([p](long long j) { return p[j]; }, n, u, sh);
  if (threadIdx.x == 0) out[row] = ok ? t : -1;
}

// ---- speculative_accept_rows ----

__global__ void __launch_bounds__(kThreads)
    speculative_accept_kernel(const float* p, const float* q, const int32_t* tokens,
                              const int32_t* q_rows, const long long* uniforms,
                              const int32_t* row_begin, int32_t* out, long long n,
                              long long q_count, long long window_rows) {
  __shared__ SampleShared sh;
  __shared__ double sum_partials[kWarps];
  __shared__ long long accepted_sh, q_row_sh;
  __shared__ int status_sh;
  const long long row = blockIdx.x;
  const long long b = row_begin[row], e = row_begin[row + 1];
  if (threadIdx.x == 0) {
    int status = e > b && b >= 0 && e <= window_rows;
    long long k = status ? e - b - 1 : 0, accepted = 0, q_row = -1;
    for (; status && accepted < k; ++accepted) {
      const int32_t d = tokens[b + 1 + accepted];
      q_row = q_rows[b + 1 + accepted];
      double u = 0.0;
      if (d < 0 || d >= n || q_row < 0 || q_row >= q_count ||
          !uniform_from_bits(uniforms[b + accepted], &u)) {
        status = 0;
        break;
      }
      const double pt = p[(b + accepted) * n + d];
      const double qt = q[q_row * n + d];
      // accept_draft: never a token the target rules out; q = 0 counts as ratio 1.
      const bool accept = !(pt > 0.0) ? false : (!(qt > 0.0) ? true : u < fmin(1.0, pt / qt));
      if (!accept) break;
    }
    accepted_sh = accepted;
    q_row_sh = q_row;
    status_sh = status;
  }
  __syncthreads();
  const long long accepted = accepted_sh;
  const long long k = e - b - 1;
  double u_final = 0.0;
  const bool status = status_sh && uniform_from_bits(uniforms[e - 1], &u_final);
  int t = -1;
  if (status && accepted < k) {
    // residual_distribution(p, q): max(p - q, 0) normalised, or p itself when
    // q covers it; then sample_at over the normalised floats, as the CPU does.
    const float* pr = p + (b + accepted) * n;
    const float* qr = q + q_row_sh * n;
    auto residual = [pr, qr](long long j) {
      const float d = __fsub_rn(pr[j], qr[j]);
      return d < 0.0f ? 0.0f : d;  // std::max(d, 0.0f): a NaN stays a NaN
    };
    double mass = 0.0;
    stream_row(n, residual, [&](long long, float r, bool) { mass += r; });  // 0 past the end
    mass = block_sum(mass, sum_partials);
    if (mass <= 1e-12) {
      double p_mass = 0.0;
      stream_row(
          n, [pr](long long j) { return pr[j]; }, [&](long long, float x, bool) { p_mass += x; });
      const double inv = 1.0 / block_sum(p_mass, sum_partials);
      t = block_sample([pr, inv](long long j) { return static_cast<float>(pr[j] * inv); }, n,
                       u_final, sh);
    } else {
      const double inv = 1.0 / mass;
      t = block_sample(
          [residual, inv](long long j) { return static_cast<float>(residual(j) * inv); }, n,
          u_final, sh);
    }
  } else if (status) {
    const float* pr = p + (e - 1) * n;
    t = block_sample([pr](long long j) { return pr[j]; }, n, u_final, sh);
  }
  if (threadIdx.x == 0) {
    out[2 * row] = static_cast<int32_t>(accepted);
    out[2 * row + 1] = status ? t : -1;
  }
}

}  // namespace

void CudaBackend::process_logits_rows(const Tensor& logits, const Tensor& params,
                                      const Tensor& probs) {
  OpTimer timer(*this, "process_logits_rows");
  constexpr const char* kOp = "process_logits_rows";
  check_on(*this, kOp, "logits", logits);
  check_on(*this, kOp, "params", params);
  check_on(*this, kOp, "probs", probs);
  const ops::SamplingRowsDims d = ops::check_process_logits_rows(kOp, logits, params, probs);
  if (d.rows == 0) return;
  if (d.rows > std::numeric_limits<int32_t>::max())
    fail("{}: too many rows in {}", kOp, logits.describe());
  allow_dynamic_smem(reinterpret_cast<const void*>(&process_logits_kernel), kHistBytes,
                     "process_logits_kernel");
  if (d.rows > std::numeric_limits<int32_t>::max() / kRowBlocks)
    fail("{}: too many rows in {}", kOp, logits.describe());
  process_logits_kernel<<<static_cast<unsigned>(d.rows * kRowBlocks), kThreads, kHistBytes,
                          stream()>>>(logits.data_as<const float>(),
                                      static_cast<const RowSampling*>(params.data()),
                                      probs.data_as<float>(), d.vocab);
  check_cuda(cudaGetLastError(), "process_logits_kernel");
}

void CudaBackend::sample_rows(const Tensor& probs, const Tensor& uniforms, const Tensor& out) {
  OpTimer timer(*this, "sample_rows");
  constexpr const char* kOp = "sample_rows";
  check_on(*this, kOp, "probs", probs);
  check_on(*this, kOp, "uniforms", uniforms);
  check_on(*this, kOp, "out", out);
  const ops::SamplingRowsDims d = ops::check_sample_rows(kOp, probs, uniforms, out);
  if (d.rows == 0) return;
  if (d.rows > std::numeric_limits<int32_t>::max())
    fail("{}: too many rows in {}", kOp, probs.describe());
  sample_rows_kernel<<<static_cast<unsigned>(d.rows), kThreads, 0, stream()>>>(
      probs.data_as<const float>(), static_cast<const long long*>(uniforms.data()),
      out.data_as<int32_t>(), d.vocab);
  check_cuda(cudaGetLastError(), "sample_rows_kernel");
}

void CudaBackend::speculative_accept_rows(const SpeculativeAcceptParams& p) {
  OpTimer timer(*this, "speculative_accept_rows");
  constexpr const char* kOp = "speculative_accept_rows";
  check_on(*this, kOp, "p", p.p);
  check_on(*this, kOp, "q", p.q);
  check_on(*this, kOp, "tokens", p.tokens);
  check_on(*this, kOp, "q_rows", p.q_rows);
  check_on(*this, kOp, "uniforms", p.uniforms);
  check_on(*this, kOp, "row_begin", p.row_begin);
  check_on(*this, kOp, "out", p.out);
  const ops::SpeculativeAcceptDims d = ops::check_speculative_accept(kOp, p);
  if (d.rows == 0) return;
  if (d.rows > std::numeric_limits<int32_t>::max()) fail("{}: too many rows", kOp);
  speculative_accept_kernel<<<static_cast<unsigned>(d.rows), kThreads, 0, stream()>>>(
      p.p.data_as<const float>(), p.q.numel() ? p.q.data_as<const float>() : nullptr,
      p.tokens.data_as<const int32_t>(), p.q_rows.data_as<const int32_t>(),
      static_cast<const long long*>(p.uniforms.data()), p.row_begin.data_as<const int32_t>(),
      p.out.data_as<int32_t>(), d.vocab, d.q_rows, d.window_rows);
  check_cuda(cudaGetLastError(), "speculative_accept_kernel");
}

namespace {

// penalised_logit (sampler.h) with every operation rounded as the host's:
// explicit IEEE intrinsics, so nvcc cannot contract x · y + z into an fma.
__device__ float penalised_logit_ieee(float x, int32_t generated, float repetition, float presence,
                                      float frequency) {
  if (repetition != 1.0f && x != -INFINITY) {
    x = x > 0.0f ? __fdiv_rn(x, repetition) : __fmul_rn(x, repetition);
  }
  if (generated > 0) {
    x = __fsub_rn(x, __fadd_rn(presence, __fmul_rn(frequency, static_cast<float>(generated))));
  }
  return x;
}

// Row blockIdx.x of apply_penalties_rows. The row's extras (at most
// kMaxPenaltyExtras) are read into shared memory; then the threads take the
// list's entries in turn (distinct tokens, so no two touch one logit), each
// adding the extras equal to its token to its count and marking them as
// taken; last, one thread per extra penalises an extra the list lacks, at its
// first occurrence, with its number of occurrences.
__global__ void __launch_bounds__(kThreads)
    apply_penalties_kernel(float* __restrict__ logits, const int32_t* __restrict__ list_begin,
                           const int32_t* __restrict__ tokens, const int32_t* __restrict__ counts,
                           const float* __restrict__ penalties,
                           const int32_t* __restrict__ row_list, int32_t lists,
                           const int32_t* __restrict__ extra_source, int64_t sources,
                           const int32_t* __restrict__ extra_index, int32_t extras, int64_t vocab) {
  __shared__ int32_t extra[kMaxPenaltyExtras];
  __shared__ int32_t taken[kMaxPenaltyExtras];
  const int64_t m = blockIdx.x;
  const int32_t l = row_list != nullptr ? row_list[m] : static_cast<int32_t>(m);
  if (l < 0 || l >= lists) return;  // the contract: device backends skip it
  const float repetition = penalties[m * 3];
  const float presence = penalties[m * 3 + 1];
  const float frequency = penalties[m * 3 + 2];
  if (static_cast<int32_t>(threadIdx.x) < extras) {
    const int32_t at = extra_index[m * extras + threadIdx.x];
    const int32_t t = at >= 0 && at < sources ? extra_source[at] : -1;
    extra[threadIdx.x] = t >= 0 && t < vocab ? t : -1;
    taken[threadIdx.x] = 0;
  }
  __syncthreads();
  float* row = logits + m * vocab;
  for (int32_t e = list_begin[l] + static_cast<int32_t>(threadIdx.x); e < list_begin[l + 1];
       e += kThreads) {
    const int32_t t = tokens[e];
    if (t < 0 || t >= vocab) continue;
    int32_t count = counts[e];
    for (int32_t j = 0; j < extras; ++j) {
      if (extra[j] == t) {
        ++count;
        taken[j] = 1;  // only this thread's token equals extra[j]
      }
    }
    row[t] = penalised_logit_ieee(row[t], count, repetition, presence, frequency);
  }
  __syncthreads();
  const int32_t j = static_cast<int32_t>(threadIdx.x);
  if (j < extras && extra[j] >= 0 && taken[j] == 0) {
    const int32_t t = extra[j];
    bool first = true;
    int32_t count = 0;
    for (int32_t i = 0; i < extras; ++i) {
      if (extra[i] == t) {
        ++count;
        first = first && i >= j;
      }
    }
    if (first) row[t] = penalised_logit_ieee(row[t], count, repetition, presence, frequency);
  }
}

}  // namespace

void CudaBackend::apply_penalties_rows(const PenaltyRowsParams& p) {
  OpTimer timer(*this, "apply_penalties_rows");
  constexpr const char* kOp = "apply_penalties_rows";
  for (const ops::NamedTensor& t : ops::penalty_rows_tensors(p))
    check_on(*this, kOp, t.name, *t.tensor);
  const ops::PenaltyRowsDims d = ops::check_penalty_rows(kOp, p);
  if (d.rows == 0) return;
  if (d.rows > std::numeric_limits<int32_t>::max() ||
      d.lists > std::numeric_limits<int32_t>::max()) {
    fail("{}: too many rows or lists", kOp);
  }
  const bool extras = d.extras > 0;
  apply_penalties_kernel<<<static_cast<unsigned>(d.rows), kThreads, 0, stream()>>>(
      p.logits.data_as<float>(), p.list_begin.data_as<const int32_t>(),
      p.tokens.data_as<const int32_t>(), p.counts.data_as<const int32_t>(),
      p.penalties.data_as<const float>(),
      p.row_list.empty() ? nullptr : p.row_list.data_as<const int32_t>(),
      static_cast<int32_t>(d.lists), extras ? p.extra_source.data_as<const int32_t>() : nullptr,
      extras ? p.extra_source.dim(0) : 0, extras ? p.extra_index.data_as<const int32_t>() : nullptr,
      static_cast<int32_t>(d.extras), d.vocab);
  check_cuda(cudaGetLastError(), "apply_penalties_kernel");
}

}  // namespace specula::cuda
