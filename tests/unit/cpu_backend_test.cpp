// SPDX-License-Identifier: Apache-2.0
// The CPU backend against naive double-precision references written here from
// the op contracts (engine/ops/backend.h) and gemma4-architecture.md: the dot
// kernels, the registry, products (linear, linear_multi, linear_gelu_mul),
// embedding, MoE and copy, and the thread team. Attention and RoPE:
// cpu_backend_attention_test.cpp; norms, element-wise ops and row reductions:
// cpu_backend_elementwise_test.cpp. Tolerance: cpu_backend_test_util.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <thread>
#include <vector>

#include "engine/backend/cpu/cpu_internal.h"
#include "engine/backend/cpu/cpu_parallel.h"
#include "tests/unit/cpu_backend_test_util.h"

namespace specula {
namespace {

using namespace testing;  // the helpers of cpu_backend_test_util.h and op_test_util.h

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
  // moe_experts over x, w and gate_up with the given ids, down and out.
  const auto moe = [&](const Tensor& ids, const Tensor& down_w, const Tensor& out_t) {
    be_.moe_experts({.x = x,
                     .expert_ids = ids,
                     .expert_weights = w,
                     .gate_up = gate_up,
                     .down = down_w,
                     .out = out_t});
  };
  HostTensor bad_ids = make_i32({2, 2}, {0, 1, 2, 3});
  expect_error([&] { moe(bad_ids, down, out); }, {"moe_experts", "expert id 3", "[0, 3)"});
  HostTensor ids = make_i32({2, 2}, {0, 1, 2, 0});
  HostTensor down_bad = random({3, 4, 2});
  expect_error([&] { moe(ids, down_bad, out); }, {"moe_experts", "f32[3, 4, 2]", "f32[3, 6, 4]"});
  expect_error([&] { moe(ids, down, x); }, {"moe_experts", "overlaps"});
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
