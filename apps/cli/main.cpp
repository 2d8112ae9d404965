// SPDX-License-Identifier: Apache-2.0
// `specula`: the command-line front end. Flag parsing and wiring only; every
// verb lives in its own cmd_*.cpp file.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "apps/cli/commands.h"
#include "engine/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"specula: Gemma 4 inference with lossless speculative decoding"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "specula " SPECULA_VERSION);
  specula::cli::register_generate(app);
  specula::cli::register_chat(app);
  specula::cli::register_tokenize(app);
  specula::cli::register_score(app);
  specula::cli::register_draft_trace(app);
  specula::cli::register_bench(app);
  specula::cli::register_serve(app);
  specula::cli::register_bench_serve(app);
  specula::cli::register_calibrate(app);
  specula::cli::register_ab(app);
  specula::cli::register_dspark_record(app);
  specula::cli::register_regen(app);
  specula::cli::register_quantize(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const specula::Error& e) {
    fmt::print(stderr, "specula: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "specula: internal error: {}\n", e.what());
    return 2;
  }
  return 0;
}
