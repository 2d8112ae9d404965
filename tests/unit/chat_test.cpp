// SPDX-License-Identifier: Apache-2.0
// Chat format: render_chat against goldens rendered by transformers with the
// released Gemma 4 template (tests/golden/chat, tools/golden/make_chat_golden.py),
// the rejection of unsupported input, the trimming helpers, SHA-256 and the
// template recogniser.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/chat/chat_format.h"
#include "engine/chat/chat_template_check.h"
#include "engine/chat/sha256.h"
#include "engine/core/error.h"
#include "tests/unit/test_util.h"

namespace specula {
namespace {

const std::string kGoldenDir = std::string(SPECULA_SOURCE_DIR) + "/tests/golden/chat";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<nlohmann::json> golden_cases() {
  std::vector<nlohmann::json> cases;
  std::istringstream lines(slurp(kGoldenDir + "/cases.jsonl"));
  std::string line;
  while (std::getline(lines, line)) {
    if (!line.empty()) cases.push_back(nlohmann::json::parse(line));
  }
  return cases;
}

using testing::error_of;

// ---------------------------------------------------------------- goldens

TEST(ChatFormat, MatchesTransformersGoldens) {
  const auto cases = golden_cases();
  ASSERT_GE(cases.size(), 60u);
  int large = 0, edge = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c["family"].get<std::string>() + " " + c["name"].get<std::string>());
    ChatOptions options;
    options.add_generation_prompt = c["add_generation_prompt"].get<bool>();
    options.enable_thinking = c["enable_thinking"].get<bool>();
    options.family =
        c["family"] == "large" ? ChatTemplateFamily::kLarge : ChatTemplateFamily::kEdge;
    (options.family == ChatTemplateFamily::kLarge ? large : edge)++;
    const auto messages = chat_messages_from_json(c["messages"]);
    EXPECT_EQ(render_chat(messages, options), c["rendered"].get<std::string>());
  }
  EXPECT_EQ(large, edge);
}

TEST(ChatFormat, GoldenTemplatesAreTheKnownRevisions) {
  const auto templates = nlohmann::json::parse(slurp(kGoldenDir + "/templates.json"));
  ASSERT_GE(templates.size(), 2u);
  int current = 0;
  for (const auto& t : templates) {
    const std::string digest = t["sha256_normalized"];
    const KnownChatTemplate* found = nullptr;
    for (const auto& known : known_chat_templates()) {
      if (known.sha256 == digest) found = &known;
    }
    ASSERT_NE(found, nullptr) << t["file"] << " " << digest
                              << " missing from known_chat_templates()";
    EXPECT_EQ(found->current, t["current"].get<bool>()) << t["file"];
    EXPECT_EQ(found->family == ChatTemplateFamily::kLarge, t["family"] == "large") << t["file"];
    current += found->current;
  }
  EXPECT_EQ(current, 2);
}

// Checks of the recogniser on one template text: the verdict and family,
// the family guess, a digest that CRLF line ends and trailing spaces do not
// change, and one that an edit does.
void check_template_text(const std::string& name, const std::string& body,
                         ChatTemplateCheck::Status want, bool large) {
  SCOPED_TRACE(name);
  const auto check = check_chat_template(body);
  EXPECT_EQ(check.status, want);
  EXPECT_EQ(check.match != nullptr, want != ChatTemplateCheck::Status::kUnknown);
  EXPECT_EQ(check.family == ChatTemplateFamily::kLarge, large);
  EXPECT_EQ(guess_chat_template_family(body) == ChatTemplateFamily::kLarge, large);
  std::string crlf;
  for (char ch : body)
    if (ch != '\r') crlf += ch == '\n' ? std::string(" \r\n") : std::string(1, ch);
  EXPECT_EQ(check_chat_template(crlf).sha256, check.sha256);
  std::string edited = body;
  const size_t at = edited.find("<|turn>");
  ASSERT_NE(at, std::string::npos);
  edited.replace(at, 7, "<|turn >");
  EXPECT_NE(check_chat_template(edited).sha256, check.sha256);
  EXPECT_EQ(check_chat_template(edited).status, ChatTemplateCheck::Status::kUnknown);
}

// Stand-in templates of our own, tracked in tests/golden/chat/template_samples
// (one saved with CRLF line ends and trailing blanks), with their digests from
// make_chat_golden.py's normalisation, an implementation independent of ours:
// the digest, the family guess and the unknown verdict, in every clone.
TEST(ChatTemplateCheck, RecognisesTrackedSampleTemplates) {
  const std::string dir = kGoldenDir + "/template_samples";
  const auto digests = nlohmann::json::parse(slurp(dir + "/digests.json"));
  ASSERT_EQ(digests.size(), 3u);
  for (const auto& d : digests) {
    const std::string name = d["file"];
    const std::string body = slurp(dir + "/" + name);
    EXPECT_EQ(check_chat_template(body).sha256, d["sha256_normalized"].get<std::string>()) << name;
    check_template_text(name, body, ChatTemplateCheck::Status::kUnknown, d["family"] == "large");
  }
  EXPECT_EQ(digests[1]["sha256_normalized"], digests[2]["sha256_normalized"])
      << "the CRLF copy normalises to the same text";
}

// The official template texts are not in the repository (only their digests,
// in templates.json); when a developer has them in .carry/chat_templates (see
// make_chat_golden.py), the same checks run on them, with their verdicts.
TEST(ChatTemplateCheck, RecognisesTheOfficialTemplateFiles) {
  const std::string dir = std::string(SPECULA_SOURCE_DIR) + "/.carry/chat_templates";
  if (!std::filesystem::exists(dir + "/gemma4_large_2026-07-14.jinja")) {
    GTEST_SKIP() << "template texts not present in " << dir;
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    check_template_text(name, slurp(entry.path().string()),
                        name.find("2026-07-14") != std::string::npos
                            ? ChatTemplateCheck::Status::kCurrent
                            : ChatTemplateCheck::Status::kOlderOfficial,
                        name.find("large") != std::string::npos);
  }
}

// ---------------------------------------------------------------- rendering details

TEST(ChatFormat, BuildsMessagesInCode) {
  ChatOptions options;
  const std::vector<ChatMessage> messages = {ChatMessage::text("system", " Be nice. "),
                                             ChatMessage::text("user", "Hi")};
  EXPECT_EQ(render_chat(messages, options),
            "<bos><|turn>system\nBe nice.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
            "<|channel>thought\n<channel|>");
  options.family = ChatTemplateFamily::kEdge;
  options.add_generation_prompt = false;
  options.bos_token = "";
  EXPECT_EQ(render_chat(messages, options),
            "<|turn>system\nBe nice.<turn|>\n<|turn>user\nHi<turn|>\n");
  options.enable_thinking = true;
  EXPECT_EQ(render_chat({ChatMessage::text("user", "x")}, options),
            "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nx<turn|>\n");
  EXPECT_NE(error_of([&] { render_chat({}, options); }).find("empty chat conversation"),
            std::string::npos);
}

TEST(ChatFormat, RejectsWhatTheEngineDoesNotSupport) {
  using nlohmann::json;
  auto parse_error = [](const json& j) { return error_of([&] { chat_messages_from_json(j); }); };
  EXPECT_NE(
      parse_error(json::parse(R"([{"role":"user","content":"a"},{"role":"tool","content":"r"}])"))
          .find("chat message 1 has role \"tool\""),
      std::string::npos);
  EXPECT_NE(
      parse_error(json::parse(R"([{"role":"user","content":[{"type":"image","url":"x"}]}])"))
          .find("content part 0 has type \"image\": images, audio and video are not supported"),
      std::string::npos);
  EXPECT_NE(
      parse_error(
          json::parse(R"([{"role":"assistant","content":null,"tool_calls":[{"function":{}}]}])"))
          .find("\"tool_calls\": tool calls are not supported"),
      std::string::npos);
  EXPECT_NE(parse_error(json::parse(R"([{"role":"robot","content":"a"}])")).find("role \"robot\""),
            std::string::npos);
  EXPECT_NE(parse_error(json::parse(R"([{"content":"a"}])")).find("has no \"role\""),
            std::string::npos);
  EXPECT_NE(parse_error(json::parse(R"([{"role":"user","content":5}])")).find("got number"),
            std::string::npos);
  EXPECT_NE(parse_error(json::parse(R"([{"role":"user","content":[{"type":"text"}]}])"))
                .find("has no string \"text\""),
            std::string::npos);
  EXPECT_NE(parse_error(json::parse(R"({"role":"user"})")).find("must be a JSON array"),
            std::string::npos);
  // An empty tool_calls list is what OpenAI clients often send: accepted.
  EXPECT_NO_THROW(chat_messages_from_json(
      json::parse(R"([{"role":"assistant","content":"a","tool_calls":[]}])")));
  // Messages built in code are checked too.
  ChatMessage m = ChatMessage::text("user", "");
  m.has_parts = true;
  m.parts = {{"text", "a"}, {"video", ""}};
  EXPECT_NE(error_of([&] {
              render_chat({m}, {});
            }).find("chat message 0 content part 1 has type \"video\""),
            std::string::npos);
}

TEST(ChatFormat, PythonStripMatchesStrStrip) {
  EXPECT_EQ(python_strip("  a b \n\t"), "a b");
  EXPECT_EQ(python_strip(""), "");
  EXPECT_EQ(python_strip(" \n "), "");
  // U+3000, U+00A0, U+2028, U+001C are whitespace to Python; U+200B is not.
  EXPECT_EQ(python_strip("\xE3\x80\x80\xC2\xA0x\xE2\x80\xA8\x1C"), "x");
  EXPECT_EQ(python_strip("\xE2\x80\x8Bx\xE2\x80\x8B"), "\xE2\x80\x8Bx\xE2\x80\x8B");
  // Malformed UTF-8 at either end is kept, never over-read.
  EXPECT_EQ(python_strip("\x80 x \xE3\x80"), "\x80 x \xE3\x80");
}

TEST(ChatFormat, StripThinkingFollowsTheTemplateMacro) {
  EXPECT_EQ(strip_thinking("<|channel>thought\nhidden<channel|>Shown."), "Shown.");
  EXPECT_EQ(strip_thinking("Visible<|channel>never closed"), "Visible");
  EXPECT_EQ(strip_thinking("a<channel|>b"), "ab");
  EXPECT_EQ(strip_thinking("a<|channel>x<|channel>y<channel|> b "), "a b");
  EXPECT_EQ(strip_thinking("  plain  "), "plain");
}

// ---------------------------------------------------------------- sha256 and checks

TEST(Sha256, MatchesFips180Vectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in uneven pieces to exercise the buffering.
  Sha256 h;
  const std::string chunk(997, 'a');
  size_t fed = 0;
  while (fed + chunk.size() <= 1000000) {
    h.update(chunk);
    fed += chunk.size();
  }
  h.update(std::string(1000000 - fed, 'a'));
  EXPECT_EQ(h.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Padding boundaries: 55, 56 and 64 bytes.
  EXPECT_EQ(sha256_hex(std::string(55, 'a')),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha256_hex(std::string(56, 'a')),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(sha256_hex(std::string(64, 'a')),
            "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

TEST(ChatTemplateCheck, NormalisesLineEndsAndTrailingSpace) {
  EXPECT_EQ(normalize_chat_template("a \r\nb\t\rc\n\n\n"), "a\nb\nc");
  EXPECT_EQ(normalize_chat_template("  x"), "  x");
  EXPECT_EQ(normalize_chat_template(""), "");
}

TEST(ChatTemplateCheck, UnknownTemplatesAreReportedWithTheirDigest) {
  const std::string gemma3 = "{{ bos_token }}{% for message in messages %}<start_of_turn>...";
  const auto check = check_chat_template(gemma3);
  EXPECT_EQ(check.status, ChatTemplateCheck::Status::kUnknown);
  EXPECT_EQ(check.match, nullptr);
  EXPECT_EQ(check.sha256, sha256_hex(gemma3));
  EXPECT_NE(check.message.find("not an official Gemma 4 template"), std::string::npos);
  EXPECT_NE(check.message.find(check.sha256), std::string::npos);
  EXPECT_EQ(check.family, ChatTemplateFamily::kEdge);
  EXPECT_EQ(guess_chat_template_family("{{- '<|channel>thought\\n<channel|>' -}}"),
            ChatTemplateFamily::kLarge);
}

TEST(ChatTemplateCheck, ReadsTheTemplateFromACheckpointFolder) {
  const auto root =
      std::filesystem::temp_directory_path() / ("specula_chat_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  auto write = [&](const std::string& name, const std::string& body) {
    std::ofstream(root / name, std::ios::binary) << body;
  };
  const std::string dir = root.string();
  EXPECT_FALSE(read_checkpoint_chat_template(dir).has_value());
  EXPECT_EQ(check_checkpoint_chat_template(dir).status, ChatTemplateCheck::Status::kMissing);

  write("tokenizer_config.json", R"({"bos_token": "<bos>"})");
  EXPECT_FALSE(read_checkpoint_chat_template(dir).has_value());
  write("tokenizer_config.json", R"({"chat_template": "T1"})");
  EXPECT_EQ(read_checkpoint_chat_template(dir), "T1");
  write(
      "tokenizer_config.json",
      R"({"chat_template": [{"name": "tool_use", "template": "T2"}, {"name": "default", "template": "T3"}]})");
  EXPECT_EQ(read_checkpoint_chat_template(dir), "T3");
  write("tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "T2"}]})");
  EXPECT_NE(error_of([&] { read_checkpoint_chat_template(dir); }).find("without a \"default\""),
            std::string::npos);
  write("tokenizer_config.json", R"({"chat_template": )");
  EXPECT_NE(error_of([&] {
              read_checkpoint_chat_template(dir);
            }).find("tokenizer_config.json is not valid JSON"),
            std::string::npos);
  // chat_template.jinja takes precedence over tokenizer_config.json.
  write("chat_template.jinja", "T4\n");
  EXPECT_EQ(read_checkpoint_chat_template(dir), "T4\n");
  EXPECT_EQ(check_checkpoint_chat_template(dir).status, ChatTemplateCheck::Status::kUnknown);
  std::filesystem::remove_all(root);
}

// Found by the chat_template fuzz target: entries of other shapes are skipped,
// never reported as the JSON library's type error.
TEST(ChatTemplateCheck, TemplateListEntriesOfOtherShapes) {
  EXPECT_EQ(chat_template_from_tokenizer_config(
                R"({"chat_template": [{"name": 1, "template": "T1"}, 7, {"name": "default"},)"
                R"( {"name": "default", "template": "T2"}]})",
                "tc.json"),
            "T2");
  const std::string e = error_of([] {
    (void)chat_template_from_tokenizer_config(
        R"({"chat_template": [{"name": 1, "template": "T"}]})", "tc.json");
  });
  EXPECT_NE(e.find("tc.json"), std::string::npos) << e;
  EXPECT_NE(e.find("without a \"default\""), std::string::npos) << e;
}

}  // namespace
}  // namespace specula
