// SPDX-License-Identifier: Apache-2.0
// The device sampling ops (cuda_sampling.cu) against the CPU backend, which
// runs the host sampling pipeline itself: process_logits_rows keeps the same
// tokens with the same probabilities (to an ulp) for every truncation, ties,
// masked tokens, greedy rows, in place and a row alone as in a batch;
// sample_rows and speculative_accept_rows choose the same tokens for the same
// uniforms; bad rows come back as -1; repeated runs give the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "engine/sampling/rng.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// Probabilities: exp and the double sums may round an ulp apart.
constexpr double kProbTol = 2e-6;

Twin params_twin(const std::vector<RowSampling>& rows) {
  Twin t(DType::kI32, {static_cast<int64_t>(rows.size()), 4});
  std::memcpy(t.host.view().data(), rows.data(), rows.size() * sizeof(RowSampling));
  t.push();
  return t;
}

Twin uniforms_twin(const std::vector<int64_t>& bits) {
  Twin t(DType::kI64, {static_cast<int64_t>(bits.size())});
  std::memcpy(t.host.view().data(), bits.data(), bits.size() * sizeof(int64_t));
  t.push();
  return t;
}

// Logits of `rows` x `vocab` in [-6, 6) with some structure per row: row 1
// has a run of tokens tied at the maximum, row 2 masked (-inf) tokens, row 3
// many tokens tied just below the maximum (top-k and top-p cut through ties).
Twin structured_logits(int64_t rows, int64_t vocab, uint64_t seed) {
  Twin t(DType::kF32, {rows, vocab});
  cpu_be().fill_uniform(t.host, seed, -6.0f, 6.0f);
  float* l = t.host.data<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = l + r * vocab;
    switch (r % 4) {
      case 1:
        for (int64_t j = 3; j < vocab; j += std::max<int64_t>(vocab / 7, 1)) row[j] = 9.0f;
        break;
      case 2:
        for (int64_t j = 0; j < vocab; j += 3) row[j] = neg_inf;
        break;
      case 3:
        row[vocab / 2] = 8.0f;
        for (int64_t j = 1; j < vocab; j += 5) row[j] = 7.5f;
        break;
      default:
        break;
    }
  }
  t.push();
  return t;
}

std::vector<RowSampling> sampling_cases() {
  return {
      {.temperature = 1.0f},
      {.temperature = 0.7f, .top_k = 50},
      {.temperature = 1.0f, .top_p = 0.9f},
      {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f},
      {.temperature = 0.0f},
      {.temperature = 1.3f, .min_p = 0.1f},
      {.temperature = 1.0f, .top_p = 0.5f},
      {.temperature = 1.0f, .top_k = 1},
      {.temperature = 2.0f, .top_k = 3, .top_p = 0.3f},
      {.temperature = 0.5f, .top_p = 0.999f},
  };
}

// Same surviving tokens; probabilities within kProbTol relative.
void expect_same_distribution(const Tensor& got, const Tensor& want, int64_t vocab,
                              const std::string& what) {
  const float* g = got.data_as<const float>();
  const float* w = want.data_as<const float>();
  const int64_t rows = want.numel() / vocab;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t support_mismatch = 0, value_mismatch = 0, first = -1;
    for (int64_t j = 0; j < vocab; ++j) {
      const float a = g[r * vocab + j], b = w[r * vocab + j];
      if ((a > 0.0f) != (b > 0.0f)) {
        ++support_mismatch;
        if (first < 0) first = j;
      } else if (std::fabs(double(a) - double(b)) > kProbTol * double(b) + 1e-30) {
        ++value_mismatch;
        if (first < 0) first = j;
      }
    }
    EXPECT_EQ(support_mismatch, 0) << what << " row " << r << " first at " << first;
    EXPECT_EQ(value_mismatch, 0) << what << " row " << r << " first at " << first << ": got "
                                 << (first >= 0 ? g[r * vocab + first] : 0) << " want "
                                 << (first >= 0 ? w[r * vocab + first] : 0);
  }
}

TEST(CudaSampling, ProcessLogitsRowsMatchesTheHostPipeline) {
  SKIP_WITHOUT_CUDA();
  const std::vector<RowSampling> cases = sampling_cases();
  for (int64_t vocab : {int64_t{37}, int64_t{1000}, int64_t{262144}}) {
    // Every case on every kind of row: rows = 4 kinds x cases.
    const auto rows = static_cast<int64_t>(4 * cases.size());
    Twin logits = structured_logits(rows, vocab, 7 + static_cast<uint64_t>(vocab));
    std::vector<RowSampling> per_row;
    for (int64_t r = 0; r < rows; ++r) per_row.push_back(cases[static_cast<size_t>(r / 4)]);
    Twin params = params_twin(per_row);
    Twin probs(DType::kF32, {rows, vocab});
    cpu_be().process_logits_rows(logits.host, params.host, probs.host);
    gpu_be().process_logits_rows(logits.dev, params.dev, probs.dev);
    const HostTensor got = probs.pull();
    expect_same_distribution(got, probs.host, vocab, "V " + std::to_string(vocab));

    // Deterministic, and the same in place.
    gpu_be().process_logits_rows(logits.dev, params.dev, probs.dev);
    const HostTensor again = probs.pull();
    EXPECT_EQ(std::memcmp(again.view().data(), got.view().data(), got.view().nbytes()), 0)
        << "V " << vocab << ": a second run differs";
    // A row alone gives the bits it gets inside the batch (the cluster of
    // blocks per row combines only that row's partials).
    Twin one(DType::kF32, {1, vocab});
    for (int64_t r = 0; r < rows; r += 3) {
      gpu_be().process_logits_rows(logits.dev.slice_rows(r, r + 1), params.dev.slice_rows(r, r + 1),
                                   one.dev);
      const HostTensor alone = one.pull();
      EXPECT_EQ(
          std::memcmp(alone.view().data(), got.data<float>() + r * vocab, alone.view().nbytes()), 0)
          << "V " << vocab << " row " << r << ": alone differs from inside the batch";
    }
    gpu_be().process_logits_rows(logits.dev, params.dev, logits.dev);
    const HostTensor in_place = logits.pull();
    EXPECT_EQ(std::memcmp(in_place.view().data(), got.view().data(), got.view().nbytes()), 0)
        << "V " << vocab << ": in place differs";
  }
}

TEST(CudaSampling, InvalidRowsBecomeNaNAndTokenMinusOne) {
  SKIP_WITHOUT_CUDA();
  const int64_t vocab = 4096;
  Twin logits(DType::kF32, {3, vocab});
  cpu_be().fill_uniform(logits.host, 3, -1.0f, 1.0f);
  float* l = logits.host.data<float>();
  l[17] = std::numeric_limits<float>::quiet_NaN();                                   // row 0: a NaN
  l[vocab + 5] = std::numeric_limits<float>::infinity();                             // row 1: +inf
  std::fill(l + 2 * vocab, l + 3 * vocab, -std::numeric_limits<float>::infinity());  // row 2
  logits.push();
  Twin params = params_twin(std::vector<RowSampling>(3, RowSampling{.temperature = 1.0f}));
  Twin probs(DType::kF32, {3, vocab});
  EXPECT_THROW(cpu_be().process_logits_rows(logits.host, params.host, probs.host), Error);
  gpu_be().process_logits_rows(logits.dev, params.dev, probs.dev);
  const HostTensor p = probs.pull();
  for (int64_t r = 0; r < 3; ++r) EXPECT_TRUE(std::isnan(p.data<float>()[r * vocab])) << r;
  Twin u = uniforms_twin({1, 2, 3});
  Twin out(DType::kI32, {3});
  gpu_be().sample_rows(probs.dev, u.dev, out.dev);
  const HostTensor ids = out.pull();
  for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(ids.data<int32_t>()[r], -1) << r;

  // No mass, and a uniform outside [0, 2^53).
  Twin zeros(DType::kF32, {2, vocab});
  std::fill(zeros.host.data<float>(), zeros.host.data<float>() + 2 * vocab, 0.0f);
  zeros.host.data<float>()[vocab + 9] = 1.0f;
  zeros.push();
  Twin bad_u = uniforms_twin({5, int64_t{1} << 53});
  Twin out2(DType::kI32, {2});
  gpu_be().sample_rows(zeros.dev, bad_u.dev, out2.dev);
  const HostTensor ids2 = out2.pull();
  EXPECT_EQ(ids2.data<int32_t>()[0], -1);
  EXPECT_EQ(ids2.data<int32_t>()[1], -1);
  EXPECT_THROW(cpu_be().sample_rows(zeros.host, bad_u.host, out2.host), Error);
}

TEST(CudaSampling, SampleRowsChoosesTheHostToken) {
  SKIP_WITHOUT_CUDA();
  for (int64_t vocab : {int64_t{37}, int64_t{262144}}) {
    // Distributions from the host pipeline, each row sampled with many uniforms.
    const std::vector<RowSampling> cases = sampling_cases();
    const auto kinds = static_cast<int64_t>(cases.size());
    Twin logits = structured_logits(kinds, vocab, 21);
    Twin params = params_twin(cases);
    Twin dist(DType::kF32, {kinds, vocab});
    cpu_be().process_logits_rows(logits.host, params.host, dist.host);
    const int64_t per_kind = 40;
    const int64_t rows = kinds * per_kind;
    Twin probs(DType::kF32, {rows, vocab});
    std::vector<int64_t> bits;
    Rng rng(99);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(probs.host.data<float>() + r * vocab,
                  dist.host.data<float>() + (r / per_kind) * vocab,
                  static_cast<size_t>(vocab) * sizeof(float));
      const int64_t i = r % per_kind;
      // The ends of [0, 1) too.
      bits.push_back(i == 0   ? 0
                     : i == 1 ? (int64_t{1} << 53) - 1
                              : static_cast<int64_t>(rng.uniform_bits()));
    }
    probs.push();
    Twin u = uniforms_twin(bits);
    Twin out(DType::kI32, {rows});
    cpu_be().sample_rows(probs.host, u.host, out.host);
    gpu_be().sample_rows(probs.dev, u.dev, out.dev);
    expect_equal_i32(out.pull(), out.host, ("sample_rows V " + std::to_string(vocab)).c_str());
  }
}

TEST(CudaSampling, SpeculativeAcceptRowsMatchesTheHostRule) {
  SKIP_WITHOUT_CUDA();
  for (int64_t vocab : {int64_t{53}, int64_t{262144}}) {
    // Rows with 0..5 drafts; q from logits near p's, so drafts are both
    // accepted and rejected; drafts are samples of q, or of p, or tokens q
    // rules out.
    const std::vector<int> ks = {0, 1, 3, 5, 2, 4, 5, 1, 0, 3};
    const int64_t R = static_cast<int64_t>(ks.size());
    int64_t M = 0, Q = 0;
    for (int k : ks) M += k + 1, Q += k;
    Twin p_logits(DType::kF32, {M, vocab});
    Twin q_logits(DType::kF32, {Q, vocab});
    cpu_be().fill_uniform(p_logits.host, 5, -3.0f, 3.0f);
    cpu_be().fill_uniform(q_logits.host, 6, -0.4f, 0.4f);
    std::vector<RowSampling> p_params, q_params;
    const std::vector<RowSampling> cases = sampling_cases();
    std::vector<int32_t> tokens(static_cast<size_t>(M)), q_rows(static_cast<size_t>(M), 0),
        begin(static_cast<size_t>(R + 1), 0);
    std::vector<int64_t> bits(static_cast<size_t>(M));
    Rng rng(11);
    int64_t m = 0, qi = 0;
    for (int64_t r = 0; r < R; ++r) {
      const RowSampling rs = cases[static_cast<size_t>(r) % cases.size()];
      begin[static_cast<size_t>(r)] = static_cast<int32_t>(m);
      for (int j = 0; j <= ks[static_cast<size_t>(r)]; ++j, ++m) {
        p_params.push_back(rs);
        bits[static_cast<size_t>(m)] = static_cast<int64_t>(rng.uniform_bits());
        if (j == 0) {
          tokens[static_cast<size_t>(m)] = 1;
          continue;
        }
        // q = p's logits of the position before, nudged (row r % 3 == 2: q == p exactly).
        float* ql = q_logits.host.data<float>() + qi * vocab;
        const float* pl = p_logits.host.data<float>() + (m - 1) * vocab;
        for (int64_t v = 0; v < vocab; ++v) ql[v] = r % 3 == 2 ? pl[v] : pl[v] + ql[v];
        q_params.push_back(rs);
        q_rows[static_cast<size_t>(m)] = static_cast<int32_t>(qi++);
      }
    }
    begin[static_cast<size_t>(R)] = static_cast<int32_t>(m);
    p_logits.push();
    q_logits.push();
    Twin pp = params_twin(p_params), qp = params_twin(q_params);
    Twin p(DType::kF32, {M, vocab}), q(DType::kF32, {Q, vocab});
    cpu_be().process_logits_rows(p_logits.host, pp.host, p.host);
    cpu_be().process_logits_rows(q_logits.host, qp.host, q.host);
    // Drafts: sampled from q mostly; every 4th from p's argmax; every 7th a token q rules out.
    for (int64_t r = 0; r < R; ++r) {
      for (int j = 1; j <= ks[static_cast<size_t>(r)]; ++j) {
        const int64_t w = begin[static_cast<size_t>(r)] + j;
        const float* qrow = q.host.data<float>() + q_rows[static_cast<size_t>(w)] * vocab;
        int32_t d = 0;
        if (w % 7 == 0) {
          while (d + 1 < vocab && qrow[d] > 0.0f)
            ++d;  // a token of probability 0 under q (or the last)
        } else if (w % 4 == 0) {
          const float* prow = p.host.data<float>() + (w - 1) * vocab;
          d = static_cast<int32_t>(std::max_element(prow, prow + vocab) - prow);
        } else {
          double u = rng.uniform(), run = 0;
          for (d = 0; d + 1 < vocab; ++d) {
            run += qrow[d];
            if (run > u) break;
          }
        }
        tokens[static_cast<size_t>(w)] = d;
      }
    }
    p.push();
    q.push();
    Twin tok(DType::kI32, {M}), qr(DType::kI32, {M}), rb(DType::kI32, {R + 1});
    std::memcpy(tok.host.view().data(), tokens.data(), tokens.size() * 4);
    std::memcpy(qr.host.view().data(), q_rows.data(), q_rows.size() * 4);
    std::memcpy(rb.host.view().data(), begin.data(), begin.size() * 4);
    tok.push();
    qr.push();
    rb.push();
    Twin u = uniforms_twin(bits);
    Twin out(DType::kI32, {R, 2});
    cpu_be().speculative_accept_rows({.p = p.host,
                                      .q = q.host,
                                      .tokens = tok.host,
                                      .q_rows = qr.host,
                                      .uniforms = u.host,
                                      .row_begin = rb.host,
                                      .out = out.host});
    gpu_be().speculative_accept_rows({.p = p.dev,
                                      .q = q.dev,
                                      .tokens = tok.dev,
                                      .q_rows = qr.dev,
                                      .uniforms = u.dev,
                                      .row_begin = rb.dev,
                                      .out = out.dev});
    const HostTensor got = out.pull();
    expect_equal_i32(got, out.host, ("speculative_accept_rows V " + std::to_string(vocab)).c_str());
    // The test must see both outcomes.
    int64_t accepted = 0, rejected = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int32_t n = out.host.data<int32_t>()[2 * r];
      accepted += n;
      rejected += n < ks[static_cast<size_t>(r)];
    }
    EXPECT_GT(accepted, 0) << vocab;
    EXPECT_GT(rejected, 0) << vocab;
  }
}

// apply_penalties_rows on the GPU gives the CPU's (the host sampler's)
// penalised logits bit for bit: distinct tokens per row, prompt-only and
// generated ones, repetition above and below 1, -inf and zero logits, an empty
// list, the same token in two rows; at V = 1,000 and 262,144.
TEST(CudaSampling, ApplyPenaltiesRowsMatchesTheCpu) {
  SKIP_WITHOUT_CUDA();
  for (int64_t vocab : {int64_t{1000}, int64_t{262144}}) {
    constexpr int64_t kRows = 5;
    Twin logits(DType::kF32, {kRows, vocab});
    logits.randomize(31 + static_cast<uint64_t>(vocab), -6.0f, 6.0f);
    float* lg = logits.host.data<float>();
    lg[0 * vocab + 3] = -std::numeric_limits<float>::infinity();
    lg[2 * vocab + 4] = 0.0f;
    logits.push();
    Rng rng(5);
    std::vector<int32_t> begin = {0}, tokens, counts;
    for (int64_t m = 0; m < kRows; ++m) {
      const int64_t n = m == 1 ? 0 : 50 + 97 * m;  // row 1: no entries
      std::vector<int32_t> row;
      if (m != 1) row = {3, 4};  // shared by rows, and the crafted logits above
      while (static_cast<int64_t>(row.size()) < n) {
        const auto t = static_cast<int32_t>(rng.uniform() * static_cast<double>(vocab));
        if (std::find(row.begin(), row.end(), t) == row.end()) row.push_back(t);
      }
      for (int32_t t : row) {
        tokens.push_back(t);
        counts.push_back(static_cast<int32_t>(rng.uniform() * 6.0));  // 0: prompt only
      }
      begin.push_back(static_cast<int32_t>(tokens.size()));
    }
    const std::vector<float> pen = {1.3f,  0.5f, 0.75f, 1.0f, 0.0f, 0.0f, 0.8f, -0.5f,
                                    1.25f, 1.5f, 0.0f,  0.0f, 1.1f, 2.0f, -2.0f};
    Twin b(DType::kI32, {kRows + 1}), t(DType::kI32, {static_cast<int64_t>(tokens.size())}),
        c(DType::kI32, {static_cast<int64_t>(counts.size())}), p(DType::kF32, {kRows, 3});
    std::memcpy(b.host.view().data(), begin.data(), begin.size() * sizeof(int32_t));
    std::memcpy(t.host.view().data(), tokens.data(), tokens.size() * sizeof(int32_t));
    std::memcpy(c.host.view().data(), counts.data(), counts.size() * sizeof(int32_t));
    std::memcpy(p.host.view().data(), pen.data(), pen.size() * sizeof(float));
    b.push();
    t.push();
    c.push();
    p.push();
    gpu_be().apply_penalties_rows({.logits = logits.dev,
                                   .list_begin = b.dev,
                                   .tokens = t.dev,
                                   .counts = c.dev,
                                   .penalties = p.dev});
    cpu_be().apply_penalties_rows({.logits = logits.host,
                                   .list_begin = b.host,
                                   .tokens = t.host,
                                   .counts = c.host,
                                   .penalties = p.host});
    const HostTensor got = logits.pull();
    const auto* g = got.data<float>();
    const auto* w = logits.host.data<float>();
    for (int64_t i = 0; i < kRows * vocab; ++i) {
      ASSERT_EQ(std::memcmp(&g[i], &w[i], sizeof(float)), 0)
          << "V " << vocab << " row " << i / vocab << " token " << i % vocab << ": " << g[i]
          << " vs " << w[i];
    }
  }
}

// Rows sharing lists and reading extras (a round's drafts): the GPU gives the
// CPU's penalised logits bit for bit. Extras drawn from the list (prompt-only
// and generated tokens) and outside it, repeated, -1 padding; E = 8 and 64.
TEST(CudaSampling, ApplyPenaltiesRowsSharedListsAndExtrasMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  for (int64_t vocab : {int64_t{1000}, int64_t{262144}}) {
    for (int64_t extras : {int64_t{8}, kMaxPenaltyExtras}) {
      constexpr int64_t kRows = 7, kLists = 3;
      Twin logits(DType::kF32, {kRows, vocab});
      logits.randomize(41 + static_cast<uint64_t>(vocab + extras), -6.0f, 6.0f);
      Rng rng(9);
      auto token = [&] { return static_cast<int32_t>(rng.uniform() * static_cast<double>(vocab)); };
      std::vector<int32_t> begin = {0}, tokens, counts;
      for (int64_t l = 0; l < kLists; ++l) {
        const int64_t n = l == 2 ? 0 : 40 + 300 * l;  // list 2: empty
        std::vector<int32_t> list;
        while (static_cast<int64_t>(list.size()) < n) {
          const int32_t t = token();
          if (std::find(list.begin(), list.end(), t) == list.end()) list.push_back(t);
        }
        for (int32_t t : list) {
          tokens.push_back(t);
          counts.push_back(static_cast<int32_t>(rng.uniform() * 4.0));  // 0: prompt only
        }
        begin.push_back(static_cast<int32_t>(tokens.size()));
      }
      // The source: tokens of list 0 and 1, fresh ones, and a repeated one.
      std::vector<int32_t> source;
      for (int i = 0; i < 24; ++i) source.push_back(tokens[static_cast<size_t>(i * 7)]);
      for (int i = 0; i < 24; ++i) source.push_back(token());
      source.push_back(source[3]);
      std::vector<int32_t> row_list, index;
      for (int64_t m = 0; m < kRows; ++m) {
        row_list.push_back(static_cast<int32_t>(m % kLists));
        const int64_t used = m == 0 ? 0 : std::min<int64_t>(extras, 2 * m + (m == kRows - 1) * 80);
        for (int64_t e = 0; e < extras; ++e) {
          index.push_back(
              e < used ? static_cast<int32_t>(rng.uniform() * static_cast<double>(source.size()))
                       : -1);
        }
      }
      std::vector<float> pen;
      for (int64_t m = 0; m < kRows; ++m) {
        pen.insert(pen.end(), {1.0f + 0.1f * static_cast<float>(m),
                               0.5f - 0.2f * static_cast<float>(m), 0.75f});
      }
      Twin b(DType::kI32, {kLists + 1}), t(DType::kI32, {static_cast<int64_t>(tokens.size())}),
          c(DType::kI32, {static_cast<int64_t>(counts.size())}), p(DType::kF32, {kRows, 3}),
          rl(DType::kI32, {kRows}), src(DType::kI32, {static_cast<int64_t>(source.size())}),
          ei(DType::kI32, {kRows, extras});
      const auto put = [](Twin& tw, const auto& v) {
        std::memcpy(tw.host.view().data(), v.data(), v.size() * sizeof(v[0]));
        tw.push();
      };
      put(b, begin);
      put(t, tokens);
      put(c, counts);
      put(p, pen);
      put(rl, row_list);
      put(src, source);
      put(ei, index);
      gpu_be().apply_penalties_rows({.logits = logits.dev,
                                     .list_begin = b.dev,
                                     .tokens = t.dev,
                                     .counts = c.dev,
                                     .penalties = p.dev,
                                     .row_list = rl.dev,
                                     .extra_source = src.dev,
                                     .extra_index = ei.dev});
      cpu_be().apply_penalties_rows({.logits = logits.host,
                                     .list_begin = b.host,
                                     .tokens = t.host,
                                     .counts = c.host,
                                     .penalties = p.host,
                                     .row_list = rl.host,
                                     .extra_source = src.host,
                                     .extra_index = ei.host});
      const HostTensor got = logits.pull();
      const auto* g = got.data<float>();
      const auto* w = logits.host.data<float>();
      for (int64_t i = 0; i < kRows * vocab; ++i) {
        ASSERT_EQ(std::memcmp(&g[i], &w[i], sizeof(float)), 0)
            << "V " << vocab << " E " << extras << " row " << i / vocab << " token " << i % vocab
            << ": " << g[i] << " vs " << w[i];
      }
    }
  }
}

}  // namespace
}  // namespace specula::test
