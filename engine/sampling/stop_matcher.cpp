// SPDX-License-Identifier: Apache-2.0
#include "engine/sampling/stop_matcher.h"

#include <algorithm>

#include "engine/core/error.h"

namespace specula {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (size_t i = 0; i < stops_.size(); ++i) {
    if (stops_[i].empty()) fail("StopMatcher: stop string {} is empty", i);
  }
}

StopMatcher::Step StopMatcher::feed(std::string_view text) {
  if (stopped_) fail("StopMatcher: text fed after a stop string was already matched");
  pending_.append(text);
  Step step;

  // The earliest stop string wins. No match can begin in text emitted earlier:
  // only text that could not start a stop string was ever released.
  size_t best_pos = std::string::npos;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const size_t pos = pending_.find(stops_[i]);
    if (pos < best_pos) {
      best_pos = pos;
      step.stop_index = static_cast<int>(i);
    }
  }
  if (best_pos != std::string::npos) {
    step.emit = pending_.substr(0, best_pos);
    step.stopped = true;
    stopped_ = true;
    pending_.clear();
    return step;
  }

  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  const std::string_view all(pending_);
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - 1, all.size()); len > hold; --len) {
      if (all.substr(all.size() - len) == std::string_view(s).substr(0, len)) {
        hold = len;
        break;
      }
    }
  }
  step.emit = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return step;
}

std::string StopMatcher::flush() {
  std::string rest;
  rest.swap(pending_);
  return rest;
}

}  // namespace specula
