// SPDX-License-Identifier: Apache-2.0
// `specula generate`: greedy generation from token ids.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>

#include "apps/cli/commands.h"
#include "engine/runtime/generate.h"

namespace specula::cli {
namespace {

struct GenerateArgs {
  std::string model;
  std::string prompt_ids;
  int max_tokens = 32;
  int64_t ctx_size = 4096;
  int threads = 0;
  bool json = false;
};

void run_generate(const GenerateArgs& args) {
  set_threads(args.threads);
  const std::vector<int32_t> prompt = parse_id_list(args.prompt_ids, "--prompt-ids");
  if (!args.json) fmt::print(stderr, "loading {} ...\n", args.model);
  gemma4::LoadOptions load;
  load.max_context = args.ctx_size;
  auto model = gemma4::Gemma4Model::load(args.model, load);

  GenerateOptions options;
  options.max_tokens = args.max_tokens;
  options.stop_token_ids = {};  // token-id mode: run to max_tokens unless --stop is given later
  if (!args.json) {
    options.on_token = [](int32_t token) {
      fmt::print("{} ", token);
      std::fflush(stdout);
      return true;
    };
  }
  GenerateResult result = generate_greedy(*model, prompt, options);
  const GenerateStats& s = result.stats;
  if (args.json) {
    nlohmann::json j;
    j["model"] = args.model;
    j["prompt_tokens"] = s.prompt_tokens;
    j["tokens"] = result.tokens;
    j["finish_reason"] = result.finish_reason;
    j["stats"] = {{"generated_tokens", s.generated_tokens},
                  {"target_forwards", s.target_forwards},
                  {"prefill_seconds", s.prefill_seconds},
                  {"decode_seconds", s.decode_seconds},
                  {"prefill_tokens_per_second", s.prefill_tokens_per_second()},
                  {"decode_tokens_per_second", s.decode_tokens_per_second()}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("\n");
    fmt::print(stderr, "prompt {} tokens, prefill {:.1f} tok/s | generated {} tokens, decode {:.1f} tok/s ({})\n",
               s.prompt_tokens, s.prefill_tokens_per_second(), s.generated_tokens, s.decode_tokens_per_second(),
               result.finish_reason);
  }
}

}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens greedily from a prompt of token ids");
  cmd->add_option("--model", args->model, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt token ids, comma-separated (e.g. 2,651,1234)")
      ->required();
  cmd->add_option("--max-tokens", args->max_tokens, "Maximum number of new tokens")->capture_default_str();
  cmd->add_option("--ctx-size", args->ctx_size, "Context size per sequence, in tokens")->capture_default_str();
  cmd->add_option("--threads", args->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of streaming ids and a summary");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace specula::cli
