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
void register_score(CLI::App& app);

// Parses "1,2,3" (spaces allowed) into token ids; an Error names the bad item.
std::vector<int32_t> parse_id_list(const std::string& text, const char* flag);
// Applies --threads (0 = leave the OpenMP default).
void set_threads(int threads);

}  // namespace specula::cli
