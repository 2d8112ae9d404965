// SPDX-License-Identifier: Apache-2.0
// Hugging Face compatible tokenizer: loads a tokenizer.json (BPE, with
// SentencePiece-style byte fallback as in Gemma, or GPT-2 style byte-level BPE)
// and encodes/decodes exactly as the `tokenizers` library does, plus the
// add_bos/add_eos behaviour of transformers.
//
//   auto tok = specula::Tokenizer::load("/models/gemma");   // dir or tokenizer.json
//   std::vector<int32_t> ids = tok.encode("Hello", /*add_special_tokens=*/true);
//   std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
//
// Thread-safety: a loaded Tokenizer is immutable; encode/decode may be called
// from many threads at once. A StreamingDecoder belongs to one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace specula {

// Ids of the special tokens, resolved from tokenizer_config.json,
// special_tokens_map.json and generation_config.json (whichever exist).
struct SpecialTokenIds {
  std::optional<int32_t> bos;
  std::optional<int32_t> pad;
  std::optional<int32_t> unk;
  // Generation stops on any of these: generation_config.json eos_token_id (an
  // int or a list) if present, else the eos_token of tokenizer_config.json /
  // special_tokens_map.json.
  std::vector<int32_t> eos;
};

// Result of Tokenizer::decode_partial.
struct PartialDecode {
  std::string text;     // the full decode of the ids, as decode() returns it
  size_t stable_bytes;  // length of the prefix of `text` that no appended id can change
};

class Tokenizer {
 public:
  // Loads `path`: a tokenizer.json file or a directory holding one. The files
  // tokenizer_config.json, special_tokens_map.json and generation_config.json
  // next to it are read when present. Throws Error naming the file and field
  // on malformed input or an unsupported component.
  static Tokenizer load(const std::string& path);
  // Builds from tokenizer.json text (and optional tokenizer_config.json /
  // generation_config.json text, empty = absent). `origin` names it in errors.
  static Tokenizer from_json_text(std::string_view tokenizer_json,
                                  std::string_view tokenizer_config_json = {},
                                  std::string_view generation_config_json = {},
                                  const std::string& origin = "<memory>");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Text (UTF-8; invalid UTF-8 is an Error naming the byte offset) -> ids.
  // add_special_tokens adds BOS/EOS as transformers would: from add_bos_token /
  // add_eos_token in tokenizer_config.json when it sets them, else from the
  // tokenizer.json post_processor template.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;

  // Ids -> text. Ids with no token are ignored (as tokenizers does);
  // skip_special_tokens drops tokens marked special (<bos>, <eos>, ...).
  // The result is always valid UTF-8.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // decode() plus how much of the text is final; used for streaming.
  PartialDecode decode_partial(std::span<const int32_t> ids, bool skip_special_tokens) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  // One past the largest id of any token (model vocab or added token); the
  // number of embedding rows this tokenizer can address.
  int32_t vocab_size() const;
  // True for added tokens marked "special" (skipped by skip_special_tokens).
  bool is_special(int32_t id) const;

  const SpecialTokenIds& special_ids() const;
  std::optional<int32_t> bos_id() const { return special_ids().bos; }
  const std::vector<int32_t>& eos_ids() const { return special_ids().eos; }
  std::optional<int32_t> pad_id() const { return special_ids().pad; }
  std::optional<int32_t> unk_id() const { return special_ids().unk; }

  // True if `id` contributes a token string to decode (known id, and not a
  // skipped special token).
  bool decodes_to_text(int32_t id, bool skip_special_tokens) const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Incremental detokenizer for generated ids. feed() returns the text that
// became final with this id (possibly empty); the concatenation of all
// returned pieces plus flush() equals tokenizer.decode(all ids). Every piece is
// valid UTF-8: a character spread over several byte tokens is held back until
// it is complete. The tokenizer must outlive the decoder.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);

  std::string feed(int32_t id);
  // Returns the text still held back (an unfinished character decodes to
  // U+FFFD, as decode() would) and starts a new stream.
  std::string flush();
  // Drops everything held back and starts a new stream.
  void reset();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> window_;  // ids since the last point where the text was final, + context
  size_t emitted_ = 0;           // bytes of decode(window_) already returned
};

}  // namespace specula
