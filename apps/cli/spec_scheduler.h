// SPDX-License-Identifier: Apache-2.0
// The verify scheduler's CLI side (bench, serve): --spec-scheduler
// off|on|auto, its auto threshold, and the SPS(B) table, profiled on the
// device at start-up and cached in a JSON file keyed by device and model.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "engine/model/gemma4/gemma4.h"
#include "engine/speculative/engine.h"
#include "engine/speculative/verify_scheduler.h"

namespace specula::cli {

struct SchedulerArgs {
  std::string mode = "off";  // off | on | auto
  int min_rows = 16;         // auto: schedule rounds of at least this many rows
  std::string sps_cache;     // empty: default_sps_cache_path()
  int sps_reps = 3;          // timed forwards per profiled size
  bool verbose = false;      // print the SPS table (and why a drafter is not scheduled)
};

// Adds --spec-scheduler, --spec-scheduler-min-rows, --sps-cache, --sps-reps
// and --verbose to `cmd`.
void add_scheduler_options(CLI::App* cmd, SchedulerArgs& args);
// "off" | "on" | "auto"; an Error names --spec-scheduler and the text otherwise.
speculative::SchedulerMode parse_scheduler_mode(const std::string& text);
// Checks every flag (before any loading); an Error names the flag and value.
void check_scheduler_args(const SchedulerArgs& args);

// What an SPS table records as the device: backend, device, memory and the
// hardware's name (GPU model from the driver, CPU model and threads).
std::string sps_device_identity(Backend& backend);
// What it records as the model: the target's config hash (the DSpark
// checkpoints' target identity) and the weight bytes a one-token forward
// reads (their dtypes).
std::string sps_model_identity(const gemma4::Gemma4Model& target);
// $XDG_CACHE_HOME/specula/sps/<hash of device and model>.json (else
// ~/.cache/..., else /tmp/specula-sps/...).
std::string default_sps_cache_path(const std::string& device, const std::string& model);

// The engine's scheduler options for `args` (mode off: none, nothing
// loaded): loads the cached table or profiles the target (sizes 1, 2, 4, ...
// up to max_rows · (max_k + 1), progress on stderr) and saves it. Logs what
// it did unless quiet; with --verbose prints the table.
speculative::VerifySchedulerOptions scheduler_options(const SchedulerArgs& args,
                                                      gemma4::Gemma4Model& target, int max_rows,
                                                      int max_k, bool quiet);
// The log line for an engine whose drafter is not scheduled although the mode
// asks for it (empty when it is, or the mode is off).
std::string unscheduled_note(const SchedulerArgs& args, const speculative::Engine& engine,
                             const Drafter* drafter);

}  // namespace specula::cli
