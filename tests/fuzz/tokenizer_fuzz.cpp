// SPDX-License-Identifier: Apache-2.0
// Fuzz target: tokenizer.json + tokenizer_config.json + generation_config.json
// -> Tokenizer. The input holds the three texts separated by lines "#%%" (a
// missing part is an absent file) and is capped at 64 KiB. For every accepted
// tokenizer: encoding fixed strings yields ids in [0, vocab_size) or an Error,
// decoding any ids yields valid UTF-8, the special ids are in range, and where
// the pipeline is Gemma's (byte-fallback BPE, "▁" for spaces, no stripping
// added tokens, one string per id) decode(encode(ascii)) gives the text back.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/error.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

constexpr size_t kMaxInput = 64 * 1024;
constexpr std::string_view kSeparator = "\n#%%\n";

// True if decode(encode(s)) must give s back for ASCII s without added-token
// text: the tokenizer is Gemma-shaped as described at the top.
// The member `key` of `j`, or null.
nlohmann::json member(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  const auto it = j.find(key);
  return it == j.end() ? nlohmann::json() : *it;
}

bool gemma_shaped(std::string_view tokenizer_json) {
  const nlohmann::json j = nlohmann::json::parse(tokenizer_json, nullptr, false);
  if (!j.is_object()) return false;
  static const nlohmann::json kNormalizer =
      nlohmann::json::parse(R"({"type":"Replace","pattern":{"String":" "},"content":"\u2581"})");
  static const nlohmann::json kPreTokenizer = nlohmann::json::parse(
      R"({"type":"Split","pattern":{"String":" "},"behavior":"MergedWithPrevious","invert":false})");
  static const nlohmann::json kDecoder = nlohmann::json::parse(
      R"({"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"\u2581"},)"
      R"("content":" "},{"type":"ByteFallback"},{"type":"Fuse"}]})");
  if (member(j, "normalizer") != kNormalizer || member(j, "pre_tokenizer") != kPreTokenizer ||
      member(j, "decoder") != kDecoder) {
    return false;
  }
  const nlohmann::json m = member(j, "model");
  if (member(m, "type") != "BPE" || member(m, "byte_fallback") != true) return false;
  for (const char* unset : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!member(m, unset).is_null()) return false;
  }
  const nlohmann::json vocab = member(m, "vocab");
  if (!vocab.is_object()) return false;
  std::set<int64_t> ids;
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || !ids.insert(id.get<int64_t>()).second) return false;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    if (!vocab.contains(name)) return false;
  }
  // Added tokens: never stripping, and not overriding a different vocab string.
  const nlohmann::json added = member(j, "added_tokens");
  if (!added.is_null()) {
    if (!added.is_array()) return false;
    for (const auto& a : added) {
      const nlohmann::json content = member(a, "content"), id = member(a, "id");
      if (member(a, "lstrip") == true || member(a, "rstrip") == true || !content.is_string() ||
          !id.is_number_integer()) {
        return false;
      }
      const auto v = vocab.find(content.get<std::string>());
      const bool same = v != vocab.end() && *v == id;
      if (!same && ids.count(id.get<int64_t>()) != 0) return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  if (size > kMaxInput) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view parts[3];
  size_t n_parts = 0, pos = 0;
  while (n_parts < 2) {
    const size_t sep = input.find(kSeparator, pos);
    if (sep == std::string_view::npos) break;
    parts[n_parts++] = input.substr(pos, sep - pos);
    pos = sep + kSeparator.size();
  }
  parts[n_parts++] = input.substr(pos);

  fz::last_accepted = false;
  std::optional<specula::Tokenizer> tok;
  try {
    tok.emplace(specula::Tokenizer::from_json_text(parts[0], parts[1], parts[2], "fuzz"));
  } catch (const specula::Error& e) {
    fz::last_outcome = fz::error_outcome(e.what());
    return 0;
  }
  fz::last_accepted = true;
  const int32_t vocab = tok->vocab_size();
  SPECULA_FUZZ_ASSERT(vocab >= 0);
  const specula::SpecialTokenIds& sp = tok->special_ids();
  for (const auto& id : {sp.bos, sp.pad, sp.unk}) {
    if (id) SPECULA_FUZZ_ASSERT(*id >= 0);
  }
  for (const int32_t id : sp.eos) SPECULA_FUZZ_ASSERT(id >= 0);
  uint64_t outcome = fz::mix(7, n_parts);
  outcome = fz::mix(outcome, sp.bos.has_value() * 4 + sp.pad.has_value() * 2 + sp.eos.size());

  const bool round_trip = gemma_shaped(parts[0]);
  static const char* const kTexts[] = {"", "Hello world", "  a  b\tc\n", "x=1; y=[2,3]",
                                       "caf\xC3\xA9 \xE2\x98\x83 \xF0\x9F\x98\x80"};
  for (const char* text : kTexts) {
    for (const bool special : {false, true}) {
      std::vector<int32_t> ids;
      try {
        ids = tok->encode(text, special);
      } catch (const specula::Error& e) {
        outcome = fz::mix(outcome, fz::error_outcome(e.what()));
        continue;
      }
      for (const int32_t id : ids) SPECULA_FUZZ_ASSERT(id >= 0 && id < vocab);
      const std::string back = tok->decode(ids, false);
      SPECULA_FUZZ_ASSERT(specula::fuzz::valid_utf8(back));
      SPECULA_FUZZ_ASSERT(specula::fuzz::valid_utf8(tok->decode(ids, true)));
      if (round_trip && !special) {
        bool has_added = false;
        for (const int32_t id : ids) has_added |= tok->is_special(id);
        if (!has_added) SPECULA_FUZZ_ASSERT(back == text);
      }
      outcome = fz::mix(outcome, ids.size() < 8 ? ids.size() : 8);
    }
  }
  // Any ids, known or not, decode to valid UTF-8.
  std::vector<int32_t> ids = {-1, 0, vocab, vocab - 1, 1 << 30};
  for (int32_t i = 0; i < 300 && i < vocab; i += 7) ids.push_back(i);
  SPECULA_FUZZ_ASSERT(specula::fuzz::valid_utf8(tok->decode(ids, false)));
  SPECULA_FUZZ_ASSERT(specula::fuzz::valid_utf8(tok->decode(ids, true)));
  for (const int32_t id : ids) {
    if (const auto t = tok->id_to_token(id)) (void)tok->token_to_id(*t);
  }
  fz::last_outcome = outcome;
  return 0;
}
