// SPDX-License-Identifier: Apache-2.0
// The CPU backend's norms (rms_norm, rms_norm_add_norm), element-wise ops and
// row ops (softmax_rows, argmax_rows, top_k_rows, fill_scatter_rows,
// gather_rows) against naive double-precision references written here from
// the op contracts (engine/ops/backend.h). Tolerance: cpu_backend_test_util.h.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/unit/cpu_backend_test_util.h"

namespace specula {
namespace {

using namespace testing;  // the helpers of cpu_backend_test_util.h and op_test_util.h

// ---- rms_norm ----

std::vector<double> rms_norm_ref(const Tensor& x, const Tensor* w, double eps) {
  const auto xd = to_double(x);
  const int64_t d = x.dim(-1), rows = x.numel() / d;
  std::vector<double> wd = w ? to_double(*w) : std::vector<double>(static_cast<size_t>(d), 1.0);
  std::vector<double> out(xd.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < d; ++c) ss += xd[r * d + c] * xd[r * d + c];
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int64_t c = 0; c < d; ++c) out[r * d + c] = xd[r * d + c] * inv * wd[c];
  }
  return out;
}

TEST_F(CpuBackendTest, RmsNormMatchesReferenceWithAndWithoutWeight) {
  for (Shape shape : {Shape{3, 37}, Shape{2, 3, 64}, Shape{1, 1}}) {
    const int64_t d = shape.dim(-1);
    for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
      HostTensor x = random(shape, -3.0f, 3.0f);
      HostTensor w = random(wt, {d}, 0.5f, 1.5f);
      HostTensor out(DType::kF32, shape);
      be_.rms_norm(x, w, 1e-6f, out);
      expect_close(out, rms_norm_ref(x, &w.view(), 1e-6),
                   fmt::format("rms_norm {} {}", shape.str(), dtype_name(wt)));
      // In place gives the same bits.
      be_.rms_norm(x, w, 1e-6f, x);
      expect_bitwise_equal(x.data<float>(), out.data<float>(), x.numel(), "rms_norm in place");
    }
    HostTensor x = random(shape);
    HostTensor out(DType::kF32, shape);
    be_.rms_norm(x, Tensor(), 1e-6f, out);
    expect_close(out, rms_norm_ref(x, nullptr, 1e-6), "rms_norm without weight");
  }
}

TEST_F(CpuBackendTest, RmsNormUsesWeightNotOnePlusWeight) {
  // x = [1, 1]: mean(x²) = 1 so the output is the weight itself (eps = 0).
  HostTensor x = make_float(DType::kF32, {1, 2}, {1.0f, 1.0f});
  HostTensor w = make_float(DType::kF32, {2}, {0.5f, 2.0f});
  HostTensor out(DType::kF32, {1, 2});
  be_.rms_norm(x, w, 0.0f, out);
  EXPECT_EQ(out.f32()[0], 0.5f);
  EXPECT_EQ(out.f32()[1], 2.0f);
}

TEST_F(CpuBackendTest, RmsNormRejectsMismatchedWeight) {
  HostTensor x = random({3, 8}), w = random({7}), out(DType::kF32, {3, 8});
  expect_error([&] { be_.rms_norm(x, w, 1e-6f, out); }, {"rms_norm", "f32[7]", "f32[3, 8]"});
  HostTensor out_bad(DType::kF32, {3, 7});
  expect_error([&] { be_.rms_norm(x, Tensor(), 1e-6f, out_bad); },
               {"rms_norm", "f32[3, 8]", "f32[3, 7]"});
}

// ---- element-wise ----

TEST_F(CpuBackendTest, ElementwiseOpsMatchReference) {
  const Shape shape{3, 41};
  HostTensor a = random(shape, -4.0f, 4.0f), b = random(shape, -4.0f, 4.0f);
  const auto ad = to_double(a), bd = to_double(b);
  auto ref = [&](auto f2) {
    std::vector<double> r(ad.size());
    for (size_t i = 0; i < r.size(); ++i) r[i] = f2(ad[i], bd[i]);
    return r;
  };
  HostTensor out(DType::kF32, shape);
  be_.gelu(a, out);
  expect_close(out, ref([](double x, double) { return gelu_ref(x); }), "gelu");
  be_.gelu_mul(a, b, out);
  expect_close(out, ref([](double g, double u) { return gelu_ref(g) * u; }), "gelu_mul");
  be_.add(a, b, out);
  expect_close(out, ref([](double x, double y) { return x + y; }), "add");
  be_.mul(a, b, out);
  expect_close(out, ref([](double x, double y) { return x * y; }), "mul");
  be_.scale(a, -0.3f, out);
  expect_close(out, ref([](double x, double) { return x * double(-0.3f); }), "scale");
  be_.softcap(a, 3.0f, out);
  expect_close(out, ref([](double x, double) { return 3.0 * std::tanh(x / 3.0); }), "softcap");
}

TEST_F(CpuBackendTest, ElementwiseOpsMayWorkInPlace) {
  const Shape shape{2, 33};
  HostTensor a = random(shape), b = random(shape);
  HostTensor expect(DType::kF32, shape);
  be_.gelu_mul(a, b, expect);
  be_.gelu_mul(a, b, b);  // out aliases up
  expect_bitwise_equal(b.data<float>(), expect.data<float>(), b.numel(), "gelu_mul into up");
  HostTensor a2 = random(shape);
  HostTensor sum(DType::kF32, shape);
  be_.add(a2, a2, sum);
  be_.add(a2, a2, a2);
  expect_bitwise_equal(a2.data<float>(), sum.data<float>(), a2.numel(), "add into a");
  HostTensor c = random(shape);
  HostTensor capped(DType::kF32, shape);
  be_.softcap(c, 30.0f, capped);
  be_.softcap(c, 30.0f, c);
  expect_bitwise_equal(c.data<float>(), capped.data<float>(), c.numel(), "softcap in place");
}

TEST_F(CpuBackendTest, ElementwiseOpsRejectMismatchesAndPartialOverlap) {
  HostTensor a = random({2, 3}), b = random({3, 2}), out(DType::kF32, {2, 3});
  expect_error([&] { be_.add(a, b, out); }, {"add", "f32[2, 3]", "f32[3, 2]"});
  expect_error([&] { be_.mul(a, a, b); }, {"mul", "f32[2, 3]", "f32[3, 2]"});
  expect_error([&] { be_.gelu(a, b); }, {"gelu", "f32[2, 3]", "f32[3, 2]"});
  HostTensor buf = random({10});
  Tensor lo(buf.view().data(), DType::kF32, {9});
  Tensor hi(buf.data<float>() + 1, DType::kF32, {9});
  expect_error([&] { be_.scale(lo, 2.0f, hi); }, {"scale", "partially overlaps"});
  expect_error([&] { be_.softcap(a, 0.0f, out); }, {"softcap", "cap"});
}

// ---- softmax_rows and argmax_rows ----

TEST_F(CpuBackendTest, SoftmaxRowsMatchesReferenceAndZeroesFullyMaskedRows) {
  HostTensor x = random({4, 37}, -30.0f, 30.0f);
  x.data<float>()[5] = -kInf;                                            // a masked entry in row 0
  for (int64_t j = 0; j < 37; ++j) x.data<float>()[2 * 37 + j] = -kInf;  // row 2 all masked
  // Row 3 lies far beyond exp's f32 range: only max subtraction keeps it finite.
  for (int64_t j = 0; j < 37; ++j) x.data<float>()[3 * 37 + j] += 600.0f;
  const auto xd = to_double(x);
  std::vector<double> ref(xd.size(), 0.0);
  for (int64_t r = 0; r < 4; ++r) {
    if (r == 2) continue;
    double mx = -1e300, z = 0;
    for (int64_t j = 0; j < 37; ++j) mx = std::max(mx, xd[r * 37 + j]);
    for (int64_t j = 0; j < 37; ++j) z += std::exp(xd[r * 37 + j] - mx);
    for (int64_t j = 0; j < 37; ++j) ref[r * 37 + j] = std::exp(xd[r * 37 + j] - mx) / z;
  }
  HostTensor out(DType::kF32, {4, 37});
  be_.softmax_rows(x, out);
  expect_close(out, ref, "softmax_rows");
  be_.softmax_rows(x, x);
  expect_bitwise_equal(x.data<float>(), out.data<float>(), x.numel(), "softmax_rows in place");
}

TEST_F(CpuBackendTest, ArgmaxRowsPicksTheLowestIndexOnTies) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  HostTensor x = make_float(DType::kF32, {5, 4}, {1,  3,  3, 2,   5, 5, 5,  5,  -kInf, -1,
                                                  -1, -2, 1, nan, 5, 9, -3, -2, -1,    0});
  HostTensor out(DType::kI32, {5});
  be_.argmax_rows(x, out);
  EXPECT_EQ(out.data<int32_t>()[0], 1);
  EXPECT_EQ(out.data<int32_t>()[1], 0);
  EXPECT_EQ(out.data<int32_t>()[2], 1);
  EXPECT_EQ(out.data<int32_t>()[3], 1);  // NaN counts as the maximum (torch.argmax)
  EXPECT_EQ(out.data<int32_t>()[4], 3);
  // Random wide rows against a plain scan.
  HostTensor big = random({3, 5000});
  HostTensor idx(DType::kI32, {3});
  be_.argmax_rows(big, idx);
  for (int64_t r = 0; r < 3; ++r) {
    const float* row = big.data<float>() + r * 5000;
    EXPECT_EQ(idx.data<int32_t>()[r], std::max_element(row, row + 5000) - row);
  }
  HostTensor out_bad(DType::kI32, {4});
  expect_error([&] { be_.argmax_rows(x, out_bad); }, {"argmax_rows", "i32[4]", "f32[5, 4]"});
}

// ---- top_k_rows, fill_scatter_rows, gather_rows ----

TEST_F(CpuBackendTest, TopKRowsFollowsTorchTopkOrder) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  HostTensor x = make_float(DType::kF32, {3, 5},
                            {1, 3, 3, 2, -kInf,          // ties keep the lower index first
                             -0.0f, 0.0f, nan, -1, nan,  // NaN above all; -0 equals +0
                             kInf, -kInf, 4, 4, 4});
  HostTensor out(DType::kI32, {3, 3});
  be_.top_k_rows(x, out);
  const std::vector<int32_t> want = {1, 2, 3, 2, 4, 0, 0, 2, 3};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(out.data<int32_t>()[i], want[i]) << i;
  HostTensor too_many(DType::kI32, {3, 6});
  expect_error([&] { be_.top_k_rows(x, too_many); }, {"top_k_rows", "i32[3, 6]", "f32[3, 5]"});
}

TEST_F(CpuBackendTest, FillScatterRowsFillsWithTheMinimumMinusOne) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  HostTensor values = make_float(DType::kF32, {2, 3}, {0.5f, -2.0f, 3.0f, nan, 7.0f, 1.0f});
  HostTensor ids(DType::kI32, {2, 3});
  const int32_t id_values[] = {4, 0, 2, 1, 5, 3};
  std::copy(std::begin(id_values), std::end(id_values), ids.data<int32_t>());
  HostTensor out(DType::kF32, {2, 6});
  be_.fill_scatter_rows(values, ids, out);
  const float* o = out.data<float>();
  const float row0[] = {-2.0f, -3.0f, 3.0f, -3.0f, 0.5f, -3.0f};
  for (int j = 0; j < 6; ++j) EXPECT_EQ(o[j], row0[j]) << j;
  EXPECT_TRUE(std::isnan(o[6 + 1]));  // the NaN score is kept where it belongs
  EXPECT_EQ(o[6 + 5], 7.0f);
  EXPECT_EQ(o[6 + 3], 1.0f);
  EXPECT_EQ(o[6 + 0], 0.0f);  // NaN is skipped by the minimum: 1 - 1
  ids.data<int32_t>()[4] = 6;
  expect_error([&] { be_.fill_scatter_rows(values, ids, out); }, {"fill_scatter_rows", "6"});
}

TEST_F(CpuBackendTest, GatherRowsCopiesRowsByIndex) {
  HostTensor src = random({4, 3});
  HostTensor idx(DType::kI32, {3});
  const int32_t rows[] = {3, 0, 3};
  std::copy(std::begin(rows), std::end(rows), idx.data<int32_t>());
  HostTensor out(DType::kF32, {3, 3});
  be_.gather_rows(src, idx, out);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j)
      EXPECT_EQ(out.data<float>()[i * 3 + j], src.data<float>()[rows[i] * 3 + j]);
  }
  idx.data<int32_t>()[1] = -1;
  expect_error([&] { be_.gather_rows(src, idx, out); }, {"gather_rows", "idx[1] = -1"});
  HostTensor narrow(DType::kF32, {3, 2});
  expect_error([&] { be_.gather_rows(src, idx, narrow); }, {"gather_rows", "f32[3, 2]"});
}

// ---- fused forms (Backend defaults on the CPU) ----

TEST_F(CpuBackendTest, RmsNormAddNormEqualsItsComposition) {
  const HostTensor x = random({4, 32});
  const HostTensor residual = random({4, 32});
  const HostTensor w = random(DType::kBF16, {32});
  const HostTensor next_w = random(DType::kBF16, {32});
  HostTensor x1 = clone(x), r1 = clone(residual), out1(DType::kF32, {4, 32});
  be_.rms_norm_add_norm(x1, w, 1e-6f, r1, 0.5f, next_w, out1);
  HostTensor x2 = clone(x), r2 = clone(residual), out2(DType::kF32, {4, 32});
  be_.rms_norm_add(x2, w, 1e-6f, r2, 0.5f);
  be_.rms_norm(r2, next_w, 1e-6f, out2);
  EXPECT_TRUE(same_bits(r1, r2));
  EXPECT_TRUE(same_bits(out1, out2));
}

}  // namespace
}  // namespace specula
