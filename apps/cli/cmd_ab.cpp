// SPDX-License-Identifier: Apache-2.0
// `specula ab`: the paired A/B gate of two drafters (engine/lab/ab_stats.h).
// Same target, same prompts in the same order, greedy, one prompt at a time
// per arm (batch 1, so tokens/s compare), A then B on each prompt so that
// drift in machine load hits both arms alike. Greedy speculative decoding is
// lossless, so both arms must emit the same tokens: a difference is a bug,
// reported as one.
#include <fmt/format.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>

#include "apps/cli/commands.h"
#include "apps/cli/prompt_set.h"
#include "apps/cli/setup.h"
#include "engine/lab/ab_stats.h"
#include "engine/lab/plot/plot.h"

namespace specula::cli {
namespace {

struct AbArgs {
  ModelArgs model;
  std::string draft_a, draft_b;
  std::string prompt_file;
  std::string prompt_format = "text";  // text, chat or code-block
  std::optional<int> num_prompts;      // the first N prompts of the file; else all
  int draft_tokens = 0;                // shared -k; 0: each drafter's own length
  int draft_tokens_a = 0, draft_tokens_b = 0;
  int max_tokens = 64;
  double max_drop = 3.0;
  std::string plot;
  bool json = false;
};

// One arm's drafter, loaded for the shared target.
struct Arm {
  std::string name;  // "A" / "B"
  std::string dir;
  std::unique_ptr<assistant::AssistantModel> assistant;
  std::unique_ptr<dspark::DSparkModel> dspark;
  std::unique_ptr<Drafter> drafter;
  speculative::DraftSchedule schedule;
  std::vector<lab::PromptRun> runs;
};

// Loads `dir` for m.target by kind and moves it out of `m` into an Arm. A
// drafter made for another target gets its loader's error, prefixed with the
// arm, the flag and the target so that the pair is named.
Arm load_arm(LoadedModels& m, const std::string& name, const std::string& flag,
             const std::string& dir, const ModelArgs& args, int k, bool quiet) {
  if (dir.empty()) fail("{}: give a drafter (a checkpoint folder or 'ngram')", flag);
  try {
    load_drafter(m, dir, args, quiet);
  } catch (const Error& e) {
    fail("arm {} ({} {}) cannot draft for the target {}: {}", name, flag, dir, m.model_dir,
         e.what());
  }
  Arm arm{.name = name, .dir = dir};
  arm.assistant = std::move(m.drafter);
  arm.dspark = std::move(m.dspark);
  arm.drafter = std::move(m.draft_source);
  arm.schedule.draft_tokens = k;
  resolve_schedule(arm.schedule, arm.drafter.get());
  return arm;
}

lab::PromptRun prompt_run(const speculative::DecodeStats& s, double wall_ms) {
  return {.generated_tokens = s.generated_tokens,
          .drafted = s.drafted,
          .accepted = s.accepted,
          .target_calls = s.target_forwards,
          .wall_ms = wall_ms,
          .drafted_by_pos = s.drafted_at,
          .accepted_by_pos = s.accepted_at};
}

// Greedy decoding of one prompt on one arm; returns the tokens and appends its
// run, timed over the whole call (prefill included: both arms pay the same one).
std::vector<int32_t> run_one(LoadedModels& m, Arm& arm, const speculative::DecodeRequest& req,
                             bool record) {
  const auto t0 = std::chrono::steady_clock::now();
  speculative::DecodeResult r =
      speculative::decode(*m.target, arm.drafter.get(), std::span(&req, 1), arm.schedule).front();
  m.target->backend().synchronize();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (record) arm.runs.push_back(prompt_run(r.stats, ms));
  return std::move(r.tokens);
}

// Greedy is lossless: equal outputs, or a bug worth stopping for.
void check_same_output(const std::vector<int32_t>& a, const std::vector<int32_t>& b, size_t prompt,
                       const Arm& arm_a, const Arm& arm_b) {
  if (a == b) return;
  size_t j = 0;
  while (j < a.size() && j < b.size() && a[j] == b[j]) ++j;
  const std::string at_a = j < a.size() ? std::to_string(a[j]) : "end";
  const std::string at_b = j < b.size() ? std::to_string(b[j]) : "end";
  throw std::logic_error(fmt::format(
      "BUG: greedy outputs differ on prompt {} (A {}: {} tokens, B {}: {} tokens; first "
      "difference at token {}: A {} vs B {}). Greedy speculative decoding must emit the "
      "target's own tokens whatever the drafter: one of the drafters or the engine is broken",
      prompt + 1, arm_a.dir, a.size(), arm_b.dir, b.size(), j, at_a, at_b));
}

nlohmann::json arm_json(const Arm& arm, const lab::ArmSummary& s) {
  return {{"draft", arm.dir},
          {"draft_tokens", arm.schedule.draft_tokens},
          {"prompts", s.prompts},
          {"generated_tokens", s.generated_tokens},
          {"drafted", s.drafted},
          {"accepted", s.accepted},
          {"target_calls", s.target_calls},
          {"wall_ms", s.wall_ms},
          {"acceptance", s.acceptance},
          {"tau", s.tau},
          {"tok_per_sec", s.tok_per_sec},
          {"acceptance_by_position", s.acceptance_by_pos}};
}

nlohmann::json verdict_json(const LoadedModels& m, const Arm& a, const Arm& b,
                            const lab::AbVerdict& v) {
  nlohmann::json per_prompt = nlohmann::json::array();
  for (const lab::PromptDelta& d : v.per_prompt) {
    per_prompt.push_back({{"acceptance_a", d.acceptance_a},
                          {"acceptance_b", d.acceptance_b},
                          {"delta_pts", d.delta_pts},
                          {"tok_per_sec_a", d.tok_per_sec_a},
                          {"tok_per_sec_b", d.tok_per_sec_b},
                          {"speed_ratio", d.speed_ratio},
                          {"holds", d.holds}});
  }
  return {{"model", m.model_dir},
          {"arms", {{"a", arm_json(a, v.a)}, {"b", arm_json(b, v.b)}}},
          {"max_drop_pts", v.max_drop_pts},
          {"delta_acceptance_pts", v.delta_acc_pts},
          {"speed_ratio", v.speed_ratio},
          {"paired_holds", v.paired_holds},
          {"verdict", v.pass ? "PASS" : "FAIL"},
          {"per_prompt", per_prompt}};
}

void run_ab(const AbArgs& a) {
  if (a.max_tokens < 1) fail("--max-tokens: {} must be at least 1", a.max_tokens);
  if (!(a.max_drop >= 0) || !std::isfinite(a.max_drop))
    fail("--max-drop: {} is not a number of points >= 0", a.max_drop);
  const FormattedPromptSet prompts =
      read_formatted_prompt_set(a.prompt_file, a.prompt_format, a.num_prompts);
  LoadedModels m =
      load_models(a.model, /*with_draft=*/false, prompts.set.needs_tokenizer(), a.json);
  Arm arm_a = load_arm(m, "A", "--draft-a", a.draft_a, a.model,
                       a.draft_tokens_a ? a.draft_tokens_a : a.draft_tokens, a.json);
  Arm arm_b = load_arm(m, "B", "--draft-b", a.draft_b, a.model,
                       a.draft_tokens_b ? a.draft_tokens_b : a.draft_tokens, a.json);
  std::optional<ChatOptions> chat;
  if (prompts.format == PromptFormat::kChat) chat = chat_options(m, a.json);
  const std::vector<std::vector<int32_t>> ids =
      tokenize_prompt_set(prompts, m.tokenizer ? &*m.tokenizer : nullptr,
                          m.target->config().vocab_size, chat ? &*chat : nullptr);
  check_prompts_fit(prompts, ids, a.max_tokens, "--max-tokens", m.target->max_context());
  SamplingArgs sampling;
  sampling.params.temperature = 0.0f;
  sampling.params.max_tokens = a.max_tokens;
  const SamplingParams params = sampling_params(sampling, m);

  // One uncounted run per arm first, so neither pays the first call's setup.
  const speculative::DecodeRequest warm{.prompt = ids.front(), .params = params};
  run_one(m, arm_a, warm, false);
  run_one(m, arm_b, warm, false);
  const bool tty = isatty(STDERR_FILENO) && !a.json;
  for (size_t i = 0; i < ids.size(); ++i) {
    const speculative::DecodeRequest req{.prompt = ids[i], .params = params};
    const std::vector<int32_t> out_a = run_one(m, arm_a, req, true);
    const std::vector<int32_t> out_b = run_one(m, arm_b, req, true);
    check_same_output(out_a, out_b, i, arm_a, arm_b);
    if (tty) fmt::print(stderr, "\rab: prompts {}/{}", i + 1, ids.size());
  }
  if (tty) fmt::print(stderr, "\n");
  const lab::AbVerdict v = lab::compare_arms(arm_a.runs, arm_b.runs, {.max_drop_pts = a.max_drop});
  if (a.json) {
    fmt::print("{}\n", verdict_json(m, arm_a, arm_b, v).dump());
  } else {
    fmt::print("target {}; {} prompts, greedy, {} new tokens at most, batch 1; k A {}, B {}\n",
               m.model_dir, ids.size(), a.max_tokens, arm_a.schedule.draft_tokens,
               arm_b.schedule.draft_tokens);
    fmt::print("{}", lab::format_ab_report(v, arm_a.dir, arm_b.dir));
  }
  if (!a.plot.empty()) {
    lab::write_ab_delta_png(
        v, {.title = fmt::format("A {} vs B {}: per-prompt deltas", arm_a.dir, arm_b.dir)}, a.plot);
    if (!a.json) fmt::print("wrote {}\n", a.plot);
  }
}

}  // namespace

void register_ab(CLI::App& app) {
  auto args = std::make_shared<AbArgs>();
  CLI::App* cmd = app.add_subcommand(
      "ab",
      "Paired A/B of two drafters on one target over a prompt set (greedy, batch 1): "
      "acceptance, tau, tokens/s, by position, and the verdict (PASS iff acceptance drops at "
      "most --max-drop points and tokens/s strictly rises)");
  cmd->add_option("--draft-a", args->draft_a,
                  "Reference drafter: an assistant or DSpark checkpoint folder (kind read from "
                  "the folder), or 'ngram'")
      ->required();
  cmd->add_option("--draft-b", args->draft_b, "Candidate drafter, as --draft-a")->required();
  cmd->add_option("--prompt-file", args->prompt_file,
                  "Prompts, JSONL: {\"turns\": [\"text\", ...]} (DeepSpec's layout; the first "
                  "turn, BOS added, or as --prompt-format says) or {\"ids\": [token ids]}")
      ->required();
  cmd->add_option("--prompt-format", args->prompt_format, kPromptFormatHelp)->capture_default_str();
  cmd->add_option("--num-prompts", args->num_prompts,
                  "Use the first N prompts of the file (default: all)");
  add_model_options(cmd, args->model, /*with_draft=*/false);
  cmd->add_option("--draft-tokens,-k", args->draft_tokens,
                  "Draft tokens per round for both arms (default: each drafter's own length: a "
                  "DSpark drafter's block size, else 4)");
  cmd->add_option("--draft-tokens-a", args->draft_tokens_a, "Draft tokens per round for arm A");
  cmd->add_option("--draft-tokens-b", args->draft_tokens_b, "Draft tokens per round for arm B");
  cmd->add_option("--max-tokens,-n", args->max_tokens, "New tokens per prompt")
      ->capture_default_str();
  cmd->add_option("--max-drop", args->max_drop,
                  "Acceptance may drop by at most this many points for a PASS")
      ->capture_default_str();
  cmd->add_option("--prompt-lookup-min", args->model.prompt_lookup_min,
                  "ngram arms: the shortest suffix matched, in tokens")
      ->capture_default_str();
  cmd->add_option("--prompt-lookup-max", args->model.prompt_lookup_max,
                  "ngram arms: the longest suffix matched, in tokens")
      ->capture_default_str();
  cmd->add_option("--plot", args->plot, "Write the per-prompt deltas as a PNG");
  cmd->add_flag("--json", args->json, "Print one JSON object (both arms, verdict, per prompt)");
  cmd->callback([args] { run_ab(*args); });
}

}  // namespace specula::cli
