// SPDX-License-Identifier: Apache-2.0
// The DSpark drafter on the CPU: config parsing errors, the target identity
// check, weight-table shape errors, the specula layout's save/load round trip,
// incremental context commits equal a fresh one, and speculative decoding with
// random DSpark drafters (both layouts) is lossless against plain decoding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/io/safetensors.h"
#include "engine/speculative/decoder.h"
#include "engine/speculative/engine.h"
#include "tests/unit/dspark/dspark_engine_check.h"
#include "tests/unit/dspark/dspark_test_util.h"
#include "tests/unit/model/golden_util.h"
#include "tests/unit/test_util.h"

namespace specula {
namespace {

using dspark::DSparkConfig;
using dspark::DSparkDrafter;
using dspark::DSparkLayout;
using dspark::DSparkModel;
using nlohmann::json;

using testing::error_of;

// Scratch folders under <build>/dspark_test_tmp/.
const testing::TempDirs temp_dir("dspark_test");

// Small drafters for the dense_kev target (dspark_test_util.h).
DSparkConfig small_specula(const gemma4::Gemma4Config& t, int gamma) {
  return testing::small_specula_dspark(t, gamma);
}

json specula_json() {
  return json::parse(R"({"kind": "dspark-drafter", "variant": "dspark", "version": 1,
    "target": {"hidden_size": 32, "vocab_size": 128, "num_hidden_layers": 4, "config_hash": ""},
    "config": {"block_size": 5, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_mult": 2,
               "markov_rank": 8, "tap_layers": [2, 3, 4], "rms_norm_eps": 1e-6}})");
}

class DSparkTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    target_ = gemma4::Gemma4Model::load(testing::golden_dir("dense_kev")).release();
  }
  static void TearDownTestSuite() {
    delete target_;
    target_ = nullptr;
  }
  static std::unique_ptr<DSparkModel> random_model(DSparkLayout layout, int gamma,
                                                   uint64_t seed = 7) {
    const gemma4::Gemma4Config& t = target_->config();
    return DSparkModel::random(testing::small_dspark(layout, t, gamma), *target_,
                               target_->backend(), seed, DType::kF32);
  }
  // The target's taps of `seq` (one forward), f32 [m, N, H] in `buf`.
  static Tensor taps_of(const std::vector<int32_t>& seq, std::span<const int> taps,
                        std::vector<float>* buf) {
    const int64_t N = static_cast<int64_t>(seq.size()), H = target_->config().hidden_size;
    const auto m = static_cast<int64_t>(taps.size());
    buf->assign(static_cast<size_t>(m * N * H), 0.0f);
    Tensor out(buf->data(), DType::kF32, {m, N, H});
    SequenceKv kv = target_->new_sequence();
    const gemma4::ForwardRow row{.kv = &kv, .tokens = seq, .all_logits = false};
    gemma4::ForwardOptions o;
    o.tap_layers = taps;
    o.tap_out = out;
    target_->forward(std::span(&row, 1), o);
    return out;
  }
  static inline gemma4::Gemma4Model* target_ = nullptr;
};

TEST_F(DSparkTest, MistypedConfigFieldsNameFileFieldAndValue) {
  json j = specula_json();
  j["config"]["block_size"] = "five";
  std::string e = error_of([&] { dspark::parse_specula_dspark_config(j, "x/dspark.json"); });
  EXPECT_NE(e.find("x/dspark.json"), std::string::npos) << e;
  EXPECT_NE(e.find("config.block_size"), std::string::npos) << e;
  EXPECT_NE(e.find("\"five\""), std::string::npos) << e;

  j = specula_json();
  j["config"].erase("markov_rank");
  e = error_of([&] { dspark::parse_specula_dspark_config(j, "x/dspark.json"); });
  EXPECT_NE(e.find("config.markov_rank is missing"), std::string::npos) << e;

  j = specula_json();
  j["config"]["tap_layers"] = json::array({1, "2"});
  e = error_of([&] { dspark::parse_specula_dspark_config(j, "x/dspark.json"); });
  EXPECT_NE(e.find("config.tap_layers"), std::string::npos) << e;
  EXPECT_NE(e.find("[1,\"2\"]"), std::string::npos) << e;

  j = specula_json();
  j["target"]["vocab_size"] = 1.5;
  e = error_of([&] { dspark::parse_specula_dspark_config(j, "x/dspark.json"); });
  EXPECT_NE(e.find("target.vocab_size must be an integer, got 1.5"), std::string::npos) << e;

  j = specula_json();
  j["kind"] = "assistant";
  e = error_of([&] { dspark::parse_specula_dspark_config(j, "x/dspark.json"); });
  EXPECT_NE(e.find("kind is 'assistant'"), std::string::npos) << e;

  // DeepSpec layout: its DSpark fields and the Gemma 4 text fields.
  json d = json::parse(std::ifstream(testing::golden_dir("dense_kev") + "/config.json"));
  d["architectures"] = json::array({"Gemma4DSparkModel"});
  d["target_layer_ids"] = json::array({0, 2, 3});
  d["block_size"] = 7;
  d["mask_token_id"] = 4;
  d["markov_rank"] = 8;
  d["markov_head_type"] = "vanilla";
  d["enable_confidence_head"] = true;
  d["confidence_head_with_markov"] = true;
  d["global_head_dim"] = 32;
  d["num_global_key_value_heads"] = 1;
  const DSparkConfig ok = dspark::parse_deepspec_dspark_config(d, "y/config.json");
  EXPECT_EQ(ok.taps, (std::vector<int>{1, 3, 4}));
  EXPECT_EQ(ok.head_dim, 32);
  EXPECT_EQ(ok.num_kv_heads, 1);
  json bad = d;
  bad["markov_head_type"] = "gated";
  e = error_of([&] { dspark::parse_deepspec_dspark_config(bad, "y/config.json"); });
  EXPECT_NE(e.find("y/config.json: markov_head_type is 'gated'"), std::string::npos) << e;
  bad = d;
  bad["enable_confidence_head"] = "yes";
  e = error_of([&] { dspark::parse_deepspec_dspark_config(bad, "y/config.json"); });
  EXPECT_NE(e.find("enable_confidence_head must be true or false, got \"yes\""), std::string::npos)
      << e;
  bad = d;
  bad.erase("num_global_key_value_heads");
  e = error_of([&] { dspark::parse_deepspec_dspark_config(bad, "y/config.json"); });
  EXPECT_NE(e.find("y/config.json: field num_global_key_value_heads is missing"), std::string::npos)
      << e;
  bad = d;
  bad.erase("target_layer_ids");
  e = error_of([&] { dspark::parse_deepspec_dspark_config(bad, "y/config.json"); });
  EXPECT_NE(e.find("target_layer_ids is missing"), std::string::npos) << e;
  bad = d;
  bad["architectures"] = json::array({"Gemma4ForCausalLM"});
  e = error_of([&] { dspark::parse_deepspec_dspark_config(bad, "y/config.json"); });
  EXPECT_NE(e.find("Gemma4DSparkModel"), std::string::npos) << e;
}

TEST_F(DSparkTest, RefusesACheckpointForAnotherTarget) {
  const gemma4::Gemma4Config& t = target_->config();
  DSparkConfig c = small_specula(t, 4);
  c.target.hidden_size = 64;
  std::string e = error_of([&] { dspark::check_dspark_config(c, t, "z/dspark.json"); });
  EXPECT_NE(e.find("z/dspark.json"), std::string::npos) << e;
  EXPECT_NE(e.find("hidden_size 64, but the target has 32"), std::string::npos) << e;
  c = small_specula(t, 4);
  c.target.vocab_size = 256;
  e = error_of([&] { dspark::check_dspark_config(c, t, "z/dspark.json"); });
  EXPECT_NE(e.find("vocab_size 256, but the target has 128"), std::string::npos) << e;
  c = small_specula(t, 4);
  c.target.num_hidden_layers = 6;
  e = error_of([&] { dspark::check_dspark_config(c, t, "z/dspark.json"); });
  EXPECT_NE(e.find("num_hidden_layers 6, but the target has 4"), std::string::npos) << e;
  c = small_specula(t, 4);
  c.target.config_hash = "00ff";
  e = error_of([&] { dspark::check_dspark_config(c, t, "z/dspark.json"); });
  EXPECT_NE(e.find("00ff"), std::string::npos) << e;
  EXPECT_NE(e.find(dspark::target_config_hash(t)), std::string::npos) << e;
  c = small_specula(t, 4);
  c.taps = {2, 5};
  e = error_of([&] { dspark::check_dspark_config(c, t, "z/dspark.json"); });
  EXPECT_NE(e.find("hidden_states[5]"), std::string::npos) << e;

  // Through load(): a saved checkpoint whose target field was edited.
  const std::string dir = temp_dir("other_target");
  random_model(DSparkLayout::kSpecula, 4)->save(dir);
  json j = json::parse(std::ifstream(dir + "/dspark.json"));
  j["target"]["vocab_size"] = 300;
  std::ofstream(dir + "/dspark.json") << j.dump();
  e = error_of([&] { DSparkModel::load(dir, *target_, target_->backend()); });
  EXPECT_NE(e.find(dir + "/dspark.json"), std::string::npos) << e;
  EXPECT_NE(e.find("vocab_size 300, but the target has 128"), std::string::npos) << e;
}

// The DeepSpec default for a target with per-layer inputs (the e2b_like
// fixture, as Gemma 4 E2B/E4B): the drafter's own layers have none, so the
// default builds (--draft random-dspark-deepspec) instead of being refused.
TEST_F(DSparkTest, DeepSpecDefaultServesATargetWithPerLayerInputs) {
  if (!testing::golden_exists("e2b_like")) GTEST_SKIP() << "e2b_like missing";
  auto target = gemma4::Gemma4Model::load(testing::golden_dir("e2b_like"));
  ASSERT_TRUE(target->config().has_ple());
  const DSparkConfig c = dspark::default_deepspec_config(target->config());
  EXPECT_FALSE(c.text.has_ple());
  EXPECT_FALSE(c.text.enable_moe_block);
  auto model = DSparkModel::random(c, *target, target->backend(), 5, DType::kF32);
  EXPECT_EQ(model->block_size(), 7);
  EXPECT_EQ(model->config().taps.back(), target->config().num_hidden_layers);
}

TEST_F(DSparkTest, WeightShapeErrorsNameTheTensor) {
  const std::string dir = temp_dir("bad_shape");
  random_model(DSparkLayout::kSpecula, 4)->save(dir);
  // Rewrite the checkpoint with context_norm one element short.
  std::vector<io::NamedTensor> tensors;
  std::vector<float> short_norm(31, 1.0f);
  {
    io::Checkpoint ck(dir);
    std::vector<std::vector<char>> copies;
    for (const std::string& n : ck.names()) {
      if (n == "context_norm") {
        tensors.push_back({n, Tensor(short_norm.data(), DType::kF32, {31})});
        continue;
      }
      const Tensor t = ck.get(n);
      copies.emplace_back(static_cast<const char*>(t.data()),
                          static_cast<const char*>(t.data()) + t.nbytes());
      tensors.push_back({n, Tensor(copies.back().data(), t.dtype(), t.shape())});
    }
    io::write_safetensors(dir + "/tmp.safetensors", tensors);
  }
  std::filesystem::rename(dir + "/tmp.safetensors", dir + "/model.safetensors");
  const std::string e = error_of([&] { DSparkModel::load(dir, *target_, target_->backend()); });
  EXPECT_NE(e.find("context_norm: expected [32], got [31]"), std::string::npos) << e;
}

TEST_F(DSparkTest, SaveLoadRoundTripGivesTheSameLogits) {
  const std::string dir = temp_dir("round_trip");
  auto a = random_model(DSparkLayout::kSpecula, 4);
  a->save(dir);
  auto b = DSparkModel::load(dir, *target_, target_->backend());
  EXPECT_EQ(b->config().taps, a->config().taps);
  const std::vector<int32_t> seq = {5, 9, 17, 3, 44, 90, 12, 7, 7, 31, 2};
  std::vector<float> buf;
  const Tensor taps = taps_of(seq, a->config().taps, &buf);
  std::vector<std::vector<float>> got;
  for (DSparkModel* m : {a.get(), b.get()}) {
    SequenceKv kv = m->new_context();
    const dspark::ContextPiece p{.kv = &kv, .position = 0, .count = 10, .tap_row = 0};
    m->commit_context(std::span(&p, 1), taps);
    int32_t anchor = seq[10];
    SequenceKv* rows[1] = {&kv};
    m->run_block(rows, Tensor(&anchor, DType::kI32, {1}));
    const Tensor U = m->base_logits();
    got.emplace_back(U.data_as<float>(), U.data_as<float>() + U.numel());
  }
  ASSERT_EQ(got[0].size(), got[1].size());
  EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)), 0);
}

// Drafts after committing the context in pieces equal drafts on a fresh cache
// committed in one piece.
TEST_F(DSparkTest, IncrementalContextEqualsFromScratch) {
  for (DSparkLayout layout : {DSparkLayout::kSpecula, DSparkLayout::kDeepSpec}) {
    auto m = random_model(layout, 5);
    std::vector<int32_t> seq;
    for (int i = 0; i < 23; ++i) seq.push_back((i * 37 + 11) % 128);
    std::vector<float> buf;
    const Tensor taps = taps_of(seq, m->config().taps, &buf);
    SequenceKv whole = m->new_context(), pieces = m->new_context();
    const dspark::ContextPiece one{.kv = &whole, .position = 0, .count = 22, .tap_row = 0};
    m->commit_context(std::span(&one, 1), taps);
    for (auto [from, to] : {std::pair{0, 5}, {5, 6}, {6, 14}, {14, 22}}) {
      const dspark::ContextPiece p{
          .kv = &pieces, .position = from, .count = to - from, .tap_row = from};
      m->commit_context(std::span(&p, 1), taps);
    }
    ASSERT_EQ(pieces.length(), 22);
    int32_t anchor = seq[22];
    std::vector<std::vector<float>> got;
    for (SequenceKv* kv : {&whole, &pieces}) {
      SequenceKv* rows[1] = {kv};
      m->run_block(rows, Tensor(&anchor, DType::kI32, {1}));
      const Tensor U = m->base_logits();
      got.emplace_back(U.data_as<float>(), U.data_as<float>() + U.numel());
    }
    const double err =
        testing::relative_error(got[1].data(), got[0].data(), static_cast<int64_t>(got[0].size()));
    EXPECT_LE(err, 1e-6) << (layout == DSparkLayout::kSpecula ? "specula" : "DeepSpec");
    // Committing a position out of order is refused, the cache unchanged.
    const dspark::ContextPiece gap{.kv = &pieces, .position = 23, .count = 1, .tap_row = 0};
    const std::string e = error_of([&] { m->commit_context(std::span(&gap, 1), taps); });
    EXPECT_NE(e.find("committed position 23"), std::string::npos) << e;
    EXPECT_EQ(pieces.length(), 22);
  }
}

// A round commits anywhere from one row per sequence (nothing accepted) to
// its whole verify window (all accepted): the context commit's scratch must
// depend on the forward's tokens only, so that a round accepting more than
// any before allocates nothing.
TEST_F(DSparkTest, CommitScratchDependsOnTheForwardOnly) {
  for (DSparkLayout layout : {DSparkLayout::kSpecula, DSparkLayout::kDeepSpec}) {
    auto m = random_model(layout, 4);
    std::vector<int32_t> seq;
    for (int i = 0; i < 24; ++i) seq.push_back((i * 41 + 7) % 128);
    std::vector<float> buf;
    const Tensor taps = taps_of(seq, m->config().taps, &buf);
    SequenceKv kv = m->new_context();
    const dspark::ContextPiece small{.kv = &kv, .position = 0, .count = 1, .tap_row = 0};
    m->commit_context(std::span(&small, 1), taps);
    const int64_t before = target_->backend().allocation_count();
    const size_t scratch = m->scratch_bytes();
    const dspark::ContextPiece all{.kv = &kv, .position = 1, .count = 23, .tap_row = 1};
    m->commit_context(std::span(&all, 1), taps);
    EXPECT_EQ(target_->backend().allocation_count(), before) << testing::layout_name(layout);
    EXPECT_EQ(m->scratch_bytes(), scratch) << testing::layout_name(layout);
  }
}

std::vector<speculative::DecodeRequest> greedy_requests(int n, uint32_t seed, int max_tokens);

// A DeepSpec save_pretrained folder written by hand, without embed_tokens and
// lm_head (the target's embedding and tied head stand in), with v_proj
// (attention_k_eq_v false) and a confidence head without Markov features:
// it loads, and decoding with it is lossless.
TEST_F(DSparkTest, DeepSpecFolderWithoutEmbeddingOrHeadLoadsAndIsLossless) {
  json d = json::parse(std::ifstream(testing::golden_dir("dense_kev") + "/config.json"));
  d.erase("per_layer_config");
  d["architectures"] = json::array({"Gemma4DSparkModel"});
  d["num_hidden_layers"] = 2;
  d["layer_types"] = json::array({"full_attention", "full_attention"});
  d["attention_k_eq_v"] = false;
  d["global_head_dim"] = 16;
  d["num_global_key_value_heads"] = 1;
  d["tie_word_embeddings"] = false;
  d["target_layer_ids"] = json::array({-1, 1, 3});
  d["num_target_layers"] = 4;
  d["block_size"] = 4;
  d["mask_token_id"] = 4;
  d["markov_rank"] = 6;
  d["markov_head_type"] = "vanilla";
  d["enable_confidence_head"] = true;
  d["confidence_head_with_markov"] = false;
  const std::string dir = temp_dir("deepspec_folder");
  std::ofstream(dir + "/config.json") << d.dump(2);
  const DSparkConfig c = dspark::load_dspark_config(dir);
  ASSERT_EQ(c.layout, DSparkLayout::kDeepSpec);
  EXPECT_EQ(c.taps, (std::vector<int>{0, 2, 4}));
  EXPECT_FALSE(c.k_eq_v);
  EXPECT_EQ(c.num_kv_heads, 2);
  dspark::DSparkWeights w;
  io::WeightTable table;
  dspark::declare_dspark_weights(c, 32, 128, &w, &table);
  std::mt19937 rng(5);
  std::vector<std::vector<float>> data;
  std::vector<io::NamedTensor> tensors;
  for (const io::WeightTable::Entry& e : table.entries()) {
    if (e.name == "embed_tokens.weight" || e.name == "lm_head.weight") continue;
    const float bound =
        e.shape.rank() <= 1 ? 0.1f : std::sqrt(3.0f / static_cast<float>(e.shape[1]));
    std::uniform_real_distribution<float> u(-bound, bound);
    data.emplace_back(static_cast<size_t>(e.shape.numel()));
    for (float& v : data.back()) v = (e.shape.rank() <= 1 ? 1.0f : 0.0f) + u(rng);
    tensors.push_back({e.name, Tensor(data.back().data(), DType::kF32, e.shape)});
  }
  io::write_safetensors(dir + "/model.safetensors", tensors);
  auto model = DSparkModel::load(dir, *target_, target_->backend());
  EXPECT_TRUE(model->has_confidence_head());
  DSparkDrafter drafter(*target_, *model);
  const auto reqs = greedy_requests(3, 77, 12);
  const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
  const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = 4});
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].tokens, plain[i].tokens) << i;
}

// Prompts of 6..20 tokens (past the sliding window of 4), greedy.
std::vector<speculative::DecodeRequest> greedy_requests(int n, uint32_t seed, int max_tokens) {
  std::mt19937 rng(seed);
  std::vector<speculative::DecodeRequest> reqs;
  for (int i = 0; i < n; ++i) {
    speculative::DecodeRequest r;
    const int len = std::uniform_int_distribution<int>(6, 20)(rng);
    for (int j = 0; j < len; ++j)
      r.prompt.push_back(std::uniform_int_distribution<int>(3, 127)(rng));
    r.params.temperature = 0.0f;
    r.params.max_tokens = max_tokens;
    r.params.stop_token_ids.clear();
    reqs.push_back(std::move(r));
  }
  return reqs;
}

struct LosslessCase {
  DSparkLayout layout;
  int gamma;
};

class DSparkLossless : public DSparkTest, public ::testing::WithParamInterface<LosslessCase> {};

TEST_P(DSparkLossless, GreedyOutputEqualsPlainDecoding) {
  const LosslessCase lc = GetParam();
  auto model = random_model(lc.layout, lc.gamma, 11);
  DSparkDrafter drafter(*target_, *model);
  for (int batch : {1, 3, 8}) {
    const auto reqs = greedy_requests(batch, 100 + static_cast<uint32_t>(batch), 14);
    const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
    for (int k = 1; k <= lc.gamma; ++k) {
      for (bool host : {false, true}) {
        if (host && k % 3 != 1) continue;  // host rounds at a few k
        const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = k}, {},
                                             {.host_rounds = host});
        for (size_t i = 0; i < reqs.size(); ++i) {
          EXPECT_EQ(got[i].tokens, plain[i].tokens)
              << "batch " << batch << " k " << k << " request " << i << (host ? " host" : "");
        }
        EXPECT_EQ(drafter.live_sequences(), 0) << "every sequence released";
      }
    }
  }
  // A schedule past the block is refused, naming both.
  const std::string e = error_of([&] {
    speculative::Engine engine(*target_, &drafter, {.schedule = {.draft_tokens = lc.gamma + 1}});
  });
  EXPECT_NE(e.find(std::to_string(lc.gamma + 1)), std::string::npos) << e;
  EXPECT_NE(e.find("maximum of " + std::to_string(lc.gamma)), std::string::npos) << e;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DSparkLossless,
                         ::testing::Values(LosslessCase{DSparkLayout::kSpecula, 8},
                                           LosslessCase{DSparkLayout::kDeepSpec, 4}),
                         [](const auto& info) {
                           return std::string(info.param.layout == DSparkLayout::kSpecula
                                                  ? "specula"
                                                  : "deepspec") +
                                  "_gamma" + std::to_string(info.param.gamma);
                         });

// Confidence pruning only shortens the verified window: greedy output with
// thresholds equals plain decoding (device and host rounds, batch 1, 3, 8),
// drafts were really cut, and a round's kept length follows the rule: every
// kept position k >= 1 has c_k >= thr_k, the first cut one is below it.
TEST_P(DSparkLossless, PrunedOutputEqualsPlainDecoding) {
  const LosslessCase lc = GetParam();
  auto model = random_model(lc.layout, lc.gamma, 11);
  DSparkDrafter drafter(*target_, *model);
  EXPECT_FALSE(drafter.prunes());
  std::vector<float> thr(static_cast<size_t>(lc.gamma), 0.5f);
  thr[0] = 0.9f;  // ignored: position 0 is always kept
  drafter.set_thresholds(thr);
  ASSERT_TRUE(drafter.prunes());
  int64_t pruned = 0, drafted = 0;
  for (int batch : {1, 3, 8}) {
    const auto reqs = greedy_requests(batch, 300 + static_cast<uint32_t>(batch), 14);
    const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
    for (int k : {1, lc.gamma / 2 + 1, lc.gamma}) {
      for (bool host : {false, true}) {
        const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = k}, {},
                                             {.host_rounds = host});
        for (size_t i = 0; i < reqs.size(); ++i) {
          EXPECT_EQ(got[i].tokens, plain[i].tokens)
              << "batch " << batch << " k " << k << " request " << i << (host ? " host" : "");
          pruned += got[i].stats.pruned;
          drafted += got[i].stats.drafted;
        }
      }
    }
  }
  EXPECT_GT(pruned, 0) << "the thresholds never cut a block";
  EXPECT_GT(drafted, 0);

  // One round by hand: the kept length follows the confidences.
  std::vector<int32_t> seq;
  for (int i = 0; i < 15; ++i) seq.push_back((i * 29 + 5) % 128);
  std::vector<float> buf;
  const Tensor taps = taps_of(seq, model->config().taps, &buf);
  drafter.on_committed(
      std::vector<CommittedRow>{{.sequence = 0, .position = 0, .count = 14, .tap_row = 0}}, taps);
  std::vector<int32_t> drafts;
  int32_t token = seq[14];
  for (int s = 0; s < lc.gamma; ++s) {
    const DraftRow row{.sequence = 0, .token = token, .position = 14};
    const Tensor logits = drafter.step(s, std::span(&row, 1));
    const float* l = logits.data_as<const float>();
    token = static_cast<int32_t>(std::max_element(l, l + model->vocab_size()) - l);
    drafts.push_back(token);
  }
  const DraftRow row0{.sequence = 0, .token = seq[14], .position = 14};
  const int made = lc.gamma;
  int keep = -1;
  drafter.draft_lengths(std::span(&row0, 1), std::span(&made, 1), std::span(&keep, 1));
  const std::span<const float> c = drafter.last_confidences();
  ASSERT_GE(keep, 1);
  ASSERT_LE(keep, lc.gamma);
  for (int k = 1; k < keep; ++k) EXPECT_GE(c[static_cast<size_t>(k)], 0.5f) << k;
  if (keep < lc.gamma) {
    EXPECT_LT(c[static_cast<size_t>(keep)], 0.5f);
  }
  drafter.release(0);

  // Bad thresholds are refused, naming the problem.
  EXPECT_NE(error_of([&] { drafter.set_thresholds({0.5f}); }).find("block has"), std::string::npos);
  std::vector<float> bad(static_cast<size_t>(lc.gamma), 0.5f);
  bad[1] = 1.5f;
  EXPECT_NE(error_of([&] { drafter.set_thresholds(bad); }).find("1.5"), std::string::npos);
}

// After warm-up, DSpark rounds (device and host rounds, greedy and sampled
// rows, with and without pruning) make no backend allocation: the model's
// arenas and the drafter's buffers grow only for shapes larger than before.
TEST_P(DSparkLossless, SteadyRoundsMakeNoBackendAllocations) {
  const LosslessCase lc = GetParam();
  auto model = random_model(lc.layout, lc.gamma, 17);
  DSparkDrafter drafter(*target_, *model);
  for (bool prune : {false, true}) {
    drafter.set_thresholds(prune ? std::vector<float>(static_cast<size_t>(lc.gamma), 0.5f)
                                 : std::vector<float>());
    for (bool host : {false, true}) {
      const int64_t n = testing::dspark_steady_allocations(
          *target_, drafter, *model, {.rows = 4, .draft_tokens = lc.gamma, .host_rounds = host});
      EXPECT_EQ(n, 0) << "backend allocations in steady-state rounds" << (prune ? ", pruned" : "")
                      << (host ? ", host rounds" : ", device rounds");
    }
  }
}

// Issue #33: a zero-initialized Markov W2 and confidence head give every
// confidence σ(0) = 0.5, so a threshold of 0.6 cuts every block after its
// first draft (position 0 is never cut): every round verifies one draft, and
// greedy output still equals plain decoding.
TEST_F(DSparkTest, ThresholdAboveAZeroInitializedHeadPrunesTheBlockToOneToken) {
  const int gamma = 5;
  auto random = random_model(DSparkLayout::kSpecula, gamma, 23);
  const std::string dir = temp_dir("zero_confidence");
  random->save(dir);
  // Rewrite the weights with markov.w2 and the confidence head zeroed.
  const std::string file = dir + "/model.safetensors";
  std::vector<std::vector<uint8_t>> data;
  std::vector<io::NamedTensor> tensors;
  int zeroed = 0;
  {
    io::SafetensorsFile in(file);
    for (const io::TensorInfo& info : in.tensors()) {
      const Tensor t = in.get(info.name);
      const auto* bytes = static_cast<const uint8_t*>(t.data());
      data.emplace_back(bytes, bytes + t.nbytes());
      if (info.name == "markov.w2" || info.name.starts_with("confidence.")) {
        std::fill(data.back().begin(), data.back().end(), uint8_t{0});
        ++zeroed;
      }
    }
    for (size_t i = 0; i < in.tensors().size(); ++i) {
      const io::TensorInfo& info = in.tensors()[i];
      tensors.push_back({info.name, Tensor(data[i].data(), info.dtype, info.shape)});
    }
  }
  ASSERT_EQ(zeroed, 3) << "markov.w2, confidence.weight, confidence.bias";
  io::write_safetensors(file, tensors);

  auto model = DSparkModel::load(dir, *target_, target_->backend());
  DSparkDrafter drafter(*target_, *model);
  drafter.set_thresholds(std::vector<float>(gamma, 0.6f));
  const auto reqs = greedy_requests(3, 77, 12);
  const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
  for (bool host : {false, true}) {
    const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = gamma}, {},
                                         {.host_rounds = host});
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, plain[i].tokens) << "request " << i;
      const speculative::DecodeStats& s = got[i].stats;
      ASSERT_FALSE(s.round_drafted.empty());
      // Rounds near max_tokens may draft nothing; none verifies more than one.
      for (int32_t d : s.round_drafted) EXPECT_LE(d, 1) << "request " << i << (host ? " host" : "");
      EXPECT_EQ(s.drafted, static_cast<int64_t>(
                               std::count(s.round_drafted.begin(), s.round_drafted.end(), 1)));
      EXPECT_GT(s.drafted, 0);
      EXPECT_GT(s.pruned, 0);
    }
    for (float c : drafter.last_confidences()) {
      if (!std::isnan(c)) {
        EXPECT_FLOAT_EQ(c, 0.5f);
      }
    }
  }
}

// Sampling rows run through the engine, and after every step the context
// caches hold exactly the positions the target's caches hold.
// An engine destroyed with rows still decoding hands their contexts back:
// the same drafter then serves a new engine, and its output is still lossless.
TEST_F(DSparkTest, AnEngineDestroyedMidwayReleasesItsRows) {
  auto model = random_model(DSparkLayout::kSpecula, 5, 4);
  DSparkDrafter drafter(*target_, *model);
  const auto reqs = greedy_requests(3, 21, 16);
  {
    speculative::Engine engine(*target_, &drafter, {.schedule = {.draft_tokens = 3}});
    for (const auto& r : reqs) ASSERT_TRUE(engine.submit(r).accepted());
    for (int i = 0; i < 4; ++i) engine.step();
    ASSERT_GT(drafter.live_sequences(), 0) << "rows are mid-way";
  }
  EXPECT_EQ(drafter.live_sequences(), 0);
  const auto plain = speculative::decode(*target_, nullptr, reqs, {.draft_tokens = 1});
  const auto got = speculative::decode(*target_, &drafter, reqs, {.draft_tokens = 3});
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].tokens, plain[i].tokens) << i;
}

TEST_F(DSparkTest, SamplingRowsRunAndContextTracksTheTargetCache) {
  for (DSparkLayout layout : {DSparkLayout::kSpecula, DSparkLayout::kDeepSpec}) {
    auto model = random_model(layout, 5, 3);
    DSparkDrafter drafter(*target_, *model);
    auto reqs = greedy_requests(6, 9, 20);
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (i % 2 == 0) continue;
      reqs[i].params.temperature = 0.9f;
      reqs[i].params.top_p = 0.95f;
      reqs[i].params.seed = 40 + i;
    }
    speculative::Engine engine(*target_, &drafter,
                               {.schedule = {.draft_tokens = 4},
                                .max_rows = 4,
                                .max_batch_tokens = 40,
                                .prefill_chunk = 8});
    for (const auto& r : reqs) ASSERT_TRUE(engine.submit(r).accepted());
    int finished = 0, steps = 0;
    while (engine.has_work()) {
      ASSERT_LT(++steps, 500);
      for (const auto& u : engine.step()) finished += u.finished ? 1 : 0;
      EXPECT_EQ(drafter.context_positions(), engine.kv_pool().tokens_in_use) << "step " << steps;
      if (drafter.round_steps() > 0 && model->has_confidence_head()) {
        const std::span<const float> cs = drafter.last_confidences();
        const std::vector<float> c(cs.begin(), cs.end());
        ASSERT_EQ(c.size(), drafter.round_sequences().size() * 5);
        EXPECT_GT(c[0], 0.0f);  // step 0 of row 0 always runs: a sigmoid
        EXPECT_LT(c[0], 1.0f);
      }
    }
    EXPECT_EQ(finished, static_cast<int>(reqs.size()));
    EXPECT_EQ(drafter.live_sequences(), 0);
  }
}

}  // namespace
}  // namespace specula
