// SPDX-License-Identifier: Apache-2.0
// A bf16 KV cache on CUDA (issue #30) against the CPU backend: the stores
// (store_kv, attention_inputs' cache store, convert) round to the CPU's bits;
// attention over bf16 keys matches the CPU's attention over the same bf16 keys
// within the f32 tolerance (decode, verify, sliding windows, rings) and is
// batch invariant bit for bit; prefill chunks take the tensor-core (TF32) path
// with bf16 keys too, within its tolerance of the CPU and bit for bit equal to
// that path over an f32 cache holding the same (rounded) values; greedy output with and without
// speculation is identical with a bf16 cache (f32 fixtures with their cache set to bf16, the
// embedded family whose default it is); model logits over a bf16 cache match the CPU's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/ops/backend.h"
#include "engine/speculative/decoder.h"
#include "tests/cuda/cuda_model_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/model/golden_util.h"
#include "tests/unit/speculative/sampling_test_util.h"

namespace specula::test {
namespace {

constexpr float kAttentionTol = 1e-5f;  // as tests/cuda/attention_test.cpp
// The tensor-core prefill path's TF32 products (as attention_test.cpp).
constexpr float kFastPrefillTol = 5e-3f;

// f32 values in [-2, 2) plus rounding ties, zeros, infinities and NaN.
HostTensor tricky_f32(Shape shape, uint64_t seed) {
  HostTensor t(DType::kF32, shape);
  cpu_be().fill_uniform(t, seed, -2.0f, 2.0f);
  float* x = t.data<float>();
  const float special[] = {1.0f + 0x1p-8f,
                           1.0f + 0x3p-8f,
                           -1.0f - 0x1p-8f,
                           -0.0f,
                           0.0f,
                           1e-40f,
                           std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  for (size_t i = 0; i < std::size(special) && static_cast<int64_t>(i) < t.numel(); ++i)
    x[i * 7 % static_cast<size_t>(t.numel())] = special[i];
  return t;
}

// A bf16 twin holding f32_to_bf16 of random values (same bits on both sides).
Twin bf16_twin(Shape shape, uint64_t seed) {
  HostTensor f(DType::kF32, shape);
  cpu_be().fill_uniform(f, seed, -1.0f, 1.0f);
  Twin t(DType::kBF16, shape);
  cpu_be().convert(f, t.host);
  t.push();
  return t;
}

Twin positions_twin(const std::vector<int32_t>& positions) {
  Twin pos(DType::kI32, {static_cast<int64_t>(positions.size())});
  std::copy(positions.begin(), positions.end(), pos.host.data<int32_t>());
  pos.push();
  return pos;
}

void expect_same_bits(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.nbytes(), b.nbytes()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << what;
}

TEST(CudaKvDtype, StoreKvAndConvertRoundLikeTheCpu) {
  SKIP_WITHOUT_CUDA();
  constexpr int64_t N = 5, KV = 2, D = 12, R = 8;
  Twin k(DType::kF32, {N, KV, D}), v(DType::kF32, {N, KV, D});
  k.host = tricky_f32({N, KV, D}, 1);
  v.host = tricky_f32({N, KV, D}, 2);
  k.push();
  v.push();
  const Twin pos = positions_twin({9, 3, 4, 0, 14});  // mod 8: 1, 3, 4, 0, 6
  Twin ck(DType::kBF16, {R, KV, D}), cv(DType::kBF16, {R, KV, D});
  std::memset(ck.host.view().data(), 0, ck.host.view().nbytes());
  std::memset(cv.host.view().data(), 0, cv.host.view().nbytes());
  ck.push();
  cv.push();
  gpu_be().store_kv(k.dev, v.dev, pos.dev, ck.dev, cv.dev);
  cpu_be().store_kv(k.host, v.host, pos.host, ck.host, cv.host);
  expect_same_bits(ck.pull(), ck.host, "store_kv cache_k");
  expect_same_bits(cv.pull(), cv.host, "store_kv cache_v");
  // convert both ways.
  Twin b(DType::kBF16, {N, KV, D});
  gpu_be().convert(k.dev, b.dev);
  cpu_be().convert(k.host, b.host);
  expect_same_bits(b.pull(), b.host, "convert f32 -> bf16");
  Twin w(DType::kF32, {N, KV, D});
  gpu_be().convert(b.dev, w.dev);
  cpu_be().convert(b.host, w.host);
  expect_same_bits(w.pull(), w.host, "convert bf16 -> f32");
}

// attention_inputs with a bf16 cache: the cache rows are the bf16 rounding of
// the finished k / v rows the same call leaves (store_kv of them), and
// attention_with_inputs over that cache equals the two ops.
TEST(CudaKvDtype, AttentionInputsStoreRoundedFinishedRows) {
  SKIP_WITHOUT_CUDA();
  constexpr int64_t M = 3, NH = 4, KV = 2, D = 64, R = 64;
  Twin q(DType::kF32, {M, NH, D}), k(DType::kF32, {M, KV, D}), v(DType::kF32, {M, KV, D});
  Twin qn(DType::kF32, {D}), kn(DType::kF32, {D}), freq(DType::kF32, {D / 2});
  q.randomize(1);
  k.randomize(2);
  v.randomize(3);
  qn.randomize(4, 0.5f, 1.5f);
  kn.randomize(5, 0.5f, 1.5f);
  freq.randomize(6, 0.0f, 0.5f);
  const Twin pos = positions_twin({40, 41, 42});
  Twin ck = bf16_twin({R, KV, D}, 7), cv = bf16_twin({R, KV, D}, 8);
  AttentionInputsParams in{.q = q.dev,
                           .q_norm = qn.dev,
                           .k = k.dev,
                           .k_norm = kn.dev,
                           .v = v.dev,
                           .positions = pos.dev,
                           .inv_freq = freq.dev,
                           .cache_k = ck.dev,
                           .cache_v = cv.dev};
  gpu_be().attention_inputs(in);
  const HostTensor k_done = k.pull(), v_done = v.pull();
  HostTensor want_k(DType::kBF16, {R, KV, D}), want_v(DType::kBF16, {R, KV, D});
  std::memcpy(want_k.view().data(), ck.host.view().data(), want_k.view().nbytes());
  std::memcpy(want_v.view().data(), cv.host.view().data(), want_v.view().nbytes());
  cpu_be().store_kv(k_done, v_done, pos.host, want_k, want_v);
  expect_same_bits(ck.pull(), want_k, "cache_k rows");
  expect_same_bits(cv.pull(), want_v, "cache_v rows");
}

struct Case {
  int64_t s, t, heads, kv, d;
  int window;
  bool ring;
  bool fast_prefill;
};

HostTensor run_attention(Backend& be, bool gpu, const Twin& q, const Twin& k, const Twin& v,
                         const Twin& pos, const Case& c, int64_t k_pos0, int64_t ring_keys) {
  Twin out(DType::kF32, q.host.shape());
  AttentionParams p{.q = gpu ? q.dev : q.host.view(),
                    .k = gpu ? k.dev : k.host.view(),
                    .v = gpu ? v.dev : v.host.view(),
                    .out = gpu ? out.dev : out.host.view(),
                    .q_positions = gpu ? pos.dev : pos.host.view(),
                    .k_pos0 = k_pos0,
                    .window = c.window,
                    .scale = 1.0f / std::sqrt(static_cast<float>(c.d)),
                    .ring_keys = ring_keys,
                    .allow_fast_prefill = c.fast_prefill};
  be.attention(p);
  if (gpu) return out.pull();
  return std::move(out.host);
}

TEST(CudaKvDtype, Bf16AttentionMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const Case cases[] = {
      {1, 300, 8, 2, 256, 0, false, false}, {1, 700, 8, 1, 512, 0, false, false},
      {5, 300, 8, 2, 256, 0, false, false}, {5, 90, 8, 2, 256, 64, false, false},
      {128, 400, 4, 2, 64, 0, false, true}, {1, 80, 8, 2, 256, 64, true, false},
      {5, 80, 8, 2, 256, 64, true, false},  {1, 50, 4, 2, 30, 0, false, false},
  };
  uint64_t seed = 10;
  for (const Case& c : cases) {
    Twin q(DType::kF32, {c.s, c.heads, c.d});
    q.randomize(seed++);
    Twin k = bf16_twin({c.t, c.kv, c.d}, seed++);
    Twin v = bf16_twin({c.t, c.kv, c.d}, seed++);
    std::vector<int32_t> positions;
    int64_t k_pos0 = 0, ring_keys = -1;
    if (c.ring) {
      // A ring of t rows holding positions [q0 - window + 1, q_last].
      const int64_t last = 3 * c.t + 5;
      for (int64_t i = 0; i < c.s; ++i)
        positions.push_back(static_cast<int32_t>(last - c.s + 1 + i));
      k_pos0 = last - c.s + 1 - c.window + 1;
      ring_keys = last - k_pos0 + 1;
    } else {
      for (int64_t i = 0; i < c.s; ++i) positions.push_back(static_cast<int32_t>(c.t - c.s + i));
    }
    const Twin pos = positions_twin(positions);
    const HostTensor got = run_attention(gpu_be(), true, q, k, v, pos, c, k_pos0, ring_keys);
    const HostTensor want = run_attention(cpu_be(), false, q, k, v, pos, c, k_pos0, ring_keys);
    const std::string label =
        fmt::format("S={} T={} D={} window={} ring={}", c.s, c.t, c.d, c.window, c.ring);
    expect_close(got, want, c.fast_prefill ? kFastPrefillTol : kAttentionTol, label.c_str());
  }
}

// The tensor-core prefill path over bf16 keys (allow_fast_prefill, 64+
// queries, contiguous keys): within its tolerance of the CPU over the same bf16
// keys, and bit for bit the path's result over an f32 cache holding the same
// values (widened exactly; TF32 keeps all of a bf16 mantissa). That it took
// the fast path shows in its bits differing from the exact partials path.
TEST(CudaKvDtype, Bf16FastPrefillEqualsF32CacheOfTheRoundedValues) {
  SKIP_WITHOUT_CUDA();
  struct P {
    int64_t s, t, heads, kv, d, k_pos0;
    int window;
  };
  uint64_t seed = 40;
  for (const P& c :
       {P{300, 300, 8, 2, 256, 0, 0}, P{128, 400, 4, 4, 64, 50, 0}, P{200, 260, 8, 4, 512, 0, 64},
        P{64, 64, 2, 1, 32, 7, 16}, P{96, 1000, 16, 2, 256, 0, 0}}) {
    const std::string what = fmt::format("bf16 fast prefill S={} T={} H={}/{} D={} window={}", c.s,
                                         c.t, c.heads, c.kv, c.d, c.window);
    SCOPED_TRACE(what);
    Twin q(DType::kF32, {c.s, c.heads, c.d});
    q.randomize(seed++);
    Twin k = bf16_twin({c.t, c.kv, c.d}, seed++);
    Twin v = bf16_twin({c.t, c.kv, c.d}, seed++);
    Twin kf(DType::kF32, {c.t, c.kv, c.d}), vf(DType::kF32, {c.t, c.kv, c.d});
    cpu_be().convert(k.host, kf.host);
    cpu_be().convert(v.host, vf.host);
    kf.push();
    vf.push();
    std::vector<int32_t> positions;
    for (int64_t i = 0; i < c.s; ++i)
      positions.push_back(static_cast<int32_t>(c.k_pos0 + c.t - c.s + i));
    if (c.window > 0) positions[0] = static_cast<int32_t>(c.k_pos0 - c.window - 5);  // sees nothing
    const Twin pos = positions_twin(positions);
    const auto run = [&](Backend& be, bool gpu, const Twin& kk, const Twin& vv, bool fast) {
      Twin out(DType::kF32, {c.s, c.heads, c.d});
      AttentionParams p{.q = gpu ? q.dev : q.host.view(),
                        .k = gpu ? kk.dev : kk.host.view(),
                        .v = gpu ? vv.dev : vv.host.view(),
                        .out = gpu ? out.dev : out.host.view(),
                        .q_positions = gpu ? pos.dev : pos.host.view(),
                        .k_pos0 = c.k_pos0,
                        .window = c.window,
                        .scale = 1.0f / std::sqrt(static_cast<float>(c.d)),
                        .allow_fast_prefill = fast};
      be.attention(p);
      if (gpu) return out.pull();
      return std::move(out.host);
    };
    const HostTensor got = run(gpu_be(), true, k, v, true);
    expect_close(got, run(cpu_be(), false, k, v, false), kFastPrefillTol, what.c_str());
    expect_same_bits(got, run(gpu_be(), true, kf, vf, true), "bf16 vs f32 of its values");
    // Run again: the path is deterministic (the widened copies are reused scratch).
    expect_same_bits(got, run(gpu_be(), true, k, v, true), "bf16 fast prefill twice");
    const HostTensor exact = run(gpu_be(), true, k, v, false);
    EXPECT_NE(std::memcmp(got.view().data(), exact.view().data(), got.view().nbytes()), 0)
        << "the same bits as the partials path: the fast path did not run";
  }
}

// A query's bits over bf16 keys do not depend on the window it is verified in.
TEST(CudaKvDtype, Bf16AttentionIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  const Case c{8, 500, 8, 2, 256, 0, false, false};
  Twin q(DType::kF32, {c.s, c.heads, c.d});
  q.randomize(1);
  Twin k = bf16_twin({c.t, c.kv, c.d}, 2);
  Twin v = bf16_twin({c.t, c.kv, c.d}, 3);
  std::vector<int32_t> positions;
  for (int64_t i = 0; i < c.s; ++i) positions.push_back(static_cast<int32_t>(c.t - c.s + i));
  const Twin pos = positions_twin(positions);
  const HostTensor all = run_attention(gpu_be(), true, q, k, v, pos, c, 0, -1);
  const int64_t row = c.heads * c.d;
  for (int64_t i = 0; i < c.s; ++i) {
    Twin q1(DType::kF32, {1, c.heads, c.d});
    std::memcpy(q1.host.data<float>(), q.host.data<float>() + i * row, row * 4);
    q1.push();
    const Twin p1 = positions_twin({positions[static_cast<size_t>(i)]});
    const HostTensor got = run_attention(gpu_be(), true, q1, k, v, p1, c, 0, -1);
    EXPECT_EQ(std::memcmp(got.data<float>(), all.data<float>() + i * row, row * 4), 0)
        << "query " << i;
  }
}

using testing::greedy_requests;

gemma4::LoadOptions cuda_bf16_kv() {
  gemma4::LoadOptions o = on_cuda();
  o.kv_dtype = DType::kBF16;
  return o;
}

struct Pair {
  const char* target;
  const char* drafter;
};
class CudaKvDtypeSpeculation : public ::testing::TestWithParam<Pair> {};

TEST_P(CudaKvDtypeSpeculation, GreedyOutputIdenticalWithAndWithoutDrafter) {
  SKIP_WITHOUT_CUDA();
  const Pair c = GetParam();
  if (!have(c.target) || !have(c.drafter)) GTEST_SKIP() << "fixtures missing";
  auto target = gemma4::Gemma4Model::load(golden(c.target), cuda_bf16_kv());
  ASSERT_EQ(target->kv_spec().dtype, DType::kBF16);
  auto drafter =
      assistant::AssistantModel::load(golden(c.drafter), target->config(), target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  const int vocab = target->config().vocab_size;
  for (int batch : {1, 3, 8}) {
    auto reqs = greedy_requests(batch, vocab, 24);
    const auto plain = speculative::decode(*target, nullptr, reqs, {});
    expect_speculation_matches_plain(*target, source, reqs, plain, {1, 2, 4, 8},
                                     std::string(c.target) + ", bf16 cache");
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaKvDtypeSpeculation,
                         ::testing::Values(Pair{"e2b_like", "e2b_like_assistant"},
                                           Pair{"dense_kev", "dense_kev_assistant"}));

// The embedded family (bf16 weights: a bf16 cache by default) on CUDA:
// speculation matches plain decoding, and prefill logits over a bf16 cache
// match the CPU's over its bf16 cache.
TEST(CudaKvDtypeEmbedded, DefaultBf16CacheSpeculationMatchesPlainAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = std::string(SPECULA_SOURCE_DIR) + "/models/gemma4-tiny-py";
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP();
  auto gpu = gemma4::Gemma4Model::load(dir, on_cuda());
  ASSERT_EQ(gpu->kv_spec().dtype, DType::kBF16);
  auto cpu = gemma4::Gemma4Model::load(dir);
  ASSERT_EQ(cpu->kv_spec().dtype, DType::kBF16);
  auto drafter = assistant::AssistantModel::load(dir + "-assistant", gpu->config(), gpu->backend());
  assistant::AssistantDrafter source(*gpu, *drafter);
  std::vector<int32_t> ids;
  for (int i = 0; i < 70; ++i) ids.push_back(3 + (i * 7919) % (gpu->config().vocab_size - 3));
  auto logits_of = [&](gemma4::Gemma4Model& m) {
    SequenceKv kv = m.new_sequence();
    gemma4::ForwardRow row{.kv = &kv, .tokens = ids, .all_logits = true};
    const auto& out = m.forward(std::span(&row, 1));
    HostTensor h(DType::kF32, out.logits.shape());
    m.backend().download(out.logits, h.view().data());
    return h;
  };
  const HostTensor g = logits_of(*gpu), c = logits_of(*cpu);
  const double err = testing::relative_error(g.data<float>(), c.data<float>(), c.numel());
  std::printf("[ cuda kv bf16 ] embedded prefill logits vs CPU rel err %.3g\n", err);
  // The 70-token prefill takes the TF32 tensor-core attention (the bound of the
  // other fast-prefill tests), and a K/V value that the GPU's and the CPU's
  // projections put on either side of a bf16 rounding boundary is stored one
  // bf16 step (2^-8) apart: 4.1e-3 measured on an H200 (2026-12-04).
  EXPECT_LT(err, 5e-3);
  auto reqs = greedy_requests(3, gpu->config().vocab_size, 32);
  const auto plain = speculative::decode(*gpu, nullptr, reqs, {});
  expect_speculation_matches_plain(*gpu, source, reqs, plain, {1, 4, 8}, "embedded");
}

// Verify windows of B x (k + 1) rows past cuda::kInvariantRows (40 x 9 = 360
// rows: the products run in two chunks) still give every request plain
// decoding's tokens. Before the products were chunked, rows past 256 took
// cuBLASLt, whose bits depend on M: 4 of 64 requests differed at 32 x 9 rows.
TEST(CudaKvDtypeEmbedded, VerifyWindowsPastInvariantRowsMatchPlain) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = std::string(SPECULA_SOURCE_DIR) + "/models/gemma4-tiny-py";
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP();
  auto gpu = gemma4::Gemma4Model::load(dir, on_cuda());
  auto drafter = assistant::AssistantModel::load(dir + "-assistant", gpu->config(), gpu->backend());
  assistant::AssistantDrafter source(*gpu, *drafter);
  const int batch = 40, k = 8;
  static_assert(40 * (8 + 1) > cuda::kInvariantRows);
  const auto reqs = greedy_requests(batch, gpu->config().vocab_size, 40);
  const auto plain = speculative::decode(*gpu, nullptr, reqs, {});
  expect_speculation_matches_plain(*gpu, source, reqs, plain, {k}, "embedded, 360-row windows");
}

}  // namespace
}  // namespace specula::test
