// SPDX-License-Identifier: Apache-2.0
// The libFuzzer entry point every fuzz target defines. The same function is
// driven either by libFuzzer (clang, -fsanitize=fuzzer) or by fuzz_driver.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string_view>

// Runs the target on one input. Returns 0; a crash, a sanitizer report or an
// exception other than specula::Error escaping is a finding.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace specula::fuzz {

// What the last input did, reported by the target for fuzz_driver.cpp (which
// has no coverage feedback): whether it parsed, and a summary of the outcome
// (the kind of error, or the structure accepted). The driver keeps inputs
// with outcomes it has not seen yet as seeds. libFuzzer ignores both.
inline bool last_accepted = false;
inline uint64_t last_outcome = 0;

// FNV-1a step.
inline uint64_t mix(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  return h;
}

// The kind of an error, so that failures at different checks differ but
// different bad values do not: the letters of its message before the first
// quote and after the last one (quoted parts are names and values, which may
// hold quotes themselves), ignoring the bad value after "got " and the JSON
// parser's "last read: ...".
inline uint64_t error_outcome(std::string_view message) {
  for (std::string_view stop : {std::string_view("got "), std::string_view("last read")}) {
    if (const size_t at = message.find(stop); at != std::string_view::npos)
      message = message.substr(0, at);
  }
  uint64_t h = 0xcbf29ce484222325ull;
  auto add_letters = [&h](std::string_view part) {
    for (char c : part) {
      if ((c >= 'a' && c <= 'z') || c == '_') h = mix(h, static_cast<uint8_t>(c));
    }
  };
  const size_t first = message.find_first_of("'\"");
  if (first == std::string_view::npos) {
    add_letters(message);
  } else {
    add_letters(message.substr(0, first));
    h = mix(h, '|');
    add_letters(message.substr(message.find_last_of("'\"") + 1));
  }
  return h;
}

// Whether s is well-formed UTF-8 (shortest forms, no surrogates, at most U+10FFFF).
inline bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

}  // namespace specula::fuzz

// Stops the process when a target's own invariant check fails, so both
// drivers report the input that broke it.
#define SPECULA_FUZZ_ASSERT(cond)                                                             \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      __builtin_trap();                                                                       \
    }                                                                                         \
  } while (0)
