// SPDX-License-Identifier: Apache-2.0
// `specula bench`: plain vs speculative decoding on the same prompts, per batch
// size and draft length, with a table (or JSON) of tokens/s, τ and acceptance.
//
// With --random-weights the target (and, with `--draft random`, the assistant
// drafter) is built from a released shape with seeded random weights, so the
// big models can be measured without a checkpoint. With --micro the model
// forwards are timed directly (decode steps per batch size, a verify window, a
// drafter step, a prefill) and set against what the same run measures of the
// device: the device-to-device copy bandwidth and the bf16 matrix peak.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>

#include <unistd.h>

#include "apps/cli/bench.h"
#include "apps/cli/commands.h"
#include "apps/cli/prompt_format.h"
#include "apps/cli/setup.h"
#include "engine/backend/backends.h"
#include "engine/model/gemma4/presets.h"
#include "engine/speculative/engine.h"

namespace specula::cli {
namespace {

// Where the decode table's prompts came from: a prompt set (file, format,
// count, token lengths), a plain text file cut into windows, or random ids.
nlohmann::json prompts_json(const BenchArgs& a, const BenchPromptSet* set) {
  if (!set) {
    return {{"source", a.prompt_file.empty() ? "random" : "text"},
            {"file", a.prompt_file},
            {"prompt_tokens", a.prompt_tokens}};
  }
  size_t lo = SIZE_MAX, hi = 0, total = 0;
  for (const auto& ids : set->ids) {
    lo = std::min(lo, ids.size());
    hi = std::max(hi, ids.size());
    total += ids.size();
  }
  return {{"source", "prompt-set"},
          {"file", set->prompts.set.path},
          {"format", set->prompts.format_name},
          {"count", set->ids.size()},
          {"prompt_tokens",
           {{"min", lo},
            {"mean", static_cast<double>(total) / static_cast<double>(set->ids.size())},
            {"max", hi}}}};
}

void run_bench(BenchArgs a) {
  set_cuda_kernel_choices(
      {.tiled_products = a.cuda_tiled_products, .raw_kv_staging = a.cuda_raw_kv_staging});
  if (!a.print_preset_config.empty() || !a.print_assistant_config.empty()) {
    if (!a.print_preset_config.empty() && !a.print_assistant_config.empty())
      fail("give one of --print-preset-config and --print-assistant-config");
    const nlohmann::json j = a.print_preset_config.empty()
                                 ? gemma4::gemma4_assistant_preset_json(a.print_assistant_config)
                                 : gemma4::gemma4_preset_json(a.print_preset_config);
    fmt::print("{}\n", j.dump(2));
    return;
  }
  const Device device = parse_device(a.model.device);
  if (!a.random_weights.empty() && !a.model.model.empty())
    fail("--random-weights and --model are exclusive: a random model replaces the checkpoint");
  if (a.model.draft == kRandomDraft && a.model.no_draft)
    fail("--draft random and --no-draft contradict each other");
  for (int b : a.batches)
    if (b < 1) fail("--batch values must be >= 1, got {}", b);
  for (int k : a.draft_tokens)
    if (k < 1) fail("--draft-tokens values must be >= 1, got {}", k);
  check_scheduler_args(a.scheduler);
  parse_prompt_format(a.prompt_format);  // an unknown name fails here, naming the flag
  if (a.prompt_tokens < 1) fail("--prompt-tokens must be >= 1, got {}", a.prompt_tokens);
  if (a.gen_tokens < 1) fail("--gen-tokens must be >= 1, got {}", a.gen_tokens);
  {
    // Sampling flags, checked before any model loads (the error names the field).
    SamplingParams sampling;
    sampling.temperature = a.temperature;
    sampling.top_p = a.top_p;
    sampling.top_k = a.top_k;
    sampling.min_p = a.min_p;
    sampling.repetition_penalty = a.repetition_penalty;
    sampling.presence_penalty = a.presence_penalty;
    sampling.frequency_penalty = a.frequency_penalty;
    sampling.validate();
  }
  if (a.micro) {
    if (!a.batches_given) a.batches = {1, 8, 16, 32, 64};
    if (a.context < 1) fail("--context must be >= 1, got {}", a.context);
    if (a.prefill_tokens < 1) fail("--prefill-tokens must be >= 1, got {}", a.prefill_tokens);
    if (a.reps < 1) fail("--reps must be >= 1, got {}", a.reps);
    if (a.copy_mib < 1 || a.copy_mib > (int64_t{1} << 20))
      fail("--copy-mib must be in [1, 1048576], got {}", a.copy_mib);
    if (a.peak_size < 1 || a.peak_size > 65536)
      fail("--peak-size must be in [1, 65536], got {}", a.peak_size);
  }

  const bool replay = a.model.draft.starts_with("replay:");
  if (replay && (a.temperature != 0 || a.repetition_penalty != 1.0f || a.presence_penalty != 0.0f ||
                 a.frequency_penalty != 0.0f)) {
    fail(
        "--draft {}: the replay simulation is for greedy rows only (--temperature 0, no "
        "penalties)",
        a.model.draft);
  }
  if (replay) replay::parse_acceptance_profile(a.model.draft.substr(7));  // errors before loading
  if (a.serving) {
    if (a.num_prompts < 1) fail("--num-prompts must be >= 1, got {}", a.num_prompts);
    if (!(a.request_rate >= 0) || !std::isfinite(a.request_rate))
      fail("--request-rate must be >= 0, got {}", a.request_rate);
    if (!(a.range_ratio >= 0 && a.range_ratio < 1))
      fail("--range-ratio must be in [0, 1), got {}", a.range_ratio);
    if (a.max_num_seqs < 1) fail("--max-num-seqs must be >= 1, got {}", a.max_num_seqs);
    if (a.max_batch_tokens < 0) fail("--max-batch-tokens must be >= 0, got {}", a.max_batch_tokens);
    if (!(a.kv_memory >= 0)) fail("--kv-memory must be >= 0, got {}", a.kv_memory);
    if (a.micro) fail("--serving and --micro are separate programs: give one");
    if (a.temperature != 0) fail("--serving measures greedy requests: give --temperature 0");
  }
  // A prompt set is read (and its code blocks found) before anything loads.
  std::optional<BenchPromptSet> prompt_set;
  if (!a.prompt_file.empty() && is_prompt_set_file(a.prompt_file)) {
    if (a.serving) {
      fail(
          "--prompt-file {}: --serving draws its own prompt lengths from a plain text file or "
          "random ids; a prompt set (.jsonl) is measured by the decode table (leave out "
          "--serving)",
          a.prompt_file);
    }
    prompt_set = read_bench_prompt_set(a);
    a.need_tokenizer = a.need_tokenizer || prompt_set->prompts.set.needs_tokenizer();
  } else if (a.prompt_format != "text") {
    fail("--prompt-format {}: formats the prompts of a prompt set (--prompt-file FILE.jsonl){}",
         a.prompt_format,
         a.prompt_file.empty() ? "" : fmt::format("; {} is plain text", a.prompt_file));
  } else if (a.num_prompts_given && !a.serving) {
    fail(
        "--num-prompts: takes the first N prompts of a prompt set (--prompt-file FILE.jsonl) or "
        "sets the requests of --serving");
  }
  LoadedModels m = load_bench_models(a, device);
  if (prompt_set) tokenize_bench_prompt_set(*prompt_set, a, m);
  const BenchPromptSet* prompts = prompt_set ? &*prompt_set : nullptr;
  if (const int block = m.draft_source ? m.draft_source->max_draft_tokens() : 0; block > 0) {
    // A block drafter drafts at most its block per round: measure that by
    // default, and refuse longer drafts by name.
    if (!a.draft_tokens_given) a.draft_tokens = {block};
    for (int k : a.draft_tokens) {
      if (k > block)
        fail("--draft-tokens {}: the drafter drafts at most {} tokens per round (its block size)",
             k, block);
    }
  }
  if (m.draft_source && !a.micro &&
      parse_scheduler_mode(a.scheduler.mode) != speculative::SchedulerMode::kOff) {
    const int max_rows =
        a.serving ? a.max_num_seqs : *std::max_element(a.batches.begin(), a.batches.end());
    const int max_k = *std::max_element(a.draft_tokens.begin(), a.draft_tokens.end());
    a.scheduler_resolved = scheduler_options(a.scheduler, *m.target, max_rows, max_k, a.json);
  }
  if (a.serving) {
    const nlohmann::json rows = serving_table(a, m);
    if (a.json) {
      fmt::print("{}\n", nlohmann::json{{"model", m.model_dir},
                                        {"draft", m.draft_dir},
                                        {"device", device.str()},
                                        {"serving", rows}}
                             .dump());
    }
    return;
  }
  if (a.micro) {
    // Rolling back a verify window must stay within the sliding rings' slack.
    const int max_window = m.target->kv_spec().max_rollback;
    if (a.verify_tokens < 1 || a.verify_tokens > max_window)
      fail("--verify-tokens must be in [1, {}] (the cache's rollback slack), got {}", max_window,
           a.verify_tokens);
    // The default prefill fits small models (the embedded family's context is 4096).
    if (!a.prefill_tokens_given && int64_t{a.prefill_tokens} + 1 > m.target->max_context())
      a.prefill_tokens = static_cast<int>(m.target->max_context() - 1);
    if (int64_t{a.context} + a.verify_tokens + 1 > m.target->max_context() ||
        int64_t{a.prefill_tokens} + 1 > m.target->max_context()) {
      fail("--context {} / --prefill-tokens {} exceed the model's maximum context of {} tokens",
           a.context, a.prefill_tokens, m.target->max_context());
    }
    nlohmann::json micro = run_micro(a, m);
    // End to end through the decode loop, batch 1, when there is a drafter.
    nlohmann::json e2e = nlohmann::json::array();
    if (m.draft_source) {
      if (!a.json) {
        fmt::print("\nend to end (speculative::decode, batch 1, {}, {} new tokens):\n",
                   prompts ? fmt::format("{} prompts of {}", prompts->ids.size(),
                                         prompts->prompts.set.path)
                           : fmt::format("{}-token prompts", a.prompt_tokens),
                   a.gen_tokens);
      }
      e2e = decode_table(a, m, {1}, prompts);
    }
    if (a.json) {
      fmt::print("{}\n", nlohmann::json{{"model", m.model_dir},
                                        {"draft", m.draft_dir},
                                        {"device", device.str()},
                                        {"seed", a.seed},
                                        {"micro", micro},
                                        {"prompts", prompts_json(a, prompts)},
                                        {"results", e2e}}
                             .dump());
    }
    return;
  }
  nlohmann::json rows = decode_table(a, m, a.batches, prompts);
  const bool penalties =
      a.repetition_penalty != 1.0f || a.presence_penalty != 0.0f || a.frequency_penalty != 0.0f;
  const bool plain_greedy = a.temperature == 0 && !penalties;
  if (a.json) {
    fmt::print("{}\n", nlohmann::json{{"model", m.model_dir},
                                      {"draft", m.draft_dir},
                                      {"device", device.str()},
                                      {"prompts", prompts_json(a, prompts)},
                                      {"sampling",
                                       {{"temperature", a.temperature},
                                        {"top_p", a.top_p},
                                        {"top_k", a.top_k},
                                        {"min_p", a.min_p},
                                        {"repetition_penalty", a.repetition_penalty},
                                        {"presence_penalty", a.presence_penalty},
                                        {"frequency_penalty", a.frequency_penalty},
                                        {"on", plain_greedy      ? "greedy"
                                               : a.host_sampling ? "host"
                                                                 : "device"}}},
                                      {"results", rows}}
                           .dump());
  }
}

}  // namespace

void register_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Measure plain vs speculative decoding (tokens/s, tau, acceptance); with --micro, time "
      "model forwards against the measured copy bandwidth and matrix peak");
  add_model_options(cmd, args->model, /*with_draft=*/true);
  add_scheduler_options(cmd, args->scheduler);
  cmd->add_option("--prompt-file", args->prompt_file,
                  "Prompts: a .jsonl prompt set ({\"turns\": [...]} or {\"ids\": [...]} a "
                  "line; each prompt used as it is, in file order), or a text file to cut "
                  "--prompt-tokens windows from (default: random token ids)");
  cmd->add_option("--prompt-format", args->prompt_format, kPromptFormatHelp)->capture_default_str();
  cmd->add_option("--prompt-tokens", args->prompt_tokens,
                  "Tokens per prompt (random ids and text files; a prompt set's prompts keep "
                  "their lengths)")
      ->capture_default_str();
  cmd->add_option("--gen-tokens", args->gen_tokens, "Tokens generated per prompt")
      ->capture_default_str();
  CLI::Option* batch =
      cmd->add_option("--batch", args->batches,
                      "Batch sizes (rows decoded together); --micro default: 1 8 16 32 64");
  batch->capture_default_str();
  cmd->add_option("--draft-tokens,-k", args->draft_tokens,
                  "Draft lengths to measure (default: 1 2 4 6; a DSpark drafter's block size)")
      ->each([args](const std::string&) { args->draft_tokens_given = true; })
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of a table");
  cmd->add_option("--random-weights", args->random_weights,
                  fmt::format("Build a model with seeded random bf16 weights instead of loading "
                              "--model: a preset ({}) or a config.json",
                              fmt::join(gemma4::gemma4_preset_names(), ", ")));
  cmd->add_option("--seed", args->seed,
                  "Seed of --random-weights (a --draft random drafter uses seed + 1)")
      ->capture_default_str();
  cmd->add_option("--draft-head", args->draft_head,
                  "Output head of a --draft random drafter: centroid, dense, or auto (as the "
                  "released drafters: centroid for E2B/E4B-class targets, dense for 26B/31B)")
      ->check(CLI::IsMember({"auto", "centroid", "dense"}))
      ->capture_default_str();
  cmd->add_option("--draft-dtype", args->draft_dtype,
                  "Weights of a --draft random / random-dspark drafter: bf16, or int8 / fp8 "
                  "(its bf16 matrices quantized as `specula quantize` does)")
      ->check(CLI::IsMember({"bf16", "int8", "fp8"}))
      ->capture_default_str();
  cmd->add_flag(
      "--micro", args->micro,
      "Time model forwards directly: copy bandwidth, matrix peak, decode steps per "
      "batch, a verify window, a drafter step, a prefill; then end to end with a drafter");
  cmd->add_flag("--no-graphs", args->no_graphs,
                "--micro: run decode steps and verify windows directly instead of replaying "
                "recorded CUDA graphs (same results; for comparing launch overhead)");
  cmd->add_flag("--cuda-tiled-products", args->cuda_tiled_products,
                "A/B switch under measurement: products of 24+ rows with bf16 weights through "
                "the tiled CUDA kernels (same bits; off by default until they measure faster)");
  cmd->add_flag("--cuda-raw-kv-staging", args->cuda_raw_kv_staging,
                "A/B switch under measurement: CUDA attention partials copy bf16/fp8 cache "
                "bytes to shared memory asynchronously and widen them where they are read "
                "(same bits; off by default until it measures faster)");
  cmd->add_option("--temperature", args->temperature,
                  "Sampling temperature of the end-to-end rows (0: greedy)")
      ->capture_default_str();
  cmd->add_option("--top-p", args->top_p, "Nucleus mass of the end-to-end rows")
      ->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "Top-k of the end-to-end rows (0: off)")
      ->capture_default_str();
  cmd->add_option("--min-p", args->min_p, "Min-p of the end-to-end rows (0: off)")
      ->capture_default_str();
  cmd->add_option("--repetition-penalty", args->repetition_penalty,
                  "Repetition penalty of the end-to-end rows (1: off)")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", args->presence_penalty,
                  "Presence penalty of the end-to-end rows (0: off)")
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", args->frequency_penalty,
                  "Frequency penalty of the end-to-end rows (0: off)")
      ->capture_default_str();
  cmd->add_flag("--host-sampling", args->host_sampling,
                "Sample on the host (logits read back every step) instead of on the device, "
                "for A/B runs; the same tokens either way");
  cmd->add_flag("--host-rounds", args->host_rounds,
                "Read the drafts back every draft step instead of once per round, for A/B runs; "
                "the same tokens either way");
  cmd->add_flag("--serving", args->serving,
                "Serve a continuous-arrival workload on the engine (Poisson arrivals, mixed "
                "lengths): tokens/s, time to first token, inter-token latency, plain and "
                "speculative");
  CLI::Option* num_prompts = cmd->add_option(
      "--num-prompts", args->num_prompts,
      "A .jsonl prompt set: measure its first N prompts (default: all); --serving: requests in "
      "the workload (default: 64)");
  cmd->add_option("--request-rate", args->request_rate,
                  "--serving: arrivals per second (Poisson); 0 = all at once")
      ->capture_default_str();
  cmd->add_option("--range-ratio", args->range_ratio,
                  "--serving: prompt and output lengths uniform in mean x [1 - r, 1 + r]")
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", args->max_num_seqs,
                  "--serving: rows the engine decodes at once")
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens,--max-num-batched-tokens", args->max_batch_tokens,
                  "--serving: tokens per engine step (verify windows first, then prefill "
                  "chunks); 0 = no limit")
      ->capture_default_str();
  cmd->add_option("--kv-memory", args->kv_memory,
                  "--serving: KV cache memory, bytes (> 1) or a fraction of free device memory; "
                  "0 = room for --max-num-seqs rows")
      ->capture_default_str();
  cmd->add_option("--context", args->context, "--micro: tokens per row before a decode step")
      ->capture_default_str();
  cmd->add_option("--prefill-tokens", args->prefill_tokens,
                  "--micro: tokens of the timed prefill (default 4096, or the model's context - 1 "
                  "when that is smaller)")
      ->each([args](const std::string&) { args->prefill_tokens_given = true; });
  cmd->add_option("--verify-tokens", args->verify_tokens, "--micro: tokens of the verify window")
      ->capture_default_str();
  cmd->add_option("--reps", args->reps, "--micro: timed repetitions (the median is reported)")
      ->capture_default_str();
  cmd->add_option("--copy-mib", args->copy_mib, "--micro: size of the copy-bandwidth buffer, MiB")
      ->capture_default_str();
  cmd->add_option("--peak-size", args->peak_size,
                  "--micro: S of the S x S x S bf16 product that measures the matrix peak")
      ->capture_default_str();
  cmd->add_option("--print-preset-config", args->print_preset_config,
                  "Print the config.json of a preset and exit");
  cmd->add_option("--print-assistant-config", args->print_assistant_config,
                  "Print the config.json of a preset's assistant drafter and exit");
  cmd->footer(
      "--prompt-file FILE.jsonl (a prompt set, by the .jsonl extension; the layout of `specula "
      "ab` and DeepSpec's eval sets) decodes each of its prompts (--num-prompts: the first N) as "
      "it is, --gen-tokens new tokens each, `--batch B` at a time in file order; per draft "
      "length the table gives tau (tokens per verify round), the acceptance rate and by draft "
      "position, decode tokens/s and the speedup over the plain row (--json: also "
      "plain_decode_tokens_per_second, drafted_at / accepted_at counts, the prompts' lengths). "
      "A prompt longer than the context (with --gen-tokens; --ctx-size) is an error naming its "
      "line.\n"
      "--draft random (with --random-weights or --model) builds a random assistant drafter of "
      "the released shape for the target (head: --draft-head).\n"
      "--draft random-dspark[:G] builds a random DSpark drafter (specula layout) of the seed's "
      "default shape for the target (block 5, width 1024, 5 layers, Markov rank 256), with "
      "block size G when given; random-dspark-deepspec[:G] one of DeepSpec's released shape "
      "(Gemma4DSparkModel: block 7, 5 layers of the target's geometry). With --micro the "
      "drafter's whole round (backbone and G head steps) is timed against a decode step.\n"
      "--draft replay:A0,A1,... (e.g. replay:0.84,0.60,0.39,0.27) is a SIMULATION for "
      "benchmarks: it runs the drafter of the shape (the embedded one for the embedded model, "
      "else a random one) for its cost, and proposes the target's own greedy output from the "
      "plain run, corrupted so that draft position i is accepted with probability Ai. Greedy "
      "only.\n"
      "--micro definitions: copy bandwidth = 2 x bytes / time of a device-to-device copy (read + "
      "write); bytes per decode step = weights read (model.weight_bytes_read(batch)) + K/V read "
      "(per row and layer: rows visible (sliding: min(window, context + 1)) x kv heads x head dim "
      "x 4 bytes x 2; KV-shared layers re-read their donor's); roofline = (bytes / step time) / "
      "copy bandwidth; flops of a forward = 2 x tokens x matrix parameters per token + 2 x V x H a "
      "logit row + attention 4 x heads x head dim x visible keys summed over queries (a prefill: "
      "logits for its last token); limit = max(bytes / copy bandwidth, flops / matrix peak), "
      "'of limit' = limit / step time; each batch also times a verify window of "
      "--verify-tokens tokens a row (all with logits) against its decode step.");
  cmd->callback([args, batch, num_prompts] {
    BenchArgs a = *args;
    a.batches_given = batch->count() > 0;
    a.num_prompts_given = num_prompts->count() > 0;
    run_bench(std::move(a));
  });
}

}  // namespace specula::cli
