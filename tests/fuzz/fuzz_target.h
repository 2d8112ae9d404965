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
