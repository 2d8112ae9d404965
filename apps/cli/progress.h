// SPDX-License-Identifier: Apache-2.0
// A progress report for long CLI runs over many items (prompts): on a
// terminal (stderr is a tty) one bar redrawn in place, with items done,
// tokens/s and an ETA; otherwise a plain line at most every `interval`
// seconds (and at the end), so logs stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace specula::cli {

class Progress {
 public:
  // `total` items of which `already` were done before this run (resumed work
  // counts as done but not towards tokens/s or the ETA).
  Progress(std::string label, int64_t total, int64_t already = 0, double interval_s = 10.0);
  // `items` more done, producing `tokens` tokens.
  void advance(int64_t items, int64_t tokens);
  // Ends the bar's line (tty) or prints the final plain line.
  void finish();

 private:
  std::string line() const;
  void draw(bool force);

  std::string label_;
  int64_t total_, done_, start_done_, tokens_ = 0;
  double interval_s_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_print_;
};

}  // namespace specula::cli
