// SPDX-License-Identifier: Apache-2.0
// The configurable stages of a Hugging Face tokenizer.json around the model:
// normalizer, pre-tokenizer, decoder and post-processor. Each is parsed from
// its JSON object (nested "Sequence"s are flattened, which is equivalent) and
// applied with the semantics of the tokenizers library. An unsupported type is
// an Error that names the file, the field and the type.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/tokenizer/json_fields.h"

namespace specula::tokenizer {

// Text -> text rewrites applied to each plain (non added-token) piece.
class Normalizer {
 public:
  // `view` may be null JSON (no normalizer).
  static Normalizer from_json(const JsonView& view);
  bool empty() const { return steps_.empty(); }
  // Rewrites `text` in place (valid UTF-8 in and out).
  void apply(std::string& text) const;

 private:
  enum class Kind { kReplace, kPrepend, kNfc, kNfd, kStrip };
  struct Step {
    Kind kind;
    std::string pattern{};  // Replace
    std::string content{};  // Replace: replacement; Prepend: prefix
    bool left = false;      // Strip
    bool right = false;     // Strip
  };
  void add(const JsonView& view);
  std::vector<Step> steps_;
};

// One pre-token produced by the pre-tokenizer: the text the model sees.
struct PreToken {
  std::string text;
  bool at_start;  // starts at offset 0 of the original input (Metaspace "first")
};

// Splits a normalized piece into the words the model tokenizes.
class PreTokenizer {
 public:
  static PreTokenizer from_json(const JsonView& view);
  bool empty() const { return steps_.empty(); }
  // Replaces `pieces` by their pre-tokens (pieces that become empty are dropped).
  void apply(std::vector<PreToken>& pieces) const;

 private:
  enum class Kind { kSplit, kMetaspace, kByteLevel, kWhitespaceSplit, kDigits };
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  enum class Prepend { kAlways, kFirst, kNever };
  struct Step {
    Kind kind;
    std::string pattern{};    // Split: literal pattern (empty when regex_gpt2)
    bool regex_gpt2 = false;  // Split: the built-in GPT-2 pattern
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
    std::string replacement{};  // Metaspace
    Prepend prepend = Prepend::kAlways;
    bool split = true;               // Metaspace
    bool add_prefix_space = false;   // ByteLevel
    bool use_regex = true;           // ByteLevel
    bool individual_digits = false;  // Digits
  };
  void add(const JsonView& view);
  void apply_step(const Step& step, const PreToken& piece, std::vector<PreToken>& out) const;
  std::vector<Step> steps_;
};

// Ids -> text. Works on the token strings of the ids, like tokenizers' Decoder.
class Decoder {
 public:
  static Decoder from_json(const JsonView& view);
  // Joins the decoded tokens. When `stable_bytes` is given it receives the
  // length of the prefix of the result that no appended token can change (an
  // unfinished byte-fallback group or UTF-8 sequence at the end is unstable).
  std::string decode(std::vector<std::string> tokens, size_t* stable_bytes) const;

 private:
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace, kByteLevel };
  struct Step {
    Kind kind;
    std::string pattern{};  // Replace
    std::string content{};  // Replace; Strip: the character; Metaspace: replacement
    size_t start = 0;       // Strip
    size_t stop = 0;        // Strip
    bool prepend = true;    // Metaspace: prepend_scheme != never
  };
  void add(const JsonView& view);
  std::vector<std::string> run(std::vector<std::string> tokens, size_t first_step,
                               size_t* stable_bytes) const;
  bool present_ = false;
  std::vector<Step> steps_;
};

// Adds special tokens around an encoded sequence (TemplateProcessing,
// BertProcessing, RobertaProcessing; ByteLevel changes only offsets).
class PostProcessor {
 public:
  static PostProcessor from_json(const JsonView& view);
  // Template "[bos] $A [eos]" as transformers builds it from add_bos/add_eos.
  static PostProcessor bos_eos(std::vector<int32_t> bos, std::vector<int32_t> eos);
  bool adds_tokens() const { return !templates_.empty(); }
  std::vector<int32_t> apply(std::vector<int32_t> ids) const;

 private:
  // One single-sequence template: ids before and after the sequence (the
  // sequence itself is left out when `has_sequence` is false).
  struct Template {
    std::vector<int32_t> before;
    std::vector<int32_t> after;
    bool has_sequence = true;
  };
  void add(const JsonView& view);
  std::vector<Template> templates_;
};

}  // namespace specula::tokenizer
