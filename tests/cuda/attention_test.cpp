// SPDX-License-Identifier: Apache-2.0
// CudaBackend::attention against the CPU reference: decode, verify windows,
// prefill, sliding windows, GQA, head dims up to 512, long key ranges that
// cross many chunks (and the query tiling of the partials scratch), queries
// that see nothing, non-causal attention; bit-exact batch invariance (a query
// alone vs. inside a verify window or a prefill, over differently gathered
// keys); scratch allocated once; clear errors for bad arguments.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/ops/backend.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/op_test_util.h"

namespace specula::test {
namespace {

using testing::attention_params;
using testing::expect_error;
using testing::last_positions;

// Relative to max |reference|: f32 scores, f32 online softmax over chunks vs
// the CPU's direct softmax with a double denominator.
constexpr float kAttentionTol = 1e-5f;

struct Case {
  int64_t s = 1;
  int64_t t = 1;
  int64_t n_heads = 1;
  int64_t n_kv = 1;
  int64_t d = 32;
  int window = 0;
  bool causal = true;
  int64_t k_pos0 = 0;
  float scale = 0.0f;                // 0: 1/sqrt(d)
  std::vector<int32_t> positions{};  // empty: the last s key positions
  uint64_t seed = 1;

  std::string label() const {
    return fmt::format("S={} T={} H={} Hkv={} D={} window={} causal={} k_pos0={}", s, t, n_heads,
                       n_kv, d, window, causal, k_pos0);
  }
};

Twin positions_twin(const std::vector<int32_t>& positions) {
  Twin pos(DType::kI32, {static_cast<int64_t>(positions.size())});
  std::copy(positions.begin(), positions.end(), pos.host.data<int32_t>());
  pos.push();
  return pos;
}

// GPU attention on the twins' device sides; `out` starts as garbage (7s) so a
// row the kernels forget to write shows up.
HostTensor gpu_attention(const Twin& q, const Twin& k, const Twin& v, const Twin& pos,
                         int64_t k_pos0, bool causal, int window, float scale) {
  Twin out(DType::kF32, q.host.shape());
  std::fill(out.host.f32().begin(), out.host.f32().end(), 7.0f);
  out.push();
  gpu_be().attention(
      attention_params(q.dev, k.dev, v.dev, out.dev, pos.dev, k_pos0, causal, window, scale));
  return out.pull();
}

HostTensor cpu_attention(const Twin& q, const Twin& k, const Twin& v, const Twin& pos,
                         int64_t k_pos0, bool causal, int window, float scale) {
  HostTensor out(DType::kF32, q.host.shape());
  cpu_be().attention(
      attention_params(q.host, k.host, v.host, out, pos.host, k_pos0, causal, window, scale));
  return out;
}

// Random q, k, v for `c`, GPU vs CPU within kAttentionTol. Returns the GPU output.
HostTensor check_case(const Case& c) {
  Twin q(DType::kF32, {c.s, c.n_heads, c.d});
  Twin k(DType::kF32, {c.t, c.n_kv, c.d});
  Twin v(DType::kF32, {c.t, c.n_kv, c.d});
  q.randomize(c.seed);
  k.randomize(c.seed + 1);
  v.randomize(c.seed + 2);
  const Twin pos =
      positions_twin(c.positions.empty() ? last_positions(c.s, c.t, c.k_pos0) : c.positions);
  const float scale = c.scale != 0.0f ? c.scale : 1.0f / std::sqrt(static_cast<float>(c.d));
  HostTensor got = gpu_attention(q, k, v, pos, c.k_pos0, c.causal, c.window, scale);
  const HostTensor want = cpu_attention(q, k, v, pos, c.k_pos0, c.causal, c.window, scale);
  expect_close(got, want, kAttentionTol, c.label().c_str());
  return got;
}

TEST(CudaAttention, DecodeMatchesCpuOverHeadDimsGroupsAndWindows) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {32, 64, 256, 512}) {
    for (int64_t group : {1, 2, 4}) {
      for (int64_t t : {1, 300, 1500}) {
        for (int window : {0, 128}) {
          check_case({.s = 1,
                      .t = t,
                      .n_heads = 2 * group,
                      .n_kv = 2,
                      .d = d,
                      .window = window,
                      .k_pos0 = 0,
                      .seed = static_cast<uint64_t>(d * 100 + group * 10 + window)});
        }
      }
    }
  }
}

TEST(CudaAttention, VerifyWindowsMatchCpu) {
  SKIP_WITHOUT_CUDA();
  for (int64_t s : {5, 9}) {
    for (int window : {0, 16, 128}) {
      for (int64_t group : {1, 2, 4}) {
        for (int64_t d : {64, 256}) {
          // k_pos0 > 0 and unaligned: the keys start mid-chunk.
          check_case({.s = s,
                      .t = 140 + s,
                      .n_heads = 2 * group,
                      .n_kv = 2,
                      .d = d,
                      .window = window,
                      .k_pos0 = 377,
                      .seed = static_cast<uint64_t>(s + d)});
        }
      }
    }
  }
}

TEST(CudaAttention, PrefillMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  for (int window : {0, 16, 128}) {
    for (int64_t d : {32, 64}) {
      check_case({.s = 300, .t = 300, .n_heads = 4, .n_kv = 2, .d = d, .window = window});
    }
  }
  // A prefill that continues a cached prefix, with head dim 256.
  check_case({.s = 100, .t = 700, .n_heads = 8, .n_kv = 2, .d = 256, .window = 0});
}

TEST(CudaAttention, ManyChunksAndUnalignedKeyStart) {
  SKIP_WITHOUT_CUDA();
  for (int window : {0, 300, 1024}) {
    for (int64_t k_pos0 : {0, 700}) {
      check_case({.s = 9,
                  .t = 1500,
                  .n_heads = 8,
                  .n_kv = 2,
                  .d = 128,
                  .window = window,
                  .k_pos0 = k_pos0});
    }
  }
  // Queries spread over the key range (each sees a different number of chunks).
  check_case({.s = 6,
              .t = 1500,
              .n_heads = 4,
              .n_kv = 4,
              .d = 64,
              .window = 0,
              .k_pos0 = 10,
              .positions = {10, 265, 266, 777, 1300, 1509}});
}

TEST(CudaAttention, NonCausal) {
  SKIP_WITHOUT_CUDA();
  for (int window : {0, 16, 300}) {
    // Without causality a window bounds only the oldest key: later keys all stay visible.
    check_case({.s = 7,
                .t = 600,
                .n_heads = 4,
                .n_kv = 2,
                .d = 64,
                .window = window,
                .causal = false,
                .k_pos0 = 50,
                .positions = {50, 60, 200, 300, 420, 640, 900}});
  }
}

TEST(CudaAttention, OddHeadDimsScalesAndLargeScores) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {16, 80, 500}) {
    check_case({.s = 3, .t = 400, .n_heads = 4, .n_kv = 2, .d = d, .window = 0});
  }
  check_case({.s = 4, .t = 200, .n_heads = 2, .n_kv = 1, .d = 32, .scale = 1.0f});
  check_case({.s = 4, .t = 200, .n_heads = 2, .n_kv = 1, .d = 32, .scale = 0.125f});
  // Scores of several hundred overflow expf unless the running max is
  // subtracted. Small-integer q, k and a power-of-two scale keep the scores
  // exact on both backends, so the comparison stays well conditioned.
  const int64_t s = 3, t = 600, h = 4, kv = 2, d = 64;
  Twin q(DType::kF32, {s, h, d}), k(DType::kF32, {t, kv, d}), v(DType::kF32, {t, kv, d});
  q.randomize(11);
  k.randomize(12);
  v.randomize(13);
  for (Twin* x : {&q, &k}) {
    for (float& e : x->host.f32()) e = std::round(2.0f * e);
    x->push();
  }
  const Twin pos = positions_twin({100, 420, 599});
  const HostTensor got = gpu_attention(q, k, v, pos, 0, true, 0, 16.0f);
  const HostTensor want = cpu_attention(q, k, v, pos, 0, true, 0, 16.0f);
  for (float e : got.f32()) ASSERT_TRUE(std::isfinite(e));
  expect_close(got, want, kAttentionTol, "attention scale 16, integer q and k");
}

// Head dims that are not a multiple of 4 (rows staged one float at a time,
// zero-padded to whole float4s) and wide GQA groups, whose (query, head)
// pairs span several pair tiles of a partials block.
TEST(CudaAttention, HeadDimsNotMultipleOfFourAndWideGroups) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {18, 70, 126}) {
    for (int64_t s : {1, 9}) {
      check_case({.s = s,
                  .t = 200 + s,
                  .n_heads = 4,
                  .n_kv = 2,
                  .d = d,
                  .window = 64,
                  .k_pos0 = 45,
                  .seed = static_cast<uint64_t>(d + s)});
    }
  }
  // Group 16: S = 2 is one tile of 32 pairs, S = 3 and S = 9 are several.
  for (int64_t s : {1, 2, 3, 9}) {
    check_case({.s = s,
                .t = 300 + s,
                .n_heads = 16,
                .n_kv = 1,
                .d = 64,
                .window = 0,
                .k_pos0 = 13,
                .seed = static_cast<uint64_t>(40 + s)});
  }
}

// q, k and v that are not 16-byte aligned (views one float into their
// buffers) take the 4-byte copy path; results must equal the aligned run bit
// for bit (the staging differs, the arithmetic does not).
TEST(CudaAttention, UnalignedInputsGiveTheSameBits) {
  SKIP_WITHOUT_CUDA();
  const int64_t s = 5, t = 150, h = 8, kv = 4, d = 64, k_pos0 = 20;
  Twin q(DType::kF32, {s, h, d}), k(DType::kF32, {t, kv, d}), v(DType::kF32, {t, kv, d});
  q.randomize(31);
  k.randomize(32);
  v.randomize(33);
  // The same values, one float into buffers of numel + 1 floats.
  auto shifted = [](const Twin& x, Twin& buf) {
    std::copy_n(x.host.data<float>(), x.host.numel(), buf.host.data<float>() + 1);
    buf.push();
    return Tensor(buf.dev.data_as<float>() + 1, DType::kF32, x.host.shape(), gpu_be().device());
  };
  Twin qb(DType::kF32, {s * h * d + 1}), kb(DType::kF32, {t * kv * d + 1}),
      vb(DType::kF32, {t * kv * d + 1});
  const Tensor q1 = shifted(q, qb);
  const Tensor k1 = shifted(k, kb);
  const Tensor v1 = shifted(v, vb);
  const Twin pos = positions_twin(last_positions(s, t, k_pos0));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int window : {0, 40}) {
    const HostTensor aligned = gpu_attention(q, k, v, pos, k_pos0, true, window, scale);
    Twin out(DType::kF32, {s, h, d});
    gpu_be().attention(attention_params(q1, k1, v1, out.dev, pos.dev, k_pos0, true, window, scale));
    const HostTensor unaligned = out.pull();
    const HostTensor want = cpu_attention(q, k, v, pos, k_pos0, true, window, scale);
    expect_close(unaligned, want, kAttentionTol, "unaligned q, k, v");
    const size_t bytes = static_cast<size_t>(s * h * d) * sizeof(float);
    EXPECT_EQ(std::memcmp(aligned.view().data(), unaligned.view().data(), bytes), 0)
        << "aligned vs unaligned inputs, window " << window;
  }
}

TEST(CudaAttention, QueriesThatSeeNoKeyGetZeroRows) {
  SKIP_WITHOUT_CUDA();
  // Keys at positions 100..149. Position 90 precedes them all (causal); with a
  // window of 16, position 200 needs keys > 184; 120 and 149 see some.
  const std::vector<int32_t> positions = {90, 120, 200, 149};
  const HostTensor got = check_case({.s = 4,
                                     .t = 50,
                                     .n_heads = 4,
                                     .n_kv = 2,
                                     .d = 64,
                                     .window = 16,
                                     .k_pos0 = 100,
                                     .positions = positions});
  const int64_t row = 4 * 64;  // floats per query
  for (int64_t i : {0, 2}) {
    for (int64_t c = 0; c < row; ++c) ASSERT_EQ(got.f32()[i * row + c], 0.0f) << i << " " << c;
  }
  // No keys at all: every row is zero.
  Twin q(DType::kF32, {2, 4, 32}), k(DType::kF32, {0, 2, 32}), v(DType::kF32, {0, 2, 32});
  q.randomize(3);
  const Twin pos = positions_twin({5, 6});
  const HostTensor none = gpu_attention(q, k, v, pos, 7, true, 0, 1.0f);
  for (float e : none.f32()) ASSERT_EQ(e, 0.0f);
}

TEST(CudaAttention, LongContextTilesTheQueries) {
  SKIP_WITHOUT_CUDA();
  // 131072 keys: 512 chunks per query, so 64 queries of 8 heads x 512 dims
  // need more partials than the scratch holds and run in several tiles. Most
  // queries sit early (cheap for the CPU reference), two see every key.
  const int64_t t = 131072, s = 64;
  std::vector<int32_t> positions;
  for (int64_t i = 0; i < s - 2; ++i) positions.push_back(static_cast<int32_t>(i * 61 + i % 3));
  positions.push_back(static_cast<int32_t>(t - 2));
  positions.push_back(static_cast<int32_t>(t - 1));
  check_case({.s = s,
              .t = t,
              .n_heads = 8,
              .n_kv = 1,
              .d = 512,
              .window = 0,
              .positions = positions,
              .seed = 77});
}

// The same query (same q row, same visible keys at the same absolute positions)
// must give bit-identical rows alone (decode), inside a verify window and inside
// a prefill, whatever k_pos0 and T are. Rows of q, k and v come from tables
// indexed by absolute position.
void check_invariance(int64_t n_heads, int64_t n_kv, int64_t d, int window, int32_t p) {
  const int64_t span = p + 200;  // absolute positions 0 .. span - 1
  HostTensor q_all(DType::kF32, {span, n_heads, d});
  HostTensor k_all(DType::kF32, {span, n_kv, d});
  HostTensor v_all(DType::kF32, {span, n_kv, d});
  cpu_be().fill_uniform(q_all, 21, -1.0f, 1.0f);
  cpu_be().fill_uniform(k_all, 22, -1.0f, 1.0f);
  cpu_be().fill_uniform(v_all, 23, -1.0f, 1.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t q_row = n_heads * d;
  const int64_t k_row = n_kv * d;

  // Runs the queries at `positions` over keys [k_pos0, k_pos0 + t) and returns
  // the row of the query at p.
  auto row_of_p = [&](const std::vector<int32_t>& positions, int64_t k_pos0, int64_t t) {
    const auto s = static_cast<int64_t>(positions.size());
    Twin q(DType::kF32, {s, n_heads, d}), k(DType::kF32, {t, n_kv, d}),
        v(DType::kF32, {t, n_kv, d});
    int64_t at = -1;
    for (int64_t i = 0; i < s; ++i) {
      std::memcpy(q.host.data<float>() + i * q_row, q_all.data<float>() + positions[i] * q_row,
                  q_row * sizeof(float));
      if (positions[i] == p) at = i;
    }
    std::memcpy(k.host.data<float>(), k_all.data<float>() + k_pos0 * k_row,
                t * k_row * sizeof(float));
    std::memcpy(v.host.data<float>(), v_all.data<float>() + k_pos0 * k_row,
                t * k_row * sizeof(float));
    q.push();
    k.push();
    v.push();
    const Twin pos = positions_twin(positions);
    const HostTensor out = gpu_attention(q, k, v, pos, k_pos0, true, window, scale);
    const HostTensor want = cpu_attention(q, k, v, pos, k_pos0, true, window, scale);
    expect_close(out, want, kAttentionTol, "invariance run vs cpu");
    return std::vector<float>(out.data<float>() + at * q_row, out.data<float>() + (at + 1) * q_row);
  };

  const std::string what =
      fmt::format("H={} Hkv={} D={} window={} p={}", n_heads, n_kv, d, window, p);
  // (a) decode: the query alone, keys gathered from its window start (or 0).
  const int64_t start_a = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
  const std::vector<float> alone = row_of_p({p}, start_a, p - start_a + 1);
  // (b) a verify window of 5 with p in the middle, keys from an earlier start
  // to past the last query.
  const int64_t start_b = std::max<int64_t>(0, start_a - 37);
  const std::vector<float> in_window =
      row_of_p({p - 2, p - 1, p, p + 1, p + 2}, start_b, p + 12 - start_b + 1);
  // (c) p first in a window of 9, keys from 0 to the end of the table.
  std::vector<int32_t> nine;
  for (int32_t i = 0; i < 9; ++i) nine.push_back(p + i);
  const std::vector<float> first_of_nine = row_of_p(nine, 0, span);
  // (d) inside a 96-query prefill chunk.
  std::vector<int32_t> prefill;
  for (int32_t i = 0; i < 96; ++i) prefill.push_back(p - 50 + i);
  const std::vector<float> in_prefill = row_of_p(prefill, start_b, p + 46 - start_b + 1);

  for (const auto* other : {&in_window, &first_of_nine, &in_prefill}) {
    ASSERT_EQ(other->size(), alone.size());
    for (size_t c = 0; c < alone.size(); ++c) {
      ASSERT_EQ(std::memcmp(&alone[c], &(*other)[c], sizeof(float)), 0)
          << what << ": element " << c << " alone " << alone[c] << " vs " << (*other)[c];
    }
  }
}

TEST(CudaAttention, BatchInvariantAcrossQueriesAndKeyGathering) {
  SKIP_WITHOUT_CUDA();
  // Sliding layers (windows crossing chunk boundaries) and full layers, GQA 2 and 4.
  check_invariance(8, 4, 256, 128, 1000);
  check_invariance(8, 4, 256, 300, 1000);
  check_invariance(8, 4, 256, 1024, 1500);
  check_invariance(8, 2, 512, 0, 1000);
  check_invariance(8, 2, 512, 0, 1535);
  check_invariance(4, 2, 64, 16, 256);  // p at a chunk start
  check_invariance(4, 1, 32, 0, 255);   // p at a chunk end
  check_invariance(16, 1, 64, 0, 700);  // pairs over several pair tiles
  check_invariance(4, 2, 18, 40, 333);  // head dim not a multiple of 4
}

TEST(CudaAttention, ScratchIsAllocatedOnceAcrossGrowingKeyRanges) {
  SKIP_WITHOUT_CUDA();
  const int64_t t_max = 4000, h = 8, kv = 2, d = 256;
  Twin q(DType::kF32, {9, h, d}), k(DType::kF32, {t_max, kv, d}), v(DType::kF32, {t_max, kv, d});
  Twin out(DType::kF32, {9, h, d});
  q.randomize(1);
  k.randomize(2);
  v.randomize(3);
  const Twin pos = positions_twin({10, 11, 12, 13, 14, 15, 16, 17, 18});
  auto run = [&](int64_t t, int64_t s) {
    Tensor pos_s = pos.dev.slice_rows(0, s);
    gpu_be().attention(attention_params(q.dev.slice_rows(0, s), k.dev.slice_rows(0, t),
                                        v.dev.slice_rows(0, t), out.dev.slice_rows(0, s), pos_s, 0,
                                        true, 0, 1.0f));
  };
  run(20, 9);
  gpu_be().synchronize();
  const int64_t before = gpu_be().allocation_count();
  for (int64_t t : {int64_t{100}, int64_t{1000}, int64_t{2500}, t_max}) {
    run(t, 1);
    run(t, 9);
  }
  gpu_be().synchronize();
  EXPECT_EQ(gpu_be().allocation_count(), before);
}

// Ring layout (sliding caches read in place): the same keys stored at row
// kp % R of a ring give bit-identical results to the contiguous layout, on both
// backends, including a ring that wrapped.
TEST(CudaAttention, RingLayoutEqualsContiguousKeys) {
  SKIP_WITHOUT_CUDA();
  const int64_t n_heads = 8, n_kv = 2, d = 256, ring_rows = 40, window = 24;
  for (int64_t k_pos0 : {int64_t{0}, int64_t{13}, int64_t{77}}) {
    for (int64_t s : {int64_t{1}, int64_t{5}}) {
      const int64_t t = std::min<int64_t>(window - 1 + s, ring_rows);
      Twin q(DType::kF32, {s, n_heads, d});
      Twin k(DType::kF32, {t, n_kv, d}), v(DType::kF32, {t, n_kv, d});
      q.randomize(11);
      k.randomize(12);
      v.randomize(13);
      Twin rk(DType::kF32, {ring_rows, n_kv, d}), rv(DType::kF32, {ring_rows, n_kv, d});
      rk.randomize(14);  // rows outside the keys hold junk
      rv.randomize(15);
      const int64_t row = n_kv * d;
      for (int64_t j = 0; j < t; ++j) {
        const int64_t slot = (k_pos0 + j) % ring_rows;
        std::copy_n(k.host.data<float>() + j * row, row, rk.host.data<float>() + slot * row);
        std::copy_n(v.host.data<float>() + j * row, row, rv.host.data<float>() + slot * row);
      }
      rk.push();
      rv.push();
      const Twin pos = positions_twin(last_positions(s, t, k_pos0));
      const HostTensor contiguous_gpu = gpu_attention(q, k, v, pos, k_pos0, true, window, 1.0f);
      const HostTensor contiguous_cpu = cpu_attention(q, k, v, pos, k_pos0, true, window, 1.0f);

      Twin out(DType::kF32, {s, n_heads, d});
      AttentionParams ap =
          attention_params(q.dev, rk.dev, rv.dev, out.dev, pos.dev, k_pos0, true, window, 1.0f);
      ap.ring_keys = t;
      gpu_be().attention(ap);
      const HostTensor ring_gpu = out.pull();
      HostTensor ring_cpu(DType::kF32, {s, n_heads, d});
      AttentionParams cp = attention_params(q.host, rk.host, rv.host, ring_cpu, pos.host, k_pos0,
                                            true, window, 1.0f);
      cp.ring_keys = t;
      cpu_be().attention(cp);
      const size_t bytes = static_cast<size_t>(s * n_heads * d) * sizeof(float);
      EXPECT_EQ(std::memcmp(ring_gpu.view().data(), contiguous_gpu.view().data(), bytes), 0)
          << "gpu ring vs contiguous, k_pos0 " << k_pos0 << " s " << s;
      EXPECT_EQ(std::memcmp(ring_cpu.view().data(), contiguous_cpu.view().data(), bytes), 0)
          << "cpu ring vs contiguous, k_pos0 " << k_pos0 << " s " << s;
    }
  }
}

// positions_bound (one launch for every step below the bound, for CUDA graphs)
// gives the same bits as the launch sized by T: on full caches read from
// position 0 and on rings read in place, for decode and verify windows whose
// positions cross chunk boundaries, and under several bounds.
TEST(CudaAttention, PositionsBoundGivesTheSameBits) {
  SKIP_WITHOUT_CUDA();
  const int64_t n_heads = 8, n_kv = 2, d = 256;
  auto run = [&](const Twin& q, const Tensor& k, const Tensor& v, const Twin& pos, int64_t k_pos0,
                 int64_t ring_keys, int window, int64_t bound) {
    Twin out(DType::kF32, q.host.shape());
    AttentionParams ap =
        attention_params(q.dev, k, v, out.dev, pos.dev, k_pos0, true, window, 1.0f);
    ap.ring_keys = ring_keys;
    ap.positions_bound = bound;
    gpu_be().attention(ap);
    return out.pull();
  };
  for (int64_t s : {int64_t{1}, int64_t{5}, int64_t{17}}) {
    for (int64_t last : {int64_t{31}, int64_t{32}, int64_t{200}, int64_t{511}}) {
      const std::string what = fmt::format("s {} last position {}", s, last);
      const std::vector<int32_t> positions = last_positions(s, last + 1);
      if (positions[0] < 0) continue;
      const Twin pos = positions_twin(positions);
      Twin q(DType::kF32, {s, n_heads, d});
      q.randomize(31 + s);
      // Full cache: keys 0 .. last.
      const int64_t t = last + 1;
      Twin k(DType::kF32, {t, n_kv, d}), v(DType::kF32, {t, n_kv, d});
      k.randomize(32);
      v.randomize(33);
      const HostTensor base = run(q, k.dev, v.dev, pos, 0, -1, 0, 0);
      const HostTensor cpu = cpu_attention(q, k, v, pos, 0, true, 0, 1.0f);
      expect_close(base, cpu, kAttentionTol, what.c_str());
      for (int64_t bound : {int64_t{512}, int64_t{2048}}) {
        const HostTensor got = run(q, k.dev, v.dev, pos, 0, -1, 0, bound);
        EXPECT_EQ(std::memcmp(got.view().data(), base.view().data(), base.view().nbytes()), 0)
            << "full cache, " << what << ", bound " << bound;
      }
      // Ring of 64 rows for a window of 40 (slack 24 >= s): the last 40 + s - 1 keys.
      const int window = 40;
      const int64_t ring_rows = 64;
      const int64_t from = std::max<int64_t>(0, positions[0] - window + 1);
      const int64_t ring_keys = last + 1 - from;
      Twin rk(DType::kF32, {ring_rows, n_kv, d}), rv(DType::kF32, {ring_rows, n_kv, d});
      rk.randomize(34);
      rv.randomize(35);
      const HostTensor ring_base = run(q, rk.dev, rv.dev, pos, from, ring_keys, window, 0);
      for (int64_t bound : {int64_t{512}, int64_t{1024}}) {
        const HostTensor got = run(q, rk.dev, rv.dev, pos, from, ring_keys, window, bound);
        EXPECT_EQ(
            std::memcmp(got.view().data(), ring_base.view().data(), ring_base.view().nbytes()), 0)
            << "ring, " << what << ", bound " << bound;
      }
    }
  }
  // Keys past the bound, or a bound on keys that do not start at position 0, are refused.
  Twin q(DType::kF32, {1, n_heads, d}), k(DType::kF32, {600, n_kv, d}),
      v(DType::kF32, {600, n_kv, d});
  const Twin pos = positions_twin({599});
  EXPECT_THROW(run(q, k.dev, v.dev, pos, 0, -1, 0, 512), Error);
  EXPECT_THROW(run(q, k.dev, v.dev, pos, 5, -1, 0, 1024), Error);
}

// The tensor-core prefill path (allow_fast_prefill, 64+ queries): TF32
// products, so a looser tolerance; masking, windows, GQA and k_pos0 as on the CPU.
constexpr float kFastPrefillTol = 5e-3f;
TEST(CudaAttention, FastPrefillMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  struct P {
    int64_t s, t, heads, kv, d, k_pos0;
    int window;
  };
  for (const P& c : {P{300, 300, 8, 2, 256, 0, 0}, P{128, 400, 4, 4, 64, 50, 0},
                     P{200, 260, 8, 4, 512, 0, 64}, P{64, 64, 2, 1, 32, 7, 16}}) {
    Twin q(DType::kF32, {c.s, c.heads, c.d});
    Twin k(DType::kF32, {c.t, c.kv, c.d}), v(DType::kF32, {c.t, c.kv, c.d});
    q.randomize(21);
    k.randomize(22);
    v.randomize(23);
    std::vector<int32_t> positions = last_positions(c.s, c.t, c.k_pos0);
    if (c.window > 0) positions[0] = static_cast<int32_t>(c.k_pos0 - c.window - 5);  // sees nothing
    const Twin pos = positions_twin(positions);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    Twin out(DType::kF32, {c.s, c.heads, c.d});
    AttentionParams ap =
        attention_params(q.dev, k.dev, v.dev, out.dev, pos.dev, c.k_pos0, true, c.window, scale);
    ap.allow_fast_prefill = true;
    gpu_be().attention(ap);
    const HostTensor got = out.pull();
    const HostTensor want = cpu_attention(q, k, v, pos, c.k_pos0, true, c.window, scale);
    const std::string what = fmt::format("fast prefill S={} T={} H={}/{} D={} window={}", c.s, c.t,
                                         c.heads, c.kv, c.d, c.window);
    expect_close(got, want, kFastPrefillTol, what.c_str());
    if (c.window > 0) {
      for (int64_t j = 0; j < c.heads * c.d; ++j) ASSERT_EQ(got.data<float>()[j], 0.0f) << what;
    }
  }
}

TEST(CudaAttention, RejectsBadArguments) {
  SKIP_WITHOUT_CUDA();
  Twin q(DType::kF32, {2, 4, 64}), k(DType::kF32, {10, 2, 64}), v(DType::kF32, {10, 2, 64});
  Twin out(DType::kF32, {2, 4, 64});
  const Twin pos = positions_twin({8, 9});
  auto attend = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, const Tensor& oo,
                    const Tensor& pp, int window = 0) {
    gpu_be().attention(attention_params(qq, kk, vv, oo, pp, 0, true, window, 1.0f));
  };
  // Mismatched head dimension.
  Twin k32(DType::kF32, {10, 2, 32}), v32(DType::kF32, {10, 2, 32});
  expect_error([&] { attend(q.dev, k32.dev, v32.dev, out.dev, pos.dev); },
               {"attention", "f32[2, 4, 64]", "f32[10, 2, 32]"});
  // k and v disagree.
  expect_error([&] { attend(q.dev, k.dev, v32.dev, out.dev, pos.dev); },
               {"attention", "f32[10, 2, 64]", "f32[10, 2, 32]"});
  // Heads not a multiple of the kv heads.
  Twin q3(DType::kF32, {2, 3, 64}), out3(DType::kF32, {2, 3, 64});
  expect_error([&] { attend(q3.dev, k.dev, v.dev, out3.dev, pos.dev); },
               {"attention", "3 heads", "2 kv heads"});
  // Wrong dtypes.
  Twin q_bf16(DType::kBF16, {2, 4, 64}), k_f16(DType::kF16, {10, 2, 64});
  Twin pos_f32(DType::kF32, {2});
  expect_error([&] { attend(q_bf16.dev, k.dev, v.dev, out.dev, pos.dev); },
               {"attention", "q", "bf16[2, 4, 64]"});
  expect_error([&] { attend(q.dev, k_f16.dev, v.dev, out.dev, pos.dev); },
               {"attention", "k", "f16[10, 2, 64]"});
  expect_error([&] { attend(q.dev, k.dev, v.dev, out.dev, pos_f32.dev); },
               {"attention", "q_positions", "f32[2]"});
  // Positions of the wrong length, a negative window.
  const Twin pos3 = positions_twin({7, 8, 9});
  expect_error([&] { attend(q.dev, k.dev, v.dev, out.dev, pos3.dev); },
               {"attention", "q_positions", "i32[3]"});
  expect_error([&] { attend(q.dev, k.dev, v.dev, out.dev, pos.dev, -1); }, {"attention", "window"});
  // out aliasing q.
  expect_error([&] { attend(q.dev, k.dev, v.dev, q.dev, pos.dev); }, {"attention", "overlaps"});
  // Head dimension beyond the kernels' 512.
  Twin q_big(DType::kF32, {1, 1, 544}), k_big(DType::kF32, {4, 1, 544}),
      out_big(DType::kF32, {1, 1, 544});
  const Twin pos1 = positions_twin({3});
  expect_error([&] { attend(q_big.dev, k_big.dev, k_big.dev, out_big.dev, pos1.dev); },
               {"attention", "head dimension", "544"});
  // A host tensor handed to the GPU backend.
  expect_error([&] { attend(q.host, k.dev, v.dev, out.dev, pos.dev); }, {"attention", "q", "cpu"});
}

}  // namespace
}  // namespace specula::test
