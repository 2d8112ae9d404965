// SPDX-License-Identifier: Apache-2.0
// `specula generate`: a prompt (text or token ids) in, a streamed continuation out.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/runtime/text_generation.h"

namespace specula::cli {
namespace {

struct GenerateArgs {
  ModelArgs model;
  SamplingArgs sampling;
  speculative::DraftSchedule schedule;
  std::string prompt;
  std::string prompt_ids;
  bool json = false;
  const CLI::Option* prompt_option = nullptr;  // tells `--prompt ""` from no --prompt
  const CLI::Option* prompt_ids_option = nullptr;
};

void run_generate(const GenerateArgs& args) {
  const bool text_mode = args.prompt_option->count() > 0;
  if (text_mode == (args.prompt_ids_option->count() > 0))
    fail("give exactly one of --prompt and --prompt-ids");
  if (text_mode && args.prompt.empty())
    fail("--prompt: the prompt is empty (give some text, or token ids with --prompt-ids)");
  LoadedModels m =
      load_models(args.model, /*with_draft=*/true, /*with_tokenizer=*/text_mode, args.json);
  const SamplingParams params = sampling_params(args.sampling, m);
  speculative::DraftSchedule schedule = args.schedule;
  resolve_schedule(schedule, m.draft_source.get());
  const bool speculative = m.draft_source != nullptr;
  Drafter* drafter = m.draft_source.get();

  // Streams to stdout unless --json; ends with the JSON object or the summary line.
  auto stream = [&](std::string_view piece) {
    if (args.json) return;
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  auto finish = [&](nlohmann::json j, const std::vector<int32_t>& tokens, const std::string& reason,
                    const speculative::DecodeStats& stats) {
    if (args.json) {
      j["model"] = m.model_dir;
      j["draft"] = m.draft_dir;
      j["tokens"] = tokens;
      j["finish_reason"] = reason;
      j["stats"] = stats_json(stats, speculative);
      fmt::print("{}\n", j.dump());
    } else {
      fmt::print("\n");
      fmt::print(stderr, "{} ({})\n", summary_line(stats, speculative), reason);
    }
  };

  if (text_mode) {
    std::vector<int32_t> prompt = m.tokenizer->encode(args.prompt, /*add_special_tokens=*/true);
    stream(args.prompt);
    TextGenerationResult r = generate_text(*m.target, drafter, *m.tokenizer, prompt, params,
                                           schedule, [&](std::string_view text) {
                                             stream(text);
                                             return true;
                                           });
    finish({{"prompt", args.prompt}, {"text", r.text}}, r.tokens, r.finish_reason, r.stats);
    return;
  }

  speculative::DecodeRequest request{.prompt = parse_id_list(args.prompt_ids, "--prompt-ids"),
                                     .params = params};
  auto on_tokens = [&](int, std::span<const int32_t> fresh) {
    for (int32_t t : fresh) stream(fmt::format("{} ", t));
    return true;
  };
  speculative::DecodeResult r =
      speculative::decode(*m.target, drafter, std::span(&request, 1), schedule, on_tokens).front();
  finish({{"prompt_ids", request.prompt}}, r.tokens, r.finish_reason, r.stats);
}

}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd =
      app.add_subcommand("generate", "Continue a prompt, streaming the output (greedy by default)");
  args->prompt_option = cmd->add_option(
      "--prompt,-p", args->prompt, "Prompt text (tokenized with the model's tokenizer, BOS added)");
  args->prompt_ids_option = cmd->add_option(
      "--prompt-ids", args->prompt_ids, "Prompt token ids, comma-separated (instead of --prompt)");
  add_model_options(cmd, args->model, /*with_draft=*/true);
  add_sampling_options(cmd, args->sampling, 128);
  add_draft_options(cmd, args->schedule);
  cmd->add_flag("--json", args->json,
                "Print one JSON object (text, ids, statistics) instead of streaming");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace specula::cli
