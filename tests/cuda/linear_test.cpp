// SPDX-License-Identifier: Apache-2.0
// CudaBackend::linear and ::embedding against the CPU reference: the
// batch-invariant paths (bf16 weights in chunks of kInvariantRows rows past
// it; cuBLASLt only in linear_prefill), every weight dtype, K tails,
// misaligned operands, bit-exact batch invariance at any M, and the
// shape/dtype errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/core/error.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// Invariant kernel: f32 accumulation on both sides, only the order differs.
constexpr float kInvariantTol = 1e-5f;
// cuBLASLt path (linear_prefill past kPrefillGemmRows): x (and f32/f16
// weights) are rounded to bf16 before the product.
constexpr float kLtTol = 1e-2f;
// Embedding: an exact widening and one f32 multiply on both sides.
constexpr float kEmbeddingTol = 0.0f;

constexpr DType kWeightDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// y f32 [1, N] of row r of x [M, K] multiplied alone (a one-row, decode-path call).
HostTensor one_row_linear(const Twin& x, int64_t r, const Twin& w) {
  const int64_t k = x.host.shape().dim(1);
  Twin x1(DType::kF32, {1, k});
  std::memcpy(x1.host.data<float>(), x.host.data<float>() + r * k,
              static_cast<size_t>(k) * sizeof(float));
  x1.push();
  Twin y1 = poisoned_output({1, w.host.shape().dim(0)});
  gpu_be().linear(x1.dev, w.dev, y1.dev);
  return y1.pull();
}

// Runs `fn`, expecting a specula::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, std::vector<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no Error thrown (expected one mentioning '" << parts.front() << "')";
  } catch (const Error& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "message '" << e.what() << "' lacks '" << part << "'";
    }
  }
}

// ---------------------------------------------------------------------------
// linear vs the CPU reference.

using LinearCase = std::tuple<int64_t, std::pair<int64_t, int64_t>, DType>;  // M, (N, K), w dtype

class CudaLinear : public ::testing::TestWithParam<LinearCase> {};

TEST_P(CudaLinear, MatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const auto [m, nk, dtype] = GetParam();
  const auto [n, k] = nk;
  Twin x(DType::kF32, {m, k});
  x.randomize(static_cast<uint64_t>(1000 + m * 7 + k));
  Twin w(dtype, {n, k});
  w.randomize(static_cast<uint64_t>(77 + n + k), -0.5f, 0.5f);
  HostTensor want(DType::kF32, {m, n});
  cpu_be().linear(x.host, w.host, want);
  Twin y = poisoned_output({m, n});
  gpu_be().linear(x.dev, w.dev, y.dev);
  const HostTensor got = y.pull();
  expect_close(got, want, kInvariantTol, "linear");
}

std::string linear_case_name(const ::testing::TestParamInfo<LinearCase>& info) {
  const auto [m, nk, dtype] = info.param;
  return "M" + std::to_string(m) + "_N" + std::to_string(nk.first) + "_K" +
         std::to_string(nk.second) + "_" + std::string(dtype_name(dtype));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLinear,
    ::testing::Combine(::testing::Values<int64_t>(1, 3, 5, 8, 17, 64, 256, 300, 1024),
                       // (N, K): aligned; K % 8 == 4 (bf16/f16 rows misaligned, f32 partial
                       // chunk); a tiny ragged one (K < one chunk per lane, N < one block);
                       // and a model-sized one.
                       ::testing::Values(std::pair<int64_t, int64_t>{64, 256},
                                         std::pair<int64_t, int64_t>{33, 4100},
                                         std::pair<int64_t, int64_t>{7, 13},
                                         std::pair<int64_t, int64_t>{2048, 2816}),
                       ::testing::ValuesIn(kWeightDtypes)),
    linear_case_name);

// Operands that are not 16-byte aligned take the scalar-load kernel, which must
// do the same arithmetic as the vectorised one: bit-identical results.
TEST(CudaLinearMisaligned, ScalarLoadsGiveTheSameBits) {
  SKIP_WITHOUT_CUDA();
  const int64_t n = 50, k = 512;
  for (DType dtype : kWeightDtypes) {
    for (int64_t m : {1, 5, 8, 20}) {
      Twin x(DType::kF32, {m, k});
      x.randomize(11 + m);
      Twin w(dtype, {n, k});
      w.randomize(12, -0.5f, 0.5f);
      Twin y = poisoned_output({m, n});
      gpu_be().linear(x.dev, w.dev, y.dev);
      const HostTensor aligned = y.pull();

      // The same values one element past a 16-byte boundary.
      const size_t elt = dtype_size(dtype);
      DeviceBuffer x_buf(gpu_be(), x.host.view().nbytes() + 4);
      DeviceBuffer w_buf(gpu_be(), w.host.view().nbytes() + elt);
      const Tensor x_off(static_cast<char*>(x_buf.data()) + 4, DType::kF32, {m, k},
                         gpu_be().device());
      const Tensor w_off(static_cast<char*>(w_buf.data()) + elt, dtype, {n, k}, gpu_be().device());
      gpu_be().upload(x.host.view().data(), x_off);
      gpu_be().upload(w.host.view().data(), w_off);
      Twin y2 = poisoned_output({m, n});
      gpu_be().linear(x_off, w_off, y2.dev);
      const HostTensor misaligned = y2.pull();
      EXPECT_TRUE(same_bits(misaligned.data<float>(), aligned.data<float>(), m * n))
          << "w " << dtype_name(dtype) << ", M = " << m;

      HostTensor want(DType::kF32, {m, n});
      cpu_be().linear(x.host, w.host, want);
      expect_close(misaligned, want, kInvariantTol, "misaligned linear");
    }
  }
}

// ---------------------------------------------------------------------------
// Batch invariance: one x row gives the same bits alone (decode), inside a
// verify window, and inside batches of rows, at any offset.

using InvariantCase = std::tuple<DType, int64_t>;  // w dtype, K

class CudaLinearInvariance : public ::testing::TestWithParam<InvariantCase> {};

TEST_P(CudaLinearInvariance, RowBitsDoNotDependOnTheBatch) {
  SKIP_WITHOUT_CUDA();
  const auto [dtype, k] = GetParam();
  const int64_t n = 97;
  Twin w(dtype, {n, k});
  w.randomize(31, -0.5f, 0.5f);
  HostTensor row(DType::kF32, {1, k});
  cpu_be().fill_uniform(row, 32, -1.0f, 1.0f);
  HostTensor want(DType::kF32, {1, n});
  cpu_be().linear(row, w.host, want);

  // (rows in the call, offset of the row): 1 = decode, 5 = a verify window,
  // 72 and 256 = batched rows (8-row groups, the row in various group slots).
  // 16 and 33: the row in the second and fifth 8-row tile of a bf16 pass.
  std::vector<std::pair<int64_t, int64_t>> calls = {{1, 0},  {5, 3},     {2, 1},    {8, 7},
                                                    {9, 8},  {16, 13},   {33, 32},  {72, 69},
                                                    {72, 0}, {256, 200}, {256, 255}};
  // Past kInvariantRows: f32|f16 weights stay on the FMA kernel (an f32
  // checkpoint's prefill pieces of up to 512 rows, a long prompt's score), bf16
  // weights run the tensor-core kernels in 256-row chunks (verify windows of
  // B x (k + 1) rows): the row first, last and inside a later chunk.
  calls.insert(calls.end(), {{257, 256}, {300, 299}, {600, 300}, {1024, 517}});
  std::vector<float> reference;
  for (const auto& [m, offset] : calls) {
    Twin x(DType::kF32, {m, k});
    cpu_be().fill_uniform(x.host, static_cast<uint64_t>(500 + m + offset), -1.0f, 1.0f);
    std::memcpy(x.host.data<float>() + offset * k, row.data<float>(),
                static_cast<size_t>(k) * sizeof(float));
    x.push();
    Twin y = poisoned_output({m, n});
    gpu_be().linear(x.dev, w.dev, y.dev);
    const HostTensor got = y.pull();
    const float* got_row = got.data<float>() + offset * n;
    if (reference.empty()) {
      reference.assign(got_row, got_row + n);
      expect_close(Tensor(reference.data(), DType::kF32, {1, n}), want, kInvariantTol,
                   "invariant row vs cpu");
    } else {
      EXPECT_TRUE(same_bits(got_row, reference.data(), n))
          << "row at offset " << offset << " of " << m << " rows differs from the 1-row call (w "
          << dtype_name(dtype) << ", K = " << k << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, CudaLinearInvariance,
    ::testing::Combine(::testing::ValuesIn(kWeightDtypes),
                       // Vectorised rows; bf16/f16 rows misaligned (scalar kernel) with a tail.
                       ::testing::Values<int64_t>(2816, 4100)),
    [](const ::testing::TestParamInfo<InvariantCase>& info) {
      return std::string(dtype_name(std::get<0>(info.param))) + "_K" +
             std::to_string(std::get<1>(info.param));
    });

// ---------------------------------------------------------------------------
// bf16 weights run on the tensor cores with x split into three bf16 terms
// (cuda_linear_mma.h): no bit of an f32 activation may be lost, and infinities
// and NaN must come out as the CPU's f32 products give them.

// w = identity rows, so y[m, n] = x[m, n] · 1 exactly: any activation bit the
// split dropped would show. Values use all 24 significand bits, over many
// magnitudes and both signs; K = 40 gives a tail step and 3 rows a partial tile.
TEST(CudaLinearTensorCore, KeepsEveryBitOfF32Activations) {
  SKIP_WITHOUT_CUDA();
  const int64_t m = 3, n = 40, k = 40;
  Twin w(DType::kBF16, {n, k});
  auto* wv = w.host.data<uint16_t>();
  for (int64_t i = 0; i < n * k; ++i) wv[i] = f32_to_bf16((i / k == i % k) ? 1.0f : 0.0f);
  w.push();
  Twin x(DType::kF32, {m, k});
  float* xv = x.host.data<float>();
  for (int64_t i = 0; i < m * k; ++i) {
    // 1.xxx with the low significand bits set, scaled by 2^(i mod 61 - 30).
    const float significand = 1.0f + static_cast<float>((i * 2654435761u) % 8388608u) / 8388608.0f;
    const float v = std::ldexp(significand, static_cast<int>(i % 61) - 30);
    xv[i] = (i % 3 == 1) ? -v : v;
  }
  x.push();
  Twin y = poisoned_output({m, n});
  gpu_be().linear(x.dev, w.dev, y.dev);
  const HostTensor got = y.pull();
  for (int64_t i = 0; i < m * n; ++i) {
    ASSERT_EQ(got.data<float>()[i], xv[i]) << "element " << i << " of x · I";
  }
}

// One infinite or NaN activation makes its whole output row ±inf or NaN, as in
// f32 (the split must not turn inf into NaN through inf - inf).
TEST(CudaLinearTensorCore, NonFiniteActivationsMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  const int64_t m = 4, n = 24, k = 64;
  Twin w(DType::kBF16, {n, k});
  w.randomize(61, 0.25f, 0.75f);  // positive, so the sign of an infinity survives
  Twin x(DType::kF32, {m, k});
  x.randomize(62);
  float* xv = x.host.data<float>();
  xv[0 * k + 5] = std::numeric_limits<float>::infinity();
  xv[1 * k + 33] = -std::numeric_limits<float>::infinity();
  xv[2 * k + 63] = std::numeric_limits<float>::quiet_NaN();
  x.push();
  HostTensor want(DType::kF32, {m, n});
  cpu_be().linear(x.host, w.host, want);
  Twin y = poisoned_output({m, n});
  gpu_be().linear(x.dev, w.dev, y.dev);
  const HostTensor got = y.pull();
  for (int64_t i = 0; i < m * n; ++i) {
    const float g = got.data<float>()[i];
    const float c = want.data<float>()[i];
    if (std::isnan(c) || std::isinf(c)) {
      EXPECT_EQ(std::isnan(g), std::isnan(c)) << "element " << i << ": got " << g << " want " << c;
      if (std::isinf(c)) {
        EXPECT_EQ(g, c) << "element " << i;
      }
    } else {
      EXPECT_NEAR(g, c, 1e-4f * std::fabs(c) + 1e-5f) << "element " << i;
    }
  }
}

// The split activations live in backend scratch that the previous product
// filled: a K tail must read zeros of its own row, never what an earlier,
// larger product left there (here NaN).
TEST(CudaLinearTensorCore, KTailsNeverReadAnEarlierProductsScratch) {
  SKIP_WITHOUT_CUDA();
  {
    const int64_t m = 32, k = 4128;
    Twin x(DType::kF32, {m, k});
    float* xv = x.host.data<float>();
    for (int64_t i = 0; i < m * k; ++i) xv[i] = std::numeric_limits<float>::quiet_NaN();
    x.push();
    Twin w(DType::kBF16, {8, k});
    w.randomize(71);
    Twin y = poisoned_output({m, 8});
    gpu_be().linear(x.dev, w.dev, y.dev);
    y.pull();
  }
  for (int64_t k : {4100, 4104, 4120}) {  // misaligned rows; aligned rows with a partial step
    const int64_t m = 17, n = 33;
    Twin x(DType::kF32, {m, k});
    x.randomize(72);
    Twin w(DType::kBF16, {n, k});
    w.randomize(73, -0.5f, 0.5f);
    HostTensor want(DType::kF32, {m, n});
    cpu_be().linear(x.host, w.host, want);
    Twin y = poisoned_output({m, n});
    gpu_be().linear(x.dev, w.dev, y.dev);
    expect_close(y.pull(), want, kInvariantTol,
                 ("linear after NaN scratch, K=" + std::to_string(k)).c_str());
  }
}

// Single-row products of grids larger than three blocks per SM take a shorter
// pipeline (more blocks per SM); the bits must be those of the same row in a
// several-row call, for linear and for the fused q/k/v-shaped launch.
TEST(CudaLinearTensorCore, WideDecodeGridsKeepTheBits) {
  SKIP_WITHOUT_CUDA();
  const int64_t k = 512;
  const int64_t ns[3] = {8192, 4096, 4096};  // 1,024 blocks of 16 columns
  Twin x(DType::kF32, {3, k});
  x.randomize(81);
  Twin x1(DType::kF32, {1, k});
  std::memcpy(x1.host.data<float>(), x.host.data<float>() + k, static_cast<size_t>(k) * 4);
  x1.push();
  std::vector<Twin> ws;
  for (int i = 0; i < 3; ++i) {
    ws.emplace_back(DType::kBF16, Shape{ns[i], k});
    ws.back().randomize(82 + i, -0.5f, 0.5f);
  }
  std::vector<Twin> one, three;
  for (int i = 0; i < 3; ++i) {
    one.push_back(poisoned_output({1, ns[i]}));
    three.push_back(poisoned_output({3, ns[i]}));
  }
  const LinearOut outs[3] = {
      {ws[0].dev, one[0].dev}, {ws[1].dev, one[1].dev}, {ws[2].dev, one[2].dev}};
  gpu_be().linear_multi(x1.dev, outs);
  for (int i = 0; i < 3; ++i) gpu_be().linear(x.dev, ws[i].dev, three[i].dev);
  for (int i = 0; i < 3; ++i) {
    const HostTensor got = one[i].pull();
    const HostTensor rows = three[i].pull();
    EXPECT_TRUE(same_bits(got.data<float>(), rows.data<float>() + ns[i], ns[i])) << "output " << i;
    HostTensor want(DType::kF32, {1, ns[i]});
    cpu_be().linear(x1.host, ws[i].host, want);
    expect_close(got, want, kInvariantTol, "wide decode grid vs cpu");
    Twin single = poisoned_output({1, ns[i]});
    gpu_be().linear(x1.dev, ws[i].dev, single.dev);
    EXPECT_TRUE(same_bits(single.pull().data<float>(), got.data<float>(), ns[i])) << "output " << i;
  }
}

// A decode product of few tiles spreads each tile over a cluster of blocks
// (cuda_linear_mma.cu: 8 blocks up to a tile per SM, 4 up to 1.5): the row
// must keep the bits it has in a several-row call (one block per tile) and
// stay close to the CPU. N = 100 ends in a partial tile, K = 4,104 in a
// partial step; N = 2,560 (160 tiles) takes clusters of 4 on a 132-SM H200.
TEST(CudaLinearTensorCore, ClusteredDecodeKeepsTheBits) {
  SKIP_WITHOUT_CUDA();
  const std::pair<int64_t, int64_t> shapes[] = {{1536, 6144}, {100, 4104}, {2560, 8192}};
  uint64_t seed = 700;
  for (const auto& [n, k] : shapes) {
    const std::string where = "N=" + std::to_string(n) + " K=" + std::to_string(k);
    Twin w(DType::kBF16, {n, k});
    w.randomize(++seed, -0.5f, 0.5f);
    Twin x(DType::kF32, {3, k});
    x.randomize(++seed);
    Twin rows = poisoned_output({3, n});
    gpu_be().linear(x.dev, w.dev, rows.dev);
    const HostTensor all = rows.pull();
    for (int64_t r = 0; r < 3; ++r) {
      const HostTensor got = one_row_linear(x, r, w);
      EXPECT_TRUE(same_bits(got.data<float>(), all.data<float>() + r * n, n))
          << where << ": row " << r << " differs from the same row of a 3-row call";
      if (r == 0) {
        HostTensor x0(DType::kF32, {1, k});
        std::memcpy(x0.data<float>(), x.host.data<float>(), static_cast<size_t>(k) * sizeof(float));
        HostTensor want(DType::kF32, {1, n});
        cpu_be().linear(x0, w.host, want);
        expect_close(got, want, kInvariantTol, ("clustered decode vs cpu, " + where).c_str());
      }
    }
  }
}

// Products of 2-8 rows with K >= 4,096 and at least a block per SM stream
// their weights through the cp.async pipeline, smaller ones through a register
// ring (cuda_linear_mma.cu): either way a row must keep the bits of the
// one-row call and stay close to the CPU. N = 8,192 gives 256 blocks of 32
// columns (a block per SM on any Hopper); K = 4,104 adds a partial last step.
// The q/k/v-shaped launch and the gate/up product take the pipeline where the
// single products they must equal (k, v: 128 blocks; gate, up) take the ring.
TEST(CudaLinearTensorCore, SeveralRowPipelineKeepsTheBits) {
  SKIP_WITHOUT_CUDA();
  for (const int64_t k : {int64_t{4096}, int64_t{4104}}) {
    const int64_t n = 8192;
    Twin w(DType::kBF16, {n, k});
    w.randomize(static_cast<uint64_t>(91 + k), -0.5f, 0.5f);
    for (const int64_t m : {int64_t{2}, int64_t{5}, int64_t{8}}) {
      const std::string where = "M=" + std::to_string(m) + " K=" + std::to_string(k);
      Twin x(DType::kF32, {m, k});
      x.randomize(static_cast<uint64_t>(92 + m + k));
      Twin y = poisoned_output({m, n});
      gpu_be().linear(x.dev, w.dev, y.dev);
      const HostTensor got = y.pull();
      HostTensor want(DType::kF32, {m, n});
      cpu_be().linear(x.host, w.host, want);
      expect_close(got, want, kInvariantTol, ("several-row pipeline vs cpu, " + where).c_str());
      for (int64_t r = 0; r < m; ++r) {
        EXPECT_TRUE(same_bits(one_row_linear(x, r, w).data<float>(), got.data<float>() + r * n, n))
            << where << ": row " << r << " differs from the one-row call";
      }
    }
  }

  const int64_t k = 4096;
  const int64_t m = 5;
  Twin x(DType::kF32, {m, k});
  x.randomize(95);
  const int64_t widths[3] = {8192, 4096, 4096};
  std::vector<Twin> ws;
  std::vector<Twin> ys;
  std::vector<LinearOut> outs;
  ws.reserve(3);
  ys.reserve(3);
  for (int i = 0; i < 3; ++i) {
    ws.emplace_back(DType::kBF16, Shape{widths[i], k});
    ws.back().randomize(static_cast<uint64_t>(96 + i), -0.5f, 0.5f);
    ys.push_back(poisoned_output({m, widths[i]}));
    outs.push_back({ws.back().dev, ys.back().dev});
  }
  gpu_be().linear_multi(x.dev, outs);
  for (int i = 0; i < 3; ++i) {
    Twin single = poisoned_output({m, widths[i]});
    gpu_be().linear(x.dev, ws[i].dev, single.dev);
    EXPECT_TRUE(same_bits(ys[i].pull().data<float>(), single.pull().data<float>(), m * widths[i]))
        << "linear_multi output " << i << " differs from linear()";
  }

  const int64_t inter = 4096;  // 256 blocks of 16 gate (and 16 up) columns
  Twin w_gate(DType::kBF16, {inter, k});
  w_gate.randomize(99, -0.5f, 0.5f);
  Twin w_up(DType::kBF16, {inter, k});
  w_up.randomize(100, -0.5f, 0.5f);
  Twin gate = poisoned_output({m, inter});
  Twin up = poisoned_output({m, inter});
  gpu_be().linear_gelu_mul(x.dev, w_gate.dev, w_up.dev, gate.dev, up.dev);
  Twin g = poisoned_output({m, inter});
  Twin u = poisoned_output({m, inter});
  gpu_be().linear(x.dev, w_gate.dev, g.dev);
  gpu_be().linear(x.dev, w_up.dev, u.dev);
  gpu_be().gelu_mul(g.dev, u.dev, g.dev);
  EXPECT_TRUE(same_bits(gate.pull().data<float>(), g.pull().data<float>(), m * inter))
      << "linear_gelu_mul differs from linear, linear, gelu_mul";
}

// The cuBLASLt path (linear_prefill above kPrefillGemmRows, for every weight
// dtype) is deterministic for a given shape and, once warm, allocates nothing.
TEST(CudaLinearPrefill, DeterministicAndAllocationFree) {
  SKIP_WITHOUT_CUDA();
  const int64_t m = 300, n = 256, k = 1024;
  for (DType dtype : kWeightDtypes) {
    Twin x(DType::kF32, {m, k});
    x.randomize(41);
    Twin w(dtype, {n, k});
    w.randomize(42, -0.5f, 0.5f);
    Twin y = poisoned_output({m, n});
    gpu_be().linear_prefill(x.dev, w.dev, y.dev);
    const HostTensor first = y.pull();
    const int64_t allocations = gpu_be().allocation_count();
    poison(y.host);
    y.push();
    gpu_be().linear_prefill(x.dev, w.dev, y.dev);
    const HostTensor second = y.pull();
    EXPECT_EQ(gpu_be().allocation_count(), allocations) << "w " << dtype_name(dtype);
    EXPECT_TRUE(same_bits(first.data<float>(), second.data<float>(), m * n))
        << "w " << dtype_name(dtype);
  }
}

// linear_prefill: cuBLASLt above kPrefillGemmRows rows (bf16 activations, so the
// cuBLASLt tolerance), the invariant kernel at or below it (bit-equal to linear).
TEST(CudaLinearPrefill, PrefillPathMatchesCpuAndSmallOnesStayInvariant) {
  SKIP_WITHOUT_CUDA();
  const int64_t n = 512, k = 2048;
  for (int64_t m : {int64_t{4}, cuda::kPrefillGemmRows, int64_t{17}, int64_t{64}, int64_t{200}}) {
    Twin x(DType::kF32, {m, k});
    x.randomize(51);
    Twin w(DType::kBF16, {n, k});
    w.randomize(52, -0.5f, 0.5f);
    Twin y = poisoned_output({m, n});
    gpu_be().linear_prefill(x.dev, w.dev, y.dev);
    const HostTensor got = y.pull();
    HostTensor want(DType::kF32, {m, n});
    cpu_be().linear(x.host, w.host, want);
    const float tol = m > cuda::kPrefillGemmRows ? kLtTol : kInvariantTol;
    expect_close(got, want, tol, ("linear_prefill M=" + std::to_string(m)).c_str());
    if (m <= cuda::kPrefillGemmRows) {
      Twin y2 = poisoned_output({m, n});
      gpu_be().linear(x.dev, w.dev, y2.dev);
      EXPECT_TRUE(same_bits(got.data<float>(), y2.pull().data<float>(), m * n)) << "M=" << m;
    }
  }
}

// K = 0: an empty sum, y = 0 on both paths.
TEST(CudaLinearEdge, EmptyReductionGivesZeros) {
  SKIP_WITHOUT_CUDA();
  for (int64_t m : {3, 300}) {
    Twin x(DType::kF32, {m, 0});
    Twin w(DType::kBF16, {5, 0});
    Twin y = poisoned_output({m, 5});
    gpu_be().linear(x.dev, w.dev, y.dev);
    const HostTensor got = y.pull();
    for (int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.data<float>()[i], 0.0f) << i;
  }
}

// ---------------------------------------------------------------------------
// embedding.

class CudaEmbedding : public ::testing::TestWithParam<DType> {};

TEST_P(CudaEmbedding, MatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam();
  for (const auto& [vocab, h, n] : {std::tuple<int64_t, int64_t, int64_t>{50, 37, 9},
                                    std::tuple<int64_t, int64_t, int64_t>{1000, 1536, 70}}) {
    Twin table(dtype, {vocab, h});
    table.randomize(static_cast<uint64_t>(60 + h), -2.0f, 2.0f);
    Twin ids(DType::kI32, {n});
    for (int64_t i = 0; i < n; ++i) {
      // Both ends of the vocabulary, repeats, and a spread in between.
      ids.host.data<int32_t>()[i] = static_cast<int32_t>(i == 0   ? 0
                                                         : i == 1 ? vocab - 1
                                                                  : (i * 37) % vocab);
    }
    ids.push();
    const float scale = 2.5f;
    HostTensor want(DType::kF32, {n, h});
    cpu_be().embedding(table.host, ids.host, scale, want);
    Twin out = poisoned_output({n, h});
    gpu_be().embedding(table.dev, ids.dev, scale, out.dev);
    expect_close(out.pull(), want, kEmbeddingTol, "embedding");
  }
}

// The CUDA embedding cannot throw from the kernel: an id outside [0, V) gives a
// zero row (the model validates ids on the host before every forward).
TEST_P(CudaEmbedding, OutOfRangeIdGivesZeroRow) {
  SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam();
  const int64_t vocab = 20, h = 24;
  Twin table(dtype, {vocab, h});
  table.randomize(70);
  Twin ids(DType::kI32, {3});
  ids.host.data<int32_t>()[0] = -1;
  ids.host.data<int32_t>()[1] = static_cast<int32_t>(vocab);
  ids.host.data<int32_t>()[2] = 3;
  ids.push();
  Twin out = poisoned_output({3, h});
  gpu_be().embedding(table.dev, ids.dev, 1.5f, out.dev);
  const HostTensor got = out.pull();
  for (int64_t j = 0; j < 2 * h; ++j) EXPECT_EQ(got.data<float>()[j], 0.0f) << j;

  Twin valid_id(DType::kI32, {1});
  valid_id.host.data<int32_t>()[0] = 3;
  HostTensor want(DType::kF32, {1, h});
  cpu_be().embedding(table.host, valid_id.host, 1.5f, want);
  EXPECT_TRUE(same_bits(got.data<float>() + 2 * h, want.data<float>(), h));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaEmbedding, ::testing::ValuesIn(kWeightDtypes),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// ---------------------------------------------------------------------------
// Errors name the op and the offending tensor.

TEST(CudaLinearErrors, BadShapesDtypesAndAliasing) {
  SKIP_WITHOUT_CUDA();
  Backend& be = gpu_be();
  Twin x(DType::kF32, {2, 8});
  Twin w(DType::kBF16, {4, 8});
  Twin y(DType::kF32, {2, 4});
  Twin w_k9(DType::kBF16, {4, 9});
  Twin y_wide(DType::kF32, {2, 5});
  Twin x_bf16(DType::kBF16, {2, 8});
  Twin w_i32(DType::kI32, {4, 8});
  Twin y_bf16(DType::kBF16, {2, 4});
  Twin x_rank1(DType::kF32, {8});

  expect_error([&] { be.linear(x.dev, w_k9.dev, y.dev); }, {"linear", "K", "[4, 9]"});
  expect_error([&] { be.linear(x.dev, w.dev, y_wide.dev); }, {"linear", "y", "[2, 5]"});
  expect_error([&] { be.linear(x_bf16.dev, w.dev, y.dev); }, {"linear", "x"});
  expect_error([&] { be.linear(x.dev, w_i32.dev, y.dev); }, {"linear", "w"});
  expect_error([&] { be.linear(x.dev, w.dev, y_bf16.dev); }, {"linear", "y"});
  expect_error([&] { be.linear(x_rank1.dev, w.dev, y.dev); }, {"linear", "x", "rank"});
  // A host tensor handed to the GPU backend.
  expect_error([&] { be.linear(x.host, w.dev, y.dev); }, {"linear", "x"});
  // y overlapping x.
  const Tensor y_on_x(x.dev.data(), DType::kF32, {2, 4}, be.device());
  expect_error([&] { be.linear(x.dev, w.dev, y_on_x); }, {"linear", "overlaps"});
}

TEST(CudaEmbeddingErrors, BadShapesAndDtypes) {
  SKIP_WITHOUT_CUDA();
  Backend& be = gpu_be();
  Twin table(DType::kBF16, {10, 6});
  Twin ids(DType::kI32, {3});
  Twin out(DType::kF32, {3, 6});
  Twin out_bad(DType::kF32, {3, 7});
  Twin ids_f32(DType::kF32, {3});
  Twin table_i32(DType::kI32, {10, 6});
  Twin table_rank1(DType::kF32, {60});
  Twin out_bf16(DType::kBF16, {3, 6});

  expect_error([&] { be.embedding(table.dev, ids.dev, 1.0f, out_bad.dev); },
               {"embedding", "out", "[3, 7]"});
  expect_error([&] { be.embedding(table.dev, ids_f32.dev, 1.0f, out.dev); }, {"embedding", "ids"});
  expect_error([&] { be.embedding(table_i32.dev, ids.dev, 1.0f, out.dev); },
               {"embedding", "table"});
  expect_error([&] { be.embedding(table_rank1.dev, ids.dev, 1.0f, out.dev); },
               {"embedding", "table", "rank"});
  expect_error([&] { be.embedding(table.dev, ids.dev, 1.0f, out_bf16.dev); }, {"embedding", "out"});
}

// ---------------------------------------------------------------------------
// linear_multi and linear_gelu_mul: the bits of the separate calls.

// gelu_tanh(g) · u after two invariant products vs the CPU: the products within
// kInvariantTol, then CUDA's tanhf vs glibc's (an ulp or two) and two roundings.
constexpr float kGeluMulTol = 1e-4f;
// Four invariant products in a row (f32 activations throughout) vs the CPU.
constexpr float kChainTol = 1e-4f;

using MultiCase = std::tuple<int64_t, DType>;  // M, w dtype

std::string multi_case_name(const ::testing::TestParamInfo<MultiCase>& info) {
  return "M" + std::to_string(std::get<0>(info.param)) + "_" +
         std::string(dtype_name(std::get<1>(info.param)));
}

class CudaLinearMulti : public ::testing::TestWithParam<MultiCase> {};

// Every y of linear_multi is bit-identical to a separate linear() of the same
// x and w (fused path for M <= kInvariantRows, several launches above 4
// outputs; linear() per output at 300 rows) and close to the CPU.
TEST_P(CudaLinearMulti, EachOutputHasTheBitsOfLinear) {
  SKIP_WITHOUT_CUDA();
  const auto [m, dtype] = GetParam();
  // 2, 3 and 5 outputs; widths below one block (16 columns), not multiples of
  // 16, and above one block.
  const std::vector<std::vector<int64_t>> width_sets = {
      {64, 33}, {7, 130, 16}, {48, 5, 100, 17, 64}};
  // K: vectorised; K % 8 == 4 (f32: the partial chunk on the vector path;
  // bf16/f16: misaligned rows, the per-output scalar path); tiny and ragged.
  for (int64_t k : {int64_t{256}, int64_t{4100}, int64_t{13}}) {
    for (const std::vector<int64_t>& widths : width_sets) {
      const std::string where = "M=" + std::to_string(m) + " K=" + std::to_string(k) + " w " +
                                std::string(dtype_name(dtype)) + ", " +
                                std::to_string(widths.size()) + " outputs";
      Twin x(DType::kF32, {m, k});
      x.randomize(static_cast<uint64_t>(2000 + m * 13 + k));
      std::vector<Twin> ws;
      std::vector<Twin> ys;
      ws.reserve(widths.size());
      ys.reserve(widths.size());
      std::vector<LinearOut> outs;
      for (size_t i = 0; i < widths.size(); ++i) {
        ws.emplace_back(dtype, Shape{widths[i], k});
        ws.back().randomize(static_cast<uint64_t>(300 + 17 * i + widths[i]), -0.5f, 0.5f);
        ys.push_back(poisoned_output({m, widths[i]}));
      }
      for (size_t i = 0; i < widths.size(); ++i) outs.push_back({ws[i].dev, ys[i].dev});
      gpu_be().linear_multi(x.dev, outs);

      for (size_t i = 0; i < widths.size(); ++i) {
        const int64_t n = widths[i];
        const HostTensor got = ys[i].pull();
        Twin single = poisoned_output({m, n});
        gpu_be().linear(x.dev, ws[i].dev, single.dev);
        EXPECT_TRUE(same_bits(got.data<float>(), single.pull().data<float>(), m * n))
            << where << ": output " << i << " (N = " << n << ") differs from linear()";
        HostTensor want(DType::kF32, {m, n});
        cpu_be().linear(x.host, ws[i].host, want);
        expect_close(got, want, kInvariantTol, ("linear_multi " + where).c_str());
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinearMulti,
                         ::testing::Combine(::testing::Values<int64_t>(1, 3, 8, 13, 300),
                                            ::testing::ValuesIn(kWeightDtypes)),
                         multi_case_name);

// Outputs the fused launch cannot take (mixed weight dtypes, a misaligned x)
// go through linear() one by one: the same bits all the same.
TEST(CudaLinearMultiFallback, MixedDtypesAndMisalignedXKeepTheBits) {
  SKIP_WITHOUT_CUDA();
  const int64_t m = 5, k = 512;
  const int64_t widths[3] = {40, 9, 70};
  Twin x(DType::kF32, {m, k});
  x.randomize(91);
  DeviceBuffer x_buf(gpu_be(), x.host.view().nbytes() + 4);
  const Tensor x_off(static_cast<char*>(x_buf.data()) + 4, DType::kF32, {m, k}, gpu_be().device());
  gpu_be().upload(x.host.view().data(), x_off);
  std::vector<Twin> ws;
  ws.reserve(3);
  for (int i = 0; i < 3; ++i) {
    ws.emplace_back(kWeightDtypes[i], Shape{widths[i], k});
    ws.back().randomize(static_cast<uint64_t>(92 + i), -0.5f, 0.5f);
  }
  for (const Tensor& xt : {x.dev, x_off}) {
    for (bool mixed : {true, false}) {
      std::vector<Twin> ys;
      ys.reserve(3);
      std::vector<LinearOut> outs;
      // mixed: f32, bf16 and f16 weights; else bf16 three times (fused for the aligned x).
      for (int i = 0; i < 3; ++i) {
        const Tensor& w = ws[mixed ? i : 1].dev;
        ys.push_back(poisoned_output({m, w.dim(0)}));
        outs.push_back({w, ys.back().dev});
      }
      gpu_be().linear_multi(xt, outs);
      for (int i = 0; i < 3; ++i) {
        const Tensor& w = outs[i].w;
        const int64_t n = w.dim(0);
        Twin single = poisoned_output({m, n});
        gpu_be().linear(xt, w, single.dev);
        EXPECT_TRUE(same_bits(ys[i].pull().data<float>(), single.pull().data<float>(), m * n))
            << "output " << i << (mixed ? " (mixed dtypes)" : " (bf16)")
            << (xt.data() == x_off.data() ? ", misaligned x" : ", aligned x");
      }
    }
  }
}

class CudaLinearGeluMul : public ::testing::TestWithParam<MultiCase> {};

// linear_gelu_mul is bit-identical to linear(gate), linear(up), gelu_mul (fused
// for M <= kInvariantRows; at 300 rows the same three steps) and close to the CPU.
TEST_P(CudaLinearGeluMul, MatchesLinearLinearGeluMul) {
  SKIP_WITHOUT_CUDA();
  const auto [m, dtype] = GetParam();
  // (I, K): aligned; I below one 8-column block and ragged; K % 8 == 4 (f32:
  // partial chunk on the fused path; bf16/f16: the fallback).
  for (const auto& [n, k] :
       {std::pair<int64_t, int64_t>{64, 256}, std::pair<int64_t, int64_t>{5, 1024},
        std::pair<int64_t, int64_t>{131, 4100}}) {
    const std::string where = "M=" + std::to_string(m) + " I=" + std::to_string(n) +
                              " K=" + std::to_string(k) + " w " + std::string(dtype_name(dtype));
    Twin x(DType::kF32, {m, k});
    x.randomize(static_cast<uint64_t>(3000 + m + k));
    Twin w_gate(dtype, {n, k});
    w_gate.randomize(static_cast<uint64_t>(3100 + n), -0.5f, 0.5f);
    Twin w_up(dtype, {n, k});
    w_up.randomize(static_cast<uint64_t>(3200 + n), -0.5f, 0.5f);
    Twin gate = poisoned_output({m, n});
    Twin up = poisoned_output({m, n});
    gpu_be().linear_gelu_mul(x.dev, w_gate.dev, w_up.dev, gate.dev, up.dev);
    const HostTensor got = gate.pull();

    Twin g = poisoned_output({m, n});
    Twin u = poisoned_output({m, n});
    gpu_be().linear(x.dev, w_gate.dev, g.dev);
    gpu_be().linear(x.dev, w_up.dev, u.dev);
    gpu_be().gelu_mul(g.dev, u.dev, g.dev);
    EXPECT_TRUE(same_bits(got.data<float>(), g.pull().data<float>(), m * n))
        << where << ": differs from linear, linear, gelu_mul";

    HostTensor g_cpu(DType::kF32, {m, n});
    HostTensor u_cpu(DType::kF32, {m, n});
    cpu_be().linear(x.host, w_gate.host, g_cpu);
    cpu_be().linear(x.host, w_up.host, u_cpu);
    cpu_be().gelu_mul(g_cpu, u_cpu, g_cpu);
    expect_close(got, g_cpu, kGeluMulTol, ("linear_gelu_mul " + where).c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinearGeluMul,
                         ::testing::Combine(::testing::Values<int64_t>(1, 5, 8, 20, 300),
                                            ::testing::ValuesIn(kWeightDtypes)),
                         multi_case_name);

// Past kInvariantRows rows, bf16 products run in chunks of kInvariantRows rows:
// every row of linear_multi and linear_gelu_mul at 257, 300 and 600 rows has
// the bits of the same row alone (a decode call), whichever chunk it is in.
TEST(CudaLinearRowChunks, FusedProductsKeepEachRowsOneRowBits) {
  SKIP_WITHOUT_CUDA();
  const int64_t k = 384, n_q = 96, n_k = 40, n_i = 136;
  Twin w_q(DType::kBF16, {n_q, k});
  w_q.randomize(61, -0.5f, 0.5f);
  Twin w_k(DType::kBF16, {n_k, k});
  w_k.randomize(62, -0.5f, 0.5f);
  Twin w_gate(DType::kBF16, {n_i, k});
  w_gate.randomize(63, -0.5f, 0.5f);
  Twin w_up(DType::kBF16, {n_i, k});
  w_up.randomize(64, -0.5f, 0.5f);
  for (int64_t m : {int64_t{257}, int64_t{300}, int64_t{600}}) {
    Twin x(DType::kF32, {m, k});
    x.randomize(static_cast<uint64_t>(700 + m));
    Twin q = poisoned_output({m, n_q});
    Twin kk = poisoned_output({m, n_k});
    const std::vector<LinearOut> outs = {{w_q.dev, q.dev}, {w_k.dev, kk.dev}};
    gpu_be().linear_multi(x.dev, outs);
    Twin gate = poisoned_output({m, n_i});
    Twin up = poisoned_output({m, n_i});
    gpu_be().linear_gelu_mul(x.dev, w_gate.dev, w_up.dev, gate.dev, up.dev);
    const HostTensor q_all = q.pull(), k_all = kk.pull(), gate_all = gate.pull();
    for (int64_t r : {int64_t{0}, int64_t{255}, int64_t{256}, m - 1, m / 2}) {
      Twin x1(DType::kF32, {1, k});
      std::memcpy(x1.host.data<float>(), x.host.data<float>() + r * k,
                  static_cast<size_t>(k) * sizeof(float));
      x1.push();
      Twin q1 = poisoned_output({1, n_q});
      Twin k1 = poisoned_output({1, n_k});
      gpu_be().linear_multi(x1.dev, std::vector<LinearOut>{{w_q.dev, q1.dev}, {w_k.dev, k1.dev}});
      Twin g1 = poisoned_output({1, n_i});
      Twin u1 = poisoned_output({1, n_i});
      gpu_be().linear_gelu_mul(x1.dev, w_gate.dev, w_up.dev, g1.dev, u1.dev);
      const std::string where = "row " + std::to_string(r) + " of " + std::to_string(m);
      EXPECT_TRUE(same_bits(q_all.data<float>() + r * n_q, q1.pull().data<float>(), n_q))
          << where << ": linear_multi output 0";
      EXPECT_TRUE(same_bits(k_all.data<float>() + r * n_k, k1.pull().data<float>(), n_k))
          << where << ": linear_multi output 1";
      EXPECT_TRUE(same_bits(gate_all.data<float>() + r * n_i, g1.pull().data<float>(), n_i))
          << where << ": linear_gelu_mul";
    }
  }
}

// The invariant kernels are programmatic dependent launches: each may start
// while its predecessor runs, so this chain (every product reads the previous
// one's output) run back to back must give the bits of the same calls with a
// download (a stream synchronisation) after each, and poisoned (NaN) outputs
// show any read that came too early.
TEST(CudaLinearPdl, BackToBackProductsSeeTheirInputs) {
  SKIP_WITHOUT_CUDA();
  const int64_t m = 3, h = 2048, kv = 256, inter = 4096;
  for (DType dtype : kWeightDtypes) {
    Twin x(DType::kF32, {m, h});
    x.randomize(401);
    Twin w_in(dtype, {h, h});
    w_in.randomize(402, -0.05f, 0.05f);
    Twin w_q(dtype, {h, h});
    w_q.randomize(403, -0.05f, 0.05f);
    Twin w_k(dtype, {kv, h});
    w_k.randomize(404, -0.05f, 0.05f);
    Twin w_gate(dtype, {inter, h});
    w_gate.randomize(405, -0.05f, 0.05f);
    Twin w_up(dtype, {inter, h});
    w_up.randomize(406, -0.05f, 0.05f);
    Twin w_down(dtype, {h, inter});
    w_down.randomize(407, -0.05f, 0.05f);

    // a = x·w_inᵀ; (q, k) = a·(w_q, w_k)ᵀ; gate = gelu(q·w_gateᵀ) ⊙ q·w_upᵀ; out = gate·w_downᵀ.
    const auto run = [&](bool sync) {
      Twin a = poisoned_output({m, h});
      Twin q = poisoned_output({m, h});
      Twin k = poisoned_output({m, kv});
      Twin gate = poisoned_output({m, inter});
      Twin up = poisoned_output({m, inter});
      Twin out = poisoned_output({m, h});
      gpu_be().linear(x.dev, w_in.dev, a.dev);
      if (sync) a.pull();
      const LinearOut outs[2] = {{w_q.dev, q.dev}, {w_k.dev, k.dev}};
      gpu_be().linear_multi(a.dev, outs);
      if (sync) q.pull();
      gpu_be().linear_gelu_mul(q.dev, w_gate.dev, w_up.dev, gate.dev, up.dev);
      if (sync) gate.pull();
      gpu_be().linear(gate.dev, w_down.dev, out.dev);
      std::vector<HostTensor> results;
      results.push_back(k.pull());
      results.push_back(gate.pull());
      results.push_back(out.pull());
      return results;
    };
    const std::vector<HostTensor> chained = run(false);
    const std::vector<HostTensor> synced = run(true);
    const char* names[3] = {"k", "gate", "out"};
    for (size_t i = 0; i < chained.size(); ++i) {
      EXPECT_TRUE(same_bits(chained[i].data<float>(), synced[i].data<float>(), chained[i].numel()))
          << names[i] << " (w " << dtype_name(dtype) << ") differs when run back to back";
    }

    HostTensor a(DType::kF32, {m, h});
    HostTensor q(DType::kF32, {m, h});
    HostTensor g(DType::kF32, {m, inter});
    HostTensor u(DType::kF32, {m, inter});
    HostTensor out(DType::kF32, {m, h});
    cpu_be().linear(x.host, w_in.host, a);
    cpu_be().linear(a, w_q.host, q);
    cpu_be().linear(q, w_gate.host, g);
    cpu_be().linear(q, w_up.host, u);
    cpu_be().gelu_mul(g, u, g);
    cpu_be().linear(g, w_down.host, out);
    expect_close(chained[2], out, kChainTol, "chained out vs cpu");
  }
}

TEST(CudaLinearMultiErrors, BadShapesAndAliasing) {
  SKIP_WITHOUT_CUDA();
  Backend& be = gpu_be();
  Twin x(DType::kF32, {2, 8});
  Twin w(DType::kBF16, {4, 8});
  Twin w3(DType::kBF16, {3, 8});
  Twin w_k9(DType::kBF16, {4, 9});
  Twin w_i32(DType::kI32, {4, 8});
  Twin y(DType::kF32, {2, 4});
  Twin y3(DType::kF32, {2, 3});
  Twin y_wide(DType::kF32, {2, 5});
  const Tensor y_on_x(x.dev.data(), DType::kF32, {2, 4}, be.device());

  {
    const LinearOut outs[2] = {{w.dev, y.dev}, {w3.dev, y_wide.dev}};
    expect_error([&] { be.linear_multi(x.dev, outs); }, {"linear_multi", "outs[1].y", "[2, 5]"});
  }
  {
    const LinearOut outs[2] = {{w.dev, y.dev}, {w_k9.dev, y_wide.dev}};
    expect_error([&] { be.linear_multi(x.dev, outs); },
                 {"linear_multi", "outs[1].w", "K", "[4, 9]"});
  }
  {
    const LinearOut outs[2] = {{w3.dev, y3.dev}, {w_i32.dev, y.dev}};
    expect_error([&] { be.linear_multi(x.dev, outs); }, {"linear_multi", "outs[1].w"});
  }
  {
    const LinearOut outs[2] = {{w3.dev, y3.dev}, {w.dev, y_on_x}};
    expect_error([&] { be.linear_multi(x.dev, outs); }, {"linear_multi", "outs[1].y", "overlaps"});
  }
  {
    // Two outputs into one buffer.
    const LinearOut outs[2] = {{w.dev, y.dev}, {w.dev, y.dev}};
    expect_error([&] { be.linear_multi(x.dev, outs); },
                 {"linear_multi", "outs[0].y", "outs[1].y", "overlaps"});
  }
  {
    // A host tensor handed to the GPU backend.
    const LinearOut outs[1] = {{w.host, y.dev}};
    expect_error([&] { be.linear_multi(x.dev, outs); }, {"linear_multi", "outs[0].w"});
  }
}

TEST(CudaLinearGeluMulErrors, BadShapesAndAliasing) {
  SKIP_WITHOUT_CUDA();
  Backend& be = gpu_be();
  Twin x(DType::kF32, {2, 8});
  Twin w_gate(DType::kBF16, {4, 8});
  Twin w_up(DType::kBF16, {4, 8});
  Twin w_up3(DType::kBF16, {3, 8});
  Twin w_up_k9(DType::kBF16, {4, 9});
  Twin gate(DType::kF32, {2, 4});
  Twin up(DType::kF32, {2, 4});
  Twin up3(DType::kF32, {2, 3});
  Twin up_wide(DType::kF32, {2, 5});
  const Tensor gate_on_x(x.dev.data(), DType::kF32, {2, 4}, be.device());

  expect_error([&] { be.linear_gelu_mul(x.dev, w_gate.dev, w_up3.dev, gate.dev, up3.dev); },
               {"linear_gelu_mul", "gate", "up", "same shape"});
  expect_error([&] { be.linear_gelu_mul(x.dev, w_gate.dev, w_up.dev, gate.dev, up_wide.dev); },
               {"linear_gelu_mul", "up", "[2, 5]"});
  expect_error([&] { be.linear_gelu_mul(x.dev, w_gate.dev, w_up_k9.dev, gate.dev, up.dev); },
               {"linear_gelu_mul", "w_up", "K"});
  expect_error([&] { be.linear_gelu_mul(x.dev, w_gate.dev, w_up.dev, gate_on_x, up.dev); },
               {"linear_gelu_mul", "gate", "overlaps"});
  expect_error([&] { be.linear_gelu_mul(x.dev, w_gate.dev, w_up.dev, gate.dev, gate.dev); },
               {"linear_gelu_mul", "gate", "up", "overlaps"});
}

}  // namespace
}  // namespace specula::test
