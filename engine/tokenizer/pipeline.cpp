// SPDX-License-Identifier: Apache-2.0
#include "engine/tokenizer/pipeline.h"

#include <algorithm>

#include "engine/core/error.h"
#include "engine/tokenizer/byte_level.h"
#include "engine/tokenizer/unicode.h"

namespace specula::tokenizer {
namespace {

// The split pattern of GPT-2 style byte-level BPE (tokenizers' ByteLevel regex).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A span of the text and whether it matched the split pattern.
struct Match {
  size_t begin;
  size_t end;
  bool is_match;
};

void replace_all(std::string& text, std::string_view pattern, std::string_view content) {
  if (pattern.empty()) return;
  size_t pos = text.find(pattern);
  if (pos == std::string::npos) return;
  std::string out;
  out.reserve(text.size() + text.size() / 2);
  size_t last = 0;
  while (pos != std::string::npos) {
    out.append(text, last, pos - last);
    out.append(content);
    last = pos + pattern.size();
    pos = text.find(pattern, last);
  }
  out.append(text, last);
  text.swap(out);
}

// Pattern for JSON {"String": s} / {"Regex": r}; regex_out set for a regex.
std::string pattern_of(const JsonView& view, bool allow_gpt2_regex, bool* is_gpt2) {
  view.expect_object();
  if (auto s = view.find("String")) return s->as_string();
  if (auto r = view.find("Regex")) {
    const std::string regex = r->as_string();
    if (allow_gpt2_regex && regex == kGpt2Pattern) {
      *is_gpt2 = true;
      return "";
    }
    r->fail_here(
        fmt::format("unsupported regex pattern '{}' (only literal strings{} are supported)", regex,
                    allow_gpt2_regex ? " and the GPT-2 split regex" : ""));
  }
  view.fail_here("expected {\"String\": ...} or {\"Regex\": ...}");
}

// Character classes of the GPT-2 pattern.
enum class Gpt2Class { kLetter, kNumber, kSpace, kOther };

Gpt2Class gpt2_class(uint32_t cp) {
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return Gpt2Class::kLetter;
    if (cp >= '0' && cp <= '9') return Gpt2Class::kNumber;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return Gpt2Class::kSpace;
    return Gpt2Class::kOther;
  }
  if (is_whitespace(cp)) return Gpt2Class::kSpace;
  switch (char_class(cp)) {
    case CharClass::kLetter:
      return Gpt2Class::kLetter;
    case CharClass::kNumber:
      return Gpt2Class::kNumber;
    default:
      return Gpt2Class::kOther;
  }
}

// Matches of the GPT-2 pattern; they always tile the whole text.
void find_gpt2(std::string_view text, std::vector<Match>& out) {
  thread_local std::vector<uint32_t> cps;
  thread_local std::vector<size_t> offsets;
  thread_local std::vector<Gpt2Class> classes;
  cps.clear();
  offsets.clear();
  classes.clear();
  size_t pos = 0;
  while (pos < text.size()) {
    offsets.push_back(pos);
    const uint32_t cp = next_code_point(text, pos);
    cps.push_back(cp);
    classes.push_back(gpt2_class(cp));
  }
  offsets.push_back(text.size());
  const size_t n = cps.size();
  size_t i = 0;
  while (i < n) {
    size_t j = i;
    // 's 't 're 've 'm 'll 'd
    if (cps[i] == '\'' && i + 1 < n) {
      const uint32_t c1 = cps[i + 1];
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        j = i + 2;
      } else if (i + 2 < n &&
                 ((c1 == 'r' && cps[i + 2] == 'e') || (c1 == 'v' && cps[i + 2] == 'e') ||
                  (c1 == 'l' && cps[i + 2] == 'l'))) {
        j = i + 3;
      }
    }
    if (j == i) {
      // " ?X+" for X in letters, numbers, others (an optional literal space first).
      const size_t body =
          (cps[i] == ' ' && i + 1 < n && classes[i + 1] != Gpt2Class::kSpace) ? i + 1 : i;
      const Gpt2Class cls = classes[body];
      if (cls != Gpt2Class::kSpace) {
        j = body + 1;
        while (j < n && classes[j] == cls) ++j;
      } else {
        // \s+(?!\S) then \s+: a whitespace run leaves its last character to
        // the next word unless the run ends the text.
        size_t k = i;
        while (k < n && classes[k] == Gpt2Class::kSpace) ++k;
        j = (k == n || k - i == 1) ? k : k - 1;
      }
    }
    out.push_back(Match{offsets[i], offsets[j], true});
    i = j;
  }
}

// Non-overlapping occurrences of a literal pattern, with the gaps between them.
void find_literal(std::string_view text, std::string_view pattern, std::vector<Match>& out) {
  if (pattern.empty()) {
    out.push_back(Match{0, text.size(), false});
    return;
  }
  size_t prev = 0;
  size_t pos = text.find(pattern);
  while (pos != std::string_view::npos) {
    if (prev != pos) out.push_back(Match{prev, pos, false});
    out.push_back(Match{pos, pos + pattern.size(), true});
    prev = pos + pattern.size();
    pos = text.find(pattern, prev);
  }
  if (prev != text.size()) out.push_back(Match{prev, text.size(), false});
}

// Each character for which pred holds is its own match.
template <typename Pred>
void find_chars(std::string_view text, Pred pred, std::vector<Match>& out) {
  size_t last = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t begin = pos;
    const uint32_t cp = next_code_point(text, pos);
    if (pred(cp)) {
      if (last < begin) out.push_back(Match{last, begin, false});
      out.push_back(Match{begin, pos, true});
      last = pos;
    }
  }
  if (last < text.size()) out.push_back(Match{last, text.size(), false});
}

}  // namespace

// ---------------------------------------------------------------- Normalizer

Normalizer Normalizer::from_json(const JsonView& view) {
  Normalizer n;
  if (!view.json().is_null()) n.add(view);
  return n;
}

void Normalizer::add(const JsonView& view) {
  const std::string type = view.at("type").as_string();
  if (type == "Sequence") {
    const JsonView list = view.at("normalizers");
    list.expect_array();
    for (size_t i = 0; i < list.json().size(); ++i) add(list.at(i));
  } else if (type == "Replace") {
    bool gpt2 = false;
    steps_.push_back(Step{Kind::kReplace, pattern_of(view.at("pattern"), false, &gpt2),
                          view.at("content").as_string()});
  } else if (type == "Prepend") {
    steps_.push_back(Step{Kind::kPrepend, "", view.at("prepend").as_string()});
  } else if (type == "NFC") {
    steps_.push_back(Step{Kind::kNfc});
  } else if (type == "NFD") {
    steps_.push_back(Step{Kind::kNfd});
  } else if (type == "Strip") {
    Step s{Kind::kStrip};
    s.left = view.bool_or("strip_left", false);
    s.right = view.bool_or("strip_right", false);
    steps_.push_back(s);
  } else {
    view.at("type").fail_here(fmt::format(
        "unsupported normalizer type '{}' (supported: Sequence, Replace, Prepend, NFC, NFD, Strip)",
        type));
  }
}

void Normalizer::apply(std::string& text) const {
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Kind::kReplace:
        replace_all(text, s.pattern, s.content);
        break;
      case Kind::kPrepend:
        if (!text.empty()) text.insert(0, s.content);
        break;
      case Kind::kNfc:
        text = normalize_nfc(text);
        break;
      case Kind::kNfd:
        text = normalize_nfd(text);
        break;
      case Kind::kStrip: {
        size_t begin = 0;
        size_t end = text.size();
        if (s.left) {
          while (begin < end) {
            size_t next = begin;
            if (!is_whitespace(next_code_point(text, next))) break;
            begin = next;
          }
        }
        if (s.right) {
          while (end > begin) {
            size_t start = end - 1;
            while (start > begin && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
            size_t p = start;
            if (!is_whitespace(next_code_point(text, p))) break;
            end = start;
          }
        }
        text = text.substr(begin, end - begin);
        break;
      }
    }
  }
}

// -------------------------------------------------------------- PreTokenizer

PreTokenizer PreTokenizer::from_json(const JsonView& view) {
  PreTokenizer p;
  if (!view.json().is_null()) p.add(view);
  return p;
}

void PreTokenizer::add(const JsonView& view) {
  const std::string type = view.at("type").as_string();
  if (type == "Sequence") {
    const JsonView list = view.at("pretokenizers");
    list.expect_array();
    for (size_t i = 0; i < list.json().size(); ++i) add(list.at(i));
  } else if (type == "Split") {
    Step s{Kind::kSplit};
    s.pattern = pattern_of(view.at("pattern"), true, &s.regex_gpt2);
    const JsonView behavior_view = view.at("behavior");
    const std::string behavior = behavior_view.as_string();
    if (behavior == "Removed") {
      s.behavior = Behavior::kRemoved;
    } else if (behavior == "Isolated") {
      s.behavior = Behavior::kIsolated;
    } else if (behavior == "MergedWithPrevious") {
      s.behavior = Behavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      s.behavior = Behavior::kMergedWithNext;
    } else if (behavior == "Contiguous") {
      s.behavior = Behavior::kContiguous;
    } else {
      behavior_view.fail_here(fmt::format("unknown split behavior '{}'", behavior));
    }
    s.invert = view.bool_or("invert", false);
    steps_.push_back(s);
  } else if (type == "Metaspace") {
    Step s{Kind::kMetaspace};
    s.replacement = view.string_or("replacement", "\u2581");
    size_t len = 0;
    if (!s.replacement.empty()) len = utf8_sequence_length(static_cast<uint8_t>(s.replacement[0]));
    if (s.replacement.empty() || len != s.replacement.size()) {
      view.at("replacement")
          .fail_here(fmt::format("replacement '{}' must be one character", s.replacement));
    }
    if (auto scheme = view.find("prepend_scheme")) {
      const std::string v = scheme->as_string();
      if (v == "always") {
        s.prepend = Prepend::kAlways;
      } else if (v == "first") {
        s.prepend = Prepend::kFirst;
      } else if (v == "never") {
        s.prepend = Prepend::kNever;
      } else {
        scheme->fail_here(fmt::format("unknown prepend_scheme '{}'", v));
      }
    } else {
      s.prepend = view.bool_or("add_prefix_space", true) ? Prepend::kAlways : Prepend::kNever;
    }
    s.split = view.bool_or("split", true);
    steps_.push_back(s);
  } else if (type == "ByteLevel") {
    Step s{Kind::kByteLevel};
    s.add_prefix_space = view.bool_or("add_prefix_space", true);
    s.use_regex = view.bool_or("use_regex", true);
    steps_.push_back(s);
  } else if (type == "WhitespaceSplit") {
    steps_.push_back(Step{Kind::kWhitespaceSplit});
  } else if (type == "Digits") {
    Step s{Kind::kDigits};
    s.individual_digits = view.bool_or("individual_digits", false);
    steps_.push_back(s);
  } else {
    view.at("type").fail_here(
        fmt::format("unsupported pre_tokenizer type '{}' (supported: Sequence, Split, Metaspace, "
                    "ByteLevel, WhitespaceSplit, Digits)",
                    type));
  }
}

void PreTokenizer::apply(std::vector<PreToken>& pieces) const {
  std::vector<PreToken> next;
  for (const Step& step : steps_) {
    next.clear();
    for (const PreToken& piece : pieces) apply_step(step, piece, next);
    pieces.swap(next);
  }
}

void PreTokenizer::apply_step(const Step& step, const PreToken& piece,
                              std::vector<PreToken>& out) const {
  std::string_view text = piece.text;
  std::string rewritten;
  std::vector<Match> matches;
  Behavior behavior = step.behavior;
  bool invert = step.invert;
  switch (step.kind) {
    case Kind::kSplit:
      if (step.regex_gpt2) {
        find_gpt2(text, matches);
      } else {
        find_literal(text, step.pattern, matches);
      }
      break;
    case Kind::kMetaspace: {
      rewritten = piece.text;
      replace_all(rewritten, " ", step.replacement);
      const bool starts = rewritten.compare(0, step.replacement.size(), step.replacement) == 0;
      if (!starts && (step.prepend == Prepend::kAlways ||
                      (step.prepend == Prepend::kFirst && piece.at_start))) {
        rewritten.insert(0, step.replacement);
      }
      text = rewritten;
      if (!step.split) {
        matches.push_back(Match{0, text.size(), false});
      } else {
        size_t pos = 0;
        const uint32_t rep = next_code_point(step.replacement, pos);
        find_chars(
            text, [rep](uint32_t cp) { return cp == rep; }, matches);
      }
      behavior = Behavior::kMergedWithNext;
      invert = false;
      break;
    }
    case Kind::kByteLevel: {
      if (step.add_prefix_space && (text.empty() || text[0] != ' ')) {
        rewritten = " ";
        rewritten.append(text);
        text = rewritten;
      }
      if (step.use_regex) {
        find_gpt2(text, matches);
      } else {
        matches.push_back(Match{0, text.size(), false});
      }
      for (const Match& m : matches) {
        if (m.end > m.begin) {
          out.push_back(PreToken{bytes_to_unicode(text.substr(m.begin, m.end - m.begin)),
                                 piece.at_start && m.begin == 0});
        }
      }
      return;
    }
    case Kind::kWhitespaceSplit:
      find_chars(
          text, [](uint32_t cp) { return is_whitespace(cp); }, matches);
      behavior = Behavior::kRemoved;
      invert = false;
      break;
    case Kind::kDigits:
      find_chars(
          text, [](uint32_t cp) { return char_class(cp) == CharClass::kNumber; }, matches);
      behavior = step.individual_digits ? Behavior::kIsolated : Behavior::kContiguous;
      invert = false;
      break;
  }
  if (invert) {
    for (Match& m : matches) m.is_match = !m.is_match;
  }
  // (begin, end, remove) after applying the behaviour, as tokenizers' NormalizedString::split.
  std::vector<Match> parts;
  parts.reserve(matches.size());
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Match& m : matches) parts.push_back(Match{m.begin, m.end, false});
      break;
    case Behavior::kRemoved:
      parts = matches;
      break;
    case Behavior::kContiguous: {
      bool previous = false;
      for (const Match& m : matches) {
        if (m.is_match == previous && !parts.empty()) {
          parts.back().end = m.end;
        } else {
          parts.push_back(Match{m.begin, m.end, false});
        }
        previous = m.is_match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool previous = false;
      for (const Match& m : matches) {
        if (m.is_match && !previous && !parts.empty()) {
          parts.back().end = m.end;
        } else {
          parts.push_back(Match{m.begin, m.end, false});
        }
        previous = m.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous = false;
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        if (it->is_match && !previous && !parts.empty()) {
          parts.back().begin = it->begin;
        } else {
          parts.push_back(Match{it->begin, it->end, false});
        }
        previous = it->is_match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
    }
  }
  for (const Match& p : parts) {
    if (p.is_match || p.end <= p.begin) continue;  // is_match here means "remove"
    out.push_back(PreToken{std::string(text.substr(p.begin, p.end - p.begin)),
                           piece.at_start && p.begin == 0});
  }
}

// ------------------------------------------------------------------- Decoder

Decoder Decoder::from_json(const JsonView& view) {
  Decoder d;
  if (!view.json().is_null()) {
    d.present_ = true;
    d.add(view);
  }
  return d;
}

void Decoder::add(const JsonView& view) {
  const std::string type = view.at("type").as_string();
  if (type == "Sequence") {
    const JsonView list = view.at("decoders");
    list.expect_array();
    for (size_t i = 0; i < list.json().size(); ++i) add(list.at(i));
  } else if (type == "Replace") {
    bool gpt2 = false;
    steps_.push_back(Step{Kind::kReplace, pattern_of(view.at("pattern"), false, &gpt2),
                          view.at("content").as_string()});
  } else if (type == "ByteFallback") {
    steps_.push_back(Step{Kind::kByteFallback});
  } else if (type == "Fuse") {
    steps_.push_back(Step{Kind::kFuse});
  } else if (type == "Strip") {
    Step s{Kind::kStrip};
    s.content = view.at("content").as_string();
    if (s.content.empty() ||
        utf8_sequence_length(static_cast<uint8_t>(s.content[0])) != s.content.size()) {
      view.at("content").fail_here(fmt::format("'{}' must be one character", s.content));
    }
    const int64_t start = view.int_or("start", 0);
    const int64_t stop = view.int_or("stop", 0);
    if (start < 0 || stop < 0) view.fail_here("Strip start/stop must not be negative");
    s.start = static_cast<size_t>(start);
    s.stop = static_cast<size_t>(stop);
    steps_.push_back(s);
  } else if (type == "Metaspace") {
    Step s{Kind::kMetaspace};
    s.content = view.string_or("replacement", "\u2581");
    if (s.content.empty() ||
        utf8_sequence_length(static_cast<uint8_t>(s.content[0])) != s.content.size()) {
      view.at("replacement").fail_here(fmt::format("'{}' must be one character", s.content));
    }
    if (auto scheme = view.find("prepend_scheme")) {
      s.prepend = scheme->as_string() != "never";
    } else {
      s.prepend = view.bool_or("add_prefix_space", true);
    }
    steps_.push_back(s);
  } else if (type == "ByteLevel") {
    steps_.push_back(Step{Kind::kByteLevel});
  } else {
    view.at("type").fail_here(fmt::format(
        "unsupported decoder type '{}' (supported: Sequence, Replace, ByteFallback, Fuse, Strip, "
        "Metaspace, ByteLevel)",
        type));
  }
}

namespace {

// "<0xNN>" -> byte, as tokenizers parses it (u8::from_str_radix on two characters).
bool parse_byte_token(std::string_view token, uint8_t* byte) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return false;
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(token[3]);
  const int lo = hex(token[4]);
  if (token[3] == '+' && lo >= 0) {  // Rust accepts a leading '+'
    *byte = static_cast<uint8_t>(lo);
    return true;
  }
  if (hi < 0 || lo < 0) return false;
  *byte = static_cast<uint8_t>(hi * 16 + lo);
  return true;
}

bool is_valid_utf8(std::string_view bytes) {
  size_t tail = 0;
  const std::string lossy = utf8_lossy(bytes, &tail);
  return lossy.size() == bytes.size() && lossy == bytes;
}

}  // namespace

std::string Decoder::decode(std::vector<std::string> tokens, size_t* stable_bytes) const {
  if (!present_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out.push_back(' ');
      out.append(tokens[i]);
    }
    if (stable_bytes != nullptr) *stable_bytes = out.size();
    return out;
  }
  std::vector<std::string> parts = run(std::move(tokens), 0, stable_bytes);
  std::string out;
  for (const std::string& p : parts) out.append(p);
  if (stable_bytes != nullptr) *stable_bytes = std::min(*stable_bytes, out.size());
  return out;
}

std::vector<std::string> Decoder::run(std::vector<std::string> tokens, size_t first_step,
                                      size_t* stable_bytes) const {
  // An unstable point found at some step: the stable text is what the rest of
  // the chain makes of the tokens before it.
  const auto settle = [&](std::vector<std::string> prefix, size_t step) {
    size_t stable = 0;
    std::vector<std::string> done = run(std::move(prefix), step, &stable);
    size_t total = 0;
    for (const std::string& p : done) total += p.size();
    *stable_bytes = std::min(stable, total);
    stable_bytes = nullptr;  // later steps cannot move the stable point further back
  };
  if (stable_bytes != nullptr) *stable_bytes = ~size_t{0};
  for (size_t si = first_step; si < steps_.size(); ++si) {
    const Step& s = steps_[si];
    switch (s.kind) {
      case Kind::kReplace:
        for (std::string& t : tokens) replace_all(t, s.pattern, s.content);
        break;
      case Kind::kByteFallback: {
        if (stable_bytes != nullptr) {
          size_t g = tokens.size();
          uint8_t b = 0;
          while (g > 0 && parse_byte_token(tokens[g - 1], &b)) --g;
          if (g < tokens.size()) {
            settle(std::vector<std::string>(tokens.begin(),
                                            tokens.begin() + static_cast<std::ptrdiff_t>(g)),
                   si);
          }
        }
        std::vector<std::string> out;
        out.reserve(tokens.size());
        std::string group;
        size_t group_len = 0;
        const auto flush = [&] {
          if (group_len == 0) return;
          if (is_valid_utf8(group)) {
            out.push_back(group);
          } else {
            for (size_t k = 0; k < group_len; ++k) out.emplace_back("\xEF\xBF\xBD");
          }
          group.clear();
          group_len = 0;
        };
        for (std::string& t : tokens) {
          uint8_t byte = 0;
          if (parse_byte_token(t, &byte)) {
            group.push_back(static_cast<char>(byte));
            ++group_len;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens.swap(out);
        break;
      }
      case Kind::kFuse: {
        std::string joined;
        for (const std::string& t : tokens) joined.append(t);
        tokens.assign(1, std::move(joined));
        break;
      }
      case Kind::kStrip: {
        size_t pos = 0;
        const uint32_t ch = next_code_point(s.content, pos);
        for (std::string& t : tokens) {
          std::vector<size_t> starts;  // byte offset of each character
          for (size_t p = 0; p < t.size();) {
            starts.push_back(p);
            p += utf8_sequence_length(static_cast<uint8_t>(t[p]));
          }
          const size_t n = starts.size();
          const auto char_at = [&](size_t i) {
            size_t p = starts[i];
            return next_code_point(t, p);
          };
          size_t start_cut = 0;
          for (size_t i = 0; i < std::min(s.start, n) && char_at(i) == ch; ++i) start_cut = i + 1;
          size_t stop_cut = n;
          for (size_t i = 0; i < std::min(s.stop, n) && char_at(n - 1 - i) == ch; ++i)
            stop_cut = n - 1 - i;
          if (start_cut >= stop_cut) {
            t.clear();
          } else {
            const size_t b = starts[start_cut];
            const size_t e = stop_cut < n ? starts[stop_cut] : t.size();
            t = t.substr(b, e - b);
          }
        }
        break;
      }
      case Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          if (i == 0 && s.prepend) {
            std::string& t = tokens[i];
            std::string out;
            size_t pos = 0;
            while (pos < t.size()) {
              const size_t p = t.find(s.content, pos);
              if (p == std::string::npos) {
                out.append(t, pos);
                break;
              }
              out.append(t, pos, p - pos);
              pos = p + s.content.size();
            }
            t.swap(out);
          } else {
            replace_all(tokens[i], s.content, " ");
          }
        }
        break;
      case Kind::kByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) unicode_to_bytes(t, bytes);
        size_t tail = 0;
        std::string text = utf8_lossy(bytes, &tail);
        if (stable_bytes != nullptr && tail > 0) {
          settle(std::vector<std::string>{utf8_lossy(
                     std::string_view(bytes).substr(0, bytes.size() - tail))},
                 si + 1);
        }
        tokens.assign(1, std::move(text));
        break;
      }
    }
  }
  if (stable_bytes != nullptr) {
    size_t total = 0;
    for (const std::string& t : tokens) total += t.size();
    *stable_bytes = total;
  }
  return tokens;
}

// ------------------------------------------------------------- PostProcessor

PostProcessor PostProcessor::from_json(const JsonView& view) {
  PostProcessor p;
  if (!view.json().is_null()) p.add(view);
  return p;
}

PostProcessor PostProcessor::bos_eos(std::vector<int32_t> bos, std::vector<int32_t> eos) {
  PostProcessor p;
  if (!bos.empty() || !eos.empty())
    p.templates_.push_back(Template{std::move(bos), std::move(eos), true});
  return p;
}

void PostProcessor::add(const JsonView& view) {
  const std::string type = view.at("type").as_string();
  if (type == "Sequence") {
    const JsonView list = view.at("processors");
    list.expect_array();
    for (size_t i = 0; i < list.json().size(); ++i) add(list.at(i));
  } else if (type == "ByteLevel") {
    // Only adjusts offsets.
  } else if (type == "TemplateProcessing") {
    const JsonView single = view.at("single");
    single.expect_array();
    const JsonView specials = view.at("special_tokens");
    Template t;
    t.has_sequence = false;
    for (size_t i = 0; i < single.json().size(); ++i) {
      const JsonView item = single.at(i);
      if (auto seq = item.find("Sequence")) {
        const std::string id = seq->at("id").as_string();
        if (id != "A" || t.has_sequence) {
          seq->fail_here(
              fmt::format("unsupported sequence '{}' in a single-sequence template", id));
        }
        t.has_sequence = true;
      } else if (auto special = item.find("SpecialToken")) {
        const std::string name = special->at("id").as_string();
        const JsonView entry = specials.at(name);
        const JsonView ids = entry.at("ids");
        ids.expect_array();
        std::vector<int32_t>& dst = t.has_sequence ? t.after : t.before;
        for (size_t k = 0; k < ids.json().size(); ++k) {
          const int64_t id = ids.at(k).as_int();
          if (id < 0 || id > INT32_MAX) ids.at(k).fail_here(fmt::format("bad token id {}", id));
          dst.push_back(static_cast<int32_t>(id));
        }
      } else {
        item.fail_here("expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    templates_.push_back(std::move(t));
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    const auto token_id = [](const JsonView& pair) {
      pair.expect_array();
      const int64_t id = pair.at(1).as_int();
      if (id < 0 || id > INT32_MAX) pair.at(1).fail_here(fmt::format("bad token id {}", id));
      return static_cast<int32_t>(id);
    };
    templates_.push_back(Template{{token_id(view.at("cls"))}, {token_id(view.at("sep"))}, true});
  } else {
    view.at("type").fail_here(fmt::format(
        "unsupported post_processor type '{}' (supported: Sequence, TemplateProcessing, ByteLevel, "
        "BertProcessing, RobertaProcessing)",
        type));
  }
}

std::vector<int32_t> PostProcessor::apply(std::vector<int32_t> ids) const {
  for (const Template& t : templates_) {
    std::vector<int32_t> out;
    out.reserve(t.before.size() + ids.size() + t.after.size());
    out.insert(out.end(), t.before.begin(), t.before.end());
    if (t.has_sequence) out.insert(out.end(), ids.begin(), ids.end());
    out.insert(out.end(), t.after.begin(), t.after.end());
    ids.swap(out);
  }
  return ids;
}

}  // namespace specula::tokenizer
