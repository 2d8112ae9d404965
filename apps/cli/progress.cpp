// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace specula::cli {
namespace {

std::string duration_text(double s) {
  const auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, t / 60 % 60);
  return fmt::format("{}m{:02d}s", t / 60, t % 60);
}

}  // namespace

Progress::Progress(std::string label, int64_t total, int64_t already, double interval_s)
    : label_(std::move(label)),
      total_(total),
      done_(already),
      start_done_(already),
      interval_s_(interval_s),
      tty_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_print_(start_) {}

std::string Progress::line() const {
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double tps = s > 0 ? static_cast<double>(tokens_) / s : 0.0;
  const int64_t run = done_ - start_done_;
  std::string eta = "?";
  if (run > 0 && done_ < total_)
    eta = duration_text(s / static_cast<double>(run) * static_cast<double>(total_ - done_));
  else if (done_ >= total_)
    eta = "0m00s";
  return fmt::format("{}: {}/{} prompts, {} tokens, {:.1f} tok/s, elapsed {}, ETA {}", label_,
                     done_, total_, tokens_, tps, duration_text(s), eta);
}

void Progress::draw(bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled =
        total_ > 0 ? static_cast<int>(kWidth * std::min<int64_t>(done_, total_) / total_) : kWidth;
    fmt::print(stderr, "\r[{}{}] {}\x1b[K", std::string(static_cast<size_t>(filled), '#'),
               std::string(static_cast<size_t>(kWidth - filled), '.'), line());
    std::fflush(stderr);
    return;
  }
  if (!force && std::chrono::duration<double>(now - last_print_).count() < interval_s_) return;
  last_print_ = now;
  fmt::print(stderr, "{}\n", line());
}

void Progress::advance(int64_t items, int64_t tokens) {
  done_ += items;
  tokens_ += tokens;
  draw(false);
}

void Progress::finish() {
  if (tty_) {
    draw(true);
    fmt::print(stderr, "\n");
  } else {
    draw(true);
  }
}

}  // namespace specula::cli
