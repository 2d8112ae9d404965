// SPDX-License-Identifier: Apache-2.0
// attention on the GPU (gemma4-architecture.md §2.5-§2.6): causal, optionally
// sliding-window, grouped-query attention, split across the key sequence.
//
// Batch invariance. A query's output depends only on its own q row, the keys
// it can see and their absolute positions, never on S, on the other queries,
// on k_pos0, on the ring layout or on how far the key tensor extends past what
// the query sees. That is what lets a decode step (1 query, keys gathered from
// the window start) and a verify window (k + 1 queries over a longer key
// tensor) agree bit for bit. It holds because every reduction is pinned to
// absolute positions and to the (query, head) alone:
// - keys are split into chunks of kChunk = 32 absolute positions ([c·32,
//   (c+1)·32)); a chunk's partial covers only the keys of that chunk the query
//   sees: m = max score, l = Σ expf(score - m) (xor butterfly over the 32 key
//   lanes), acc[d] = Σ expf(score - m)·v[d] (one fmaf per key, increasing
//   position, starting from 0);
// - a score is scale · q·k, the dot summed as four running fmaf sums over the
//   dims ≡ 0, 1, 2, 3 (mod 4), each in increasing dim, then (s0 + s1) + (s2 + s3);
// - the combine merges the chunks c = 0 .. n-1 the query sees (counted from its
//   first visible chunk): M = max m_c, w_c = expf(m_c - M), L = Σ l_c·w_c
//   (lane-strided over c, then xor butterfly), acc = Σ w_c·acc_c summed in 8
//   interleaved groups (c mod 8, increasing c) added in a fixed tree; out = acc / L.
// Which threads do what (pairs per block, pairs per register tile, which key
// rows a block stages) varies with S and T; the arithmetic of a (query, head)
// does not. exp is expf, no atomics; products are explicit fmaf / __fmul_rn and
// sums __fadd_rn, so no FMA contraction or reassociation can differ.
//
// Speed. Decode is latency bound, so a partials block stages the K and V rows
// of its chunk in shared memory with asynchronous copies issued all at once
// (one memory latency per block, V arriving while the scores are computed),
// and every (query, head) pair of its kv head (the GQA group, times the
// queries of a verify window) reuses that tile. The combine is launched as a
// programmatic dependent (PDL) so its launch overlaps the partials kernel.
// attention_with_inputs (a lone row) runs attention_fused_kernel instead of
// the partials kernel: it also finishes the q/k/v inputs (as attention_inputs
// does, bit for bit) and stages the cached keys before its inputs are ready.
#include "engine/backend/backends.h"
#include "engine/backend/cuda/cuda_attention.cuh"

namespace specula::cuda {
namespace attn {
namespace {

// Partials: one block per (absolute chunk, kv head, tile of up to kPairTile
// (query, head) pairs of that kv head); pair = query · group + head in group.
// Grid: x = chunk - c_first (every chunk the key tensor touches), y = kv head,
// z = pair tile. Each block stages q rows and the chunk's K and V rows that any
// of its pairs sees (cp.async, K group then V group), scores every (pair, key),
// takes each pair's chunk softmax, then its weighted V sum. Writes, for each
// pair with a visible key in the chunk, ml = (m, l) and acc[D] at slot
// chunk - (first chunk the query sees); other slots are left unwritten (the
// combine never reads them). Blocks where no pair sees a key exit at once.
// Up to 3 blocks per SM (80 registers; a decode block's tiles take 71 KB at D = 256).
// KvT: float (an f32 cache), uint16_t (bf16 bits, widened as they are staged)
// or uint8_t (fp8 codes, dequantized with their scales k_scales / v_scales,
// one per (row, kv head), as they are staged; null for the other dtypes).
//
// Batches (kSeqs > 1, attention_batch): kv holds the caches of up to kSeqs
// sequences of g.s queries each, whose q rows, positions and partial entries
// follow one another (sequence i's queries are queries i·s .. i·s + s - 1 of
// the launch); grid z = sequence · g.seq_tiles + pair tile. A block does for
// its sequence exactly what a launch for that sequence alone does (the same
// tiles, staging and sums), so the bits are those of separate calls.
template <typename KvT, int kSeqs, bool kRaw = false>
__global__ void __launch_bounds__(kPartialThreads, 3)
    attention_partials_kernel(const float* __restrict__ q,
                              const __grid_constant__ KvSources<KvT, kSeqs> kv,
                              const int32_t* __restrict__ q_pos, float* __restrict__ part_ml,
                              float* __restrict__ part_acc, AttnGeom g) {
  // The combine may launch now: it waits (griddepcontrol.wait) for this whole
  // grid to finish, and its memory to be visible, before reading anything.
  // This kernel is itself a programmatic dependent of the kernel before it,
  // and waits for it before touching anything.
  pdl_launch_dependents();
  pdl_wait();
  const int seq = kSeqs == 1 ? 0 : static_cast<int>(blockIdx.z) / g.seq_tiles;
  const int pair_tile_index = static_cast<int>(blockIdx.z) - seq * g.seq_tiles;
  const KvT* __restrict__ k = kv.k[seq];
  const KvT* __restrict__ v = kv.v[seq];
  const float* k_scales = kv.k_scales[seq];
  const float* v_scales = kv.v_scales[seq];
  if constexpr (kSeqs > 1) {
    const int64_t q0 = int64_t{seq} * g.s;  // the sequence's first query in the launch
    q += q0 * g.n_heads * g.d;
    q_pos += q0;
    part_ml += 2 * q0 * g.n_heads * g.n_slots;
    part_acc += q0 * g.n_heads * g.n_slots * g.d;
  }
  extern __shared__ float4 smem[];
  float* sK = reinterpret_cast<float*>(smem);          // [kChunk][ld] keys of the chunk
  float* sV = sK + kChunk * g.ld;                      // [kChunk][ld] values
  float* sQ = sV + kChunk * g.ld;                      // [staged_q_rows][ld] q rows
  float* sP = sQ + staged_q_rows(g.pair_tile) * g.ld;  // [pair_tile][kChunk] scores, then weights
  __shared__ int s_j0[kPairTile];                      // keys j0 .. j1 of the chunk pair p sees
  __shared__ int s_j1[kPairTile];                      // (j0 > j1: none)
  __shared__ int64_t s_entry[kPairTile];               // its partial entry (-1: none)

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  // Derived launches: the keys of this tile's queries (consecutive positions)
  // span [first visible key of query 0, position of the last query].
  const KeyRange hull =
      g.derive ? KeyRange{visible_keys(q_pos[0], g).lo, static_cast<int64_t>(q_pos[g.s - 1])}
               : KeyRange{g.k_pos0, g.k_pos0 + g.t - 1};
  const int64_t c_first = g.derive ? floor_div(hull.lo, kChunk) : g.c_first;
  const int64_t c0 = (c_first + blockIdx.x) * kChunk;  // position of key 0 of the chunk
  const int kvh = static_cast<int>(blockIdx.y);
  const int64_t pair0 = static_cast<int64_t>(pair_tile_index) * g.pair_tile;
  const int np =
      static_cast<int>(min(static_cast<int64_t>(g.pair_tile), int64_t{g.s} * g.group - pair0));

  // Stages q rows and K rows j0..j1 (cp.async group 0), then V rows j0..j1
  // (group 1). Row of absolute position kp: kp - k_pos0, or kp % ring for ring
  // caches (which may wrap inside a chunk).
  auto stage_tiles = [&](int j0, int j1) {
    const int64_t kv_row = int64_t{g.n_kv} * g.d;  // floats per key
    const KvT* k_head = k + int64_t{kvh} * g.d;
    const KvT* v_head = v + int64_t{kvh} * g.d;
    auto key_row = [&](int64_t kp) { return g.ring > 0 ? kp % g.ring : kp - g.k_pos0; };
    for (int p = warp; p < np; p += kPartialWarps) {
      const int64_t pair = pair0 + p;
      const int64_t h = int64_t{kvh} * g.group + pair % g.group;
      stage_row(sQ + p * g.ld, q + ((pair / g.group) * g.n_heads + h) * g.d, g, lane);
    }
    // Chunk row j of the kv head whose row 0 is `head`.
    auto rows_of = [&](const KvT* head) {
      return [&, head](int j) {
        const int64_t r = key_row(c0 + j);
        return KvRowRef<KvT>{head + r * kv_row, r};
      };
    };
    if constexpr (kRaw) {
      stage_raw_rows<KvT>(sK, j0 + warp, j1, rows_of(k_head), k_scales, kvh, g, lane);
      __pipeline_commit();
      stage_raw_rows<KvT>(sV, j0 + warp, j1, rows_of(v_head), v_scales, kvh, g, lane);
    } else {
      stage_kv_rows<KvT>(sK, j0 + warp, j1, rows_of(k_head), k_scales, kvh, g, lane);
      __pipeline_commit();
      stage_kv_rows<KvT>(sV, j0 + warp, j1, rows_of(v_head), v_scales, kvh, g, lane);
    }
    __pipeline_commit();
  };
  // Eager: stage every row of the chunk inside the key tensor before reading
  // q_pos, saving a memory latency (the visible keys are a subset).
  if (g.eager) {
    stage_tiles(static_cast<int>(max(c0, hull.lo) - c0),
                static_cast<int>(min(c0 + kChunk - 1, hull.hi) - c0));
  }

  chunk_pair_ranges(q_pos, c0, kvh, pair0, np, g, s_j0, s_j1, s_entry);
  __syncthreads();
  // Keys [u0, u1]: the hull of the pairs' ranges (rows the loops below read).
  const int2 hull_keys = chunk_key_hull(s_j0, s_j1, np);
  const int u0 = hull_keys.x;
  const int u1 = hull_keys.y;
  if (u0 > u1) {                            // block-uniform: no pair sees a key of this chunk
    if (g.eager) __pipeline_wait_prior(0);  // no copy outlives the block
    return;
  }
  if (!g.eager) stage_tiles(u0, u1);

  __pipeline_wait_prior(1);  // this thread's q and K copies have landed
  __syncthreads();           // ... and everyone's
  auto rows = [&](const float* base) {
    if constexpr (kRaw) {
      return raw_rows<KvT>(base, g);
    } else {
      return F32Rows{base, g.ld};
    }
  };
  chunk_softmax(rows(sK), sQ, sP, s_j0, s_j1, s_entry, np, part_ml, g, [] {});
  __pipeline_wait_prior(0);  // V rows
  __syncthreads();
  chunk_weighted_values(rows(sV), sP, s_j0, s_j1, s_entry, np, u0, u1, part_acc, g);
}

// The partials kernel may use up to kMaxPartialsSmem of dynamic shared memory;
// raise its limit once per device (an attribute of the function per context).
void allow_partials_smem(int device) {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit) != 0) return;
  auto allow = [](auto kernel) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kMaxPartialsSmem)),
               "cudaFuncSetAttribute(attention_partials_kernel)");
  };
  allow(attention_partials_kernel<float, 1>);
  allow(attention_partials_kernel<uint16_t, 1>);
  allow(attention_partials_kernel<uint8_t, 1>);
  allow(attention_partials_kernel<float, kBatchSeqs>);
  allow(attention_partials_kernel<uint16_t, kBatchSeqs>);
  allow(attention_partials_kernel<uint8_t, kBatchSeqs>);
  allow(attention_partials_kernel<uint16_t, 1, true>);
  allow(attention_partials_kernel<uint16_t, kBatchSeqs, true>);
  allow(attention_partials_kernel<uint8_t, 1, true>);
  allow(attention_partials_kernel<uint8_t, kBatchSeqs, true>);
  done.fetch_or(bit, std::memory_order_relaxed);
}

// The partials grid: x = chunks, y = kv heads, z = pair tiles (of every
// sequence of a batch: sequences · g.seq_tiles).
template <typename KvT, int kSeqs>
void launch_partials(const float* q, const KvSources<KvT, kSeqs>& kv, const int32_t* q_pos,
                     float* part_ml, float* part_acc, const AttnGeom& g, int64_t n_chunks,
                     int64_t z_tiles, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(n_chunks), static_cast<unsigned>(g.n_kv),
                  static_cast<unsigned>(z_tiles));
  auto* kernel = attention_partials_kernel<KvT, kSeqs>;
  if constexpr (!std::is_same_v<KvT, float>) {
    // The raw staging (an A/B switch under measurement, backends.h).
    if (cuda_kernel_choices().raw_kv_staging && raw_staging_fits<KvT>(g.d, g.vec4)) {
      kernel = attention_partials_kernel<KvT, kSeqs, true>;
    }
  }
  launch_pdl(kernel, grid, dim3(kPartialThreads), partials_smem_bytes(g.d, g.pair_tile), stream,
             "attention_partials_kernel", q, kv, q_pos, part_ml, part_acc, g);
}

// Pair tiles of one sequence of g.s queries.
int64_t pair_tiles(const AttnGeom& g) {
  const int64_t pairs = int64_t{g.s} * g.group;
  return (pairs + g.pair_tile - 1) / g.pair_tile;
}

// Runs f(KvSources<KvT, kSeqs>) with the cache element type of `dtype`: the
// dispatch every partials launch shares.
template <int kSeqs, typename F>
void with_kv_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF8E4M3:
      f(KvSources<uint8_t, kSeqs>{});
      break;
    case DType::kBF16:
      f(KvSources<uint16_t, kSeqs>{});
      break;
    default:
      f(KvSources<float, kSeqs>{});
      break;
  }
}

// Entry i of `kv` from the cache tensors of p (scales for fp8 only).
template <typename KvT, int kSeqs>
void set_source(KvSources<KvT, kSeqs>& kv, int i, const AttentionParams& p) {
  kv.k[i] = p.k.data_as<const KvT>();
  kv.v[i] = p.v.data_as<const KvT>();
  kv.k_scales[i] = std::is_same_v<KvT, uint8_t> ? p.k.scale_data() : nullptr;
  kv.v_scales[i] = std::is_same_v<KvT, uint8_t> ? p.v.scale_data() : nullptr;
}

}  // namespace

// attention()'s checks (shapes, devices, what the kernels support).
ops::AttentionDims check_cuda_attention(CudaBackend& be, const AttentionParams& p) {
  constexpr const char* kOp = "attention";
  check_on(be, kOp, "q", p.q);
  check_on(be, kOp, "k", p.k);
  check_on(be, kOp, "v", p.v);
  check_on(be, kOp, "out", p.out);
  check_on(be, kOp, "q_positions", p.q_positions);
  const ops::AttentionDims dims = ops::check_attention(p);
  if (dims.head_dim > kMaxHeadDim) {
    fail("attention: head dimension {} of q {} exceeds the {} the CUDA kernels support",
         dims.head_dim, p.q.describe(), kMaxHeadDim);
  }
  if (dims.heads > 65535) {
    fail("attention: q {} / k {} have more heads than the CUDA kernels support", p.q.describe(),
         p.k.describe());
  }
  return dims;
}

AttnPlan plan_attention(CudaBackend& be, const AttentionParams& p, const ops::AttentionDims& dims) {
  const int64_t s_len = dims.queries;
  const int64_t n_heads = dims.heads;
  const int64_t d = dims.head_dim;
  const int64_t t_len = dims.keys;
  AttnPlan plan;
  AttnGeom& g = plan.g;
  g.n_heads = static_cast<int>(n_heads);
  g.n_kv = static_cast<int>(dims.kv_heads);
  g.group = static_cast<int>(n_heads / dims.kv_heads);
  g.d = static_cast<int>(d);
  g.ld = smem_row_floats(g.d);
  g.t = t_len;
  g.k_pos0 = p.k_pos0;
  g.ring = dims.ring ? p.k.dim(0) : 0;
  g.c_first = floor_div(p.k_pos0, kChunk);
  g.window = p.window;
  g.causal = p.causal;
  g.vec4 = d % 4 == 0 && aligned16(p.q.data()) && aligned16(p.k.data()) && aligned16(p.v.data());
  g.scale = p.scale;
  g.derive = p.positions_bound > 0 && p.causal;
  // Chunks the key tensor touches (the partials grid), and slots per (query,
  // head): the chunks a visible range can touch, bounded by those and, for a
  // causal window, by the window length (a range of w positions touches at
  // most (w + kChunk - 2) / kChunk + 1 chunks; without causality a window
  // bounds only the start of the range). Derived launches size both by
  // positions_bound instead of T, so they do not change from step to step.
  int64_t n_chunks = t_len > 0 ? floor_div(p.k_pos0 + t_len - 1, kChunk) - g.c_first + 1 : 0;
  if (g.derive) {
    if (p.q_positions.numel() > 0 && t_len > 0 && p.k_pos0 + t_len > p.positions_bound) {
      fail("attention: keys up to position {} reach past positions_bound {}", p.k_pos0 + t_len - 1,
           p.positions_bound);
    }
    n_chunks = (p.positions_bound + kChunk - 1) / kChunk;
  }
  if (n_chunks > INT_MAX) {
    fail("attention: k {} spans {} chunks of {} keys, more than the CUDA kernels support",
         p.k.describe(), n_chunks, kChunk);
  }
  plan.n_chunks = n_chunks;
  int64_t n_slots = n_chunks;
  if (p.causal && p.window > 0) {
    n_slots = std::min<int64_t>(n_slots, (p.window + kChunk - 2) / kChunk + 1);
  }
  g.n_slots = static_cast<int>(n_slots);

  // Tile the queries so one tile's partials fit the scratch; tiles are
  // independent (a query's result does not depend on its tile).
  const size_t per_query = static_cast<size_t>(n_heads) * static_cast<size_t>(n_slots) *
                           static_cast<size_t>(d + 2) * sizeof(float);
  int64_t tile = s_len;
  void* base = nullptr;
  if (per_query > 0) {
    const size_t bytes = std::max(kPartialsBudget, per_query);
    base = be.scratch(be.attn_partials_, bytes);
    plan.query_capacity = static_cast<int64_t>(bytes / per_query);
    tile = std::min<int64_t>(s_len, plan.query_capacity);
  }
  // Grid z of the partials kernel is at most 65535 pair tiles; the combine grid
  // (x = tile · H blocks) at most INT_MAX.
  tile = std::min<int64_t>(tile, int64_t{65535} * kPairTile / g.group);
  tile = std::min<int64_t>(tile, int64_t{INT_MAX} / n_heads);
  plan.tile = std::max<int64_t>(tile, 1);
  // acc [tile·H·slots][D] first (16-byte aligned rows when D % 4 == 0), then
  // the (m, l) pairs.
  plan.part_acc = static_cast<float*>(base);
  plan.part_ml =
      plan.part_acc == nullptr ? nullptr : plan.part_acc + plan.tile * n_heads * n_slots * d;
  if (n_chunks > 0) allow_partials_smem(be.device_index());
  plan.nr = static_cast<int>((d + 31) / 32);
  return plan;
}

// Sets the per-launch fields of g for queries [s0, s0 + s) of an S-query call.
void set_tile(AttnGeom& g, const AttentionParams& p, int64_t s0, int64_t s, int64_t s_len) {
  g.s = static_cast<int>(s);
  g.pair_tile = static_cast<int>(std::min<int64_t>(kPairTile, int64_t{g.s} * g.group));
  // Decode and verify windows (one pair tile): their keys are nearly all
  // visible, so staging a chunk's rows before knowing the ranges wastes little.
  g.eager = int64_t{g.s} * g.group <= kPairTile;
  g.release_next = p.product_follows && s0 + s >= s_len;
  g.v_early = kChunk;
}

}  // namespace attn

using namespace attn;

// q f32 [S, H, D], k/v f32|bf16|f8e4m3 [T, Hkv, D] (fp8 with its scales), out f32
// [S, H, D], q_positions i32 [S]
// (all on this device); H a multiple of Hkv, D <= 512. See AttentionParams.
void CudaBackend::attention(const AttentionParams& p) {
  OpTimer timer(*this, "attention");
  const ops::AttentionDims dims = check_cuda_attention(*this, p);
  const int64_t s_len = dims.queries;
  if (p.out.numel() == 0) return;
  // (The tensor-core prefill path reads a bf16 cache through f32 copies of
  // its keys and values, up to kPrefillWidenBudget; past that a bf16 cache
  // takes the partials kernels, which widen its rows as they stage them.)
  if (p.allow_fast_prefill && !dims.ring && s_len >= kFastPrefillQueries && dims.keys > 0 &&
      prefill_widen_bytes(p) <= kPrefillWidenBudget) {
    attention_prefill_gemm(*this, p);
    return;
  }
  AttnPlan plan = plan_attention(*this, p, dims);
  AttnGeom& g = plan.g;
  const int64_t n_heads = dims.heads;
  const int64_t d = dims.head_dim;
  const auto* q = p.q.data_as<const float>();
  const auto* pos = p.q_positions.data_as<const int32_t>();
  auto* out = p.out.data_as<float>();
  for (int64_t s0 = 0; s0 < s_len; s0 += plan.tile) {
    set_tile(g, p, s0, std::min(plan.tile, s_len - s0), s_len);
    const int64_t offset = s0 * n_heads * d;
    if (plan.n_chunks > 0) {
      with_kv_type<1>(p.k.dtype(), [&](auto kv) {
        set_source(kv, 0, p);
        launch_partials(q + offset, kv, pos + s0, plan.part_ml, plan.part_acc, g,
                        plan.grid_chunks(g.s), pair_tiles(g), stream());
      });
    }
    dispatch_combine(plan.nr, std::make_integer_sequence<int, kMaxLaneDims>{}, pos + s0,
                     plan.part_ml, plan.part_acc, out + offset, g,
                     /*after_partials=*/plan.n_chunks > 0, stream());
  }
}

namespace {

// Whether entry e can share entry `first`'s batched launch as its i-th
// sequence: the same geometry (dims, cache dtype and layout, window, scale,
// alignment), a recordable derived launch (positions_bound) outside the
// prefill path, and q, out and q_positions that continue those of `first` (so
// one combine launch covers every sequence).
bool joins_batch(const AttentionParams& first, const ops::AttentionDims& d0,
                 const AttentionParams& e, const ops::AttentionDims& d, int64_t i) {
  const auto derived = [](const AttentionParams& p) { return p.positions_bound > 0 && p.causal; };
  const auto vec4 = [](const AttentionParams& p) {
    return aligned16(p.q.data()) && aligned16(p.k.data()) && aligned16(p.v.data());
  };
  // Where entry i's copy of tensor t of `first` would start: right after i
  // tensors of t's size (entries have the same shapes).
  const auto at = [&](const Tensor& t, size_t elem_bytes) {
    return static_cast<const char*>(t.data()) + static_cast<size_t>(i) * t.numel() * elem_bytes;
  };
  if (!derived(e) || e.allow_fast_prefill || e.out.numel() == 0) return false;
  if (d.queries != d0.queries || d.heads != d0.heads || d.kv_heads != d0.kv_heads ||
      d.head_dim != d0.head_dim || d.ring != d0.ring) {
    return false;
  }
  if (e.k.dtype() != first.k.dtype() || e.window != first.window || e.scale != first.scale ||
      vec4(e) != vec4(first)) {
    return false;
  }
  // A ring's rows and a full cache's key 0 enter the geometry of the launch.
  if (d.ring ? e.k.dim(0) != first.k.dim(0) : e.k_pos0 != first.k_pos0) return false;
  return e.q.data() == at(first.q, sizeof(float)) && e.out.data() == at(first.out, sizeof(float)) &&
         e.q_positions.data() == at(first.q_positions, sizeof(int32_t));
}

}  // namespace

// See Backend::attention_batch. Runs of consecutive entries that joins_batch
// admits (up to kBatchSeqs, and as many as the partials scratch holds) take
// one partials launch (attention_partials_kernel<KvT, kBatchSeqs>: a block per
// (chunk, kv head, sequence, pair tile)) and one combine launch over all their
// queries; any other entry is an attention() call. A batched sequence's
// blocks do what attention() launches for it alone (its own pair tiles and
// key staging; the partial slots are sized for the batch's largest
// positions_bound, which changes no sum), so the bits are the same.
void CudaBackend::attention_batch(std::span<const AttentionParams> entries) {
  OpTimer timer(*this, "attention_batch");
  size_t i = 0;
  while (i < entries.size()) {
    const AttentionParams& first = entries[i];
    const ops::AttentionDims d0 = check_cuda_attention(*this, first);
    size_t n = 1;
    int64_t bound = first.positions_bound;
    while (i + n < entries.size() && n < static_cast<size_t>(kBatchSeqs)) {
      const AttentionParams& e = entries[i + n];
      const ops::AttentionDims d = check_cuda_attention(*this, e);
      if (!joins_batch(first, d0, e, d, static_cast<int64_t>(n))) break;
      bound = std::max(bound, e.positions_bound);
      ++n;
    }
    if (n < 2 || !joins_batch(first, d0, first, d0, 0)) {
      attention(first);
      ++i;
      continue;
    }
    // Every entry's own checks (keys within its positions_bound) as attention()
    // makes them; the plan itself is entry 0's at the batch's largest bound.
    for (size_t j = 0; j < n; ++j) {
      plan_attention(*this, entries[i + j], check_cuda_attention(*this, entries[i + j]));
    }
    AttentionParams widest = first;
    widest.positions_bound = bound;
    AttnPlan plan = plan_attention(*this, widest, d0);
    const int64_t s = d0.queries;
    n = std::min<size_t>(n, static_cast<size_t>(plan.query_capacity / s));
    if (n < 2 || plan.n_chunks == 0) {
      attention(first);
      ++i;
      continue;
    }
    // The plan laid out (m, l) after one sequence's accumulators; the batch's
    // n·s queries need theirs first.
    plan.part_ml =
        plan.part_acc + static_cast<int64_t>(n) * s * d0.heads * plan.g.n_slots * d0.head_dim;
    AttnGeom& g = plan.g;
    set_tile(g, first, 0, s, s);
    g.release_next = false;  // several sequences: measured slower (see the combine)
    g.seq_tiles = static_cast<int>(pair_tiles(g));
    with_kv_type<kBatchSeqs>(first.k.dtype(), [&](auto kv) {
      for (size_t j = 0; j < n; ++j) set_source(kv, static_cast<int>(j), entries[i + j]);
      launch_partials(first.q.data_as<const float>(), kv,
                      first.q_positions.data_as<const int32_t>(), plan.part_ml, plan.part_acc, g,
                      plan.grid_chunks(s), static_cast<int64_t>(n) * g.seq_tiles, stream());
    });
    AttnGeom all = g;
    all.s = static_cast<int>(static_cast<int64_t>(n) * s);
    dispatch_combine(plan.nr, std::make_integer_sequence<int, kMaxLaneDims>{},
                     first.q_positions.data_as<const int32_t>(), plan.part_ml, plan.part_acc,
                     first.out.data_as<float>(), all, /*after_partials=*/true, stream());
    i += n;
  }
}

}  // namespace specula::cuda
