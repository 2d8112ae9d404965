// SPDX-License-Identifier: Apache-2.0
// attention_with_inputs on the GPU for decode steps and short verify windows:
// attention_fused_kernel finishes the q/k/v inputs (as attention_inputs does,
// bit for bit) inside the partials blocks and stages the cached keys before its
// inputs are ready; the combine is cuda_attention.cu's. Numerics: see there.
// f32, bf16 and fp8 caches alike (a bf16 or fp8 cache's new rows are rounded
// as store_kv rounds them, and the block attends to the rounded values).
#include "engine/backend/cuda/cuda_attention.cuh"

namespace specula::cuda {
namespace attn {
namespace {

// ---- attention_with_inputs: the inputs finished inside the partials kernel ----

// The un-finished inputs of a fused launch (AttentionInputsParams as pointers).
struct FusedInputs {
  const float* q;      // raw q [S, H, D]
  const float* k;      // raw k [S, KV, D], or null (a KV-shared layer: q only)
  const float* v;      // raw v [S, KV, D] (unused when v_from_k)
  const void* q_norm;  // [D] of q_norm_dtype, or null (no weight)
  const void* k_norm;
  DType q_norm_dtype;
  DType k_norm_dtype;
  const float* inv_freq;  // [D/2]
  float eps;
  bool v_from_k;
};

// Element i of a [n] weight of any float dtype, as f32 (exact widening).
__device__ inline float load_weight(const void* w, DType dt, int i) {
  if (dt == DType::kBF16) return load_float<DType::kBF16>(w, i);
  if (dt == DType::kF16) return load_float<DType::kF16>(w, i);
  return load_float<DType::kF32>(w, i);
}

// Cache rows of a fused launch hold KvT: float (an f32 cache), uint16_t (bf16
// bits) or uint8_t (fp8 codes, with one scale per (row, kv head)). A bf16 row
// holds f32_to_bf16_bits of the finished f32 row, an fp8 row the codes and
// scale of kv_e4m3_quantize_row of it (what attention_inputs then store_kv
// write), and the block attends to those rounded values widened back (what the
// partials kernel stages from the cache), so the fused launch and the two ops
// agree bit for bit for every dtype.

// fp8: the scale of a finished row held by a warp (kPer values a lane, element
// lane + 32·i; amax over the finite ones, a max: exact in any order).
template <int kPer>
__device__ inline float warp_row_fp8_scale(const float (&fin)[kPer], int d, int lane) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (lane + 32 * i < d && isfinite(fin[i])) amax = fmaxf(amax, fabsf(fin[i]));
  }
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  return kv_e4m3_scale_dev(amax);
}

// fp8: a finished row held by a warp (element lane + 32·i in fin[i]) quantized
// as kv_e4m3_quantize_row does: its codes to cache and its scale to
// *cache_scale (unless null), the dequantized values to staged (unless null),
// the values attention then reads.
template <int kPer>
__device__ inline void quantize_row_fp8(const float (&fin)[kPer], int d, int lane, float* staged,
                                        uint8_t* cache, float* cache_scale) {
  const float scale = warp_row_fp8_scale(fin, d, lane);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = lane + 32 * i;
    if (c < d) {
      const uint8_t code = kv_e4m3_encode_dev(fin[i], scale);
      if (staged != nullptr) staged[c] = e4m3_dequant(code, scale);
      if (cache != nullptr) cache[c] = code;
    }
  }
  if (cache != nullptr && lane == 0) *cache_scale = scale;
}

// The finished v row (vals · inv, weightless) of a new position into smem (the
// staged V row, or null) and cache (its cache row, or null), not both null.
// f32: write_plain_norm as before; bf16: each element rounded once, the cache
// taking the bits and smem their exact widening; fp8: the row quantized (its
// scale to *cache_scale with the cache row), smem taking the dequantized values.
template <typename KvT, int kPer>
__device__ inline void write_value_row(const float (&vals)[kPer], float inv, int d, int lane,
                                       float* smem, KvT* cache, float* cache_scale) {
  if constexpr (std::is_same_v<KvT, float>) {
    if (smem == nullptr) {
      smem = cache;
      cache = nullptr;
    }
    write_plain_norm(vals, inv, d, lane, smem, cache);
  } else if constexpr (std::is_same_v<KvT, uint8_t>) {
    float fin[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) fin[i] = rms_apply_loaded(vals[i], inv, false, 0.0f);
    quantize_row_fp8(fin, d, lane, smem, cache, cache_scale);
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int c = lane + 32 * i;
      if (c < d) {
        const uint16_t bits = f32_to_bf16_bits(rms_apply_loaded(vals[i], inv, false, 0.0f));
        if (smem != nullptr) smem[c] = bf16_bits_to_f32(bits);
        if (cache != nullptr) cache[c] = bits;
      }
    }
  }
}

// The finished k row of a new position: write_norm_rope into the staged row
// `row` and (f32, unless null) the cache row; for a bf16 cache the staged row
// is then rounded in place (each element by one lane, after write_norm_rope's
// closing __syncwarp) and its bits go to the cache row (unless null).
// fp8: the staged row quantized in place (dequantized values), its codes and
// scale to the cache row and *cache_scale (unless null).
template <typename KvT, int kPer, typename WeightAt, typename FreqAt>
__device__ inline void write_key_row(const float (&vals)[kPer], float inv, bool has_weight,
                                     WeightAt weight_at, int d, int lane, float* row,
                                     int32_t position, FreqAt freq_at, KvT* cache,
                                     float* cache_scale) {
  if constexpr (std::is_same_v<KvT, float>) {
    write_norm_rope(vals, inv, has_weight, weight_at, d, lane, row, position, freq_at, cache,
                    nullptr);
  } else if constexpr (std::is_same_v<KvT, uint8_t>) {
    write_norm_rope(vals, inv, has_weight, weight_at, d, lane, row, position, freq_at, nullptr,
                    nullptr);
    float fin[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) fin[i] = lane + 32 * i < d ? row[lane + 32 * i] : 0.0f;
    quantize_row_fp8(fin, d, lane, row, cache, cache_scale);
    __syncwarp();  // the row is read by other lanes only after the block barrier
  } else {
    write_norm_rope(vals, inv, has_weight, weight_at, d, lane, row, position, freq_at, nullptr,
                    nullptr);
    for (int c = lane; c < d; c += 32) {
      const uint16_t bits = f32_to_bf16_bits(row[c]);
      row[c] = bf16_bits_to_f32(bits);
      if (cache != nullptr) cache[c] = bits;
    }
    __syncwarp();  // the row is read by other lanes only after the block barrier
  }
}

// A partials block (decode steps and verify windows of up to kFusedPairTiles
// pair tiles, derived launches) that finishes its inputs itself, so no attention_inputs kernel
// runs between the q/k/v product and attention, and the chunk's old keys load
// while the product is still running:
// - before pdl_wait(): q_pos, the norm weights and frequencies (into shared
//   memory), and the cache rows at positions below the first query (the
//   ordering promise of attention_with_inputs), staged with cp.async;
// - after it: each pair's q row, normalised and rotated into sQ exactly as
//   attention_inputs finishes it, and for each new position in this chunk the
//   finished k and v rows of this kv head, into sK / sV and into their cache
//   rows (each (position, kv head) lies in one chunk; of that chunk's pair
//   tiles, the one with the first pair of the position's own query writes the
//   row, so each cache row has one writer). A KV-shared layer (no k) stages those rows from
//   the cache instead (its donor wrote them earlier in the same forward).
// Then scores, softmax and values as the partials kernel computes them.
// Positions are consecutive (the derived-launch promise), so new position p is
// token p - q_pos[0] of k and v. KvT: the cache's element type (see above).
template <typename KvT, int kPer, int kMinBlocks>
__global__ void __launch_bounds__(kPartialThreads, kMinBlocks)
    attention_fused_kernel(FusedInputs in, KvT* __restrict__ k_cache, KvT* __restrict__ v_cache,
                           float* k_scales, float* v_scales, const int32_t* __restrict__ q_pos,
                           float* __restrict__ part_ml, float* __restrict__ part_acc, AttnGeom g) {
  pdl_launch_dependents();  // the combine: it waits for this whole grid
  extern __shared__ float4 smem[];
  const int d = g.d;
  // V rows below v_early arrive with K; the others after the scores, where
  // the q rows were (see AttnGeom::v_early).
  const int v_early = g.v_early;
  const bool late_v = v_early < kChunk;
  float* sK = reinterpret_cast<float*>(smem);
  float* sV = sK + kChunk * g.ld;
  float* sQ = sV + (late_v ? v_early : kChunk) * g.ld;
  float* sP = late_v ? sV + kChunk * g.ld : sQ + staged_q_rows(g.pair_tile) * g.ld;
  float* sQn = sP + g.pair_tile * kChunk;  // [d] q_norm as f32
  float* sKn = sQn + d;                    // [d] k_norm as f32
  float* sFreq = sKn + d;                  // [d / 2]
  __shared__ int s_j0[kPairTile];
  __shared__ int s_j1[kPairTile];
  __shared__ int64_t s_entry[kPairTile];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t first = q_pos[0];
  const int64_t last = q_pos[g.s - 1];
  const int64_t hull_lo = visible_keys(first, g).lo;
  const int64_t c0 = (floor_div(hull_lo, kChunk) + blockIdx.x) * kChunk;
  const int kvh = static_cast<int>(blockIdx.y);
  // Pair tile z: pairs pair0 .. pair0 + np - 1 (pair = query · group + head in group).
  const int64_t pair0 = int64_t{blockIdx.z} * g.pair_tile;
  const int np = static_cast<int>(min(int64_t{g.pair_tile}, int64_t{g.s} * g.group - pair0));
  const int64_t kv_row = int64_t{g.n_kv} * d;  // floats per key
  const auto key_row = [&](int64_t kp) { return g.ring > 0 ? kp % g.ring : kp - g.k_pos0; };
  // Rows j0..j1 of the chunk from the cache: K, and V below v_early.
  // (fp8: each row dequantized with its scale, scales[row · n_kv + kvh].)
  const auto stage_keys = [&](int j0, int j1) {
    for (int j = j0 + warp; j <= j1; j += kPartialWarps) {
      const int64_t r = key_row(c0 + j);
      stage_kv_row(sK + j * g.ld, k_cache + r * kv_row + int64_t{kvh} * d, k_scales, r, kvh, g,
                   lane);
      if (j < v_early) {
        stage_kv_row(sV + j * g.ld, v_cache + r * kv_row + int64_t{kvh} * d, v_scales, r, kvh, g,
                     lane);
      }
    }
    __pipeline_commit();
  };
  // The same rows' V at or past v_early (once the q rows there are read).
  const auto stage_late_values = [&](int j0, int j1) {
    for (int j = max(j0, v_early) + warp; j <= j1; j += kPartialWarps) {
      const int64_t r = key_row(c0 + j);
      stage_kv_row(sV + j * g.ld, v_cache + r * kv_row + int64_t{kvh} * d, v_scales, r, kvh, g,
                   lane);
    }
  };
  // Old keys of the chunk: [max(c0, first visible), min(chunk end, first - 1)].
  const int old0 = static_cast<int>(max(c0, hull_lo) - c0);
  const int old1 = static_cast<int>(min(c0 + kChunk - 1, first - 1) - c0);
  stage_keys(old0, old1);
  const bool has_qn = in.q_norm != nullptr;
  const bool has_kn = in.k_norm != nullptr;
  for (int i = static_cast<int>(threadIdx.x); i < d; i += kPartialThreads) {
    sQn[i] = has_qn ? load_weight(in.q_norm, in.q_norm_dtype, i) : 0.0f;
    sKn[i] = has_kn && in.k != nullptr ? load_weight(in.k_norm, in.k_norm_dtype, i) : 0.0f;
    if (i < d / 2) sFreq[i] = in.inv_freq[i];
  }
  chunk_pair_ranges(q_pos, c0, kvh, pair0, np, g, s_j0, s_j1, s_entry);
  __syncthreads();
  // Keys [u0, u1]: the hull of the pairs' ranges (rows the loops below read).
  const int2 hull_keys = chunk_key_hull(s_j0, s_j1, np);
  const int u0 = hull_keys.x;
  const int u1 = hull_keys.y;
  if (u0 > u1) {  // block-uniform: no pair sees a key here, so no new position lies here either
    __pipeline_wait_prior(0);
    return;
  }

  pdl_wait();
  // New keys of the chunk: positions [max(c0, first), min(chunk end, last)]
  // (of them, this tile's pairs read rows u0 .. u1 only).
  const int new0 = max(static_cast<int>(max(c0, first) - c0), u0);
  const int new1 = min(static_cast<int>(min(c0 + kChunk - 1, last) - c0), u1);
  const int n_new = in.k != nullptr ? max(0, new1 - new0 + 1) : 0;
  if (in.k == nullptr) stage_keys(new0, new1);
  // The finished v row of new position c0 + j (its raw v row, or with v_from_k
  // its raw k row, plainly normalised) to smem_dst and, unless null, cache_dst:
  // the same bits as the item loop below writes.
  const auto finish_value = [&](int j, float* smem_dst, KvT* cache_dst) {
    const int64_t src = ((c0 + j - first) * g.n_kv + kvh) * d;
    float vv[kPer];
    load_held<kPer, 32>(in.v_from_k ? in.k + src : in.v + src, lane, d, vv);
    const float inv_v = rms_inv(warp_row_sum_squares(vv, d, lane), d, in.eps);
    write_value_row<KvT>(vv, inv_v, d, lane, smem_dst, cache_dst, nullptr);
  };
  const auto q_weight = [&](int, int c) { return sQn[c]; };
  const auto k_weight = [&](int, int c) { return sKn[c]; };
  const auto freq = [&](int, int pair) { return sFreq[pair]; };
  // Work items, one warp each: the pairs' q rows, then the new k/v rows.
  for (int item = warp; item < np + n_new; item += kPartialWarps) {
    float vals[kPer];
    if (item < np) {
      const int64_t qi = (pair0 + item) / g.group;
      const int64_t h = int64_t{kvh} * g.group + (pair0 + item) % g.group;
      load_held<kPer, 32>(in.q + (qi * g.n_heads + h) * d, lane, d, vals);
      const float inv = rms_inv(warp_row_sum_squares(vals, d, lane), d, in.eps);
      write_norm_rope(vals, inv, has_qn, q_weight, d, lane, sQ + item * g.ld, q_pos[qi], freq,
                      nullptr, nullptr);
      continue;
    }
    const int j = new0 + (item - np);
    const int64_t pos = c0 + j;
    const int64_t src = ((pos - first) * g.n_kv + kvh) * d;
    const int64_t dst = key_row(pos) * kv_row + int64_t{kvh} * d;
    const int64_t dst_scale = key_row(pos) * g.n_kv + kvh;  // fp8 only
    // Several tiles may finish the row; the cache gets it from the one holding
    // the first pair of its own query (which sees it, so never exits early).
    const bool writer = (pos - first) * g.group / g.pair_tile == int64_t{blockIdx.z};
    // k and v load together (one memory round trip); v_from_k normalises k's row.
    float vv[kPer];
    load_held<kPer, 32>(in.k + src, lane, d, vals);
    load_held<kPer, 32>(in.v_from_k ? nullptr : in.v + src, lane, d, vv);
    const float inv_k = rms_inv(warp_row_sum_squares(vals, d, lane), d, in.eps);
    // A late v row's slot still holds q rows: only the cache gets it now, and
    // the block finishes it again into its slot after the scores.
    float* v_smem = j < v_early ? sV + j * g.ld : nullptr;
    KvT* v_out = writer ? v_cache + dst : nullptr;
    float* v_scale_out = writer && v_scales != nullptr ? v_scales + dst_scale : nullptr;
    if (v_smem == nullptr && v_out == nullptr) {
      // not the writer, and the row is late: nothing to store yet
    } else if (in.v_from_k) {
      write_value_row<KvT>(vals, inv_k, d, lane, v_smem, v_out, v_scale_out);
    } else {
      const float inv_v = rms_inv(warp_row_sum_squares(vv, d, lane), d, in.eps);
      write_value_row<KvT>(vv, inv_v, d, lane, v_smem, v_out, v_scale_out);
    }
    write_key_row<KvT>(vals, inv_k, has_kn, k_weight, d, lane, sK + j * g.ld,
                       static_cast<int32_t>(pos), freq, writer ? k_cache + dst : nullptr,
                       writer && k_scales != nullptr ? k_scales + dst_scale : nullptr);
  }
  __pipeline_wait_prior(0);  // this thread's cache rows have landed
  __syncthreads();           // ... and everyone's, and the finished rows
  chunk_softmax(F32Rows{sK, g.ld}, sQ, sP, s_j0, s_j1, s_entry, np, part_ml, g, [&] {
    if (!late_v) return;
    // The q rows are read: their space takes V rows v_early.. of the old keys
    // (and of a KV-shared layer's new ones) by copy, of the new keys by
    // finishing them again, one warp a row, while the softmax runs.
    stage_late_values(old0, old1);
    if (in.k == nullptr) stage_late_values(new0, new1);
    __pipeline_commit();
    for (int j = max(new0, v_early) + warp; j < new0 + n_new; j += kPartialWarps) {
      finish_value(j, sV + j * g.ld, nullptr);
    }
  });
  __syncthreads();
  chunk_weighted_values(F32Rows{sV, g.ld}, sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g,
                        v_early);
}

// Most pair tiles of a fused launch (31B's full-attention verify window of 5
// queries: 40 pairs, two tiles).
constexpr int kFusedPairTiles = 4;

// Dynamic shared memory of a fused block: the partials tiles (the q rows inside
// the V tile when late_v), then the norm weights and frequencies.
constexpr size_t fused_smem_bytes(int d, int pairs, bool late_v) {
  const size_t q_rows = late_v ? 0 : static_cast<size_t>(staged_q_rows(pairs));
  return ((2 * kChunk + q_rows) * smem_row_floats(d) + static_cast<size_t>(pairs) * kChunk +
          static_cast<size_t>(2 * d + d / 2)) *
         sizeof(float);
}

// Blocks of `dynamic_bytes` dynamic (plus `static_bytes` static) shared
// memory that fit one SM of the current device (its attributes cached per
// device, as sm_count does).
int smem_blocks_per_sm(size_t dynamic_bytes, size_t static_bytes) {
  static std::atomic<int> per_sm[64];
  static std::atomic<int> reserved[64];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const int slot = device >= 0 && device < 64 ? device : 0;
  int sm = per_sm[slot].load(std::memory_order_relaxed);
  int res = reserved[slot].load(std::memory_order_relaxed);
  if (sm == 0) {
    check_cuda(cudaDeviceGetAttribute(&sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
               "cudaDeviceGetAttribute(maxSharedMemoryPerMultiprocessor)");
    check_cuda(cudaDeviceGetAttribute(&res, cudaDevAttrReservedSharedMemoryPerBlock, device),
               "cudaDeviceGetAttribute(reservedSharedMemoryPerBlock)");
    reserved[slot].store(res, std::memory_order_relaxed);
    per_sm[slot].store(sm, std::memory_order_relaxed);
  }
  return static_cast<int>(static_cast<size_t>(sm) /
                          (dynamic_bytes + static_bytes + static_cast<size_t>(res)));
}

// AttnGeom::v_early of a fused launch of `blocks` blocks of `pairs` pairs at
// head dim d: V rows past the q rows' count wait for the scores where that
// lets blocks of D <= 256 (three an SM by registers) fit three an SM by shared
// memory too, the grid has more blocks than fit the SMs at the lower count,
// and each thread has at most one value task (chunk_values_late). Else kChunk
// (every V row with K). The late rows cost a block one more memory round trip
// (H200: E2B's decode steps, 8 pairs in grids of at most 32 blocks, took 2.7%
// longer with them), so they pay only where they save a wave: 31B's sliding
// layers in verify windows of 5 queries (10 pairs: 80 KB a block, two an SM;
// 272 working blocks for 264 places) ran in two waves without them.
int fused_late_v_rows(int d, int pairs, int64_t blocks) {
  const int q_rows = staged_q_rows(pairs);
  const int value_tasks = (pairs + pairs_per_tile(pairs) - 1) / pairs_per_tile(pairs) * (d / 4);
  if (d > 256 || q_rows > kChunk || value_tasks > kPartialThreads) return kChunk;
  const int full = smem_blocks_per_sm(fused_smem_bytes(d, pairs, false), kPartialsStaticSmem);
  if (full >= 3 || blocks <= int64_t{full} * sm_count() ||
      smem_blocks_per_sm(fused_smem_bytes(d, pairs, true), kPartialsStaticSmem) < 3) {
    return kChunk;
  }
  return kChunk - q_rows;
}

}  // namespace
}  // namespace attn

using namespace attn;

int attention_fused_late_v_rows(int head_dim, int pairs, int64_t blocks) {
  return fused_late_v_rows(head_dim, std::min(pairs, kPairTile), blocks);
}

// See Backend::attention_with_inputs. attention_fused_kernel (inputs and
// partials) and the combine when the call is a derived launch of one pair tile
// (decode steps, short verify windows) with 16-byte aligned float4 rows and the
// cache read in place; otherwise the two ops.
void CudaBackend::attention_with_inputs(const AttentionInputsParams& in, const AttentionParams& p) {
  const ops::AttentionInputsDims idims = ops::check_attention_inputs(in);
  const ops::AttentionDims dims = check_cuda_attention(*this, p);
  const auto same = [](const Tensor& a, const Tensor& b) { return a.data() == b.data(); };
  // f32, bf16 and fp8 caches (attention_fused_kernel<KvT>); k and v share a dtype
  // (check_attention), and the inputs' cache is the attended one (below).
  bool fits = p.causal && p.positions_bound > 0 && !p.allow_fast_prefill && dims.keys > 0 &&
              dims.queries > 0 &&
              dims.queries * (dims.heads / dims.kv_heads) <= kFusedPairTiles * kPairTile &&
              dims.head_dim % 4 == 0 && idims.head_dim == dims.head_dim &&
              idims.tokens == dims.queries && idims.heads == dims.heads && same(in.q, p.q) &&
              same(in.positions, p.q_positions) && aligned16(p.q.data()) && aligned16(p.k.data()) &&
              aligned16(p.v.data());
  if (fits && idims.has_k) {
    // The new rows go where the attention reads them: the same cache, in place.
    fits = idims.has_cache && idims.kv_heads == dims.kv_heads && same(in.cache_k, p.k) &&
           same(in.cache_v, p.v) && in.cache_k.dtype() == p.k.dtype() &&
           (dims.ring ? p.k.dim(0) == in.cache_k.dim(0)
                      : p.k_pos0 == 0 && p.k.dim(0) <= in.cache_k.dim(0));
  }
  if (!fits) {
    Backend::attention_with_inputs(in, p);
    return;
  }
  check_on(*this, "attention_with_inputs", "q_norm", in.q_norm);
  check_on(*this, "attention_with_inputs", "inv_freq", in.inv_freq);
  if (idims.has_k) {
    check_on(*this, "attention_with_inputs", "k", in.k);
    check_on(*this, "attention_with_inputs", "k_norm", in.k_norm);
    check_on(*this, "attention_with_inputs", "v", in.v);
  }
  OpTimer timer(*this, "attention_with_inputs");
  AttnPlan plan = plan_attention(*this, p, dims);
  if (plan.tile < dims.queries) {  // (never at these sizes: the scratch holds far more)
    Backend::attention_with_inputs(in, p);
    return;
  }
  AttnGeom& g = plan.g;
  set_tile(g, p, 0, dims.queries, dims.queries);
  FusedInputs f{};
  f.q = in.q.data_as<const float>();
  f.q_norm = in.q_norm.empty() ? nullptr : in.q_norm.data();
  f.q_norm_dtype = in.q_norm.empty() ? DType::kF32 : in.q_norm.dtype();
  f.inv_freq = in.inv_freq.data_as<const float>();
  f.eps = in.eps;
  f.v_from_k = in.v_from_k;
  if (idims.has_k) {
    f.k = in.k.data_as<const float>();
    f.v = in.v.data_as<const float>();
    f.k_norm = in.k_norm.empty() ? nullptr : in.k_norm.data();
    f.k_norm_dtype = in.k_norm.empty() ? DType::kF32 : in.k_norm.dtype();
  }
  const auto* pos = p.q_positions.data_as<const int32_t>();
  const int64_t pairs = int64_t{g.s} * g.group;
  const dim3 grid(static_cast<unsigned>(plan.grid_chunks(g.s)), static_cast<unsigned>(g.n_kv),
                  static_cast<unsigned>((pairs + g.pair_tile - 1) / g.pair_tile));
  // Rows of up to 256 floats hold 8 a lane and fit three blocks an SM (the
  // occupancy of the partials kernel: with two, 31B decode steps took 0.8 ms
  // longer on an H200); wider heads fit one block an SM by shared memory anyway.
  g.v_early = fused_late_v_rows(g.d, g.pair_tile, int64_t{grid.x} * int64_t{grid.y} * grid.z);
  const size_t smem = fused_smem_bytes(g.d, g.pair_tile, g.v_early < kChunk);
  if (p.k.dtype() == DType::kF8E4M3) {
    auto kernel =
        g.d <= 256 ? attention_fused_kernel<uint8_t, 8, 3> : attention_fused_kernel<uint8_t, 16, 1>;
    launch_pdl(kernel, grid, dim3(kPartialThreads), smem, stream(), "attention_fused_kernel", f,
               p.k.data_as<uint8_t>(), p.v.data_as<uint8_t>(), const_cast<float*>(p.k.scale_data()),
               const_cast<float*>(p.v.scale_data()), pos, plan.part_ml, plan.part_acc, g);
  } else if (p.k.dtype() == DType::kBF16) {
    auto kernel = g.d <= 256 ? attention_fused_kernel<uint16_t, 8, 3>
                             : attention_fused_kernel<uint16_t, 16, 1>;
    launch_pdl(kernel, grid, dim3(kPartialThreads), smem, stream(), "attention_fused_kernel", f,
               p.k.data_as<uint16_t>(), p.v.data_as<uint16_t>(), static_cast<float*>(nullptr),
               static_cast<float*>(nullptr), pos, plan.part_ml, plan.part_acc, g);
  } else {
    auto kernel =
        g.d <= 256 ? attention_fused_kernel<float, 8, 3> : attention_fused_kernel<float, 16, 1>;
    launch_pdl(kernel, grid, dim3(kPartialThreads), smem, stream(), "attention_fused_kernel", f,
               p.k.data_as<float>(), p.v.data_as<float>(), static_cast<float*>(nullptr),
               static_cast<float*>(nullptr), pos, plan.part_ml, plan.part_acc, g);
  }
  dispatch_combine(plan.nr, std::make_integer_sequence<int, kMaxLaneDims>{}, pos, plan.part_ml,
                   plan.part_acc, p.out.data_as<float>(), g, /*after_partials=*/true, stream());
}

}  // namespace specula::cuda
