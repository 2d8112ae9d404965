// SPDX-License-Identifier: Apache-2.0
// Fuzz target: StreamingDecoder on a small Gemma-style tokenizer (byte-fallback
// BPE built below). The input is read two ways:
//  - as token ids (2 bytes each, some out of range or negative), fed one by
//    one with and without skip_special_tokens: every piece is valid UTF-8 and
//    the pieces plus flush() equal decode() of all ids, as the header promises;
//    a reset() in the middle starts an independent stream;
//  - as text: valid UTF-8 without U+2581 ("▁", which the decoder turns into a
//    space) encodes to known ids and decodes back to itself, also streamed.
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/error.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

// A tokenizer.json shaped like Gemma's: specials, the 256 byte tokens, a few
// characters (one and several bytes long) and merges, an added non-special token.
std::string tiny_tokenizer_json() {
  using nlohmann::json;
  json vocab = json::object();
  json added = json::array();
  int id = 0;
  for (const char* s : {"<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"}) {
    added.push_back({{"id", id},
                     {"content", s},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
    vocab[s] = id++;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = id++;
  }
  std::vector<std::string> pieces = {"\xE2\x96\x81", "\xC3\xA9", "\xE2\x98\x83",
                                     "\xF0\x9F\x98\x80"};
  for (char c = 'a'; c <= 'z'; ++c) pieces.emplace_back(1, c);
  for (const char* p : {".", ",", "!", "\n"}) pieces.emplace_back(p);
  const std::vector<std::pair<std::string, std::string>> merges = {{"\xE2\x96\x81", "\xE2\x96\x81"},
                                                                   {"t", "h"},
                                                                   {"th", "e"},
                                                                   {"e", "\xE2\x96\x81"},
                                                                   {"\xE2\x96\x81", "the"},
                                                                   {"i", "n"},
                                                                   {"o", "n"},
                                                                   {"\xC3\xA9", "\xE2\x96\x81"},
                                                                   {"a", "\xE2\x98\x83"},
                                                                   {"in", "g"},
                                                                   {"e", "r"}};
  for (const auto& [l, r] : merges) pieces.push_back(l + r);
  for (const std::string& p : pieces) {
    if (!vocab.contains(p)) vocab[p] = id++;
  }
  added.push_back({{"id", id},
                   {"content", "<tool>"},
                   {"single_word", false},
                   {"lstrip", false},
                   {"rstrip", false},
                   {"normalized", false},
                   {"special", false}});
  vocab["<tool>"] = id++;
  json merge_list = json::array();
  for (const auto& [l, r] : merges) merge_list.push_back({l, r});
  const json tok = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}}},
      {"pre_tokenizer",
       {{"type", "Split"},
        {"pattern", {{"String", " "}}},
        {"behavior", "MergedWithPrevious"},
        {"invert", false}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}}}}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", merge_list}}}};
  return tok.dump();
}

const specula::Tokenizer& tokenizer() {
  static const specula::Tokenizer tok = specula::Tokenizer::from_json_text(
      tiny_tokenizer_json(), R"({"add_bos_token": true, "bos_token": "<bos>"})", {}, "tiny");
  return tok;
}

// Streams `ids` and checks the pieces against decode(); returns the streamed text.
std::string stream(const std::vector<int32_t>& ids, bool skip) {
  const specula::Tokenizer& tok = tokenizer();
  specula::StreamingDecoder dec(tok, skip);
  std::string out;
  for (const int32_t id : ids) {
    const std::string piece = dec.feed(id);
    SPECULA_FUZZ_ASSERT(specula::fuzz::valid_utf8(piece));
    out += piece;
  }
  const std::string rest = dec.flush();
  SPECULA_FUZZ_ASSERT(specula::fuzz::valid_utf8(rest));
  out += rest;
  SPECULA_FUZZ_ASSERT(out == tok.decode(ids, skip));
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  if (size > 4096) return 0;
  const specula::Tokenizer& tok = tokenizer();
  const int32_t vocab = tok.vocab_size();
  uint64_t outcome = 8;

  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) {
    const int v = data[i] | (data[i + 1] << 8);
    ids.push_back(static_cast<int32_t>(v % (vocab + 4)) - 2);
  }
  for (const bool skip : {false, true}) {
    const std::string text = stream(ids, skip);
    outcome = fz::mix(outcome, text.size() < 8 ? text.size() : 8);
  }
  // After reset() the decoder forgets the first half: the second half streams alone.
  {
    specula::StreamingDecoder dec(tok);
    for (size_t i = 0; i < ids.size() / 2; ++i) (void)dec.feed(ids[i]);
    dec.reset();
    const std::vector<int32_t> tail(ids.begin() + static_cast<long>(ids.size() / 2), ids.end());
    std::string out;
    for (const int32_t id : tail) out += dec.feed(id);
    out += dec.flush();
    SPECULA_FUZZ_ASSERT(out == tok.decode(tail, false));
  }

  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fz::last_accepted = false;
  if (specula::fuzz::valid_utf8(text) && text.find("\xE2\x96\x81") == std::string_view::npos) {
    std::vector<int32_t> encoded;
    try {
      encoded = tok.encode(text, /*add_special_tokens=*/false);
    } catch (const specula::Error&) {
      SPECULA_FUZZ_ASSERT(false && "encoding valid UTF-8 failed");
    }
    fz::last_accepted = true;
    for (const int32_t id : encoded) SPECULA_FUZZ_ASSERT(id >= 0 && id < vocab);
    SPECULA_FUZZ_ASSERT(tok.decode(encoded, false) == text);
    SPECULA_FUZZ_ASSERT(stream(encoded, false) == text);
    outcome = fz::mix(outcome, encoded.size() < 16 ? encoded.size() : 16);
  }
  fz::last_outcome = outcome;
  return 0;
}
