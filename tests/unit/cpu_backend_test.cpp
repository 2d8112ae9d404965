// SPDX-License-Identifier: Apache-2.0
// The CPU backend against naive double-precision references written here from
// the op contracts (engine/ops/backend.h) and gemma4-architecture.md.
//
// Tolerance: an f32 result passes when |got - ref| <= 1e-5 · (|ref| + rms(ref)),
// i.e. 1e-5 relative, with the tensor's RMS as the floor so elements that cancel
// to near zero are judged on the tensor's scale. Inputs in bf16/f16 are decoded
// exactly, so they share the f32 tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <numbers>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/backend/cpu/cpu_internal.h"
#include "engine/backend/cpu/cpu_parallel.h"
#include "engine/core/buffer.h"

namespace specula {
namespace {

constexpr double kRtol = 1e-5;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Exact decode of any float tensor (f32/bf16/f16) to double.
std::vector<double> to_double(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::kF32:
        v[i] = t.data_as<const float>()[i];
        break;
      case DType::kBF16:
        v[i] = bf16_to_f32(t.data_as<const uint16_t>()[i]);
        break;
      case DType::kF16:
        v[i] = f16_to_f32(t.data_as<const uint16_t>()[i]);
        break;
      default:
        ADD_FAILURE() << "to_double: not a float tensor " << t.describe();
    }
  }
  return v;
}

HostTensor make_float(DType dtype, Shape shape, const std::vector<float>& values) {
  HostTensor t(dtype, shape);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case DType::kF32:
        t.data<float>()[i] = values[i];
        break;
      case DType::kBF16:
        t.data<uint16_t>()[i] = f32_to_bf16(values[i]);
        break;
      case DType::kF16:
        t.data<uint16_t>()[i] = f32_to_f16(values[i]);
        break;
      default:
        ADD_FAILURE() << "make_float: not a float dtype";
    }
  }
  return t;
}

HostTensor make_i32(Shape shape, const std::vector<int32_t>& values) {
  HostTensor t(DType::kI32, shape);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  std::copy(values.begin(), values.end(), t.data<int32_t>());
  return t;
}

// Asserts the tolerance stated at the top of the file; reports the worst element.
void expect_close(const Tensor& got, const std::vector<double>& ref, const std::string& what,
                  double rtol = kRtol) {
  ASSERT_EQ(got.dtype(), DType::kF32) << what;
  ASSERT_EQ(static_cast<size_t>(got.numel()), ref.size()) << what;
  double sq = 0.0;
  for (double r : ref) sq += r * r;
  const double rms = ref.empty() ? 0.0 : std::sqrt(sq / static_cast<double>(ref.size()));
  const float* g = got.data_as<const float>();
  int64_t bad = 0;
  int64_t worst = -1;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::abs(static_cast<double>(g[i]) - ref[i]);
    const double allowed = rtol * (std::abs(ref[i]) + rms);
    const double ratio = allowed > 0 ? err / allowed : (err > 0 ? kInf : 0.0);
    if (!(err <= allowed)) ++bad;  // also catches NaN
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size()
                    << " elements out of tolerance; worst at " << worst << ": got "
                    << (worst >= 0 ? g[worst] : 0.0f) << ", want "
                    << (worst >= 0 ? ref[worst] : 0.0);
}

void expect_bitwise_equal(const float* a, const float* b, int64_t n, const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(a[i], b[i]) << what << " differs at element " << i;
  }
}

// Runs `f`, expects an Error whose message contains every string in `parts`.
template <typename F>
void expect_error(F f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an Error mentioning " << parts.front();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

double gelu_ref(double x) {
  return 0.5 * x *
         (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

class CpuBackendTest : public ::testing::Test {
 protected:
  std::vector<float> random_values(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng_);
    return v;
  }
  HostTensor random(DType dtype, Shape shape, float lo = -1.0f, float hi = 1.0f) {
    return make_float(dtype, shape, random_values(shape.numel(), lo, hi));
  }
  HostTensor random(Shape shape, float lo = -1.0f, float hi = 1.0f) {
    return random(DType::kF32, shape, lo, hi);
  }

  std::unique_ptr<Backend> backend_owner_ = make_cpu_backend();
  Backend& be_ = *backend_owner_;
  std::mt19937 rng_{20240611};
};

// ---- Kernels and registry ----

TEST(CpuKernels, F16DecodeMatchesCoreOnEveryInput) {
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), uint16_t{0});
  std::vector<float> bulk(all.size());
  cpu::to_f32(all.data(), DType::kF16, bulk.data(), static_cast<int64_t>(all.size()));
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = f16_to_f32(static_cast<uint16_t>(h));
    const float got = cpu::f16_bits_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got) && std::isnan(bulk[h])) << h;
    } else {
      ASSERT_EQ(got, want) << h;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << h;
      ASSERT_EQ(bulk[h], want) << h;
    }
  }
}

TEST(CpuKernels, DotIsIndependentOfChunking) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> a(1037), b(1037);
  for (size_t i = 0; i < a.size(); ++i) a[i] = dist(rng), b[i] = dist(rng);
  float lanes[cpu::kLanes] = {};
  cpu::dot_accumulate(a.data(), b.data(), 512, lanes);
  cpu::dot_accumulate(a.data() + 512, b.data() + 512, 525, lanes);
  EXPECT_EQ(cpu::reduce_lanes(lanes), cpu::dot(a.data(), b.data(), 1037));
  double ref = 0;
  for (size_t i = 0; i < a.size(); ++i) ref += double(a[i]) * b[i];
  EXPECT_NEAR(cpu::dot(a.data(), b.data(), 1037), ref, 1e-5);
}

// The lane tree as it is defined (cpu_internal.h), written out in scalars.
float reduce_lanes_by_definition(const float* lanes) {
  float t[cpu::kLanes];
  for (int l = 0; l < cpu::kLanes; ++l) t[l] = lanes[l];
  for (int width = cpu::kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) t[l] += t[l + width];
  }
  return t[0];
}

TEST(CpuKernels, ReduceLanesAddsInTheDefinedTree) {
  std::mt19937 rng(11);
  // Magnitudes far apart, so that any other order of additions rounds differently.
  std::uniform_real_distribution<float> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-20, 20);
  for (int trial = 0; trial < 1000; ++trial) {
    float lanes[cpu::kLanes];
    for (float& l : lanes) l = std::ldexp(mantissa(rng), exponent(rng));
    const float want = reduce_lanes_by_definition(lanes);
    const float got = cpu::reduce_lanes(lanes);
    ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0) << trial << ": " << got << " vs " << want;
  }
}

TEST(CpuKernels, DotRowsReduceEqualsWideningDotAndReduce) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-12, 12);
  const auto value = [&] { return std::ldexp(mantissa(rng), exponent(rng)); };
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t k : {1, 5, 31, 32, 33, 64, 100, 256, 1037}) {
      for (int64_t m_rows = 1; m_rows <= 7; ++m_rows) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " k " << k << " rows " << m_rows);
        std::vector<float> wf(static_cast<size_t>(k));
        std::vector<uint16_t> wb(static_cast<size_t>(k));
        for (int64_t i = 0; i < k; ++i) {
          wb[i] = f32_to_bf16(value());
          wf[i] = dtype == DType::kBF16 ? bf16_to_f32(wb[i]) : value();
        }
        const int64_t ldx = k + 3;  // rows apart by more than k
        std::vector<float> x(static_cast<size_t>(m_rows * ldx));
        for (float& v : x) v = value();
        const int64_t ldy = 5;
        std::vector<float> y(static_cast<size_t>(m_rows * ldy), -1.0f);
        const void* w = dtype == DType::kBF16 ? static_cast<const void*>(wb.data()) : wf.data();
        cpu::dot_rows_reduce(w, dtype, x.data(), ldx, m_rows, k, y.data(), ldy);
        for (int64_t m = 0; m < m_rows; ++m) {
          float lanes[cpu::kLanes] = {};
          cpu::dot_accumulate(x.data() + m * ldx, wf.data(), k, lanes);
          const float want = reduce_lanes_by_definition(lanes);
          ASSERT_EQ(std::memcmp(&y[m * ldy], &want, sizeof want), 0)
              << "row " << m << ": " << y[m * ldy] << " vs " << want;
        }
        // cpu::dot (the attention scores) is the one-row case.
        float lanes[cpu::kLanes] = {};
        cpu::dot_accumulate(x.data(), wf.data(), k, lanes);
        const float want = reduce_lanes_by_definition(lanes);
        const float got = cpu::dot(x.data(), wf.data(), k);
        ASSERT_EQ(std::memcmp(&got, &want, sizeof want), 0) << got << " vs " << want;
      }
    }
  }
}

TEST(CpuBackendRegistry, BackendForCpuIsTheCpuBackend) {
  Backend& b = backend_for(Device::cpu());
  EXPECT_STREQ(b.name(), "cpu");
  EXPECT_EQ(b.device(), Device::cpu());
  EXPECT_EQ(&b, &backend_for(Device::cpu()));
}

// ---- linear ----

std::vector<double> linear_ref(const Tensor& x, const Tensor& w) {
  const int64_t m = x.dim(0), k = x.dim(1), n = w.dim(0);
  const auto xd = to_double(x), wd = to_double(w);
  std::vector<double> y(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t c = 0; c < k; ++c) s += xd[i * k + c] * wd[j * k + c];
      y[i * n + j] = s;
    }
  return y;
}

TEST_F(CpuBackendTest, LinearMatchesReferenceForEveryWeightDtypeAndShape) {
  struct Case {
    int64_t m, k, n;
  };
  // M <= 8 takes the GEMV kernel (K = 1030 spans several of its chunks); M > 8
  // sgemm on blocks of weight rows (N = 300 gives 16 blocks and a ragged last
  // one) and on at most 512 rows of x per call (M = 520 needs two).
  const Case cases[] = {{1, 37, 5},   {1, 64, 300}, {3, 37, 11},    {8, 128, 33},  {1, 1030, 9},
                        {8, 1030, 9}, {9, 37, 17},  {20, 100, 300}, {33, 513, 70}, {520, 9, 40}};
  for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Case& c : cases) {
      HostTensor x = random({c.m, c.k});
      HostTensor w = random(wt, {c.n, c.k});
      HostTensor y(DType::kF32, {c.m, c.n});
      be_.linear(x, w, y);
      expect_close(y, linear_ref(x, w),
                   fmt::format("linear {} M={} K={} N={}", dtype_name(wt), c.m, c.k, c.n));
    }
  }
}

TEST_F(CpuBackendTest, LinearRowsDoNotDependOnHowManyRowsShareTheCall) {
  // Decode (M = 1) and speculative verification (M = k + 1 <= 8) must agree bit
  // for bit, or greedy output would change with speculation.
  for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
    HostTensor x = random({8, 300});
    HostTensor w = random(wt, {45, 300});
    HostTensor y(DType::kF32, {8, 45});
    be_.linear(x, w, y);
    for (int64_t m = 0; m < 8; ++m) {
      HostTensor y1(DType::kF32, {1, 45});
      be_.linear(x.view().slice_rows(m, m + 1), w, y1);
      expect_bitwise_equal(y1.data<float>(), y.data<float>() + m * 45, 45,
                           fmt::format("linear {} row {}", dtype_name(wt), m));
    }
  }
}

TEST_F(CpuBackendTest, ResultsDoNotDependOnTheThreadCount) {
  HostTensor x = random({20, 300});
  HostTensor w = random(DType::kBF16, {70, 300});
  HostTensor q = random({6, 4, 16}), k = random({9, 2, 16}), v = random({9, 2, 16});
  HostTensor pos = make_i32({6}, {3, 4, 5, 6, 7, 8});
  auto run = [&](int threads) {
    const int saved = cpu_threads();
    set_cpu_threads(threads);
    std::vector<HostTensor> outs;
    outs.emplace_back(DType::kF32, Shape{20, 70});  // sgemm path
    outs.emplace_back(DType::kF32, Shape{5, 70});   // GEMV path
    outs.emplace_back(DType::kF32, Shape{6, 4, 16});
    be_.linear(x, w, outs[0]);
    be_.linear(x.view().slice_rows(0, 5), w, outs[1]);
    be_.attention({.q = q, .k = k, .v = v, .out = outs[2], .q_positions = pos, .window = 4});
    set_cpu_threads(saved);
    return outs;
  };
  const auto one = run(1);
  const auto many = run(4);
  for (size_t i = 0; i < one.size(); ++i) {
    expect_bitwise_equal(one[i].data<float>(), many[i].data<float>(), one[i].numel(),
                         fmt::format("output {}", i));
  }
}

TEST_F(CpuBackendTest, LinearHandlesEmptyDimensions) {
  HostTensor x0(DType::kF32, {0, 4}), w(DType::kBF16, {3, 4}), y0(DType::kF32, {0, 3});
  be_.linear(x0, w, y0);
  HostTensor x(DType::kF32, {2, 0}), wk(DType::kF32, {3, 0});
  HostTensor y = make_float(DType::kF32, {2, 3}, std::vector<float>(6, 7.0f));
  be_.linear(x, wk, y);
  for (float v : y.f32()) EXPECT_EQ(v, 0.0f);
}

TEST_F(CpuBackendTest, LinearRejectsBadArgumentsNamingOpAndShapes) {
  HostTensor x = random({2, 37}), w = random({5, 36}), y(DType::kF32, {2, 5});
  expect_error([&] { be_.linear(x, w, y); }, {"linear", "f32[2, 37]", "f32[5, 36]"});
  HostTensor w2 = random({5, 37}), y_bad(DType::kF32, {2, 4});
  expect_error([&] { be_.linear(x, w2, y_bad); },
               {"linear", "f32[2, 4]", "f32[2, 37]", "f32[5, 37]"});
  HostTensor x_bf16(DType::kBF16, {2, 37});
  expect_error([&] { be_.linear(x_bf16, w2, y); }, {"linear", "x", "bf16[2, 37]"});
  HostTensor w_i32(DType::kI32, {5, 37});
  expect_error([&] { be_.linear(x, w_i32, y); }, {"linear", "w", "i32[5, 37]"});
  // y aliasing x.
  HostTensor sq = random({4, 4}), wsq = random({4, 4});
  expect_error([&] { be_.linear(sq, wsq, sq); }, {"linear", "overlaps"});
  // A tensor claiming to live on a GPU.
  Tensor on_gpu(x.view().data(), DType::kF32, {2, 37}, Device::cuda(0));
  expect_error([&] { be_.linear(on_gpu, w2, y); }, {"linear", "cuda:0"});
}

TEST_F(CpuBackendTest, LinearIsSafeFromSeveralThreads) {
  // Two threads share the backend's scratch pool (bf16, M > 8 converts blocks).
  HostTensor x = random({12, 64});
  HostTensor w = random(DType::kBF16, {270, 64});
  const auto ref = linear_ref(x, w);
  std::vector<HostTensor> ys;
  for (int t = 0; t < 2; ++t) ys.emplace_back(DType::kF32, Shape{12, 270});
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 10; ++rep) be_.linear(x, w, ys[t]);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 2; ++t) expect_close(ys[t], ref, fmt::format("thread {}", t));
}

// ---- embedding ----

TEST_F(CpuBackendTest, EmbeddingGathersRowsAndScales) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    HostTensor table = random(dt, {11, 7});
    HostTensor ids = make_i32({4}, {3, 0, 10, 3});
    HostTensor out(DType::kF32, {4, 7});
    be_.embedding(table, ids, 2.5f, out);
    const auto t = to_double(table);
    std::vector<double> ref;
    for (int32_t id : {3, 0, 10, 3})
      for (int c = 0; c < 7; ++c) ref.push_back(t[id * 7 + c] * 2.5);
    expect_close(out, ref, fmt::format("embedding {}", dtype_name(dt)));
  }
}

TEST_F(CpuBackendTest, EmbeddingRejectsOutOfRangeIdsNamingIdAndVocab) {
  HostTensor table = random({11, 7});
  HostTensor out(DType::kF32, {2, 7});
  HostTensor high = make_i32({2}, {1, 11});
  expect_error([&] { be_.embedding(table, high, 1.0f, out); }, {"embedding", "11", "[0, 11)"});
  HostTensor low = make_i32({2}, {-1, 1});
  expect_error([&] { be_.embedding(table, low, 1.0f, out); }, {"embedding", "-1", "[0, 11)"});
  for (float v : out.f32()) EXPECT_EQ(v, 0.0f) << "out must be untouched";
  HostTensor out_bad(DType::kF32, {2, 6});
  HostTensor ok = make_i32({2}, {1, 2});
  expect_error([&] { be_.embedding(table, ok, 1.0f, out_bad); },
               {"embedding", "f32[2, 6]", "[11, 7]"});
}

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

// ---- rope ----

std::vector<double> rope_ref(const Tensor& x, const std::vector<int32_t>& pos,
                             const std::vector<float>& freq) {
  const auto xd = to_double(x);
  const int64_t m = x.dim(0), heads = x.dim(1), d = x.dim(2), half = d / 2;
  std::vector<double> out(xd.size());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < half; ++j) {
        // The angle is formed in f32 (as HF does); cos/sin of it in double.
        const double angle = static_cast<float>(pos[r]) * freq[j];
        const size_t base = static_cast<size_t>((r * heads + h) * d);
        const double x1 = xd[base + j], x2 = xd[base + j + half];
        out[base + j] = x1 * std::cos(angle) - x2 * std::sin(angle);
        out[base + j + half] = x2 * std::cos(angle) + x1 * std::sin(angle);
      }
  return out;
}

TEST_F(CpuBackendTest, RopeRotatesHalvesAndLeavesZeroFrequencyPairsAlone) {
  // Proportional-RoPE style table: the upper frequencies are zero (identity pairs).
  const std::vector<float> freq = {1.0f, 0.1f, 0.0f, 0.0f};
  const std::vector<int32_t> pos = {5, 0, 1234};
  HostTensor x = random({3, 2, 8});
  HostTensor before =
      make_float(DType::kF32, {3, 2, 8}, std::vector<float>(x.f32().begin(), x.f32().end()));
  const auto ref = rope_ref(x, pos, freq);
  HostTensor positions = make_i32({3}, pos);
  HostTensor inv_freq = make_float(DType::kF32, {4}, freq);
  be_.rope(x, positions, inv_freq);
  expect_close(x, ref, "rope");
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t j : {2, 3, 6, 7}) {
        const int64_t i = (r * 2 + h) * 8 + j;
        EXPECT_EQ(x.f32()[i], before.f32()[i]) << "identity pair moved at " << i;
      }
}

TEST_F(CpuBackendTest, RopeMatchesReferenceWithDefaultFrequencies) {
  const int64_t d = 64;
  std::vector<float> freq(d / 2);
  for (int64_t j = 0; j < d / 2; ++j) freq[j] = static_cast<float>(std::pow(10000.0, -2.0 * j / d));
  const std::vector<int32_t> pos = {100, 101, 102, 4097, 7};
  HostTensor x = random({5, 3, d});
  const auto ref = rope_ref(x, pos, freq);
  be_.rope(x, make_i32({5}, pos), make_float(DType::kF32, {d / 2}, freq));
  expect_close(x, ref, "rope default");
}

TEST_F(CpuBackendTest, RopeRejectsBadShapes) {
  HostTensor x = random({2, 1, 6});
  HostTensor pos = make_i32({2}, {0, 1});
  HostTensor freq = random({2});
  expect_error([&] { be_.rope(x, pos, freq); }, {"rope", "f32[2]", "f32[2, 1, 6]"});
  HostTensor odd = random({2, 1, 5});
  expect_error([&] { be_.rope(odd, pos, freq); }, {"rope", "even", "f32[2, 1, 5]"});
  HostTensor pos3 = make_i32({3}, {0, 1, 2});
  HostTensor freq3 = random({3});
  expect_error([&] { be_.rope(x, pos3, freq3); }, {"rope", "i32[3]", "f32[2, 1, 6]"});
}

// ---- attention ----

// Applies the visibility rule of AttentionParams literally, key by key.
std::vector<double> attention_ref(const AttentionParams& p) {
  const auto q = to_double(p.q), k = to_double(p.k), v = to_double(p.v);
  const int64_t s = p.q.dim(0), nh = p.q.dim(1), d = p.q.dim(2), t = p.k.dim(0), nkv = p.k.dim(1);
  const auto pos = p.q_positions.i32();
  std::vector<double> out(static_cast<size_t>(s * nh * d), 0.0);
  for (int64_t i = 0; i < s; ++i)
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kvh = h / (nh / nkv);
      const int64_t qp = pos[i];
      std::vector<double> sc;
      std::vector<int64_t> keys;
      for (int64_t j = 0; j < t; ++j) {
        const int64_t kp = p.k_pos0 + j;
        if (!((!p.causal || kp <= qp) && (p.window == 0 || kp > qp - p.window))) continue;
        double dotv = 0;
        for (int64_t c = 0; c < d; ++c)
          dotv += q[(i * nh + h) * d + c] * k[(j * nkv + kvh) * d + c];
        sc.push_back(p.scale * dotv);
        keys.push_back(j);
      }
      if (keys.empty()) continue;
      const double mx = *std::max_element(sc.begin(), sc.end());
      double z = 0;
      for (double& e : sc) z += (e = std::exp(e - mx));
      for (size_t a = 0; a < keys.size(); ++a)
        for (int64_t c = 0; c < d; ++c)
          out[(i * nh + h) * d + c] += sc[a] / z * v[(keys[a] * nkv + kvh) * d + c];
    }
  return out;
}

TEST_F(CpuBackendTest, AttentionMatchesReferenceOverMasksWindowsAndGroups) {
  const int64_t s = 5, t = 12, nkv = 2, d = 16, k_pos0 = 3;
  for (bool causal : {true, false}) {
    for (int window : {0, 1, 4}) {
      for (int64_t group : {1, 2, 4}) {
        const int64_t nh = nkv * group;
        HostTensor q = random({s, nh, d}, -2.0f, 2.0f);
        HostTensor k = random({t, nkv, d}, -2.0f, 2.0f);
        HostTensor v = random({t, nkv, d});
        HostTensor out(DType::kF32, {s, nh, d});
        // Verification-style positions: the last S of the T cached keys
        // (absolute 10..14), plus one query earlier in the sequence.
        HostTensor pos = make_i32({s}, {10, 11, 12, 14, 6});
        AttentionParams p{.q = q,
                          .k = k,
                          .v = v,
                          .out = out,
                          .q_positions = pos,
                          .k_pos0 = k_pos0,
                          .causal = causal,
                          .window = window,
                          .scale = 1.0f};
        be_.attention(p);
        expect_close(out, attention_ref(p),
                     fmt::format("attention causal={} window={} group={}", causal, window, group));
      }
    }
  }
}

TEST_F(CpuBackendTest, AttentionAppliesScaleAndGivesZerosForQueriesThatSeeNothing) {
  HostTensor q = random({3, 4, 8}), k = random({6, 2, 8}), v = random({6, 2, 8});
  HostTensor out = make_float(DType::kF32, {3, 4, 8}, std::vector<float>(96, 9.0f));
  // Position 2 precedes every key (k_pos0 = 3): causally it sees nothing.
  HostTensor pos = make_i32({3}, {2, 5, 8});
  AttentionParams p{.q = q,
                    .k = k,
                    .v = v,
                    .out = out,
                    .q_positions = pos,
                    .k_pos0 = 3,
                    .causal = true,
                    .window = 0,
                    .scale = 0.125f};
  be_.attention(p);
  for (int64_t c = 0; c < 4 * 8; ++c) EXPECT_EQ(out.f32()[c], 0.0f) << c;
  expect_close(out, attention_ref(p), "attention scale 0.125");
  // Scores of several hundred overflow exp in f32 unless the max is subtracted.
  // Small-integer q, k and a power-of-two scale keep those scores exact, so the
  // comparison stays well conditioned.
  for (float* t : {q.data<float>(), k.data<float>()}) {
    const int64_t count = t == q.data<float>() ? q.numel() : k.numel();
    for (int64_t i = 0; i < count; ++i) t[i] = std::round(2.0f * t[i]);
  }
  p.scale = 16.0f;
  be_.attention(p);
  expect_close(out, attention_ref(p), "attention scale 16");
}

TEST_F(CpuBackendTest, AttentionRowsDoNotDependOnHowManyQueriesShareTheCall) {
  HostTensor q = random({4, 4, 32}), k = random({9, 2, 32}), v = random({9, 2, 32});
  HostTensor out(DType::kF32, {4, 4, 32});
  const std::vector<int32_t> positions = {5, 6, 7, 8};
  HostTensor pos = make_i32({4}, positions);
  be_.attention({.q = q, .k = k, .v = v, .out = out, .q_positions = pos, .window = 3});
  for (int64_t i = 0; i < 4; ++i) {
    HostTensor one(DType::kF32, {1, 4, 32});
    HostTensor p1 = make_i32({1}, {positions[i]});
    be_.attention({.q = q.view().slice_rows(i, i + 1),
                   .k = k,
                   .v = v,
                   .out = one,
                   .q_positions = p1,
                   .window = 3});
    expect_bitwise_equal(one.data<float>(), out.data<float>() + i * 128, 128,
                         fmt::format("query {}", i));
  }
}

TEST_F(CpuBackendTest, AttentionRejectsBadArguments) {
  HostTensor q = random({2, 3, 8}), k = random({4, 2, 8}), v = random({4, 2, 8});
  HostTensor out(DType::kF32, {2, 3, 8});
  HostTensor pos = make_i32({2}, {3, 4});
  expect_error([&] { be_.attention({.q = q, .k = k, .v = v, .out = out, .q_positions = pos}); },
               {"attention", "f32[2, 3, 8]", "f32[4, 2, 8]"});
  HostTensor q4 = random({2, 4, 8}), out4(DType::kF32, {2, 4, 8});
  HostTensor v_bad = random({4, 2, 7});
  expect_error(
      [&] { be_.attention({.q = q4, .k = k, .v = v_bad, .out = out4, .q_positions = pos}); },
      {"attention", "f32[4, 2, 8]", "f32[4, 2, 7]"});
  expect_error([&] { be_.attention({.q = q4, .k = k, .v = v, .out = q4, .q_positions = pos}); },
               {"attention", "overlaps"});
  expect_error(
      [&] {
        be_.attention({.q = q4, .k = k, .v = v, .out = out4, .q_positions = pos, .window = -1});
      },
      {"attention", "window"});
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

// ---- MoE ----

TEST_F(CpuBackendTest, MoeRouteTakesTopKRenormalisesAndScales) {
  const int64_t n = 3, e = 6, k = 2;
  std::vector<float> logits = random_values(n * e, -2.0f, 2.0f);
  // Row 1: experts 1 and 4 tie for the top; 1 must come first.
  for (int64_t j = 0; j < e; ++j) logits[e + j] = 0.1f * static_cast<float>(j % 3);
  logits[e + 1] = 1.0f;
  logits[e + 4] = 1.0f;
  HostTensor lt = make_float(DType::kF32, {n, e}, logits);
  HostTensor scale = random(DType::kBF16, {e}, 0.5f, 1.5f);
  HostTensor ids(DType::kI32, {n, k});
  HostTensor weights(DType::kF32, {n, k});
  be_.moe_route(
      {.logits = lt, .per_expert_scale = scale, .expert_ids = ids, .expert_weights = weights});

  const auto sd = to_double(scale);
  std::vector<double> ref_w;
  for (int64_t r = 0; r < n; ++r) {
    std::vector<double> pr(static_cast<size_t>(e));
    double mx = -1e300, z = 0;
    for (int64_t j = 0; j < e; ++j) mx = std::max(mx, double(logits[r * e + j]));
    for (int64_t j = 0; j < e; ++j) z += (pr[j] = std::exp(logits[r * e + j] - mx));
    std::vector<int64_t> order(static_cast<size_t>(e));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return pr[a] > pr[b]; });
    const double top = pr[order[0]] + pr[order[1]];
    for (int64_t t = 0; t < k; ++t) {
      EXPECT_EQ(ids.data<int32_t>()[r * k + t], order[t]) << "row " << r << " slot " << t;
      ref_w.push_back(pr[order[t]] / top * sd[order[t]]);
    }
  }
  EXPECT_EQ(ids.data<int32_t>()[2], 1);
  EXPECT_EQ(ids.data<int32_t>()[3], 4);
  expect_close(weights, ref_w, "moe_route weights");

  HostTensor ids7(DType::kI32, {n, 7}), w7(DType::kF32, {n, 7});
  expect_error(
      [&] {
        be_.moe_route(
            {.logits = lt, .per_expert_scale = scale, .expert_ids = ids7, .expert_weights = w7});
      },
      {"moe_route", "i32[3, 7]", "f32[3, 6]"});
}

std::vector<double> moe_experts_ref(const Tensor& x, const std::vector<int32_t>& ids,
                                    const Tensor& w, const Tensor& gate_up, const Tensor& down) {
  const int64_t n = x.dim(0), h = x.dim(1), k = w.dim(1), inter = down.dim(2);
  const auto xd = to_double(x), wd = to_double(w), gu = to_double(gate_up), dn = to_double(down);
  std::vector<double> out(static_cast<size_t>(n * h), 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = ids[r * k + s];
      std::vector<double> act(static_cast<size_t>(inter));
      for (int64_t c = 0; c < inter; ++c) {
        double g = 0, u = 0;
        for (int64_t j = 0; j < h; ++j) {
          g += gu[(e * 2 * inter + c) * h + j] * xd[r * h + j];
          u += gu[(e * 2 * inter + inter + c) * h + j] * xd[r * h + j];
        }
        act[c] = gelu_ref(g) * u;
      }
      for (int64_t j = 0; j < h; ++j) {
        double y = 0;
        for (int64_t c = 0; c < inter; ++c) y += dn[(e * h + j) * inter + c] * act[c];
        out[r * h + j] += wd[r * k + s] * y;
      }
    }
  return out;
}

TEST_F(CpuBackendTest, MoeExpertsMatchesReference) {
  const int64_t h = 12, inter = 7, e = 4, k = 2;
  for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
    // n = 5 keeps every expert on the GEMV path; n = 12 with 4 experts puts
    // more than 8 rows on some experts (sgemm path).
    for (int64_t n : {5, 12}) {
      std::vector<int32_t> id_values;
      for (int64_t r = 0; r < n; ++r) {
        const auto a = static_cast<int32_t>(r % e), b = static_cast<int32_t>((r * 3 + 1) % e);
        id_values.push_back(a);
        id_values.push_back(b == a ? (a + 1) % e : b);
      }
      HostTensor x = random({n, h});
      HostTensor ids = make_i32({n, k}, id_values);
      HostTensor w = random({n, k}, 0.0f, 1.0f);
      HostTensor gate_up = random(wt, {e, 2 * inter, h});
      HostTensor down = random(wt, {e, h, inter});
      HostTensor out(DType::kF32, {n, h});
      be_.moe_experts({.x = x,
                       .expert_ids = ids,
                       .expert_weights = w,
                       .gate_up = gate_up,
                       .down = down,
                       .out = out});
      expect_close(out, moe_experts_ref(x, id_values, w, gate_up, down),
                   fmt::format("moe_experts {} n={}", dtype_name(wt), n));
    }
  }
}

TEST_F(CpuBackendTest, MoeExpertsTokenResultsDoNotDependOnBatch) {
  const int64_t n = 4, h = 16, inter = 6, e = 3, k = 2;
  const std::vector<int32_t> id_values = {2, 0, 1, 2, 0, 1, 2, 1};
  HostTensor x = random({n, h}), ids = make_i32({n, k}, id_values), w = random({n, k});
  HostTensor gate_up = random(DType::kBF16, {e, 2 * inter, h}),
             down = random(DType::kBF16, {e, h, inter});
  HostTensor out(DType::kF32, {n, h});
  be_.moe_experts({.x = x,
                   .expert_ids = ids,
                   .expert_weights = w,
                   .gate_up = gate_up,
                   .down = down,
                   .out = out});
  for (int64_t r = 0; r < n; ++r) {
    HostTensor one(DType::kF32, {1, h});
    be_.moe_experts({.x = x.view().slice_rows(r, r + 1),
                     .expert_ids = ids.view().slice_rows(r, r + 1),
                     .expert_weights = w.view().slice_rows(r, r + 1),
                     .gate_up = gate_up,
                     .down = down,
                     .out = one});
    expect_bitwise_equal(one.data<float>(), out.data<float>() + r * h, h,
                         fmt::format("token {}", r));
  }
}

TEST_F(CpuBackendTest, MoeExpertsRejectsBadExpertIdsAndShapes) {
  HostTensor x = random({2, 4}), w = random({2, 2}), out(DType::kF32, {2, 4});
  HostTensor gate_up = random({3, 6, 4}), down = random({3, 4, 3});
  HostTensor bad_ids = make_i32({2, 2}, {0, 1, 2, 3});
  expect_error(
      [&] {
        be_.moe_experts({.x = x,
                         .expert_ids = bad_ids,
                         .expert_weights = w,
                         .gate_up = gate_up,
                         .down = down,
                         .out = out});
      },
      {"moe_experts", "expert id 3", "[0, 3)"});
  HostTensor ids = make_i32({2, 2}, {0, 1, 2, 0});
  HostTensor down_bad = random({3, 4, 2});
  expect_error(
      [&] {
        be_.moe_experts({.x = x,
                         .expert_ids = ids,
                         .expert_weights = w,
                         .gate_up = gate_up,
                         .down = down_bad,
                         .out = out});
      },
      {"moe_experts", "f32[3, 4, 2]", "f32[3, 6, 4]"});
  expect_error(
      [&] {
        be_.moe_experts({.x = x,
                         .expert_ids = ids,
                         .expert_weights = w,
                         .gate_up = gate_up,
                         .down = down,
                         .out = x});
      },
      {"moe_experts", "overlaps"});
}

// ---- copy ----

TEST_F(CpuBackendTest, CopyCopiesBytesAndChecksShapes) {
  HostTensor src = random(DType::kBF16, {3, 5}), dst(DType::kBF16, {3, 5});
  be_.copy(src, dst);
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(dst.data<uint16_t>()[i], src.data<uint16_t>()[i]);
  HostTensor wrong(DType::kBF16, {5, 3}), wrong_type(DType::kF32, {3, 5});
  expect_error([&] { be_.copy(src, wrong); }, {"copy", "bf16[3, 5]", "bf16[5, 3]"});
  expect_error([&] { be_.copy(src, wrong_type); }, {"copy", "bf16[3, 5]", "f32[3, 5]"});
}

// ---- fused forms (Backend defaults on the CPU) ----

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.view().nbytes() == b.view().nbytes() &&
         std::memcmp(a.view().data(), b.view().data(), a.view().nbytes()) == 0;
}

HostTensor clone(const HostTensor& t) {
  HostTensor c(t.dtype(), t.shape());
  std::memcpy(c.view().data(), t.view().data(), t.view().nbytes());
  return c;
}

TEST_F(CpuBackendTest, LinearMultiAndLinearGeluMulEqualTheirCompositions) {
  const HostTensor x = random({3, 40});
  const HostTensor wa = random(DType::kBF16, {24, 40});
  const HostTensor wb = random(DType::kBF16, {24, 40});
  const HostTensor wc = random(DType::kBF16, {8, 40});
  HostTensor ya(DType::kF32, {3, 24}), yb(DType::kF32, {3, 24}), yc(DType::kF32, {3, 8});
  const LinearOut outs[3] = {{wa, ya}, {wb, yb}, {wc, yc}};
  be_.linear_multi(x, outs);
  HostTensor want(DType::kF32, {3, 24});
  be_.linear(x, wa, want);
  EXPECT_TRUE(same_bits(ya, want));
  HostTensor want_c(DType::kF32, {3, 8});
  be_.linear(x, wc, want_c);
  EXPECT_TRUE(same_bits(yc, want_c));

  HostTensor gate(DType::kF32, {3, 24}), up(DType::kF32, {3, 24});
  be_.linear_gelu_mul(x, wa, wb, gate, up);
  HostTensor g2(DType::kF32, {3, 24}), u2(DType::kF32, {3, 24});
  be_.linear(x, wa, g2);
  be_.linear(x, wb, u2);
  be_.gelu_mul(g2, u2, g2);
  EXPECT_TRUE(same_bits(gate, g2));
}

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

// attention_inputs: norms and RoPE of q and k, v from the raw k (k_eq_v) or its
// own projection, and the store at positions mod R, exactly as the base ops.
TEST_F(CpuBackendTest, AttentionInputsEqualNormRopeAndStore) {
  const int64_t m = 3, nh = 4, kvh = 2, d = 8, ring = 5;
  HostTensor inv_freq(DType::kF32, {d / 2});
  for (int64_t j = 0; j < d / 2; ++j) inv_freq.data<float>()[j] = 1.0f / static_cast<float>(j + 1);
  HostTensor pos(DType::kI32, {m});
  for (int64_t i = 0; i < m; ++i) pos.data<int32_t>()[i] = static_cast<int32_t>(4 + i);  // wraps
  const HostTensor qn = random(DType::kBF16, {d}), kn = random(DType::kBF16, {d});
  for (bool v_from_k : {false, true}) {
    const HostTensor q = random({m, nh, d}), k = random({m, kvh, d}), v = random({m, kvh, d});
    HostTensor q1 = clone(q), k1 = clone(k), v1 = clone(v);
    HostTensor ck1(DType::kF32, {ring, kvh, d}), cv1(DType::kF32, {ring, kvh, d});
    AttentionInputsParams p{.q = q1,
                            .q_norm = qn,
                            .k = k1,
                            .k_norm = kn,
                            .v = v1,
                            .v_from_k = v_from_k,
                            .positions = pos,
                            .inv_freq = inv_freq,
                            .eps = 1e-6f,
                            .cache_k = ck1,
                            .cache_v = cv1};
    be_.attention_inputs(p);
    HostTensor q2 = clone(q), k2 = clone(k), v2 = clone(v);
    be_.rms_norm(q2, qn, 1e-6f, q2);
    be_.rope(q2, pos, inv_freq);
    if (v_from_k) be_.copy(k2, v2);
    be_.rms_norm(k2, kn, 1e-6f, k2);
    be_.rope(k2, pos, inv_freq);
    be_.rms_norm(v2, Tensor(), 1e-6f, v2);
    EXPECT_TRUE(same_bits(q1, q2));
    EXPECT_TRUE(same_bits(k1, k2));
    EXPECT_TRUE(same_bits(v1, v2));
    const int64_t row = kvh * d;
    for (int64_t i = 0; i < m; ++i) {
      const int64_t slot = (4 + i) % ring;
      EXPECT_EQ(std::memcmp(ck1.data<float>() + slot * row, k2.data<float>() + i * row,
                            static_cast<size_t>(row) * sizeof(float)),
                0);
      EXPECT_EQ(std::memcmp(cv1.data<float>() + slot * row, v2.data<float>() + i * row,
                            static_cast<size_t>(row) * sizeof(float)),
                0);
    }
  }
  // q only (a KV-shared layer), and bad arguments.
  HostTensor q = random({m, nh, d});
  AttentionInputsParams only_q{.q = q, .q_norm = qn, .positions = pos, .inv_freq = inv_freq};
  be_.attention_inputs(only_q);
  HostTensor bad_pos(DType::kI32, {m + 1});
  AttentionInputsParams bad{.q = q, .q_norm = qn, .positions = bad_pos, .inv_freq = inv_freq};
  EXPECT_THROW(be_.attention_inputs(bad), Error);
}

TEST_F(CpuBackendTest, StoreKvWritesRowsAtPositionsModRAndRejectsBadInput) {
  const HostTensor k = random({2, 1, 4}), v = random({2, 1, 4});
  HostTensor ck(DType::kF32, {3, 1, 4}), cv(DType::kF32, {3, 1, 4});
  HostTensor pos(DType::kI32, {2});
  pos.data<int32_t>()[0] = 7;  // row 1
  pos.data<int32_t>()[1] = 9;  // row 0
  be_.store_kv(k, v, pos, ck, cv);
  EXPECT_EQ(std::memcmp(ck.data<float>() + 4, k.data<float>(), 16), 0);
  EXPECT_EQ(std::memcmp(cv.data<float>(), v.data<float>() + 4, 16), 0);
  pos.data<int32_t>()[1] = -1;
  EXPECT_THROW(be_.store_kv(k, v, pos, ck, cv), Error);
  HostTensor small(DType::kF32, {1, 1, 4}), small_v(DType::kF32, {1, 1, 4});
  EXPECT_THROW(be_.store_kv(k, v, pos, small, small_v), Error);  // 2 rows into 1
  HostTensor wide(DType::kF32, {3, 1, 8}), wide_v(DType::kF32, {3, 1, 8});
  EXPECT_THROW(be_.store_kv(k, v, pos, wide, wide_v), Error);
  EXPECT_FALSE(be_.supports_graphs());
  EXPECT_THROW(be_.begin_capture(), Error);
  EXPECT_THROW(be_.set_op_profile(true), Error);  // the per-op profile is the CUDA backend's
  EXPECT_NO_THROW(be_.set_op_profile(false));
}

}  // namespace
// The CPU backend's thread team (engine/backend/cpu/cpu_parallel.h): every index
// runs exactly once, slots stay below the team size, and calls made from inside
// a chunk or from several threads at once (which run on their caller) finish.
TEST(CpuParallelTest, EveryIndexRunsOnceFromAnyCaller) {
  const int saved = cpu_threads();
  for (int threads : {1, 2, 3, 8}) {
    set_cpu_threads(threads);
    auto check = [&](int64_t n) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::atomic<int> bad_slot{0};
      std::atomic<int64_t> inner{0};
      cpu::parallel_for_each(n, true, [&](int64_t i, int slot) {
        hits[static_cast<size_t>(i)].fetch_add(1);
        if (slot < 0 || slot >= threads) bad_slot.fetch_add(1);
        if (i % 97 == 0) {
          cpu::parallel_for(5, true, [&](int64_t b, int64_t e, int) { inner.fetch_add(e - b); });
        }
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << i;
      EXPECT_EQ(bad_slot.load(), 0);
      EXPECT_EQ(inner.load(), 5 * ((n + 96) / 97));
    };
    std::vector<std::thread> callers;
    for (int t = 0; t < 3; ++t) {
      callers.emplace_back([&] {
        for (int64_t n : {1, 2, 7, 64, 1000, 100000}) check(n);
      });
    }
    for (std::thread& t : callers) t.join();
    for (int rep = 0; rep < 200; ++rep) check(rep + 1);
  }
  set_cpu_threads(saved);
  EXPECT_EQ(cpu_threads(), saved);
}

}  // namespace specula
