// SPDX-License-Identifier: Apache-2.0
// CUDA element-wise and row ops (cuda_elementwise.cu) against the CPU reference:
// rms_norm, rope, gelu, gelu_mul, add, mul, scale, softcap, argmax_rows,
// softmax_rows, transpose01, gather_rows, fill_uniform, queued uploads and the
// per-op profile; aliasing, batch invariance, edge rows (ties, NaN, all -inf)
// and shape errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// Tolerances (relative to the largest reference magnitude, see expect_close).
// add, mul, scale and transpose are the same single f32 operations: exact.
constexpr float kExactTol = 0.0f;
// rms_norm: the double sum of squares agrees; (mean + eps)^-1/2 may be one ulp apart.
constexpr float kNormTol = 1e-6f;
// softmax: exp may be one ulp apart on either side; the double sums agree.
constexpr float kSoftmaxTol = 1e-6f;
// gelu, gelu_mul, softcap: CUDA's tanhf may be two ulp from glibc's.
constexpr float kTanhTol = 1e-5f;
// rope: CUDA's sincosf may be two ulp from glibc's sinf/cosf.
constexpr float kRopeTol = 1e-5f;

constexpr DType kWeightDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

const char* dtype_str(DType d) {
  return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16";
}

// Byte equality of two host tensors (batch invariance, fill_uniform).
void expect_bits_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.nbytes(), want.nbytes()) << what;
  const auto* g = static_cast<const unsigned char*>(got.data());
  const auto* w = static_cast<const unsigned char*>(want.data());
  for (size_t i = 0; i < want.nbytes(); ++i) {
    if (g[i] != w[i]) {
      ADD_FAILURE() << what << ": first differing byte " << i << " (element "
                    << i / dtype_size(want.dtype()) << ")";
      return;
    }
  }
}

// ---- rms_norm ----

TEST(CudaElementwise, RmsNormMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  // Rows up to 1024 wide use a warp per row, wider rows a block per row (held
  // in registers up to 6,144 elements, looping over memory past that).
  const Shape shapes[] = {{3, 64},   {5, 2, 256}, {2, 7},    {4, 1536},
                          {3, 5376}, {1, 1024},   {2, 6144}, {2, 6145}};
  uint64_t seed = 100;
  for (const Shape& shape : shapes) {
    const int64_t d = shape.dim(-1);
    Twin x(DType::kF32, shape);
    x.randomize(seed++, -3.0f, 3.0f);
    for (DType wd : kWeightDtypes) {
      Twin w(wd, {d});
      w.randomize(seed++, 0.5f, 1.5f);
      Twin out(DType::kF32, shape);
      cpu_be().rms_norm(x.host, w.host, 1e-6f, out.host);
      gpu_be().rms_norm(x.dev, w.dev, 1e-6f, out.dev);
      expect_close(out.pull(), out.host, kNormTol,
                   (std::string("rms_norm ") + shape.str() + " " + dtype_str(wd)).c_str());
    }
    Twin out(DType::kF32, shape);
    cpu_be().rms_norm(x.host, Tensor(), 1e-6f, out.host);
    gpu_be().rms_norm(x.dev, Tensor(), 1e-6f, out.dev);
    expect_close(out.pull(), out.host, kNormTol,
                 (std::string("rms_norm weightless ") + shape.str()).c_str());
  }
}

// The fused post-norm residual update equals rms_norm, add and scale in
// sequence on the GPU bit for bit, and the CPU within the norm tolerance.
TEST(CudaElementwise, RmsNormAddEqualsTheUnfusedSequence) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 700;
  for (const Shape& shape : {Shape{3, 64}, Shape{2, 5376}, Shape{1, 1536}, Shape{2, 7001}}) {
    const int64_t d = shape.dim(-1);
    for (float post_scale : {1.0f, 0.71f}) {
      Twin x(DType::kF32, shape), residual(DType::kF32, shape);
      Twin w(DType::kBF16, {d});
      x.randomize(seed++, -3.0f, 3.0f);
      residual.randomize(seed++, -2.0f, 2.0f);
      w.randomize(seed++, 0.5f, 1.5f);
      // Unfused on the GPU, in copies of x and residual.
      Twin x2(DType::kF32, shape), r2(DType::kF32, shape);
      gpu_be().copy(x.dev, x2.dev);
      gpu_be().copy(residual.dev, r2.dev);
      gpu_be().rms_norm(x2.dev, w.dev, 1e-6f, x2.dev);
      gpu_be().add(r2.dev, x2.dev, r2.dev);
      if (post_scale != 1.0f) gpu_be().scale(r2.dev, post_scale, r2.dev);
      gpu_be().rms_norm_add(x.dev, w.dev, 1e-6f, residual.dev, post_scale);
      const std::string what = "rms_norm_add " + shape.str();
      expect_bits_equal(residual.pull(), r2.pull(), what);
      cpu_be().rms_norm_add(x.host, w.host, 1e-6f, residual.host, post_scale);
      expect_close(residual.pull(), residual.host, kNormTol, what.c_str());
    }
  }
  Twin a(DType::kF32, {2, 8});
  EXPECT_THROW(gpu_be().rms_norm_add(a.dev, Tensor(), 1e-6f, a.dev, 1.0f), Error);
}

TEST(CudaElementwise, RmsNormInPlace) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {256, 2816}) {
    Twin x(DType::kF32, {6, d});
    x.randomize(7, -2.0f, 2.0f);
    Twin w(DType::kBF16, {d});
    w.randomize(8, 0.0f, 2.0f);
    cpu_be().rms_norm(x.host, w.host, 1e-6f, x.host);
    gpu_be().rms_norm(x.dev, w.dev, 1e-6f, x.dev);
    expect_close(x.pull(), x.host, kNormTol, "rms_norm out == x");
  }
}

TEST(CudaElementwise, RmsNormRowIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {256, 2816}) {
    constexpr int64_t kRows = 37;
    Twin x(DType::kF32, {kRows, d});
    x.randomize(11, -4.0f, 4.0f);
    Twin w(DType::kF32, {d});
    w.randomize(12, 0.5f, 1.5f);
    Twin all(DType::kF32, {kRows, d});
    gpu_be().rms_norm(x.dev, w.dev, 1e-6f, all.dev);
    const HostTensor all_host = all.pull();
    Twin one(DType::kF32, {1, d});
    for (int64_t r : {int64_t{0}, int64_t{5}, kRows - 1}) {
      gpu_be().rms_norm(x.dev.slice_rows(r, r + 1), w.dev, 1e-6f, one.dev);
      expect_bits_equal(one.pull(), all_host.view().slice_rows(r, r + 1),
                        "rms_norm row " + std::to_string(r) + " of d " + std::to_string(d));
    }
  }
}

TEST(CudaElementwise, RmsNormRejectsBadShapes) {
  SKIP_WITHOUT_CUDA();
  Twin x(DType::kF32, {2, 8});
  Twin out(DType::kF32, {2, 8});
  Twin bad_w(DType::kF32, {7});
  EXPECT_THROW(gpu_be().rms_norm(x.dev, bad_w.dev, 1e-6f, out.dev), Error);
  Twin bad_out(DType::kF32, {2, 9});
  EXPECT_THROW(gpu_be().rms_norm(x.dev, Tensor(), 1e-6f, bad_out.dev), Error);
  // A host tensor handed to the GPU backend.
  EXPECT_THROW(gpu_be().rms_norm(x.host, Tensor(), 1e-6f, out.dev), Error);
  // Partial overlap of out and x (a shift by one row).
  Twin big(DType::kF32, {3, 8});
  EXPECT_THROW(
      gpu_be().rms_norm(big.dev.slice_rows(0, 2), Tensor(), 1e-6f, big.dev.slice_rows(1, 3)),
      Error);
}

// ---- rope ----

TEST(CudaElementwise, RopeMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t m, heads, d;
  };
  const Case cases[] = {{1, 8, 256}, {7, 2, 512}, {33, 4, 64}, {3, 1, 2}};
  uint64_t seed = 200;
  for (const Case& c : cases) {
    Twin x(DType::kF32, {c.m, c.heads, c.d});
    x.randomize(seed++, -2.0f, 2.0f);
    Twin pos(DType::kI32, {c.m});
    for (int64_t i = 0; i < c.m; ++i)
      pos.host.data<int32_t>()[i] = static_cast<int32_t>(i * 977 + 3);
    pos.host.data<int32_t>()[0] = 131071;  // a long-context position
    pos.push();
    const int64_t half = c.d / 2;
    Twin freq(DType::kF32, {half});
    for (int64_t j = 0; j < half; ++j) {
      // Default RoPE frequencies, with the upper quarter zeroed as partial rotary does.
      freq.host.data<float>()[j] =
          j >= half * 3 / 4 && half > 1
              ? 0.0f
              : static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(j) / c.d));
    }
    freq.push();
    cpu_be().rope(x.host, pos.host, freq.host);
    gpu_be().rope(x.dev, pos.dev, freq.dev);
    expect_close(x.pull(), x.host, kRopeTol, "rope");
  }
}

TEST(CudaElementwise, RopeRejectsBadShapes) {
  SKIP_WITHOUT_CUDA();
  Twin x(DType::kF32, {2, 3, 8});
  Twin pos(DType::kI32, {2});
  Twin freq(DType::kF32, {4});
  Twin bad_pos(DType::kI32, {3});
  Twin bad_freq(DType::kF32, {8});
  Twin odd(DType::kF32, {2, 3, 7});
  Twin pos_f32(DType::kF32, {2});
  EXPECT_THROW(gpu_be().rope(x.dev, bad_pos.dev, freq.dev), Error);
  EXPECT_THROW(gpu_be().rope(x.dev, pos.dev, bad_freq.dev), Error);
  EXPECT_THROW(gpu_be().rope(odd.dev, pos.dev, freq.dev), Error);
  EXPECT_THROW(gpu_be().rope(x.dev, pos_f32.dev, freq.dev), Error);
}

// ---- element-wise maps ----

TEST(CudaElementwise, ActivationsAndArithmeticMatchCpu) {
  SKIP_WITHOUT_CUDA();
  const Shape shapes[] = {{1}, {3, 5}, {7, 2816}, {1000003}};
  uint64_t seed = 300;
  for (const Shape& shape : shapes) {
    const std::string name = shape.str();
    Twin a(DType::kF32, shape), b(DType::kF32, shape), out(DType::kF32, shape);
    a.randomize(seed++, -8.0f, 8.0f);
    b.randomize(seed++, -3.0f, 3.0f);

    cpu_be().gelu(a.host, out.host);
    gpu_be().gelu(a.dev, out.dev);
    expect_close(out.pull(), out.host, kTanhTol, ("gelu " + name).c_str());

    cpu_be().gelu_mul(a.host, b.host, out.host);
    gpu_be().gelu_mul(a.dev, b.dev, out.dev);
    expect_close(out.pull(), out.host, kTanhTol, ("gelu_mul " + name).c_str());

    cpu_be().add(a.host, b.host, out.host);
    gpu_be().add(a.dev, b.dev, out.dev);
    expect_close(out.pull(), out.host, kExactTol, ("add " + name).c_str());

    cpu_be().mul(a.host, b.host, out.host);
    gpu_be().mul(a.dev, b.dev, out.dev);
    expect_close(out.pull(), out.host, kExactTol, ("mul " + name).c_str());

    cpu_be().scale(a.host, 0.0883883f, out.host);
    gpu_be().scale(a.dev, 0.0883883f, out.dev);
    expect_close(out.pull(), out.host, kExactTol, ("scale " + name).c_str());

    for (float cap : {30.0f, 2.5f}) {
      cpu_be().softcap(a.host, cap, out.host);
      gpu_be().softcap(a.dev, cap, out.dev);
      expect_close(out.pull(), out.host, kTanhTol, ("softcap " + name).c_str());
    }
  }
}

TEST(CudaElementwise, MapsMayWriteTheirInput) {
  SKIP_WITHOUT_CUDA();
  const Shape shape{4, 333};
  Twin a(DType::kF32, shape), b(DType::kF32, shape);
  auto reset = [&] {
    a.randomize(41, -5.0f, 5.0f);
    b.randomize(42, -5.0f, 5.0f);
  };
  reset();
  cpu_be().gelu_mul(a.host, b.host, a.host);
  gpu_be().gelu_mul(a.dev, b.dev, a.dev);
  expect_close(a.pull(), a.host, kTanhTol, "gelu_mul out == gate");
  reset();
  cpu_be().gelu_mul(a.host, b.host, b.host);
  gpu_be().gelu_mul(a.dev, b.dev, b.dev);
  expect_close(b.pull(), b.host, kTanhTol, "gelu_mul out == up");
  reset();
  cpu_be().add(a.host, b.host, b.host);
  gpu_be().add(a.dev, b.dev, b.dev);
  expect_close(b.pull(), b.host, kExactTol, "add out == b");
  reset();
  cpu_be().mul(a.host, a.host, a.host);
  gpu_be().mul(a.dev, a.dev, a.dev);
  expect_close(a.pull(), a.host, kExactTol, "mul out == a == b");
  reset();
  cpu_be().scale(a.host, -1.5f, a.host);
  gpu_be().scale(a.dev, -1.5f, a.dev);
  expect_close(a.pull(), a.host, kExactTol, "scale out == x");
  reset();
  cpu_be().softcap(a.host, 3.0f, a.host);
  gpu_be().softcap(a.dev, 3.0f, a.dev);
  expect_close(a.pull(), a.host, kTanhTol, "softcap out == x");
  reset();
  cpu_be().gelu(a.host, a.host);
  gpu_be().gelu(a.dev, a.dev);
  expect_close(a.pull(), a.host, kTanhTol, "gelu out == x");
}

TEST(CudaElementwise, MapsRejectBadArguments) {
  SKIP_WITHOUT_CUDA();
  Twin a(DType::kF32, {2, 3}), b(DType::kF32, {3, 2}), out(DType::kF32, {2, 3});
  EXPECT_THROW(gpu_be().add(a.dev, b.dev, out.dev), Error);
  EXPECT_THROW(gpu_be().mul(a.dev, b.dev, out.dev), Error);
  EXPECT_THROW(gpu_be().gelu_mul(a.dev, b.dev, out.dev), Error);
  Twin wide(DType::kF32, {2, 4});
  EXPECT_THROW(gpu_be().gelu(a.dev, wide.dev), Error);
  EXPECT_THROW(gpu_be().scale(a.dev, 2.0f, wide.dev), Error);
  EXPECT_THROW(gpu_be().softcap(a.dev, 0.0f, out.dev), Error);
  EXPECT_THROW(gpu_be().softcap(a.dev, std::numeric_limits<float>::infinity(), out.dev), Error);
  Twin half(DType::kBF16, {2, 3});
  EXPECT_THROW(gpu_be().add(a.dev, half.dev, out.dev), Error);
  // out overlapping an input by part of it.
  Twin big(DType::kF32, {3, 3});
  const Tensor lo = big.dev.slice_rows(0, 2).reshape({2, 3});
  const Tensor hi = big.dev.slice_rows(1, 3).reshape({2, 3});
  EXPECT_THROW(gpu_be().add(lo, a.dev, hi), Error);
}

// The per-op profile (the CLI's --cuda-profile): ops give the same results,
// steps cannot be recorded while it is on, and turning it off brings graphs
// back. (The test binary then prints the profile of these ops at exit.)
TEST(CudaElementwise, OpProfileKeepsResultsAndTurnsGraphsOff) {
  SKIP_WITHOUT_CUDA();
  Backend& be = gpu_be();
  ASSERT_TRUE(be.supports_graphs());
  Twin a(DType::kF32, {4, 333}), b(DType::kF32, {4, 333}), out(DType::kF32, {4, 333});
  a.randomize(51);
  b.randomize(52);
  be.set_op_profile(true);
  EXPECT_FALSE(be.supports_graphs());
  EXPECT_THROW(be.begin_capture(), Error);
  cpu_be().add(a.host, b.host, out.host);
  be.add(a.dev, b.dev, out.dev);
  cpu_be().gelu(out.host, out.host);
  be.gelu(out.dev, out.dev);
  be.set_op_profile(false);
  EXPECT_TRUE(be.supports_graphs());
  expect_close(out.pull(), out.host, kTanhTol, "add then gelu, profiled");
  EXPECT_THROW(cpu_be().set_op_profile(true), Error);
  EXPECT_NO_THROW(cpu_be().set_op_profile(false));
}

// ---- argmax_rows ----

TEST(CudaElementwise, ArgmaxMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const Shape shapes[] = {{1, 1}, {5, 33}, {3, 262144}, {72, 4096}};
  uint64_t seed = 400;
  for (const Shape& shape : shapes) {
    Twin x(DType::kF32, shape);
    x.randomize(seed++, -10.0f, 10.0f);
    Twin out(DType::kI32, {shape.dim(0)});
    cpu_be().argmax_rows(x.host, out.host);
    gpu_be().argmax_rows(x.dev, out.dev);
    expect_equal_i32(out.pull(), out.host, ("argmax " + shape.str()).c_str());
  }
}

TEST(CudaElementwise, ArgmaxTiesAndNan) {
  SKIP_WITHOUT_CUDA();
  constexpr int64_t kN = 1000;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Twin x(DType::kF32, {7, kN});
  float* h = x.host.data<float>();
  for (int64_t i = 0; i < 7 * kN; ++i) h[i] = static_cast<float>(i % 17) * 0.01f;
  h[0 * kN + 300] = 5.0f;  // row 0: ties at 300, 301 and 999 -> 300
  h[0 * kN + 301] = 5.0f;
  h[0 * kN + 999] = 5.0f;
  h[1 * kN + 700] = 9.0f;  // row 1: NaN at 500 and 800 beats the larger 9 -> 500
  h[1 * kN + 500] = nan;
  h[1 * kN + 800] = nan;
  h[2 * kN + 0] = nan;                                    // row 2: NaN first -> 0
  for (int64_t j = 0; j < kN; ++j) h[3 * kN + j] = -inf;  // row 3: all -inf -> 0
  for (int64_t j = 0; j < kN; ++j) h[4 * kN + j] = 1.0f;  // row 4: all equal -> 0
  h[5 * kN + 998] = inf;                                  // row 5: +inf -> 998
  for (int64_t j = 0; j < kN; ++j) h[6 * kN + j] = j == 640 ? 0.0f : -0.0f;  // +-0 tie -> 0
  x.push();
  Twin out(DType::kI32, {7});
  cpu_be().argmax_rows(x.host, out.host);
  gpu_be().argmax_rows(x.dev, out.dev);
  const HostTensor got = out.pull();
  expect_equal_i32(got, out.host, "argmax ties/NaN vs cpu");
  const int32_t want[] = {300, 500, 0, 0, 0, 998, 0};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(got.data<int32_t>()[i], want[i]) << "row " << i;
}

// Long rows are reduced in slices by separate blocks, then merged: ties and
// NaNs that sit in different slices keep the CPU's answer.
TEST(CudaElementwise, ArgmaxTiesAndNanAcrossSlices) {
  SKIP_WITHOUT_CUDA();
  constexpr int64_t kN = 86016;  // 21 slices of 4,096
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Twin x(DType::kF32, {4, kN});
  float* h = x.host.data<float>();
  for (int64_t i = 0; i < 4 * kN; ++i) h[i] = static_cast<float>(i % 29) * 0.01f;
  h[0 * kN + 70000] = 5.0f;  // row 0: ties in slices 17 and 1 -> 5000
  h[0 * kN + 5000] = 5.0f;
  h[1 * kN + 100] = 9.0f;  // row 1: NaNs in slices 19 and 2 beat the 9 -> 9000
  h[1 * kN + 80000] = nan;
  h[1 * kN + 9000] = nan;
  h[2 * kN + kN - 1] = 7.0f;                              // row 2: the last element
  for (int64_t j = 0; j < kN; ++j) h[3 * kN + j] = -inf;  // row 3: all -inf -> 0
  x.push();
  Twin out(DType::kI32, {4});
  cpu_be().argmax_rows(x.host, out.host);
  gpu_be().argmax_rows(x.dev, out.dev);
  const HostTensor got = out.pull();
  expect_equal_i32(got, out.host, "argmax across slices vs cpu");
  const int32_t want[] = {5000, 9000, static_cast<int32_t>(kN - 1), 0};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got.data<int32_t>()[i], want[i]) << "row " << i;
}

TEST(CudaElementwise, ArgmaxRejectsBadShapes) {
  SKIP_WITHOUT_CUDA();
  Twin x(DType::kF32, {3, 5});
  Twin bad_out(DType::kI32, {4});
  Twin f32_out(DType::kF32, {3});
  Twin empty_rows(DType::kF32, {3, 0});
  Twin out(DType::kI32, {3});
  Twin flat(DType::kF32, {15});
  EXPECT_THROW(gpu_be().argmax_rows(x.dev, bad_out.dev), Error);
  EXPECT_THROW(gpu_be().argmax_rows(x.dev, f32_out.dev), Error);
  EXPECT_THROW(gpu_be().argmax_rows(empty_rows.dev, out.dev), Error);
  EXPECT_THROW(gpu_be().argmax_rows(flat.dev, out.dev), Error);
}

// ---- softmax_rows ----

TEST(CudaElementwise, SoftmaxMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const Shape shapes[] = {{1, 1}, {4, 9}, {2, 3, 128}, {2, 262144}};
  uint64_t seed = 500;
  for (const Shape& shape : shapes) {
    Twin x(DType::kF32, shape);
    x.randomize(seed++, -20.0f, 20.0f);
    Twin out(DType::kF32, shape);
    cpu_be().softmax_rows(x.host, out.host);
    gpu_be().softmax_rows(x.dev, out.dev);
    expect_close(out.pull(), out.host, kSoftmaxTol, ("softmax " + shape.str()).c_str());
    // In place.
    cpu_be().softmax_rows(x.host, x.host);
    gpu_be().softmax_rows(x.dev, x.dev);
    expect_close(x.pull(), x.host, kSoftmaxTol, ("softmax in place " + shape.str()).c_str());
  }
}

TEST(CudaElementwise, SoftmaxMaskedRows) {
  SKIP_WITHOUT_CUDA();
  constexpr int64_t kN = 300;
  const float inf = std::numeric_limits<float>::infinity();
  Twin x(DType::kF32, {3, kN});
  x.randomize(55, -3.0f, 3.0f);
  float* h = x.host.data<float>();
  for (int64_t j = 0; j < kN; ++j) h[j] = -inf;  // row 0: all -inf -> zeros
  for (int64_t j = 0; j < kN; ++j) {
    if (j % 3 != 0) h[kN + j] = -inf;  // row 1: partly masked
  }
  x.push();
  Twin out(DType::kF32, {3, kN});
  out.randomize(56);  // stale values the op must overwrite
  cpu_be().softmax_rows(x.host, out.host);
  gpu_be().softmax_rows(x.dev, out.dev);
  const HostTensor got = out.pull();
  expect_close(got, out.host, kSoftmaxTol, "softmax masked rows");
  for (int64_t j = 0; j < kN; ++j) {
    ASSERT_EQ(got.data<float>()[j], 0.0f) << "all -inf row, column " << j;
    if (j % 3 != 0) {
      ASSERT_EQ(got.data<float>()[kN + j], 0.0f) << "masked column " << j;
    }
  }
}

// ---- transpose01 ----

TEST(CudaElementwise, Transpose01MatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const Shape shapes[] = {{1, 1, 1}, {3, 5, 7}, {16, 8, 256}, {2, 300, 1}};
  uint64_t seed = 600;
  for (const Shape& shape : shapes) {
    Twin x(DType::kF32, shape);
    x.randomize(seed++);
    Twin out(DType::kF32, {shape.dim(1), shape.dim(0), shape.dim(2)});
    cpu_be().transpose01(x.host, out.host);
    gpu_be().transpose01(x.dev, out.dev);
    expect_bits_equal(out.pull(), out.host, "transpose01 " + shape.str());
  }
  Twin x(DType::kF32, {2, 3, 4});
  Twin same(DType::kF32, {2, 3, 4});
  EXPECT_THROW(gpu_be().transpose01(x.dev, same.dev), Error);
  EXPECT_THROW(gpu_be().transpose01(x.dev, x.dev.reshape({3, 2, 4})), Error);  // aliasing
}

// ---- top_k_rows and fill_scatter_rows ----

TEST(CudaElementwise, TopKRowsMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    int64_t rows, n, k;
  };
  uint64_t seed = 800;
  for (const Case c : {Case{1, 1, 1}, Case{3, 7, 7}, Case{4, 2048, 32}, Case{2, 5000, 3}}) {
    Twin x(DType::kF32, {c.rows, c.n});
    x.randomize(seed++);
    // Ties, signed zeros, infinities and NaN in the first row.
    float* h = x.host.data<float>();
    if (c.n >= 7) {
      h[0] = 0.5f;
      h[1] = 0.5f;
      h[2] = -0.0f;
      h[3] = 0.0f;
      h[4] = nan;
      h[5] = std::numeric_limits<float>::infinity();
      h[6] = nan;
    }
    x.push();
    Twin out(DType::kI32, {c.rows, c.k});
    cpu_be().top_k_rows(x.host, out.host);
    gpu_be().top_k_rows(x.dev, out.dev);
    expect_equal_i32(out.pull(), out.host, "top_k_rows");
  }
  Twin x(DType::kF32, {2, 4});
  Twin too_many(DType::kI32, {2, 5});
  EXPECT_THROW(gpu_be().top_k_rows(x.dev, too_many.dev), Error);
}

TEST(CudaElementwise, FillScatterRowsMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 3, n = 4096, V = 262144;
  Twin values(DType::kF32, {rows, n});
  values.randomize(900, -3.0f, 3.0f);
  values.host.data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  values.push();
  Twin ids(DType::kI32, {rows, n});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j)  // distinct per row, spread over the width
      ids.host.data<int32_t>()[r * n + j] = static_cast<int32_t>((j * 64 + r * 7 + 13) % V);
  }
  ids.push();
  Twin out(DType::kF32, {rows, V});
  cpu_be().fill_scatter_rows(values.host, ids.host, out.host);
  gpu_be().fill_scatter_rows(values.dev, ids.dev, out.dev);
  expect_bits_equal(out.pull(), out.host, "fill_scatter_rows");
  Twin narrow(DType::kF32, {rows, n - 1});
  EXPECT_THROW(gpu_be().fill_scatter_rows(values.dev, ids.dev, narrow.dev), Error);
}

// ---- gather_rows and upload_async ----

TEST(CudaElementwise, GatherRowsMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    Shape src;
    std::vector<int32_t> idx;
    DType dtype;
  };
  const Case cases[] = {{{7}, {6, 0, 3, 3, 1}, DType::kI32},
                        {{5, 3}, {4, 4, 0}, DType::kF32},
                        {{9, 640}, {8, 1, 2, 0, 7}, DType::kF32},  // rows wider than a block
                        {{4, 2, 3}, {}, DType::kF32}};
  uint64_t seed = 700;
  for (const Case& c : cases) {
    Twin src(c.dtype, c.src);
    if (c.dtype == DType::kF32) {
      src.randomize(seed++);
    } else {
      for (int64_t i = 0; i < src.host.view().numel(); ++i)
        src.host.data<int32_t>()[i] = static_cast<int32_t>(1000 + i);
      src.push();
    }
    const int64_t n = static_cast<int64_t>(c.idx.size());
    Twin idx(DType::kI32, {n});
    std::copy(c.idx.begin(), c.idx.end(), idx.host.data<int32_t>());
    idx.push();
    std::vector<int64_t> out_dims(c.src.dims().begin(), c.src.dims().end());
    out_dims[0] = n;
    Twin out(c.dtype, Shape(std::span<const int64_t>(out_dims)));
    cpu_be().gather_rows(src.host, idx.host, out.host);
    gpu_be().gather_rows(src.dev, idx.dev, out.dev);
    expect_bits_equal(out.pull(), out.host, "gather_rows " + c.src.str());
  }
  Twin src(DType::kF32, {4, 3});
  Twin idx(DType::kI32, {2});
  Twin wrong_width(DType::kF32, {2, 4});
  Twin wrong_dtype(DType::kI32, {2, 3});
  EXPECT_THROW(gpu_be().gather_rows(src.dev, idx.dev, wrong_width.dev), Error);
  EXPECT_THROW(gpu_be().gather_rows(src.dev, idx.dev, wrong_dtype.dev), Error);
  EXPECT_THROW(gpu_be().gather_rows(src.dev, idx.dev, src.dev.slice_rows(0, 2)), Error);  // alias
  idx.host.data<int32_t>()[0] = 4;  // out of range: the CPU names it
  EXPECT_THROW(cpu_be().gather_rows(src.host, idx.host, wrong_dtype.host), Error);
}

// Queued uploads land in order behind earlier work even when the host reuses
// its buffer at once, and more of them than the staging slots still arrive.
TEST(CudaElementwise, QueuedUploadsArriveInOrder) {
  SKIP_WITHOUT_CUDA();
  constexpr int kUploads = 40;
  Twin sums(DType::kF32, {kUploads, 256});
  Twin step(DType::kF32, {256});
  std::vector<float> host(256);
  for (int u = 0; u < kUploads; ++u) {
    for (int i = 0; i < 256; ++i) host[static_cast<size_t>(i)] = static_cast<float>(u * 1000 + i);
    gpu_be().upload_async(host.data(), step.dev);
    std::fill(host.begin(), host.end(), -1.0f);  // reused at once
    gpu_be().copy(step.dev, sums.dev.row(u));
  }
  const HostTensor got = sums.pull();
  for (int u = 0; u < kUploads; ++u) {
    for (int i = 0; i < 256; ++i) {
      ASSERT_EQ(got.view().data_as<const float>()[u * 256 + i], static_cast<float>(u * 1000 + i))
          << "upload " << u << " element " << i;
    }
  }
  // Uploads larger than a staging slot grow it.
  Twin big(DType::kF32, {100000});
  std::vector<float> ramp(100000);
  for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = static_cast<float>(i);
  gpu_be().upload_async(ramp.data(), big.dev);
  const HostTensor back = big.pull();
  for (size_t i = 0; i < ramp.size(); i += 997)
    ASSERT_EQ(back.view().data_as<const float>()[i], ramp[i]);
}

// ---- fill_uniform ----

TEST(CudaElementwise, FillUniformIsBitIdenticalToCpu) {
  SKIP_WITHOUT_CUDA();
  struct Range {
    float lo, hi;
  };
  const Range ranges[] = {{-1.0f, 1.0f}, {-0.02f, 0.02f}, {0.1f, 0.3f}, {-70000.0f, 70000.0f}};
  uint64_t seed = 0x5eed;
  for (DType dt : kWeightDtypes) {
    for (const Range& r : ranges) {
      Twin t(dt, {1000003});
      cpu_be().fill_uniform(t.host, seed, r.lo, r.hi);
      gpu_be().fill_uniform(t.dev, seed, r.lo, r.hi);
      expect_bits_equal(t.pull(), t.host,
                        std::string("fill_uniform ") + dtype_str(dt) + " [" + std::to_string(r.lo) +
                            ", " + std::to_string(r.hi) + ")");
      seed += 17;
    }
  }
  Twin ids(DType::kI32, {4});
  EXPECT_THROW(gpu_be().fill_uniform(ids.dev, 1, 0.0f, 1.0f), Error);
}

}  // namespace
}  // namespace specula::test
