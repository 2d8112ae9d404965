// SPDX-License-Identifier: Apache-2.0
// CudaBackend::attention_with_inputs: the fused kernel (inputs finished inside
// the partials blocks, old keys loaded before the inputs are ready) against
// the CUDA composition attention_inputs + attention byte for byte, and against
// the CPU within the norm / RoPE / attention tolerance: decode steps and verify
// windows, sliding rings that wrap and full caches, positions at chunk edges,
// GQA groups of 2 and 8, head dims 64 to 512, v from k, separate v and
// KV-shared (q only) layers, f32 and bf16 norm weights, windows of several
// pair tiles, f32 and bf16 caches (a bf16 cache: the same bytes as the
// composition, whose store rounds the finished rows, and the CPU's attention
// over the rounded cache; its new rows within one bf16 ulp of the CPU's);
// calls the fused kernel does not take give the same bytes as well.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/ops/backend.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// A norm and RoPE (CUDA's sincosf may be two ulp from glibc's), then f32
// online softmax over chunks against the CPU's direct softmax.
constexpr float kTol = 3e-5f;

enum class Kv { kQOnly, kSeparateV, kVFromK };

struct FusedCase {
  int64_t s = 1;  // queries (new tokens)
  int64_t heads = 8, kv_heads = 2, d = 256;
  int64_t last = 0;          // position of the last query
  bool ring = true;          // sliding ring (window 40, 64 rows) or a full cache
  int64_t full_rows = 1024;  // rows of a full cache (more than last)
  Kv kv = Kv::kSeparateV;
  DType norm_dtype = DType::kBF16;
  DType cache_dtype = DType::kF32;

  std::string label() const {
    return fmt::format("S={} H={}/{} D={} last={} {} {} norms {} cache {}", s, heads, kv_heads, d,
                       last, ring ? "ring" : "full",
                       kv == Kv::kQOnly    ? "q only"
                       : kv == Kv::kVFromK ? "v from k"
                                           : "separate v",
                       norm_dtype == DType::kF32 ? "f32" : "bf16",
                       cache_dtype == DType::kF32 ? "f32" : "bf16");
  }
};

constexpr int kWindow = 40;
constexpr int64_t kRingRows = 64;  // window + 24 rows of slack (>= S - 1)

// The tensors of a case: inputs (never written by the op under test) and
// copies of what it writes, one set per run.
struct Inputs {
  std::unique_ptr<Twin> q, k, v, q_norm, k_norm, freq, pos, cache_k, cache_v;
};

// A new twin holding a copy of `host` (a host tensor or a view of one: same
// dtype, shape and bytes), already pushed.
std::unique_ptr<Twin> twin_of(const Tensor& host) {
  auto c = std::make_unique<Twin>(host.dtype(), host.shape());
  std::memcpy(c->host.view().data(), host.data(), host.nbytes());
  c->push();
  return c;
}

Inputs make_inputs(const FusedCase& c, uint64_t seed) {
  Inputs in;
  const int64_t kv = c.kv_heads, d = c.d;
  in.q = std::make_unique<Twin>(DType::kF32, Shape{c.s, c.heads, d});
  in.q->randomize(seed++, -3.0f, 3.0f);
  in.q_norm = std::make_unique<Twin>(c.norm_dtype, Shape{d});
  in.q_norm->randomize(seed++, 0.5f, 1.5f);
  in.k_norm = std::make_unique<Twin>(c.norm_dtype, Shape{d});
  in.k_norm->randomize(seed++, 0.5f, 1.5f);
  in.freq = std::make_unique<Twin>(DType::kF32, Shape{d / 2});
  for (int64_t j = 0; j < d / 2; ++j) {  // the upper quarter unrotated, as partial rotary
    in.freq->host.data<float>()[j] =
        j >= d / 2 * 3 / 4
            ? 0.0f
            : static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(j) / d));
  }
  in.freq->push();
  in.pos = std::make_unique<Twin>(DType::kI32, Shape{c.s});
  for (int64_t i = 0; i < c.s; ++i) {
    in.pos->host.data<int32_t>()[i] = static_cast<int32_t>(c.last - c.s + 1 + i);
  }
  in.pos->push();
  if (c.kv != Kv::kQOnly) {
    in.k = std::make_unique<Twin>(DType::kF32, Shape{c.s, kv, d});
    in.k->randomize(seed++, -3.0f, 3.0f);
    in.v = std::make_unique<Twin>(DType::kF32, Shape{c.s, kv, d});
    in.v->randomize(seed++, -2.0f, 2.0f);
  }
  // Old rows (and, q only, the donor's new rows): normalised-looking values.
  const int64_t rows = c.ring ? kRingRows : c.full_rows;
  in.cache_k = std::make_unique<Twin>(DType::kF32, Shape{rows, kv, d});
  in.cache_k->randomize(seed++, -1.0f, 1.0f);
  in.cache_v = std::make_unique<Twin>(DType::kF32, Shape{rows, kv, d});
  in.cache_v->randomize(seed++, -1.0f, 1.0f);
  if (c.cache_dtype == DType::kBF16) {  // the same values rounded (the CPU's rule)
    for (std::unique_ptr<Twin>* cache : {&in.cache_k, &in.cache_v}) {
      auto b = std::make_unique<Twin>(DType::kBF16, Shape{rows, kv, d});
      cpu_be().convert((*cache)->host, b->host);
      b->push();
      *cache = std::move(b);
    }
  }
  return in;
}

// What one run writes: q (attention_inputs finishes it in place), k and v
// (absent for q only), the caches, and out (7s before the run, so that a row
// nobody writes shows up).
struct Outputs {
  std::unique_ptr<Twin> q, k, v, cache_k, cache_v, out;
};

Outputs fresh_outputs(const FusedCase& c, const Inputs& t) {
  Outputs o;
  o.q = twin_of(t.q->host);
  if (t.k) {
    o.k = twin_of(t.k->host);
    o.v = twin_of(t.v->host);
  }
  o.cache_k = twin_of(t.cache_k->host);
  o.cache_v = twin_of(t.cache_v->host);
  o.out = std::make_unique<Twin>(DType::kF32, Shape{c.s, c.heads, c.d});
  for (int64_t i = 0; i < o.out->host.view().numel(); ++i) o.out->host.data<float>()[i] = 7.0f;
  o.out->push();
  return o;
}

// The two op parameter sets of a case: its inputs `t` and one run's outputs
// `o`, on the device or the host side of the twins.
struct Call {
  AttentionInputsParams in;
  AttentionParams ap;
};

Call make_call(const FusedCase& c, const Inputs& t, const Outputs& o, bool on_device) {
  auto pick = [&](const Twin& x) { return on_device ? x.dev : Tensor(x.host); };
  Call call;
  AttentionInputsParams& in = call.in;
  in.q = pick(*o.q);
  in.q_norm = pick(*t.q_norm);
  in.positions = pick(*t.pos);
  in.inv_freq = pick(*t.freq);
  in.eps = 1e-6f;
  if (c.kv != Kv::kQOnly) {
    in.k = pick(*o.k);
    in.k_norm = pick(*t.k_norm);
    in.v = pick(*o.v);
    in.v_from_k = c.kv == Kv::kVFromK;
    in.cache_k = pick(*o.cache_k);
    in.cache_v = pick(*o.cache_v);
  }
  AttentionParams& ap = call.ap;
  ap.q = in.q;
  ap.out = pick(*o.out);
  ap.q_positions = in.positions;
  ap.causal = true;
  ap.scale = 1.0f;
  const int64_t pos0 = c.last - c.s + 1;
  ap.positions_bound = positions_bound_for(c.last + 1);
  if (c.ring) {
    const int64_t from = std::max<int64_t>(0, pos0 - kWindow + 1);
    ap.k = pick(*o.cache_k);
    ap.v = pick(*o.cache_v);
    ap.k_pos0 = from;
    ap.ring_keys = c.last + 1 - from;
    ap.window = kWindow;
  } else {
    ap.k = pick(*o.cache_k).slice_rows(0, c.last + 1);
    ap.v = pick(*o.cache_v).slice_rows(0, c.last + 1);
  }
  return call;
}

// The fused kernel (or the composition it falls back to) on the device, over
// the case's inputs `t`, writing `o`.
void run_fused(const FusedCase& c, const Inputs& t, const Outputs& o) {
  const Call call = make_call(c, t, o, true);
  gpu_be().attention_with_inputs(call.in, call.ap);
}

// f32 or bf16 tensors, element by element (the first differing one is named).
void expect_same_bytes(const HostTensor& got, const HostTensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.view().nbytes(), want.view().nbytes()) << what;
  const size_t size = dtype_size(want.dtype());
  const auto* g = static_cast<const char*>(got.view().data());
  const auto* w = static_cast<const char*>(want.view().data());
  for (int64_t i = 0; i < want.view().numel(); ++i) {
    const size_t at = static_cast<size_t>(i) * size;
    if (std::memcmp(g + at, w + at, size) != 0) {
      if (size == sizeof(float)) {
        float a = 0, b = 0;
        std::memcpy(&a, g + at, sizeof(float));
        std::memcpy(&b, w + at, sizeof(float));
        ADD_FAILURE() << what << ": element " << i << " is " << a << ", want " << b;
      } else {
        ADD_FAILURE() << what << ": element " << i << " differs";
      }
      return;
    }
  }
}

// t as f32 (a copy; bf16 widened exactly).
HostTensor as_f32(const HostTensor& t) {
  HostTensor f(DType::kF32, t.shape());
  cpu_be().convert(t.view(), f.view());
  return f;
}

// One bf16 ulp relative to the largest element: a bf16 cache row rounded from
// an f32 value one ulp away from the CPU's may land one bf16 step away.
constexpr float kBf16CacheTol = 0x1p-7f;

// Runs the case three ways; returns whether the fused kernel ran (it leaves q
// as it was, where attention_inputs finishes it in place).
bool check(const FusedCase& c, uint64_t seed = 1) {
  const std::string what = c.label();
  SCOPED_TRACE(what);
  const Inputs t = make_inputs(c, seed);
  Outputs fused = fresh_outputs(c, t);
  Outputs composed = fresh_outputs(c, t);
  Outputs cpu = fresh_outputs(c, t);
  run_fused(c, t, fused);
  const Call g = make_call(c, t, composed, true);
  gpu_be().attention_inputs(g.in);
  gpu_be().attention(g.ap);
  const Call h = make_call(c, t, cpu, false);
  cpu_be().attention_with_inputs(h.in, h.ap);

  const bool bf16 = c.cache_dtype == DType::kBF16;
  const auto compare = [&](std::unique_ptr<Twin> Outputs::*which, const char* name, float tol) {
    const HostTensor got = (fused.*which)->pull();
    expect_same_bytes(got, (composed.*which)->pull(), what + " " + name + " vs the composition");
    if (tol > 0) {
      expect_close(as_f32(got), as_f32((cpu.*which)->host), tol,
                   (what + " " + name + " vs cpu").c_str());
    }
  };
  // With a bf16 cache the CPU may round a new row one step away, which moves
  // its outputs by more than kTol: out is checked (below) against the CPU's
  // attention over the GPU's cache and finished q rows (the composition
  // finishes q in place).
  compare(&Outputs::out, "out", bf16 ? 0.0f : kTol);
  compare(&Outputs::cache_k, "cache_k", bf16 ? kBf16CacheTol : kTol);
  compare(&Outputs::cache_v, "cache_v", bf16 ? kBf16CacheTol : kTol);
  if (bf16) {
    const HostTensor q_done = composed.q->pull();
    const HostTensor ck = fused.cache_k->pull(), cv = fused.cache_v->pull();
    HostTensor want(DType::kF32, cpu.out->host.shape());
    AttentionParams ap = h.ap;
    ap.q = q_done.view();
    ap.k = c.ring ? ck.view() : ck.view().slice_rows(0, c.last + 1);
    ap.v = c.ring ? cv.view() : cv.view().slice_rows(0, c.last + 1);
    ap.out = want.view();
    cpu_be().attention(ap);
    expect_close(fused.out->pull(), want, kTol, (what + " out vs cpu attention").c_str());
  }
  const HostTensor q_after = fused.q->pull();
  return std::memcmp(q_after.view().data(), t.q->host.view().data(), t.q->host.view().nbytes()) ==
         0;
}

// Decode steps (S 1) and verify windows (S 5) over rings ending at each of
// `lasts` (skipping windows that would start before position 0), each kind of
// v, with caches of `cache_dtype`: each must take the fused kernel.
void expect_fused_over_rings(std::initializer_list<int64_t> lasts, DType cache_dtype) {
  for (int64_t s : {1, 5}) {
    for (int64_t last : lasts) {
      if (last - s + 1 < 0) continue;
      for (Kv kv : {Kv::kSeparateV, Kv::kVFromK, Kv::kQOnly}) {
        EXPECT_TRUE(
            check({.s = s, .last = last, .ring = true, .kv = kv, .cache_dtype = cache_dtype}))
            << "took the composition: S " << s << " last " << last;
      }
    }
  }
}

// Full caches up to `last`: 31B's full-attention shape (D 512, 4 queries per
// kv head... here 8, v from k), E2B's (D 256, 8/1, a verify window of 4 ending
// at last + 3, f32 norms) and a KV-shared D 512 layer.
std::vector<FusedCase> wide_head_cases(int64_t last, DType cache_dtype) {
  return {{.s = 1,
           .heads = 16,
           .kv_heads = 2,
           .d = 512,
           .last = last,
           .ring = false,
           .kv = Kv::kVFromK,
           .cache_dtype = cache_dtype},
          {.s = 4,
           .heads = 8,
           .kv_heads = 1,
           .d = 256,
           .last = last + 3,
           .ring = false,
           .kv = Kv::kSeparateV,
           .norm_dtype = DType::kF32,
           .cache_dtype = cache_dtype},
          {.s = 1,
           .heads = 8,
           .kv_heads = 1,
           .d = 512,
           .last = last,
           .ring = false,
           .kv = Kv::kQOnly,
           .cache_dtype = cache_dtype}};
}

// 31B's full-attention verify window: 5 queries in groups of 8 (40 pairs,
// several pair tiles), v from k, a full cache up to `last`.
FusedCase pair_tiles_case(int64_t last, DType cache_dtype) {
  return {.s = 5,
          .heads = 16,
          .kv_heads = 2,
          .d = 512,
          .last = last,
          .ring = false,
          .kv = Kv::kVFromK,
          .cache_dtype = cache_dtype};
}

// kv heads of the late-V-rows cases: enough blocks that the grid needs three
// an SM (see LateValueRowsOfVerifyWindows).
constexpr int64_t kLateKv = 128;

// 31B's sliding verify window (5 queries of groups of 2) over kLateKv kv
// heads, ending at `last`: over a ring, and over a full cache of 128 rows.
std::vector<FusedCase> late_v_cases(int64_t last, Kv kv, DType cache_dtype) {
  const FusedCase ring{.s = 5,
                       .heads = 2 * kLateKv,
                       .kv_heads = kLateKv,
                       .last = last,
                       .kv = kv,
                       .cache_dtype = cache_dtype};
  FusedCase full = ring;
  full.ring = false;
  full.full_rows = 128;
  return {ring, full};
}

TEST(CudaAttentionFused, DecodeAndVerifyWindowsOverRings) {
  SKIP_WITHOUT_CUDA();
  // Positions: the first token, both sides of chunk edges, past the window
  // (the ring wraps: 64 rows), and deep into it.
  expect_fused_over_rings({0, 4, 31, 32, 33, 63, 64, 100, 511}, DType::kF32);
}

TEST(CudaAttentionFused, FullCachesWideHeadsAndGroupsOfEight) {
  SKIP_WITHOUT_CUDA();
  for (int64_t last : {0, 31, 32, 200, 600}) {
    for (const FusedCase& c : wide_head_cases(last, DType::kF32)) {
      EXPECT_TRUE(check(c)) << c.label();
    }
  }
}

TEST(CudaAttentionFused, SmallHeadDims) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {64, 128}) {
    EXPECT_TRUE(check({.s = 5, .heads = 4, .kv_heads = 2, .d = d, .last = 70, .ring = true}));
    EXPECT_TRUE(check({.s = 2, .heads = 4, .kv_heads = 4, .d = d, .last = 33, .ring = false}));
  }
}

// Verify windows of several pair tiles (each cache row written by one of
// them): 31B's full-attention window (5 queries, groups of 8: 40 pairs) and
// E2B's, across chunk edges, a query's pairs split over two tiles (groups of
// 3), and 17 queries of pairs of 2 (34 pairs).
TEST(CudaAttentionFused, WindowsOfSeveralPairTiles) {
  SKIP_WITHOUT_CUDA();
  for (int64_t last : {4, 33, 35, 100}) {
    EXPECT_TRUE(check(pair_tiles_case(last, DType::kF32))) << "last " << last;
    EXPECT_TRUE(check({.s = 5, .heads = 8, .kv_heads = 1, .d = 256, .last = last, .ring = true}));
    EXPECT_TRUE(check({.s = 5,
                       .heads = 8,
                       .kv_heads = 1,
                       .d = 256,
                       .last = last,
                       .ring = true,
                       .kv = Kv::kQOnly}));
  }
  EXPECT_TRUE(check({.s = 11, .heads = 6, .kv_heads = 2, .d = 128, .last = 47, .ring = false}));
  EXPECT_TRUE(check({.s = 17, .heads = 8, .kv_heads = 4, .d = 256, .last = 90, .ring = true}));
}

// Windows whose blocks take V rows past the q rows' count only after the
// scores (so that three fit an SM, where the grid needs it): 31B's sliding
// window of 5 queries (10 pairs of a kv head), 3 queries of groups of 3 (9
// pairs) and 8 queries of 2 (16), over 128 kv heads so that the grid is large
// enough (positions past 63: grids of at least 3 chunks). New positions on
// both sides of the late rows' first (row 20 of a chunk at 9-12 pairs, 16 at
// 16) and of a chunk edge, rings that wrap and full caches, each kind of v.
TEST(CudaAttentionFused, LateValueRowsOfVerifyWindows) {
  SKIP_WITHOUT_CUDA();
  ASSERT_EQ(cuda::attention_fused_late_v_rows(256, 10, 3 * kLateKv), 20)
      << "the cases below would not take the late rows on this GPU";
  EXPECT_EQ(cuda::attention_fused_late_v_rows(256, 9, 3 * kLateKv), 20);
  EXPECT_EQ(cuda::attention_fused_late_v_rows(256, 16, 3 * kLateKv), 16);
  EXPECT_EQ(cuda::attention_fused_late_v_rows(256, 10, 32), 32) << "a grid of one wave";
  EXPECT_EQ(cuda::attention_fused_late_v_rows(256, 2, 4096), 32) << "decode blocks fit three";
  EXPECT_EQ(cuda::attention_fused_late_v_rows(512, 10, 4096), 32) << "one an SM either way";
  for (int64_t last : {84, 87, 95, 96, 100}) {
    for (Kv kv : {Kv::kSeparateV, Kv::kVFromK, Kv::kQOnly}) {
      for (const FusedCase& c : late_v_cases(last, kv, DType::kF32)) {
        EXPECT_TRUE(check(c)) << c.label();
      }
    }
    EXPECT_TRUE(check({.s = 3,
                       .heads = 3 * kLateKv,
                       .kv_heads = kLateKv,
                       .last = last,
                       .ring = false,
                       .full_rows = 128}));
    EXPECT_TRUE(check({.s = 8, .heads = 2 * kLateKv, .kv_heads = kLateKv, .last = last}));
  }
  // A long full cache: 16 chunks of 32 kv heads.
  EXPECT_TRUE(check({.s = 5, .heads = 64, .kv_heads = 32, .last = 511, .ring = false}));
}

// bf16 caches (issue #30): decode steps and verify windows over rings that
// wrap and full caches, each kind of v, 31B's and E2B's shapes, windows of
// several pair tiles and late V rows all take the fused kernel.
TEST(CudaAttentionFused, Bf16CachesTakeTheFusedKernel) {
  SKIP_WITHOUT_CUDA();
  constexpr DType kB = DType::kBF16;
  expect_fused_over_rings({0, 31, 33, 64, 100, 511}, kB);
  for (int64_t last : {0, 32, 200, 600}) {
    for (const FusedCase& c : wide_head_cases(last, kB)) EXPECT_TRUE(check(c)) << c.label();
  }
  for (int64_t d : {64, 128}) {
    EXPECT_TRUE(check(
        {.s = 5, .heads = 4, .kv_heads = 2, .d = d, .last = 70, .ring = true, .cache_dtype = kB}));
  }
  // Several pair tiles (31B's full-attention verify window: 40 pairs).
  EXPECT_TRUE(check(pair_tiles_case(35, kB)));
  EXPECT_TRUE(check(
      {.s = 17, .heads = 8, .kv_heads = 4, .d = 256, .last = 90, .ring = true, .cache_dtype = kB}));
  // Late V rows (see LateValueRowsOfVerifyWindows), each kind of v.
  ASSERT_EQ(cuda::attention_fused_late_v_rows(256, 10, 3 * kLateKv), 20);
  for (int64_t last : {87, 96}) {
    for (Kv kv : {Kv::kSeparateV, Kv::kVFromK, Kv::kQOnly}) {
      for (const FusedCase& c : late_v_cases(last, kv, kB)) EXPECT_TRUE(check(c)) << c.label();
    }
  }
}

// A KV-shared layer (q only: the fused kernel writes no cache row) over a
// bf16 cache gives the same bits as over an f32 cache holding the same
// (rounded) values: the staged rows are their exact widening.
TEST(CudaAttentionFused, Bf16CacheEqualsF32CacheOfTheRoundedValues) {
  SKIP_WITHOUT_CUDA();
  for (const bool ring : {true, false}) {
    for (int64_t s : {1, 5}) {
      FusedCase c{.s = s,
                  .heads = 16,
                  .kv_heads = 2,
                  .d = 256,
                  .last = 300,
                  .ring = ring,
                  .kv = Kv::kQOnly,
                  .cache_dtype = DType::kBF16};
      SCOPED_TRACE(c.label());
      const Inputs t = make_inputs(c, 3);
      Outputs b = fresh_outputs(c, t);
      Outputs f = fresh_outputs(c, t);
      // f: the same cache widened to f32.
      f.cache_k = twin_of(as_f32(f.cache_k->host));
      f.cache_v = twin_of(as_f32(f.cache_v->host));
      run_fused(c, t, b);
      run_fused(c, t, f);
      expect_same_bytes(b.out->pull(), f.out->pull(), "out: bf16 cache vs f32 of its values");
      // Both took the fused kernel (q left as it was).
      const HostTensor qb = b.q->pull(), qf = f.q->pull();
      EXPECT_EQ(std::memcmp(qb.view().data(), t.q->host.view().data(), qb.view().nbytes()), 0);
      EXPECT_EQ(std::memcmp(qf.view().data(), t.q->host.view().data(), qf.view().nbytes()), 0);
    }
  }
}

// Decode steps over a bf16 cache agree bit for bit with the verify window
// that wrote the same rows: each query of a fused window of 5 equals a fused
// decode step (1 query, its own row written again, to the same bits) at its
// position over the cache the window left.
TEST(CudaAttentionFused, Bf16CacheDecodeEqualsVerifyWindow) {
  SKIP_WITHOUT_CUDA();
  for (const bool ring : {true, false}) {
    FusedCase w{.s = 5,
                .heads = 8,
                .kv_heads = 2,
                .d = 256,
                .last = 200,
                .ring = ring,
                .kv = Kv::kSeparateV,
                .cache_dtype = DType::kBF16};
    SCOPED_TRACE(w.label());
    const Inputs t = make_inputs(w, 5);
    Outputs win = fresh_outputs(w, t);
    run_fused(w, t, win);
    const HostTensor all = win.out->pull();
    const HostTensor cache_k = win.cache_k->pull(), cache_v = win.cache_v->pull();
    const int64_t row = w.heads * w.d;
    for (int64_t i = 0; i < w.s; ++i) {
      FusedCase d = w;
      d.s = 1;
      d.last = w.last - w.s + 1 + i;
      // Query i's raw inputs, over the cache the window left.
      Inputs ti = make_inputs(d, 5);
      ti.q = twin_of(t.q->host.view().slice_rows(i, i + 1));
      ti.k = twin_of(t.k->host.view().slice_rows(i, i + 1));
      ti.v = twin_of(t.v->host.view().slice_rows(i, i + 1));
      ti.cache_k = twin_of(cache_k);
      ti.cache_v = twin_of(cache_v);
      Outputs one = fresh_outputs(d, ti);
      run_fused(d, ti, one);
      const HostTensor got = one.out->pull();
      EXPECT_EQ(std::memcmp(got.view().data(), all.data<float>() + i * row, row * 4), 0)
          << "query " << i;
      expect_same_bytes(one.cache_k->pull(), cache_k, "cache_k rewritten by the step");
      expect_same_bytes(one.cache_v->pull(), cache_v, "cache_v rewritten by the step");
    }
  }
}

// More pairs than the fused launch takes, and head dims that are not float4
// rows: the composition runs, with the same results.
TEST(CudaAttentionFused, CallsTheKernelDoesNotTakeRunTheComposition) {
  SKIP_WITHOUT_CUDA();
  EXPECT_FALSE(check({.s = 17, .heads = 8, .kv_heads = 1, .d = 256, .last = 90, .ring = false}));
  EXPECT_FALSE(check({.s = 1, .heads = 4, .kv_heads = 2, .d = 82, .last = 40, .ring = true}));
}

}  // namespace
}  // namespace specula::test
