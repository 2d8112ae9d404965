// SPDX-License-Identifier: Apache-2.0
// Errors and checks. Every failure the engine reports is a specula::Error whose
// message names what was being done and the values involved.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace specula {

// The one exception type the engine throws. `what()` is a complete sentence a
// user can act on (it names the file, tensor, field or op and the bad values).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace specula

// Invariant checks. They throw (never abort) so a server survives a bad request.
// SPECULA_CHECK(cond, "fmt", args...) prints the failed condition and the message.
#define SPECULA_CHECK(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) [[unlikely]] {                                                           \
      throw ::specula::Error(fmt::format("check failed: {} ({}:{}): {}", #cond, __FILE__, \
                                         __LINE__, fmt::format(__VA_ARGS__)));            \
    }                                                                                     \
  } while (0)

// SPECULA_CHECK_EQ(a, b, "context") prints both values on failure.
#define SPECULA_CHECK_EQ(a, b, ...)                                                               \
  do {                                                                                            \
    const auto& specula_lhs_ = (a);                                                               \
    const auto& specula_rhs_ = (b);                                                               \
    if (!(specula_lhs_ == specula_rhs_)) [[unlikely]] {                                           \
      throw ::specula::Error(fmt::format("check failed: {} == {} ({} vs {}) ({}:{}): {}", #a, #b, \
                                         specula_lhs_, specula_rhs_, __FILE__, __LINE__,          \
                                         fmt::format(__VA_ARGS__)));                              \
    }                                                                                             \
  } while (0)
