// SPDX-License-Identifier: Apache-2.0
// CUDA mixture-of-experts ops (cuda_moe.cu) against the CPU reference:
// moe_route (softmax, top-k with ties and NaN, renormalisation, per-expert
// scale) and moe_experts (decode and multi-pass prefill shapes, f32|bf16|f16
// weights, scalar and vector load paths), batch invariance and shape errors.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// moe_route: the same f32 softmax and renormalisation; exp may be one ulp apart.
constexpr float kRouteTol = 1e-6f;
// moe_experts: the dot products sum in another order than the CPU's 32-lane
// kernel (f32 accumulation over H and I elements).
constexpr float kExpertsTol = 2e-5f;
// The prefill path rounds x and the gated activation to bf16 (8 significant
// bits), as linear_prefill rounds x for cuBLASLt.
constexpr float kPrefillTol = 1e-2f;

constexpr DType kWeightDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

std::string dtype_str(DType d) {
  return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16";
}

// Routes random logits on both backends and checks they agree.
void check_route(int64_t n, int64_t n_experts, int64_t k, DType scale_dtype, uint64_t seed) {
  const std::string what = "moe_route n " + std::to_string(n) + " E " + std::to_string(n_experts) +
                           " k " + std::to_string(k) + " " + dtype_str(scale_dtype);
  Twin logits(DType::kF32, {n, n_experts});
  logits.randomize(seed, -4.0f, 4.0f);
  Twin scale(scale_dtype, {n_experts});
  scale.randomize(seed + 1, 0.5f, 2.0f);
  Twin ids(DType::kI32, {n, k});
  Twin weights(DType::kF32, {n, k});
  cpu_be().moe_route({.logits = logits.host,
                      .per_expert_scale = scale.host,
                      .expert_ids = ids.host,
                      .expert_weights = weights.host});
  gpu_be().moe_route({.logits = logits.dev,
                      .per_expert_scale = scale.dev,
                      .expert_ids = ids.dev,
                      .expert_weights = weights.dev});
  expect_equal_i32(ids.pull(), ids.host, what.c_str());
  expect_close(weights.pull(), weights.host, kRouteTol, what.c_str());
}

TEST(CudaMoe, RouteMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 1000;
  for (DType sd : kWeightDtypes) {
    check_route(1, 128, 8, sd, seed += 2);
    check_route(72, 128, 8, sd, seed += 2);
    check_route(5, 8, 2, sd, seed += 2);
    check_route(3, 40, 1, sd, seed += 2);
    check_route(4, 20, 20, sd, seed += 2);  // k == E: every expert, by probability
    check_route(9, 100, 6, sd, seed += 2);  // E not a multiple of 32
    // The most experts the GPU routes (128 a lane), more picks than lanes.
    check_route(5, 4096, 40, sd, seed += 2);
  }
}

TEST(CudaMoe, RouteTiesAndNan) {
  SKIP_WITHOUT_CUDA();
  constexpr int64_t kE = 64, kK = 4;
  Twin logits(DType::kF32, {3, kE});
  float* h = logits.host.data<float>();
  for (int64_t e = 0; e < kE; ++e) h[e] = 0.5f;  // token 0: all equal -> ids 0, 1, 2, 3
  for (int64_t e = 0; e < kE; ++e) h[kE + e] = -1.0f;
  h[kE + 50] = 2.0f;  // token 1: a tie at 50 and 9 (9 first), then 33 and 60 (33 first)
  h[kE + 9] = 2.0f;
  h[kE + 60] = 1.0f;
  h[kE + 33] = 1.0f;
  for (int64_t e = 0; e < kE; ++e) h[2 * kE + e] = static_cast<float>(e % 7);
  h[2 * kE + 12] = std::numeric_limits<float>::quiet_NaN();  // token 2: NaN probabilities
  logits.push();
  Twin scale(DType::kF32, {kE});
  scale.randomize(3, 0.5f, 2.0f);
  Twin ids(DType::kI32, {3, kK});
  Twin weights(DType::kF32, {3, kK});
  cpu_be().moe_route({.logits = logits.host,
                      .per_expert_scale = scale.host,
                      .expert_ids = ids.host,
                      .expert_weights = weights.host});
  gpu_be().moe_route({.logits = logits.dev,
                      .per_expert_scale = scale.dev,
                      .expert_ids = ids.dev,
                      .expert_weights = weights.dev});
  const HostTensor got = ids.pull();
  expect_equal_i32(got, ids.host, "moe_route ties/NaN vs cpu");
  const int32_t want[3][kK] = {{0, 1, 2, 3}, {9, 50, 33, 60}, {0, 1, 2, 3}};
  for (int t = 0; t < 3; ++t) {
    for (int j = 0; j < kK; ++j) EXPECT_EQ(got.data<int32_t>()[t * kK + j], want[t][j]);
  }
  // NaN weights compare as NaN on both sides; check the finite tokens only.
  const HostTensor got_w = weights.pull();
  for (int64_t i = 0; i < 2 * kK; ++i) {
    EXPECT_NEAR(got_w.data<float>()[i], weights.host.data<float>()[i],
                kRouteTol * std::fabs(weights.host.data<float>()[i]))
        << "weight " << i;
  }
  for (int64_t i = 2 * kK; i < 3 * kK; ++i) EXPECT_TRUE(std::isnan(got_w.data<float>()[i]));
}

TEST(CudaMoe, RouteRejectsBadShapes) {
  SKIP_WITHOUT_CUDA();
  Twin logits(DType::kF32, {2, 8});
  Twin scale(DType::kF32, {8});
  Twin ids(DType::kI32, {2, 3});
  Twin weights(DType::kF32, {2, 3});
  Twin bad_scale(DType::kF32, {7});
  Twin too_many(DType::kI32, {2, 9});
  Twin too_many_w(DType::kF32, {2, 9});
  Twin wrong_rows(DType::kI32, {3, 3});
  Twin bad_weights(DType::kF32, {2, 4});
  Twin f32_ids(DType::kF32, {2, 3});
  auto route = [](const Tensor& l, const Tensor& s, const Tensor& i, const Tensor& w) {
    gpu_be().moe_route({.logits = l, .per_expert_scale = s, .expert_ids = i, .expert_weights = w});
  };
  EXPECT_THROW(route(logits.dev, bad_scale.dev, ids.dev, weights.dev), Error);
  EXPECT_THROW(route(logits.dev, scale.dev, too_many.dev, too_many_w.dev), Error);
  EXPECT_THROW(route(logits.dev, scale.dev, wrong_rows.dev, weights.dev), Error);
  EXPECT_THROW(route(logits.dev, scale.dev, ids.dev, bad_weights.dev), Error);
  EXPECT_THROW(route(logits.dev, scale.dev, f32_ids.dev, weights.dev), Error);
  EXPECT_THROW(route(logits.host, scale.dev, ids.dev, weights.dev), Error);
  // More experts than a warp's shared probabilities hold: refused, not truncated.
  Twin wide_logits(DType::kF32, {2, 4097});
  Twin wide_scale(DType::kF32, {4097});
  EXPECT_THROW(route(wide_logits.dev, wide_scale.dev, ids.dev, weights.dev), Error);
}

// One moe_experts problem with its tensors on both sides; ids come from the
// CPU router so they are distinct and in range.
struct ExpertsCase {
  int64_t n, h, inter, n_experts, k;
  DType dtype;
  Twin x, ids, weights, gate_up, down, out;
  ExpertsCase(int64_t n_, int64_t h_, int64_t inter_, int64_t e_, int64_t k_, DType dt,
              uint64_t seed)
      : n(n_),
        h(h_),
        inter(inter_),
        n_experts(e_),
        k(k_),
        dtype(dt),
        x(DType::kF32, {n_, h_}),
        ids(DType::kI32, {n_, k_}),
        weights(DType::kF32, {n_, k_}),
        gate_up(dt, {e_, 2 * inter_, h_}),
        down(dt, {e_, h_, inter_}),
        out(DType::kF32, {n_, h_}) {
    x.randomize(seed, -2.0f, 2.0f);
    const float gu = 1.0f / std::sqrt(static_cast<float>(h_));
    const float dn = 1.0f / std::sqrt(static_cast<float>(inter_));
    gate_up.randomize(seed + 1, -gu, gu);
    down.randomize(seed + 2, -dn, dn);
    HostTensor logits(DType::kF32, {n_, e_});
    HostTensor scale(DType::kF32, {e_});
    cpu_be().fill_uniform(logits, seed + 3, -3.0f, 3.0f);
    cpu_be().fill_uniform(scale, seed + 4, 0.5f, 1.5f);
    cpu_be().moe_route({.logits = logits,
                        .per_expert_scale = scale,
                        .expert_ids = ids.host,
                        .expert_weights = weights.host});
    ids.push();
    weights.push();
    out.randomize(seed + 5);  // stale values the op must overwrite
  }
  MoeExpertsParams params(bool on_gpu, const Tensor& out_t, bool prefill = false) const {
    auto pick = [&](const Twin& t) -> Tensor { return on_gpu ? t.dev : t.host.view(); };
    return {.x = pick(x),
            .expert_ids = pick(ids),
            .expert_weights = pick(weights),
            .gate_up = pick(gate_up),
            .down = pick(down),
            .out = out_t,
            .prefill = prefill};
  }
  std::string name() const {
    return "moe_experts n " + std::to_string(n) + " H " + std::to_string(h) + " I " +
           std::to_string(inter) + " E " + std::to_string(n_experts) + " k " + std::to_string(k) +
           " " + dtype_str(dtype);
  }
  void check_against_cpu(bool prefill = false, float tol = kExpertsTol) {
    cpu_be().moe_experts(params(false, out.host));
    gpu_be().moe_experts(params(true, out.dev, prefill));
    expect_close(out.pull(), out.host, tol, (name() + (prefill ? " prefill" : "")).c_str());
  }
};

TEST(CudaMoe, ExpertsMatchCpu) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 2000;
  for (DType dt : kWeightDtypes) {
    // 16-byte load path (H, I multiples of 8), then the element path (tails).
    ExpertsCase(1, 64, 32, 8, 2, dt, seed += 10).check_against_cpu();
    ExpertsCase(10, 256, 128, 16, 4, dt, seed += 10).check_against_cpu();
    ExpertsCase(3, 37, 13, 5, 3, dt, seed += 10).check_against_cpu();
    ExpertsCase(9, 100, 20, 6, 6, dt, seed += 10).check_against_cpu();  // k == E
  }
}

TEST(CudaMoe, ExpertsMatchCpuAtGemmaDecodeShape) {
  SKIP_WITHOUT_CUDA();
  // The 26B-A4B expert shape (H 2816, I 704, k 8) with 16 of its 128 experts,
  // so that a few tokens share experts.
  ExpertsCase(1, 2816, 704, 16, 8, DType::kBF16, 3000).check_against_cpu();
  ExpertsCase(12, 2816, 704, 16, 8, DType::kBF16, 3100).check_against_cpu();
}

TEST(CudaMoe, ExpertsMatchCpuAcrossPrefillPasses) {
  SKIP_WITHOUT_CUDA();
  // More tokens than one pass (256) holds, including a partial last pass.
  ExpertsCase(600, 128, 64, 16, 4, DType::kBF16, 4000).check_against_cpu();
  ExpertsCase(257, 40, 24, 8, 2, DType::kF16, 4100).check_against_cpu();
}

TEST(CudaMoe, PrefillPathMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  // Grouped tensor-core products: experts with one and several tiles of 128
  // slots, more tokens than one pass (4,096), K and column tails (H 72 and I 40
  // are not multiples of 32 or 64), experts without any token (E 64, k 1), and
  // the 26B-A4B expert shape.
  ExpertsCase(300, 256, 128, 16, 4, DType::kBF16, 7000).check_against_cpu(true, kPrefillTol);
  ExpertsCase(4100, 64, 32, 8, 2, DType::kBF16, 7100).check_against_cpu(true, kPrefillTol);
  ExpertsCase(90, 72, 40, 6, 3, DType::kBF16, 7200).check_against_cpu(true, kPrefillTol);
  ExpertsCase(70, 64, 48, 64, 1, DType::kBF16, 7300).check_against_cpu(true, kPrefillTol);
  ExpertsCase(200, 2816, 704, 16, 8, DType::kBF16, 7400).check_against_cpu(true, kPrefillTol);
}

TEST(CudaMoe, PrefillPathIsDeterministicAndKeepsOtherCasesInvariant) {
  SKIP_WITHOUT_CUDA();
  // Runs the case on the GPU twice, with `first` and `second` as the prefill
  // flag, and checks that both outputs have the same bits.
  const auto expect_same_bits = [](ExpertsCase& c, bool first, bool second) {
    gpu_be().moe_experts(c.params(true, c.out.dev, first));
    const HostTensor a = c.out.pull();
    gpu_be().moe_experts(c.params(true, c.out.dev, second));
    const HostTensor b = c.out.pull();
    EXPECT_EQ(std::memcmp(a.view().data(), b.view().data(), static_cast<size_t>(c.n * c.h) * 4), 0)
        << c.name() << " prefill " << first << " then " << second;
  };
  // Two runs of the grouped path give the same bits (bucket order comes from
  // atomics, but a slot's sums do not depend on its tile row).
  ExpertsCase repeated(500, 128, 64, 16, 4, DType::kBF16, 7500);
  expect_same_bits(repeated, true, true);
  // Few tokens, f16 weights or an H that is not a multiple of 8 keep the
  // batch-invariant kernels even when asked for prefill: same bits as without.
  struct Case {
    int64_t n, h, inter;
    DType dt;
  };
  for (const Case& k : {Case{40, 128, 64, DType::kBF16}, Case{300, 128, 64, DType::kF16},
                        Case{300, 100, 64, DType::kBF16}}) {
    ExpertsCase c(k.n, k.h, k.inter, 8, 2, k.dt, 7600 + k.n + k.h);
    expect_same_bits(c, false, true);
  }
}

TEST(CudaMoe, PrefillPathOutOfRangeIdPoisonsOnlyItsToken) {
  SKIP_WITHOUT_CUDA();
  ExpertsCase c(100, 64, 32, 8, 2, DType::kBF16, 7700);
  cpu_be().moe_experts(c.params(false, c.out.host));
  c.ids.host.data<int32_t>()[50 * 2 + 1] = -1;  // token 50, slot 1
  c.ids.push();
  gpu_be().moe_experts(c.params(true, c.out.dev, true));
  const HostTensor got = c.out.pull();
  for (int64_t j = 0; j < c.h; ++j) {
    EXPECT_TRUE(std::isnan(got.data<float>()[50 * c.h + j])) << "token 50 column " << j;
  }
  expect_close(got.view().slice_rows(0, 50), c.out.host.view().slice_rows(0, 50), kPrefillTol,
               "tokens 0-49");
  expect_close(got.view().slice_rows(51, 100), c.out.host.view().slice_rows(51, 100), kPrefillTol,
               "tokens 51-99");
}

TEST(CudaMoe, ExpertsTokenIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  struct Shape5 {
    int64_t n, h, inter, e, k;
  };
  // Decode-sized, odd (element path) and multi-pass batches.
  const Shape5 shapes[] = {{24, 256, 128, 16, 4}, {9, 100, 36, 6, 3}, {300, 64, 32, 8, 2}};
  uint64_t seed = 5000;
  for (const Shape5& s : shapes) {
    ExpertsCase c(s.n, s.h, s.inter, s.e, s.k, DType::kBF16, seed += 10);
    gpu_be().moe_experts(c.params(true, c.out.dev));
    const HostTensor all = c.out.pull();
    Twin one(DType::kF32, {1, s.h});
    for (int64_t t : {int64_t{0}, s.n / 2, s.n - 1}) {
      gpu_be().moe_experts({.x = c.x.dev.slice_rows(t, t + 1),
                            .expert_ids = c.ids.dev.slice_rows(t, t + 1),
                            .expert_weights = c.weights.dev.slice_rows(t, t + 1),
                            .gate_up = c.gate_up.dev,
                            .down = c.down.dev,
                            .out = one.dev});
      const HostTensor alone = one.pull();
      EXPECT_EQ(std::memcmp(alone.view().data(), all.view().slice_rows(t, t + 1).data(),
                            static_cast<size_t>(s.h) * 4),
                0)
          << c.name() << ": token " << t << " alone differs from the batch";
    }
  }
}

TEST(CudaMoe, ExpertsOutOfRangeIdPoisonsOnlyItsToken) {
  SKIP_WITHOUT_CUDA();
  // The GPU cannot throw for an id it never reads on the host: the token's row
  // becomes NaN and the other tokens are unaffected.
  ExpertsCase c(3, 64, 32, 8, 2, DType::kF32, 6000);
  cpu_be().moe_experts(c.params(false, c.out.host));
  c.ids.host.data<int32_t>()[1 * 2 + 1] = 8;  // token 1, slot 1: expert 8 of 8
  c.ids.push();
  gpu_be().moe_experts(c.params(true, c.out.dev));
  const HostTensor got = c.out.pull();
  for (int64_t j = 0; j < c.h; ++j) {
    EXPECT_TRUE(std::isnan(got.data<float>()[c.h + j])) << "token 1 column " << j;
  }
  expect_close(got.view().slice_rows(0, 1), c.out.host.view().slice_rows(0, 1), kExpertsTol,
               "token 0");
  expect_close(got.view().slice_rows(2, 3), c.out.host.view().slice_rows(2, 3), kExpertsTol,
               "token 2");
}

TEST(CudaMoe, ExpertsRejectBadShapes) {
  SKIP_WITHOUT_CUDA();
  ExpertsCase c(2, 16, 8, 4, 2, DType::kBF16, 7000);
  auto with = [&](auto edit) {
    MoeExpertsParams p = c.params(true, c.out.dev);
    edit(p);
    gpu_be().moe_experts(p);
  };
  Twin bad_down(DType::kBF16, {4, 16, 9});
  Twin odd_gate_up(DType::kBF16, {4, 15, 16});
  Twin narrow_gate_up(DType::kBF16, {4, 16, 15});
  Twin ids_rows(DType::kI32, {3, 2});
  Twin weights_cols(DType::kF32, {2, 3});
  Twin out_wide(DType::kF32, {2, 17});
  Twin i32_gate_up(DType::kI32, {4, 16, 16});
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.down = bad_down.dev; }), Error);
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.gate_up = odd_gate_up.dev; }), Error);
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.gate_up = narrow_gate_up.dev; }), Error);
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.expert_ids = ids_rows.dev; }), Error);
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.expert_weights = weights_cols.dev; }), Error);
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.out = out_wide.dev; }), Error);
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.gate_up = i32_gate_up.dev; }), Error);
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.out = c.x.dev; }), Error);  // out aliases x
  EXPECT_THROW(with([&](MoeExpertsParams& p) { p.x = c.x.host; }), Error);   // host tensor
}

}  // namespace
}  // namespace specula::test
