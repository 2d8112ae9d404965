// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/spec_scheduler.h"

#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "engine/backend/backends.h"
#include "engine/chat/sha256.h"
#include "engine/draft/dspark/dspark_config.h"
#include "engine/speculative/sps_profile.h"

namespace specula::cli {
namespace {

// The first line of `path` that starts with `key`, after the key and any
// ':' and blanks; empty when none.
std::string field_of(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with(key)) continue;
    size_t at = line.find(':', key.size());
    if (at == std::string::npos) continue;
    ++at;
    while (at < line.size() && (line[at] == ' ' || line[at] == '\t')) ++at;
    return line.substr(at);
  }
  return "";
}

}  // namespace

void add_scheduler_options(CLI::App* cmd, SchedulerArgs& args) {
  cmd->add_option("--spec-scheduler", args.mode,
                  "Verify scheduler (DSpark Alg. 1) for batched speculative rows: off, on or "
                  "auto (on for rounds of at least --spec-scheduler-min-rows rows). It only "
                  "shortens what is verified, from the drafter's confidences (DSpark's "
                  "confidence head) and a profiled SPS(B) table; other drafters are not "
                  "scheduled. Default off: its cuts depend on the other rows, so a seeded sampled "
                  "request could depend on what runs beside it (greedy output never changes)")
      ->capture_default_str();
  cmd->add_option("--spec-scheduler-min-rows", args.min_rows,
                  "--spec-scheduler auto: the fewest decoding rows a scheduled round has (a "
                  "guess, not measured)")
      ->capture_default_str();
  cmd->add_option("--sps-cache", args.sps_cache,
                  "SPS(B) table cache (JSON); profiled on the device at start-up when missing "
                  "or too short. Default: $XDG_CACHE_HOME/specula/sps/<device+model hash>.json");
  cmd->add_option("--sps-reps", args.sps_reps, "Timed forwards per size when profiling SPS(B)")
      ->capture_default_str();
  cmd->add_flag("--verbose,-v", args.verbose,
                "Print the SPS(B) table and why a drafter is not scheduled");
}

speculative::SchedulerMode parse_scheduler_mode(const std::string& text) {
  if (text == "off") return speculative::SchedulerMode::kOff;
  if (text == "on") return speculative::SchedulerMode::kOn;
  if (text == "auto") return speculative::SchedulerMode::kAuto;
  fail("--spec-scheduler must be off, on or auto, got '{}'", text);
}

void check_scheduler_args(const SchedulerArgs& args) {
  parse_scheduler_mode(args.mode);
  if (args.min_rows < 1) fail("--spec-scheduler-min-rows must be >= 1, got {}", args.min_rows);
  if (args.sps_reps < 1 || args.sps_reps > 1000) {
    fail("--sps-reps must be in [1, 1000], got {}", args.sps_reps);
  }
  if (!args.sps_cache.empty() && std::filesystem::is_directory(args.sps_cache)) {
    fail("--sps-cache {}: is a folder (expected a JSON file's path)", args.sps_cache);
  }
}

std::string sps_device_identity(Backend& backend) {
  const MemoryInfo mem = backend.memory_info();
  std::string hw;
  if (backend.device().is_cpu()) {
    hw = fmt::format("{}, {} threads", field_of("/proc/cpuinfo", "model name"), cpu_threads());
  } else {
    // The driver's model names of the machine's GPUs (the backend does not
    // name its own), in bus order.
    std::set<std::string> files;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
      files.insert(e.path().string() + "/information");
    }
    for (const std::string& f : files) {
      const std::string model = field_of(f, "Model");
      if (model.empty()) continue;
      hw += (hw.empty() ? "" : " + ") + model;
    }
  }
  return fmt::format("{} {}, {:.1f} GiB{}{}", backend.name(), backend.device().str(),
                     static_cast<double>(mem.total_bytes) / (1 << 30), hw.empty() ? "" : ", ", hw);
}

std::string sps_model_identity(const gemma4::Gemma4Model& target) {
  // Bytes a one-token forward reads stand for the weights' dtypes (bf16,
  // f32, quantized) on every backend (weight_bytes() counts device copies only).
  return fmt::format("gemma4 {} ({} weight bytes a token)",
                     dspark::target_config_hash(target.config()).substr(0, 16),
                     target.weight_bytes_read(1));
}

std::string default_sps_cache_path(const std::string& device, const std::string& model) {
  std::string root;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    root = std::string(x) + "/specula/sps";
  } else if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    root = std::string(h) + "/.cache/specula/sps";
  } else {
    root = "/tmp/specula-sps";
  }
  return root + "/" + sha256_hex(device + "\n" + model).substr(0, 16) + ".json";
}

speculative::VerifySchedulerOptions scheduler_options(const SchedulerArgs& args,
                                                      gemma4::Gemma4Model& target, int max_rows,
                                                      int max_k, bool quiet) {
  speculative::VerifySchedulerOptions o;
  o.mode = parse_scheduler_mode(args.mode);
  o.auto_min_rows = args.min_rows;
  if (o.mode == speculative::SchedulerMode::kOff) return o;
  const std::string device = sps_device_identity(target.backend());
  const std::string model = sps_model_identity(target);
  const std::string path =
      args.sps_cache.empty() ? default_sps_cache_path(device, model) : args.sps_cache;
  const int64_t max_tokens = static_cast<int64_t>(std::max(1, max_rows)) * (max_k + 1);
  std::optional<speculative::SpsTable> table =
      speculative::load_sps_cache(path, device, model, max_tokens);
  if (table) {
    if (!quiet)
      fmt::print(stderr, "SPS table: {} (cached, {} sizes)\n", path, table->points().size());
  } else {
    speculative::SpsProfileOptions po;
    po.sizes = speculative::sps_sizes(max_tokens);
    po.window = max_k + 1;
    po.context = std::min<int64_t>(256, target.max_context() - po.window);
    po.reps = args.sps_reps;
    po.device = device;
    po.model = model;
    if (!quiet) {
      po.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
      fmt::print(stderr, "SPS table: profiling {} sizes up to B = {} ({} reps each) ...\n",
                 po.sizes.size(), max_tokens, po.reps);
    }
    table = speculative::profile_sps(target, po);
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    try {
      table->save(path);
      if (!quiet) fmt::print(stderr, "SPS table: saved to {}\n", path);
    } catch (const Error& e) {
      // A cache that cannot be written costs the next run a profile, no more.
      if (!quiet) fmt::print(stderr, "SPS table: not cached ({})\n", e.what());
    }
  }
  if (args.verbose) fmt::print(stderr, "{}", table->describe());
  o.sps = std::make_shared<const speculative::SpsTable>(std::move(*table));
  return o;
}

std::string unscheduled_note(const SchedulerArgs& args, const speculative::Engine& engine,
                             const Drafter* drafter) {
  if (parse_scheduler_mode(args.mode) == speculative::SchedulerMode::kOff || engine.schedules() ||
      drafter == nullptr) {
    return "";
  }
  return fmt::format(
      "--spec-scheduler {}: this drafter gives no confidences (only DSpark's confidence head "
      "and the replay simulation do), so its rounds are not scheduled",
      args.mode);
}

}  // namespace specula::cli
