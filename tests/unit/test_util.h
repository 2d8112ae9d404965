// SPDX-License-Identifier: Apache-2.0
// Small helpers shared by the unit tests: the message of the specula::Error a
// call throws, and fresh scratch folders under the build tree.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <utility>

#include "engine/core/error.h"

namespace specula::testing {

// What error_of returns when the call threw nothing; no expected message is a
// substring of it, so `error_of(...).find("x") != npos` fails as it should.
inline constexpr const char* kNoError = "(no error)";

// The what() of the specula::Error `f` throws, or kNoError. Other exceptions
// propagate (a test that throws something else should fail loudly).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return kNoError;
}

// Scratch folders of one test file: `dirs(name)` is
// <build>/<group>_tmp/<name>, emptied and created on each call (the folder is
// left behind for inspection after a failure). Needs SPECULA_BINARY_DIR.
class TempDirs {
 public:
  explicit TempDirs(std::string group) : group_(std::move(group)) {}
  std::string operator()(const std::string& name) const {
    const std::string d = std::string(SPECULA_BINARY_DIR) + "/" + group_ + "_tmp/" + name;
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    return d;
  }

 private:
  std::string group_;
};

}  // namespace specula::testing
