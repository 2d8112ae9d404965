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
// The same for an fp8 (e4m3) cache (CudaKvFp8*): stores (codes and scales)
// bit-equal to the CPU's, the fused decode kernel equal to the two ops.
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

// The new rows of the attention_inputs cache tests: 3 positions (40-42) of 4
// query heads and 2 kv heads of 64, random q/k/v, norm weights and
// frequencies. finish(cache_k, cache_v) runs attention_inputs on the GPU into
// those caches and returns the finished k and v rows it leaves.
struct NewRows {
  static constexpr int64_t M = 3, NH = 4, KV = 2, D = 64, R = 64;
  Twin q{DType::kF32, {M, NH, D}}, k{DType::kF32, {M, KV, D}}, v{DType::kF32, {M, KV, D}};
  Twin qn{DType::kF32, {D}}, kn{DType::kF32, {D}}, freq{DType::kF32, {D / 2}};
  Twin pos = positions_twin({40, 41, 42});
  NewRows() {
    q.randomize(1);
    k.randomize(2);
    v.randomize(3);
    qn.randomize(4, 0.5f, 1.5f);
    kn.randomize(5, 0.5f, 1.5f);
    freq.randomize(6, 0.0f, 0.5f);
  }
  std::pair<HostTensor, HostTensor> finish(const Tensor& cache_k, const Tensor& cache_v) {
    gpu_be().attention_inputs({.q = q.dev,
                               .q_norm = qn.dev,
                               .k = k.dev,
                               .k_norm = kn.dev,
                               .v = v.dev,
                               .positions = pos.dev,
                               .inv_freq = freq.dev,
                               .cache_k = cache_k,
                               .cache_v = cache_v});
    return {k.pull(), v.pull()};
  }
};

// attention_inputs with a bf16 cache: the cache rows are the bf16 rounding of
// the finished k / v rows the same call leaves (store_kv of them), and
// attention_with_inputs over that cache equals the two ops.
TEST(CudaKvDtype, AttentionInputsStoreRoundedFinishedRows) {
  SKIP_WITHOUT_CUDA();
  NewRows rows;
  constexpr int64_t KV = NewRows::KV, D = NewRows::D, R = NewRows::R;
  const Twin& pos = rows.pos;
  Twin ck = bf16_twin({R, KV, D}, 7), cv = bf16_twin({R, KV, D}, 8);
  const auto [k_done, v_done] = rows.finish(ck.dev, cv.dev);
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

// Where case c's s queries sit: the last s positions of a full cache of t
// rows, or (c.ring) the newest positions of a ring of t rows holding positions
// [q0 - window + 1, q_last] (k_pos0 and ring_keys as AttentionParams takes
// them; -1: no ring).
struct QueryPlacement {
  std::vector<int32_t> positions;
  int64_t k_pos0 = 0;
  int64_t ring_keys = -1;
};
QueryPlacement place_queries(const Case& c) {
  QueryPlacement p;
  if (c.ring) {
    const int64_t last = 3 * c.t + 5;
    for (int64_t i = 0; i < c.s; ++i)
      p.positions.push_back(static_cast<int32_t>(last - c.s + 1 + i));
    p.k_pos0 = last - c.s + 1 - c.window + 1;
    p.ring_keys = last - p.k_pos0 + 1;
  } else {
    for (int64_t i = 0; i < c.s; ++i) p.positions.push_back(static_cast<int32_t>(c.t - c.s + i));
  }
  return p;
}

// Attention of case c on `be` (gpu: the twins' device sides, else their host
// sides) over the caches k and v, already of that side; the output on the host.
HostTensor run_attention_on(Backend& be, bool gpu, const Twin& q, const Tensor& k, const Tensor& v,
                            const Twin& pos, const Case& c, int64_t k_pos0, int64_t ring_keys) {
  Twin out(DType::kF32, q.host.shape());
  AttentionParams p{.q = gpu ? q.dev : q.host.view(),
                    .k = k,
                    .v = v,
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

HostTensor run_attention(Backend& be, bool gpu, const Twin& q, const Twin& k, const Twin& v,
                         const Twin& pos, const Case& c, int64_t k_pos0, int64_t ring_keys) {
  return run_attention_on(be, gpu, q, gpu ? k.dev : k.host.view(), gpu ? v.dev : v.host.view(), pos,
                          c, k_pos0, ring_keys);
}

// The attention cases of the cache-dtype tests: decode and verify rows over
// full caches (head dims 256 and 512), a sliding window, the tensor-core
// prefill path (128 queries), rings, an odd head dim.
const Case kAttentionCases[] = {
    {1, 300, 8, 2, 256, 0, false, false}, {1, 700, 8, 1, 512, 0, false, false},
    {5, 300, 8, 2, 256, 0, false, false}, {5, 90, 8, 2, 256, 64, false, false},
    {128, 400, 4, 2, 64, 0, false, true}, {1, 80, 8, 2, 256, 64, true, false},
    {5, 80, 8, 2, 256, 64, true, false},  {1, 50, 4, 2, 30, 0, false, false},
};

// A prefill chunk of the fast-prefill tests: s queries at the last positions
// of t keys starting at k_pos0, heads / kv heads of head dim d.
struct FastPrefillCase {
  int64_t s, t, heads, kv, d, k_pos0;
  int window;
};

TEST(CudaKvDtype, Bf16AttentionMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 10;
  for (const Case& c : kAttentionCases) {
    Twin q(DType::kF32, {c.s, c.heads, c.d});
    q.randomize(seed++);
    Twin k = bf16_twin({c.t, c.kv, c.d}, seed++);
    Twin v = bf16_twin({c.t, c.kv, c.d}, seed++);
    const auto [positions, k_pos0, ring_keys] = place_queries(c);
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
  uint64_t seed = 40;
  for (const FastPrefillCase& c :
       {FastPrefillCase{300, 300, 8, 2, 256, 0, 0}, FastPrefillCase{128, 400, 4, 4, 64, 50, 0},
        FastPrefillCase{200, 260, 8, 4, 512, 0, 64}, FastPrefillCase{64, 64, 2, 1, 32, 7, 16},
        FastPrefillCase{96, 1000, 16, 2, 256, 0, 0}}) {
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
      return run_attention(be, gpu, q, kk, vv, pos,
                           Case{c.s, c.t, c.heads, c.kv, c.d, c.window, false, fast}, c.k_pos0, -1);
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

// Load options for CUDA with a cache of dtype `dt`.
gemma4::LoadOptions cuda_kv(DType dt) {
  gemma4::LoadOptions o = on_cuda();
  o.kv_dtype = dt;
  return o;
}

struct Pair {
  const char* target;
  const char* drafter;
};
struct SpeculationCase {
  Pair pair;
  DType kv;
};
class CudaKvDtypeSpeculation : public ::testing::TestWithParam<SpeculationCase> {};

// Greedy output with and without the fixture's assistant is identical over a
// bf16 or fp8 cache (f32 fixtures with their cache dtype overridden).
TEST_P(CudaKvDtypeSpeculation, GreedyOutputIdenticalWithAndWithoutDrafter) {
  SKIP_WITHOUT_CUDA();
  const auto [c, kv] = GetParam();
  if (!have(c.target) || !have(c.drafter)) GTEST_SKIP() << "fixtures missing";
  auto target = gemma4::Gemma4Model::load(golden(c.target), cuda_kv(kv));
  ASSERT_EQ(target->kv_spec().dtype, kv);
  auto drafter =
      assistant::AssistantModel::load(golden(c.drafter), target->config(), target->backend());
  assistant::AssistantDrafter source(*target, *drafter);
  const int vocab = target->config().vocab_size;
  for (int batch : {1, 3, 8}) {
    auto reqs = greedy_requests(batch, vocab, 24);
    const auto plain = speculative::decode(*target, nullptr, reqs, {});
    expect_speculation_matches_plain(
        *target, source, reqs, plain, {1, 2, 4, 8},
        std::string(c.target) + ", " + std::string(dtype_name(kv)) + " cache");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaKvDtypeSpeculation,
    ::testing::Values(SpeculationCase{{"e2b_like", "e2b_like_assistant"}, DType::kBF16},
                      SpeculationCase{{"dense_kev", "dense_kev_assistant"}, DType::kBF16},
                      SpeculationCase{{"e2b_like", "e2b_like_assistant"}, DType::kF8E4M3},
                      SpeculationCase{{"dense_kev", "dense_kev_assistant"}, DType::kF8E4M3}),
    [](const ::testing::TestParamInfo<SpeculationCase>& info) {
      return std::string(info.param.pair.target) + "_" + std::string(dtype_name(info.param.kv));
    });

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

// ---- fp8 (e4m3, one f32 scale per (token, kv head)) ----

// An fp8 cache tensor on both sides: codes [rows, KV, D] plus scales
// [rows · KV]; host() / dev() are the views with their scales attached.
struct Fp8Twin {
  Twin q;
  Twin scales;
  explicit Fp8Twin(Shape shape)
      : q(DType::kF8E4M3, shape), scales(DType::kF32, {shape[0] * shape[1]}) {}
  Tensor host() const { return q.host.view().with_scales(scales.host.data<float>()); }
  Tensor dev() const { return q.dev.with_scales(scales.dev.data_as<float>()); }
  void push() {
    q.push();
    scales.push();
  }
};

// An fp8 twin holding the CPU's quantization of random values (same bits and
// scales on both sides).
Fp8Twin fp8_twin(Shape shape, uint64_t seed) {
  HostTensor f(DType::kF32, shape);
  cpu_be().fill_uniform(f, seed, -1.0f, 1.0f);
  Fp8Twin t(shape);
  cpu_be().convert(f, t.host());
  t.push();
  return t;
}

void expect_same_fp8(const Fp8Twin& t, const Tensor& want, const char* what) {
  expect_same_bits(t.q.pull(), want, what);
  const HostTensor scales = t.scales.pull();
  ASSERT_NE(want.scale_data(), nullptr) << what;
  EXPECT_EQ(std::memcmp(scales.data<float>(), want.scale_data(), scales.view().nbytes()), 0)
      << what << " (scales)";
}

// An fp8 cache the GPU filled from its own f32 rows against the CPU's from
// its rows: those rows may differ in the last f32 bit (the GPU's rsqrt and
// RoPE are not the CPU's), which moves a scale by an ulp and can move a code
// across a rounding boundary, so this compares values: every scale within
// 1e-5 relative, and every dequantized element within one e4m3 step of the
// row's top binade (32 · scale).
void expect_fp8_close(const Fp8Twin& t, const Tensor& want, const char* what) {
  const HostTensor codes = t.q.pull();
  const HostTensor scales = t.scales.pull();
  const Shape shape = codes.shape();
  HostTensor got_f(DType::kF32, shape), want_f(DType::kF32, shape);
  cpu_be().convert(codes.view().with_scales(scales.data<float>()), got_f);
  cpu_be().convert(want, want_f);
  const int64_t rows = scales.numel();
  const int64_t d = codes.numel() / rows;
  int64_t moved = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float ws = want.scale_data()[r];
    const float gs = scales.data<float>()[r];
    ASSERT_LE(std::abs(gs - ws), 1e-5f * ws) << what << ": scale of row " << r;
    for (int64_t i = r * d; i < (r + 1) * d; ++i) {
      const float g = got_f.data<float>()[i], w = want_f.data<float>()[i];
      ASSERT_LE(std::abs(g - w), 32.0f * ws * (1.0f + 1e-5f)) << what << ": element " << i;
      moved += g != w;
    }
  }
  std::printf("[ cuda kv fp8 ] %s: %lld of %lld elements differ (at most one step)\n", what,
              static_cast<long long>(moved), static_cast<long long>(codes.numel()));
}

TEST(CudaKvFp8, StoreKvAndConvertQuantizeLikeTheCpu) {
  SKIP_WITHOUT_CUDA();
  constexpr int64_t N = 5, KV = 2, D = 12, R = 8;
  Twin k(DType::kF32, {N, KV, D}), v(DType::kF32, {N, KV, D});
  k.host = tricky_f32({N, KV, D}, 1);  // ties, zeros, a denormal, inf and NaN
  v.host = tricky_f32({N, KV, D}, 2);
  k.host.data<float>()[30] = 0x1p-140f;  // a tiny row element (and scale)
  k.push();
  v.push();
  const Twin pos = positions_twin({9, 3, 4, 0, 14});  // mod 8: 1, 3, 4, 0, 6
  Fp8Twin ck({R, KV, D}), cv({R, KV, D});
  ck.push();  // zeros (HostTensor is zero-filled)
  cv.push();
  gpu_be().store_kv(k.dev, v.dev, pos.dev, ck.dev(), cv.dev());
  cpu_be().store_kv(k.host, v.host, pos.host, ck.host(), cv.host());
  expect_same_fp8(ck, ck.host(), "store_kv cache_k");
  expect_same_fp8(cv, cv.host(), "store_kv cache_v");
  // convert f32 -> fp8 -> f32, and fp8 -> fp8 (codes and scales copied).
  Fp8Twin b({N, KV, D});
  gpu_be().convert(k.dev, b.dev());
  cpu_be().convert(k.host, b.host());
  expect_same_fp8(b, b.host(), "convert f32 -> fp8");
  Twin w(DType::kF32, {N, KV, D});
  gpu_be().convert(b.dev(), w.dev);
  cpu_be().convert(b.host(), w.host);
  expect_same_bits(w.pull(), w.host, "convert fp8 -> f32");
  Fp8Twin c({N, KV, D});
  gpu_be().convert(b.dev(), c.dev());
  expect_same_fp8(c, b.host(), "convert fp8 -> fp8");
  // Random rows at many magnitudes: every code and scale equal.
  constexpr int64_t M = 64, W = 256;
  Twin x(DType::kF32, {M, 4, W});
  x.randomize(9, -3.0f, 3.0f);
  for (int64_t r = 0; r < M * 4; ++r) {
    for (int64_t i = 0; i < W; ++i)
      x.host.data<float>()[r * W + i] *= std::ldexp(1.0f, int(r % 40) - 20);
  }
  x.push();
  Fp8Twin xq({M, 4, W});
  gpu_be().convert(x.dev, xq.dev());
  cpu_be().convert(x.host, xq.host());
  expect_same_fp8(xq, xq.host(), "convert of scaled random rows");
}

// attention_inputs with an fp8 cache: the cache rows are the quantization of
// the finished k / v rows the same call leaves (store_kv of them).
TEST(CudaKvFp8, AttentionInputsStoreQuantizedFinishedRows) {
  SKIP_WITHOUT_CUDA();
  NewRows rows;
  constexpr int64_t KV = NewRows::KV, D = NewRows::D, R = NewRows::R;
  const Twin& pos = rows.pos;
  Fp8Twin ck = fp8_twin({R, KV, D}, 7), cv = fp8_twin({R, KV, D}, 8);
  const auto [k_done, v_done] = rows.finish(ck.dev(), cv.dev());
  // ck.host() still holds the old cache: the CPU stores the finished rows there.
  cpu_be().store_kv(k_done, v_done, pos.host, ck.host(), cv.host());
  expect_same_fp8(ck, ck.host(), "cache_k rows");
  expect_same_fp8(cv, cv.host(), "cache_v rows");
}

// The fused decode kernel (attention_with_inputs of one row: decode steps and
// verify windows, a full cache and a ring) over an fp8 cache: its output and
// cache rows (codes and scales) equal attention_inputs then attention bit for
// bit, and the output matches the CPU's two ops within the f32 tolerance.
TEST(CudaKvFp8, FusedDecodeKernelEqualsTheTwoOps) {
  SKIP_WITHOUT_CUDA();
  struct F {
    int64_t s, heads, kv, d, rows;
    bool ring;
    int window;
  };
  uint64_t seed = 70;
  for (const F& c : {F{1, 8, 2, 256, 300, false, 0}, F{5, 8, 2, 256, 300, false, 0},
                     F{1, 8, 1, 512, 200, false, 0}, F{1, 8, 2, 256, 80, true, 64},
                     F{5, 8, 2, 256, 80, true, 64}}) {
    const std::string what =
        fmt::format("fused fp8 S={} D={} rows={} ring={}", c.s, c.d, c.rows, c.ring);
    SCOPED_TRACE(what);
    const int64_t first = c.ring ? 3 * c.rows + 7 : c.rows - c.s - 3;
    std::vector<int32_t> positions;
    for (int64_t i = 0; i < c.s; ++i) positions.push_back(static_cast<int32_t>(first + i));
    const Twin pos = positions_twin(positions);
    Twin qn(DType::kF32, {c.d}), kn(DType::kF32, {c.d}), freq(DType::kF32, {c.d / 2});
    qn.randomize(seed++, 0.5f, 1.5f);
    kn.randomize(seed++, 0.5f, 1.5f);
    freq.randomize(seed++, 0.0f, 0.5f);
    const uint64_t s_q = seed++, s_k = seed++, s_v = seed++, s_ck = seed++, s_cv = seed++;
    // Runs one of the three ways on fresh copies of the same inputs.
    const auto run = [&](Backend& be, bool gpu, bool fused, Fp8Twin& ck, Fp8Twin& cv) {
      Twin q(DType::kF32, {c.s, c.heads, c.d}), k(DType::kF32, {c.s, c.kv, c.d}),
          v(DType::kF32, {c.s, c.kv, c.d}), out(DType::kF32, {c.s, c.heads, c.d});
      q.randomize(s_q);
      k.randomize(s_k);
      v.randomize(s_v);
      ck = fp8_twin({c.rows, c.kv, c.d}, s_ck);
      cv = fp8_twin({c.rows, c.kv, c.d}, s_cv);
      AttentionInputsParams in{.q = gpu ? q.dev : q.host.view(),
                               .q_norm = gpu ? qn.dev : qn.host.view(),
                               .k = gpu ? k.dev : k.host.view(),
                               .k_norm = gpu ? kn.dev : kn.host.view(),
                               .v = gpu ? v.dev : v.host.view(),
                               .positions = gpu ? pos.dev : pos.host.view(),
                               .inv_freq = gpu ? freq.dev : freq.host.view(),
                               .cache_k = gpu ? ck.dev() : ck.host(),
                               .cache_v = gpu ? cv.dev() : cv.host()};
      AttentionParams p{.q = in.q,
                        .k = in.cache_k,
                        .v = in.cache_v,
                        .out = gpu ? out.dev : out.host.view(),
                        .q_positions = in.positions,
                        .window = c.window,
                        .scale = 1.0f,
                        .positions_bound = positions_bound_for(first + c.s)};
      if (c.ring) {
        p.k_pos0 = std::max<int64_t>(0, first - c.window + 1);
        p.ring_keys = first + c.s - p.k_pos0;
      } else {
        p.k = in.cache_k.slice_rows(0, first + c.s);
        p.v = in.cache_v.slice_rows(0, first + c.s);
      }
      if (fused) {
        be.attention_with_inputs(in, p);
      } else {
        be.attention_inputs(in);
        be.attention(p);
      }
      if (gpu) return out.pull();
      return std::move(out.host);
    };
    Fp8Twin fk({1, 1, 1}), fv({1, 1, 1}), tk({1, 1, 1}), tv({1, 1, 1}), hk({1, 1, 1}),
        hv({1, 1, 1});
    const HostTensor fused = run(gpu_be(), true, true, fk, fv);
    const HostTensor two = run(gpu_be(), true, false, tk, tv);
    const HostTensor host = run(cpu_be(), false, false, hk, hv);
    for (float x : fused.f32()) ASSERT_TRUE(std::isfinite(x));
    expect_same_bits(fused, two, "fused vs attention_inputs + attention");
    expect_same_fp8(fk, tk.q.pull().view().with_scales(tk.scales.pull().data<float>()),
                    "fused cache_k");
    expect_fp8_close(fk, hk.host(), "fused cache_k vs the CPU's");
    expect_fp8_close(fv, hv.host(), "fused cache_v vs the CPU's");
    expect_close(fused, host, kAttentionTol, what.c_str());
  }
}

TEST(CudaKvFp8, AttentionMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 110;
  for (const Case& c : kAttentionCases) {
    Twin q(DType::kF32, {c.s, c.heads, c.d});
    q.randomize(seed++);
    const Fp8Twin k = fp8_twin({c.t, c.kv, c.d}, seed++);
    const Fp8Twin v = fp8_twin({c.t, c.kv, c.d}, seed++);
    const auto [positions, k_pos0, ring_keys] = place_queries(c);
    const Twin pos = positions_twin(positions);
    const auto run = [&](Backend& be, bool gpu) {
      return run_attention_on(be, gpu, q, gpu ? k.dev() : k.host(), gpu ? v.dev() : v.host(), pos,
                              c, k_pos0, ring_keys);
    };
    const std::string label =
        fmt::format("fp8 S={} T={} D={} window={} ring={}", c.s, c.t, c.d, c.window, c.ring);
    expect_close(run(gpu_be(), true), run(cpu_be(), false),
                 c.fast_prefill ? kFastPrefillTol : kAttentionTol, label.c_str());
  }
}

// The tensor-core prefill path over fp8 keys: within its tolerance of the CPU,
// and bit for bit the path's result over an f32 cache holding the dequantized
// values (the path widens the fp8 cache into exactly those f32 copies).
TEST(CudaKvFp8, FastPrefillEqualsF32CacheOfTheDequantizedValues) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 140;
  for (const FastPrefillCase& c :
       {FastPrefillCase{300, 300, 8, 2, 256, 0, 0}, FastPrefillCase{128, 400, 4, 4, 64, 50, 0},
        FastPrefillCase{200, 260, 8, 4, 512, 0, 64}, FastPrefillCase{96, 1000, 16, 2, 256, 0, 0}}) {
    const std::string what = fmt::format("fp8 fast prefill S={} T={} H={}/{} D={} window={}", c.s,
                                         c.t, c.heads, c.kv, c.d, c.window);
    SCOPED_TRACE(what);
    Twin q(DType::kF32, {c.s, c.heads, c.d});
    q.randomize(seed++);
    const Fp8Twin k = fp8_twin({c.t, c.kv, c.d}, seed++);
    const Fp8Twin v = fp8_twin({c.t, c.kv, c.d}, seed++);
    Twin kf(DType::kF32, {c.t, c.kv, c.d}), vf(DType::kF32, {c.t, c.kv, c.d});
    cpu_be().convert(k.host(), kf.host);
    cpu_be().convert(v.host(), vf.host);
    kf.push();
    vf.push();
    std::vector<int32_t> positions;
    for (int64_t i = 0; i < c.s; ++i)
      positions.push_back(static_cast<int32_t>(c.k_pos0 + c.t - c.s + i));
    const Twin pos = positions_twin(positions);
    const auto run = [&](Backend& be, bool gpu, const Tensor& kk, const Tensor& vv, bool fast) {
      return run_attention_on(be, gpu, q, kk, vv, pos,
                              Case{c.s, c.t, c.heads, c.kv, c.d, c.window, false, fast}, c.k_pos0,
                              -1);
    };
    const HostTensor got = run(gpu_be(), true, k.dev(), v.dev(), true);
    expect_close(got, run(cpu_be(), false, k.host(), v.host(), false), kFastPrefillTol,
                 what.c_str());
    expect_same_bits(got, run(gpu_be(), true, kf.dev, vf.dev, true), "fp8 vs f32 of its values");
    const HostTensor exact = run(gpu_be(), true, k.dev(), v.dev(), false);
    EXPECT_NE(std::memcmp(got.view().data(), exact.view().data(), got.view().nbytes()), 0)
        << "the same bits as the partials path: the fast path did not run";
  }
}

// A query's bits over fp8 keys do not depend on the window it is verified in.
TEST(CudaKvFp8, AttentionIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  const int64_t S = 8, T = 500, H = 8, KV = 2, D = 256;
  Twin q(DType::kF32, {S, H, D});
  q.randomize(1);
  const Fp8Twin k = fp8_twin({T, KV, D}, 2);
  const Fp8Twin v = fp8_twin({T, KV, D}, 3);
  std::vector<int32_t> positions;
  for (int64_t i = 0; i < S; ++i) positions.push_back(static_cast<int32_t>(T - S + i));
  const auto run = [&](const Tensor& qq, const Twin& pos, int64_t s) {
    Twin out(DType::kF32, {s, H, D});
    gpu_be().attention({.q = qq,
                        .k = k.dev(),
                        .v = v.dev(),
                        .out = out.dev,
                        .q_positions = pos.dev,
                        .scale = 0.0625f});
    return out.pull();
  };
  const HostTensor all = run(q.dev, positions_twin(positions), S);
  const int64_t row = H * D;
  for (int64_t i = 0; i < S; ++i) {
    Twin q1(DType::kF32, {1, H, D});
    std::memcpy(q1.host.data<float>(), q.host.data<float>() + i * row, row * 4);
    q1.push();
    const HostTensor got = run(q1.dev, positions_twin({positions[static_cast<size_t>(i)]}), 1);
    EXPECT_EQ(std::memcmp(got.data<float>(), all.data<float>() + i * row, row * 4), 0)
        << "query " << i;
  }
}

// The embedded family with an fp8 cache on CUDA: prefill and decode logits
// match the CPU's over its fp8 cache, and speculation matches plain decoding.
TEST(CudaKvFp8Embedded, SpeculationMatchesPlainAndLogitsMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = std::string(SPECULA_SOURCE_DIR) + "/models/gemma4-tiny-py";
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP();
  auto gpu = gemma4::Gemma4Model::load(dir, cuda_kv(DType::kF8E4M3));
  gemma4::LoadOptions host;
  host.kv_dtype = DType::kF8E4M3;
  auto cpu = gemma4::Gemma4Model::load(dir, host);
  auto drafter = assistant::AssistantModel::load(dir + "-assistant", gpu->config(), gpu->backend());
  assistant::AssistantDrafter source(*gpu, *drafter);
  std::vector<int32_t> ids;
  for (int i = 0; i < 70; ++i) ids.push_back(3 + (i * 7919) % (gpu->config().vocab_size - 3));
  auto logits_of = [&](gemma4::Gemma4Model& m) {
    SequenceKv kv = m.new_sequence();
    gemma4::ForwardRow row{.kv = &kv, .tokens = std::span(ids).first(66), .all_logits = true};
    const auto& out = m.forward(std::span(&row, 1));
    std::vector<float> all(static_cast<size_t>(out.logits.numel()));
    m.backend().download(out.logits, all.data());
    for (size_t i = 66; i < ids.size(); ++i) {  // decode steps: the fused kernel
      gemma4::ForwardRow step{.kv = &kv, .tokens = std::span(&ids[i], 1)};
      const auto& o = m.forward(std::span(&step, 1));
      const size_t at = all.size();
      all.resize(at + static_cast<size_t>(o.logits.numel()));
      m.backend().download(o.logits, all.data() + at);
    }
    return all;
  };
  const std::vector<float> g = logits_of(*gpu), c = logits_of(*cpu);
  ASSERT_EQ(g.size(), c.size());
  for (float x : g) ASSERT_TRUE(std::isfinite(x));
  const double err = testing::relative_error(g.data(), c.data(), static_cast<int64_t>(c.size()));
  std::printf("[ cuda kv fp8 ] embedded logits vs CPU rel err %.3g\n", err);
  // A K/V value that the GPU's and the CPU's projections (TF32 prefill) put on
  // either side of an e4m3 rounding boundary is stored one e4m3 step (2^-3 of
  // its binade) apart, 16x bf16's step: a loose bound, not yet measured.
  EXPECT_LT(err, 5e-2);
  auto reqs = greedy_requests(3, gpu->config().vocab_size, 32);
  const auto plain = speculative::decode(*gpu, nullptr, reqs, {});
  expect_speculation_matches_plain(*gpu, source, reqs, plain, {1, 4, 8}, "embedded, fp8 cache");
}

}  // namespace
}  // namespace specula::test
