// SPDX-License-Identifier: Apache-2.0
// StopMatcher: finds stop strings in text that arrives piece by piece (one
// detokenised token at a time) and says how much text is safe to show.
// Text that could still turn into a stop string is held back until the next
// piece decides it; the stop string itself is never emitted. Matching is on
// bytes, so a stop string matches across token boundaries.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace specula {

class StopMatcher {
 public:
  struct Step {
    std::string emit;      // text to show now (everything before any stop string)
    bool stopped = false;  // a stop string was found; generation must end
    int stop_index = -1;   // which stop string (index into the constructor's list)
  };

  // Empty strings are rejected (Error); an empty list never stops.
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends `text` to what was held back and returns what may be emitted.
  // After a step that stopped, further feeds are an Error.
  Step feed(std::string_view text);
  // End of generation without a stop: returns the held-back text.
  std::string flush();

  bool stopped() const { return stopped_; }
  // Bytes currently held back as a possible stop-string prefix.
  size_t held() const { return pending_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace specula
