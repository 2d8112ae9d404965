// SPDX-License-Identifier: Apache-2.0
// CudaBackend::linear and ::embedding against the CPU reference: both linear
// paths (batch-invariant kernel for M <= kInvariantRows, cuBLASLt above), every
// weight dtype, K tails, misaligned operands, bit-exact batch invariance, and
// the shape/dtype errors.
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
// cuBLASLt path: x (and f32/f16 weights) are rounded to bf16 before the product.
constexpr float kLtTol = 1e-2f;
// Embedding: an exact widening and one f32 multiply on both sides.
constexpr float kEmbeddingTol = 0.0f;

constexpr DType kWeightDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

float linear_tol(int64_t m) {
  return m <= cuda::kInvariantRows ? kInvariantTol : kLtTol;
}

// Fills a host f32 tensor with NaN so that an output element the GPU never writes fails.
void poison(const HostTensor& t) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = std::numeric_limits<float>::quiet_NaN();
}

// A twin output tensor whose device copy starts as NaN.
Twin poisoned_output(Shape shape) {
  Twin y(DType::kF32, shape);
  poison(y.host);
  y.push();
  return y;
}

bool same_bits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
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
  expect_close(got, want, linear_tol(m), "linear");
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
  const std::pair<int64_t, int64_t> calls[] = {{1, 0},   {5, 3},  {2, 1},     {8, 7},    {9, 8},
                                               {72, 69}, {72, 0}, {256, 200}, {256, 255}};
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

// The cuBLASLt path is deterministic for a given shape and, once warm, allocates nothing.
TEST(CudaLinearPrefill, DeterministicAndAllocationFree) {
  SKIP_WITHOUT_CUDA();
  const int64_t m = 300, n = 256, k = 1024;
  for (DType dtype : kWeightDtypes) {
    Twin x(DType::kF32, {m, k});
    x.randomize(41);
    Twin w(dtype, {n, k});
    w.randomize(42, -0.5f, 0.5f);
    Twin y = poisoned_output({m, n});
    gpu_be().linear(x.dev, w.dev, y.dev);
    const HostTensor first = y.pull();
    const int64_t allocations = gpu_be().allocation_count();
    poison(y.host);
    y.push();
    gpu_be().linear(x.dev, w.dev, y.dev);
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

}  // namespace
}  // namespace specula::test
