// SPDX-License-Identifier: Apache-2.0
// Registration of the CLI verbs. Each registers a subcommand whose callback
// runs the verb; errors propagate as specula::Error to main().
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace specula::cli {

void register_generate(CLI::App& app);
void register_chat(CLI::App& app);
void register_score(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_draft_trace(CLI::App& app);
void register_bench(CLI::App& app);
void register_serve(CLI::App& app);
void register_bench_serve(CLI::App& app);
void register_calibrate(CLI::App& app);
void register_ab(CLI::App& app);
void register_dspark_record(CLI::App& app);
void register_regen(CLI::App& app);
void register_quantize(CLI::App& app);

}  // namespace specula::cli
