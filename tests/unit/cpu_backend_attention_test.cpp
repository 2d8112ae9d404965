// SPDX-License-Identifier: Apache-2.0
// The CPU backend's attention, RoPE, attention_inputs and store_kv against
// naive double-precision references written here from the op contracts
// (engine/ops/backend.h) and gemma4-architecture.md. Tolerance:
// cpu_backend_test_util.h.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/unit/cpu_backend_test_util.h"

namespace specula {
namespace {

using namespace testing;  // the helpers of cpu_backend_test_util.h and op_test_util.h

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
        const AttentionParams p = attention_params(q, k, v, out, pos, k_pos0, causal, window, 1.0f);
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
  AttentionParams p = attention_params(q, k, v, out, pos, 3, true, 0, 0.125f);
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

// The batch ops of a batched step (one entry a sequence) are the separate
// calls, in order: here two sequences over their own caches, one a ring.
TEST_F(CpuBackendTest, AttentionBatchAndStoreKvBatchAreTheSeparateCalls) {
  HostTensor q = random({3, 4, 32}), new_k = random({3, 2, 32}), new_v = random({3, 2, 32});
  HostTensor pos = make_i32({3}, {6, 7, 12});  // sequence 0: rows 0-1, sequence 1: row 2
  const HostTensor k0 = random({9, 2, 32}), v0 = random({9, 2, 32});
  const HostTensor k1 = random({5, 2, 32}), v1 = random({5, 2, 32});  // a ring of 5 rows
  HostTensor ck[2] = {clone(k0), clone(k1)}, cv[2] = {clone(v0), clone(v1)};
  HostTensor want_k[2] = {clone(k0), clone(k1)}, want_v[2] = {clone(v0), clone(v1)};
  const int64_t begin[3] = {0, 2, 3};
  std::vector<StoreKvParams> stores;
  for (int i = 0; i < 2; ++i) {
    stores.push_back({.k = new_k.view().slice_rows(begin[i], begin[i + 1]),
                      .v = new_v.view().slice_rows(begin[i], begin[i + 1]),
                      .positions = pos.view().slice_rows(begin[i], begin[i + 1]),
                      .cache_k = ck[i],
                      .cache_v = cv[i]});
    be_.store_kv(stores.back().k, stores.back().v, stores.back().positions, want_k[i], want_v[i]);
  }
  be_.store_kv_batch(stores);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(same_bits(ck[i], want_k[i])) << "k cache " << i;
    EXPECT_TRUE(same_bits(cv[i], want_v[i])) << "v cache " << i;
  }
  HostTensor out(DType::kF32, {3, 4, 32}), want(DType::kF32, {3, 4, 32});
  auto entry = [&](int i, const HostTensor& o) {
    const bool ring = i == 1;
    return AttentionParams{.q = q.view().slice_rows(begin[i], begin[i + 1]),
                           .k = ck[i],
                           .v = cv[i],
                           .out = o.view().slice_rows(begin[i], begin[i + 1]),
                           .q_positions = pos.view().slice_rows(begin[i], begin[i + 1]),
                           .k_pos0 = ring ? 9 : 0,
                           .window = ring ? 4 : 0,
                           .ring_keys = ring ? 4 : -1};
  };
  const AttentionParams entries[2] = {entry(0, out), entry(1, out)};
  be_.attention_batch(entries);
  for (int i = 0; i < 2; ++i) be_.attention(entry(i, want));
  EXPECT_TRUE(same_bits(out, want));
}

// Many entries of different query counts and key lengths, enough work for the
// one parallel pass over all their items (each thread's range starts inside
// some entry): still the separate calls' bits.
TEST_F(CpuBackendTest, AttentionBatchOfManyUnevenEntriesIsTheSeparateCalls) {
  constexpr int kEntries = 9;
  std::vector<HostTensor> q, k, v, pos;
  int64_t total = 0;
  std::vector<int64_t> begin;
  for (int e = 0; e < kEntries; ++e) {
    const int64_t s = 1 + e % 3, t = 40 + 37 * e;
    q.push_back(random({s, 8, 64}));
    k.push_back(random({t, 2, 64}));
    v.push_back(random({t, 2, 64}));
    std::vector<int32_t> p;
    for (int64_t i = 0; i < s; ++i) p.push_back(static_cast<int32_t>(t - s + i));
    pos.push_back(make_i32({s}, p));
    begin.push_back(total);
    total += s;
  }
  HostTensor out(DType::kF32, {total, 8, 64}), want(DType::kF32, {total, 8, 64});
  auto entry = [&](int e, const HostTensor& o) {
    return AttentionParams{.q = q[e],
                           .k = k[e],
                           .v = v[e],
                           .out = o.view().slice_rows(begin[e], begin[e] + q[e].view().dim(0)),
                           .q_positions = pos[e],
                           .window = e % 2 == 0 ? 0 : 50};
  };
  std::vector<AttentionParams> entries;
  for (int e = 0; e < kEntries; ++e) entries.push_back(entry(e, out));
  be_.attention_batch(entries);
  for (int e = 0; e < kEntries; ++e) be_.attention(entry(e, want));
  EXPECT_TRUE(same_bits(out, want));
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

// ---- fused forms (Backend defaults on the CPU) ----

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
}  // namespace specula
