// SPDX-License-Identifier: Apache-2.0
// Speculative sampling over whole chains: with drafts of k = 4 and 8 and
// several rounds per request, every emitted token follows the target's
// distribution given the tokens before it, whichever way it was produced
// (accepted draft, residual sample after a rejection, bonus token after a
// fully accepted window, or the prefill's first token).
//
// The statistics. A request's token at position j, given its prefix (prompt
// and tokens 0..j-1), must be drawn from p(. | prefix): the target's
// processed distribution (temperature, top-k, top-p), computed here from a
// plain target forward over the request's tokens. Prefixes differ from row to
// row, so observations are binned by the RANK of the emitted token in its own
// p (0 = most likely; the tail pooled): under the null hypothesis an
// observation falls in bin r with probability p_r(prefix), known exactly. Over
// n observations the counts O minus E = sum p(prefix) is a sum of martingale
// differences (each observation centred given everything before it in its row;
// rows are independent), with conditional covariance
// C = sum (diag(p) - p p^T). So (O - E)^T C^-1 (O - E) (one bin dropped) is
// asymptotically chi-square with (bins - 1) degrees of freedom, although the
// bins' probabilities change from one observation to the next; Pearson's
// statistic would not be, as the multinomial's covariance no longer applies.
// Trailing bins expecting fewer than kMinExpected (10) are merged into the
// one before them.
//
// Tested per (drafter, k, sampling row type): every position 0..N-1 on its
// own (the positions' statistics are asymptotically independent, being built
// from martingale differences at different times, so their sum is tested as
// well), and the bonus tokens alone: a bonus is drawn from p after every draft
// of its window was accepted, an event independent of the bonus's uniform, so
// given its prefix it too must follow p. (Accepted drafts and residual samples
// on their own follow other laws; only their union with the rest is p.)
//
// The models: the e2b_like fixture (vocabulary 128) and eight drafter setups, as the
// embedded family costs ~25 times more per token and the test must stay
// within a few seconds on one core:
//   - its assistant (takes device inputs, so its rows sample with the
//     backend's ops); random weights, so it is accepted ~4% of the time:
//     mostly rejections and residual samples;
//   - "close": a copy of the target as drafter, logits x 0.8 (host path):
//     acceptance 0.55-0.83, so whole windows of 4 and of 8 are accepted and
//     followed by a bonus token many times (asserted);
//   - "sharp": the same, logits x 3 (q much sharper than p): rejections at
//     every depth with a residual max(p - q, 0) far from p.
//   - "assistant+prune" and "close+prune": the same two wrapped in a
//     pruning drafter (pruning_drafter.h) whose draft_lengths keeps draft j
//     unless a hash of the history and the drafts before j says stop (a
//     stopping rule, as confidence pruning is): pruned windows on device
//     rounds and on host rounds, and bonus tokens after every kept draft was
//     accepted;
//   - "dspark" and "dspark+prune": a random DSpark block drafter (specula
//     layout, γ 8: one backbone pass per round, the head steps chained on the
//     device), without and with confidence pruning (threshold 0.5 at every
//     position; c_k reads draft k-1, a stopping rule). Random weights: accepted
//     ~1% of the time, so this covers its proposals' q and the pruned windows'
//     residuals and bonus tokens, not long accepted chains (close does that).
//   - "dspark+sched": the same DSpark drafter unpruned with the verify
//     scheduler on (EngineOptions::scheduler, Alg. 1 over all 400 rows of a
//     round, a synthetic SPS table that makes it cut): windows cut by a
//     stopping rule that depends on the other rows too.
// Each drafter runs 100 rows per (k, row type): top-k 8 and top-p 0.8 rows at
// temperature 0.8, 16 tokens each.
//
// The seeds are fixed, so the test is deterministic. Per-position and bonus
// tests at significance 1e-4, the summed statistic at 1e-3: with 200 tests a
// correct implementation passes with room (largest per-position statistic at
// these seeds: 28.6 against a limit of 34.1, p ~ 8e-4; a control run of 400
// rows per case without speculation and with it showed no excess either).
// Power, measured by breaking verify_window (engine/sampling/speculative.cpp)
// in a scratch build:
//   - residual sampled from p instead of norm(max(p - q, 0)): the sharp
//     drafter's summed statistics 242/80, 281/139, 301/80, 368/137 against
//     limits of 125-196, and 10 failures in all;
//   - every draft accepted: 3610 tokens outside the target's support, and the
//     summed statistics up to 10 times their limits (88 failures);
//   - the bonus drawn from the previous window row's p: 842 tokens outside the
//     support, and the bonus test fails (close, k = 4, top-p: 35.9 > 32.3).
// The assistant (acceptance ~4%) and close (q near p) drafters alone would
// not see the first break, whose effect scales with how far q is from p:
// that is the sharp drafter's job.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/sampling/sampler.h"
#include "engine/speculative/decoder.h"
#include "engine/speculative/engine.h"
#include "tests/unit/dspark/dspark_test_util.h"
#include "tests/unit/model/golden_util.h"
#include "tests/unit/speculative/pruning_drafter.h"

namespace specula {
namespace {

using speculative::DecodeRequest;
using speculative::DecodeResult;

// The target itself (a second copy) as the drafter, its logits multiplied by
// `scale` before the sampling pipeline makes q of them: 1 would give q = p
// (every draft accepted), < 1 a flatter q, > 1 a sharper one. It keeps a cache
// per sequence, trimmed to the history the engine passes at step 0. It does
// not take device inputs, so its rows draft and sample on the host path.
class SelfDrafter : public Drafter {
 public:
  SelfDrafter(gemma4::Gemma4Model& model, float scale) : model_(model), scale_(scale) {}
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  Tensor step(int step_index, std::span<const DraftRow> rows) override {
    std::vector<gemma4::ForwardRow> forward(rows.size());
    std::vector<std::vector<int32_t>> feed(rows.size());
    for (size_t b = 0; b < rows.size(); ++b) {
      const DraftRow& r = rows[b];
      auto& seq = seqs_[r.sequence];
      if (!seq) seq = std::make_unique<Sequence>(Sequence{model_.new_sequence(), {}});
      if (step_index == 0) {
        // Keep what the cache shares with the history, less at least the
        // pending token (whose logits are wanted).
        size_t keep = 0;
        while (keep + 1 < r.history.size() && keep < seq->tokens.size() &&
               seq->tokens[keep] == r.history[keep])
          ++keep;
        seq->kv.truncate(static_cast<int64_t>(keep));
        seq->tokens.resize(keep);
        feed[b].assign(r.history.begin() + static_cast<std::ptrdiff_t>(keep), r.history.end());
      } else {
        feed[b] = {r.token};
      }
      seq->tokens.insert(seq->tokens.end(), feed[b].begin(), feed[b].end());
      forward[b] = {.kv = &seq->kv, .tokens = feed[b]};
    }
    const Tensor logits = model_.forward(forward).logits;
    logits_ = HostTensor(DType::kF32, logits.shape());
    const std::span<const float> in = logits.f32();
    const std::span<float> out = logits_.f32();
    for (size_t i = 0; i < in.size(); ++i) out[i] = in[i] * scale_;
    return logits_;
  }
  void release(int sequence) override { seqs_.erase(sequence); }

 private:
  struct Sequence {
    SequenceKv kv;
    std::vector<int32_t> tokens;  // what kv holds
  };
  gemma4::Gemma4Model& model_;
  float scale_;
  std::map<int, std::unique_ptr<Sequence>> seqs_;
  HostTensor logits_;
};

// Counts of the emitted tokens' ranks against their exact law (see above).
constexpr int kBins = 10;  // ranks 0..8, and 9 or more
struct RankTally {
  int64_t n = 0;
  std::array<double, kBins> observed{}, expected{};
  std::array<std::array<double, kBins>, kBins> cov{};

  // `sorted`: the prefix's p over its support, descending.
  void add(const std::vector<float>& sorted, int rank) {
    std::array<double, kBins> pb{};
    for (size_t r = 0; r < sorted.size(); ++r) pb[std::min<size_t>(r, kBins - 1)] += sorted[r];
    for (int a = 0; a < kBins; ++a) {
      expected[a] += pb[a];
      for (int b = 0; b < kBins; ++b) cov[a][b] += (a == b ? pb[a] : 0.0) - pb[a] * pb[b];
    }
    observed[std::min(rank, kBins - 1)] += 1;
    ++n;
  }
  void merge(const RankTally& o) {
    n += o.n;
    for (int a = 0; a < kBins; ++a) {
      observed[a] += o.observed[a];
      expected[a] += o.expected[a];
      for (int b = 0; b < kBins; ++b) cov[a][b] += o.cov[a][b];
    }
  }
};

// Bins expecting fewer are merged: at 5 (the textbook rule) the statistic's
// tail is visibly heavier than chi-square's over this test's many bins.
constexpr double kMinExpected = 10;

struct Statistic {
  double chi2 = 0;
  int dof = 0;
};

// The quadratic form of RankTally's comment, the trailing bins that expect
// fewer than kMinExpected merged into the one before them.
Statistic statistic(const RankTally& t) {
  int bins = kBins;
  std::array<double, kBins> o = t.observed, e = t.expected;
  auto c = t.cov;
  while (bins > 1 && e[bins - 1] < kMinExpected) {
    const int last = bins - 1, into = bins - 2;
    o[into] += o[last];
    e[into] += e[last];
    for (int a = 0; a < bins; ++a) c[a][into] += c[a][last];
    for (int b = 0; b < bins; ++b) c[into][b] += c[last][b];
    --bins;
  }
  const int m = bins - 1;  // the last bin is determined by the others
  if (m < 1) return {};
  // Solve C x = d by Gaussian elimination (C is m x m, positive definite).
  std::vector<std::vector<double>> a(static_cast<size_t>(m), std::vector<double>(m + 1));
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < m; ++j) a[i][j] = c[i][j];
    a[i][m] = o[i] - e[i];
  }
  for (int col = 0; col < m; ++col) {
    int piv = col;
    for (int r = col + 1; r < m; ++r)
      if (std::abs(a[r][col]) > std::abs(a[piv][col])) piv = r;
    std::swap(a[col], a[piv]);
    for (int r = 0; r < m; ++r) {
      if (r == col) continue;
      const double f = a[r][col] / a[col][col];
      for (int j = col; j <= m; ++j) a[r][j] -= f * a[col][j];
    }
  }
  double chi2 = 0;
  for (int i = 0; i < m; ++i) chi2 += (o[i] - e[i]) * a[i][m] / a[i][i];
  return {chi2, m};
}

// Upper quantile of chi-square(dof) at the standard normal quantile z
// (Wilson-Hilferty).
double chi2_limit(int dof, double z) {
  const double k = dof;
  return k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3);
}
constexpr double kZ1e4 = 3.719;  // one-sided 1e-4
constexpr double kZ1e3 = 3.090;  // one-sided 1e-3

// The DSpark drafter's pruning threshold: at its seed it cuts most drafts past
// position 0 (a cut at the first position below it), some rows keeping more.
constexpr float kDSparkThreshold = 0.5f;

TEST(SpeculativeChains, EveryPositionFollowsTheTarget) {
  if (!testing::golden_exists("e2b_like") || !testing::golden_exists("e2b_like_assistant"))
    GTEST_SKIP() << "fixtures missing";
  auto target = gemma4::Gemma4Model::load(testing::golden_dir("e2b_like"));
  auto assistant_model = assistant::AssistantModel::load(testing::golden_dir("e2b_like_assistant"),
                                                         target->config(), target->backend());
  assistant::AssistantDrafter assistant(*target, *assistant_model);
  auto copy = gemma4::Gemma4Model::load(testing::golden_dir("e2b_like"));
  SelfDrafter close(*copy, 0.8f), sharp(*copy, 3.0f);
  // Pruning (Drafter::draft_lengths) by a stopping rule on the drafts before
  // each one: on device rounds (assistant) and host rounds (close).
  using testing::PruningDrafter;
  PruningDrafter assistant_pruned(assistant, target->backend(), PruningDrafter::Rule::kStopping);
  PruningDrafter close_pruned(close, target->backend(), PruningDrafter::Rule::kStopping);
  assistant_pruned.check_greedy = close_pruned.check_greedy = false;
  // DSpark: a random specula-layout block drafter of γ 8 over the target's
  // taps (device inputs: its rows sample with the backend's ops), without and
  // with confidence pruning (kDSparkThreshold at every position).
  auto dspark_model =
      dspark::DSparkModel::random(testing::small_specula_dspark(target->config(), 8), *target,
                                  target->backend(), 21, DType::kF32);
  dspark::DSparkDrafter dspark_plain(*target, *dspark_model), dspark_pruned(*target, *dspark_model);
  dspark_pruned.set_thresholds(std::vector<float>(8, kDSparkThreshold));
  const std::vector<int32_t> prompt = {5, 17, 33, 2, 90, 41, 7};
  const int64_t V = target->config().vocab_size;

  constexpr int kTokens = 16;        // positions 0..15: several rounds at k = 8
  constexpr int kRowsPerCase = 100;  // per (drafter, k, row type)
  const int ks[] = {4, 8};
  SamplingParams top_k, top_p;
  top_k.temperature = 0.8f;
  top_k.top_k = 8;
  top_p.temperature = 0.8f;
  top_p.top_p = 0.8f;
  const SamplingParams* kinds[] = {&top_k, &top_p};
  const char* kind_names[] = {"top_k=8", "top_p=0.8"};

  struct Drafted {
    const char* name;
    Drafter* drafter;
    bool pruned;
    bool scheduled = false;  // with the verify scheduler (EngineOptions::scheduler)
  };
  // The verify scheduler's cost table for "dspark+sched": a step costs 20 ms
  // plus 0.01 ms a token, so at the ~400-1000 tokens of these rounds a draft
  // is verified only when its survival is above ~0.2 of τ/B: real cuts, by
  // Alg. 1's stopping rule, and real verified drafts.
  const auto sps = std::make_shared<const speculative::SpsTable>(
      std::vector<speculative::SpsPoint>{{1, 1000.0 / 20.01}, {4096, 1000.0 / 60.96}}, "test",
      "test");
  SamplingWorkspace ws(V);
  int64_t all_bonus = 0, impossible = 0;
  double worst_logprob_diff = 0;
  for (const Drafted& d :
       {Drafted{"assistant", &assistant, false}, Drafted{"close", &close, false},
        Drafted{"sharp", &sharp, false}, Drafted{"assistant+prune", &assistant_pruned, true},
        Drafted{"close+prune", &close_pruned, true}, Drafted{"dspark", &dspark_plain, false},
        Drafted{"dspark+prune", &dspark_pruned, true},
        Drafted{"dspark+sched", &dspark_plain, false, true}}) {
    // One engine call: every (k, kind) case's rows, each with its own seed.
    std::vector<DecodeRequest> reqs;
    for (int ki = 0; ki < 2; ++ki) {
      for (int kind = 0; kind < 2; ++kind) {
        for (int i = 0; i < kRowsPerCase; ++i) {
          DecodeRequest r{.prompt = prompt, .params = *kinds[kind]};
          r.params.max_tokens = kTokens;
          r.params.seed = 1000003 * (1 + ki * 2 + kind) + static_cast<uint64_t>(i);
          r.draft_tokens = ks[ki];
          r.logprobs = 0;
          reqs.push_back(r);
        }
      }
    }
    std::vector<DecodeResult> results;
    if (d.scheduled) {
      speculative::Engine engine(
          *target, d.drafter,
          {.schedule = {.draft_tokens = 8},
           .max_rows = static_cast<int>(reqs.size()),
           .max_waiting = static_cast<int>(reqs.size()),
           .scheduler = {.mode = speculative::SchedulerMode::kOn, .sps = sps}});
      results = speculative::decode(engine, reqs);
    } else {
      results = speculative::decode(*target, d.drafter, reqs, {.draft_tokens = 8});
    }

    for (int ki = 0; ki < 2; ++ki) {
      for (int kind = 0; kind < 2; ++kind) {
        const SamplingParams& params = *kinds[kind];
        std::vector<RankTally> at(kTokens);
        RankTally bonus;
        int64_t drafted = 0, accepted = 0, pruned = 0, scheduled_cut = 0;
        int64_t full_bonus = 0;  // after a whole window of k accepted drafts
        // p for each prefix seen (the generated tokens; the prompt is fixed).
        std::map<std::vector<int32_t>, std::vector<std::pair<float, int32_t>>> cache;
        for (int i = 0; i < kRowsPerCase; ++i) {
          const size_t row = static_cast<size_t>((ki * 2 + kind) * kRowsPerCase + i);
          const DecodeResult& res = results[row];
          ASSERT_EQ(res.tokens.size(), static_cast<size_t>(kTokens));
          drafted += res.stats.drafted;
          accepted += res.stats.accepted;
          pruned += res.stats.pruned;
          scheduled_cut += res.stats.scheduled_cut;
          // Which positions are bonus tokens: position 0 comes with the
          // prefill, then each round commits its accepted drafts and a token.
          std::vector<bool> is_bonus(kTokens, false);
          size_t pos = 1;
          for (size_t r = 0; r < res.stats.round_accepted.size(); ++r) {
            const int a = res.stats.round_accepted[r], dr = res.stats.round_drafted[r];
            pos += static_cast<size_t>(a);
            if (dr > 0 && a == dr) is_bonus[pos] = true;
            full_bonus += dr == ks[ki] && a == dr;
            ++pos;
          }
          ASSERT_EQ(pos, static_cast<size_t>(kTokens));
          // The target's logits at every position, from one plain forward.
          std::vector<int32_t> ctx = prompt;
          ctx.insert(ctx.end(), res.tokens.begin(), res.tokens.end() - 1);
          SequenceKv kv = target->new_sequence();
          gemma4::ForwardRow fr{.kv = &kv, .tokens = ctx, .all_logits = true};
          const Tensor logits = target->forward(std::span(&fr, 1)).logits;
          for (int j = 0; j < kTokens; ++j) {
            const size_t out_row = prompt.size() - 1 + static_cast<size_t>(j);
            const std::span<const float> l =
                logits.f32().subspan(out_row * static_cast<size_t>(V), static_cast<size_t>(V));
            const int32_t t = res.tokens[static_cast<size_t>(j)];
            // The engine's logprob of the token, from the logits it sampled
            // from: checks that these are the same logits (same prefix).
            double mx = l[0], sum = 0;
            for (float x : l) mx = std::max<double>(mx, x);
            for (float x : l) sum += std::exp(x - mx);
            worst_logprob_diff = std::max(worst_logprob_diff,
                                          std::abs(l[static_cast<size_t>(t)] - mx - std::log(sum) -
                                                   res.token_logprobs[static_cast<size_t>(j)]));
            std::vector<int32_t> key(res.tokens.begin(), res.tokens.begin() + j);
            auto it = cache.find(key);
            if (it == cache.end()) {
              const std::span<const float> probs =
                  process_logits(l,
                                 {.tokens = std::span(ctx).first(prompt.size() + key.size()),
                                  .num_prompt = prompt.size()},
                                 params, ws);
              std::vector<std::pair<float, int32_t>> support;
              for (int32_t v : ws.support()) support.emplace_back(probs[static_cast<size_t>(v)], v);
              std::sort(support.begin(), support.end(), [](const auto& x, const auto& y) {
                return x.first != y.first ? x.first > y.first : x.second < y.second;
              });
              it = cache.emplace(std::move(key), std::move(support)).first;
            }
            const auto& support = it->second;
            std::vector<float> sorted;
            int rank = -1;
            for (size_t r = 0; r < support.size(); ++r) {
              sorted.push_back(support[r].first);
              if (support[r].second == t) rank = static_cast<int>(r);
            }
            if (rank < 0) {
              ++impossible;
              continue;
            }
            at[static_cast<size_t>(j)].add(sorted, rank);
            if (is_bonus[static_cast<size_t>(j)]) bonus.add(sorted, rank);
          }
        }
        // Every position alone, their sum, and the bonus tokens alone.
        RankTally all;
        double sum_chi2 = 0;
        int sum_dof = 0;
        std::string line;
        for (int j = 0; j < kTokens; ++j) {
          const Statistic s = statistic(at[static_cast<size_t>(j)]);
          all.merge(at[static_cast<size_t>(j)]);
          sum_chi2 += s.chi2;
          sum_dof += s.dof;
          char buf[32];
          std::snprintf(buf, sizeof buf, " %.1f/%d", s.chi2, s.dof);
          line += buf;
          EXPECT_GE(s.dof, 1) << d.name << " k " << ks[ki] << " " << kind_names[kind] << " pos "
                              << j;
          EXPECT_LT(s.chi2, chi2_limit(s.dof, kZ1e4))
              << d.name << " k " << ks[ki] << " " << kind_names[kind] << " position " << j;
        }
        const Statistic b = statistic(bonus);
        std::printf(
            "[ chains ] %s k=%d %s: acceptance %.3f, pruned %lld, scheduler cut %lld, %lld bonus "
            "tokens (%lld after k accepted; chi2 %.1f/%d), sum over "
            "positions %.1f/%d (limit %.1f); chi2/dof by position:%s\n",
            d.name, ks[ki], kind_names[kind], drafted ? double(accepted) / drafted : 0.0,
            static_cast<long long>(pruned), static_cast<long long>(scheduled_cut),
            static_cast<long long>(bonus.n), static_cast<long long>(full_bonus), b.chi2, b.dof,
            sum_chi2, sum_dof, chi2_limit(sum_dof, kZ1e3), line.c_str());
        EXPECT_LT(sum_chi2, chi2_limit(sum_dof, kZ1e3))
            << d.name << " k " << ks[ki] << " " << kind_names[kind];
        if (b.dof > 0) {
          EXPECT_LT(b.chi2, chi2_limit(b.dof, kZ1e4))
              << d.name << " k " << ks[ki] << " " << kind_names[kind] << " bonus";
        }
        all_bonus += bonus.n;
        // The close drafter's rows reach the bonus after whole windows of k
        // accepted drafts many times (k = 4: 170-230, k = 8: 50-80 at these seeds).
        if (d.drafter == &close) {
          EXPECT_GE(full_bonus, ks[ki] == 4 ? 100 : 30)
              << "k " << ks[ki] << " " << kind_names[kind];
        }
        EXPECT_GT(accepted, 0);
        EXPECT_LT(accepted, drafted);
        if (d.pruned) {
          EXPECT_GT(pruned, drafted / 10) << d.name << " k " << ks[ki] << " " << kind_names[kind];
        } else {
          EXPECT_EQ(pruned, 0);
        }
        if (d.scheduled) {
          EXPECT_GT(scheduled_cut, drafted / 10)
              << d.name << " k " << ks[ki] << " " << kind_names[kind];
        } else {
          EXPECT_EQ(scheduled_cut, 0);
        }
      }
    }
  }
  EXPECT_EQ(impossible, 0) << "tokens outside the target's support";
  EXPECT_GE(all_bonus, 800) << "the bonus path must be exercised";
  EXPECT_LT(worst_logprob_diff, 1e-3);
  std::printf("[ chains ] %lld bonus tokens; worst logprob difference %.2g\n",
              static_cast<long long>(all_bonus), worst_logprob_diff);
}

}  // namespace
}  // namespace specula
