// SPDX-License-Identifier: Apache-2.0
// `specula bench`, shared by its parts: the arguments, timing helpers, model
// setup (checkpoints or random weights of a released shape), and the three
// programs it runs: the end-to-end decode table (bench_decode.cpp), the
// continuous-arrival serving workload (bench_serving.cpp) and the --micro
// forward timings (bench_micro.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "apps/cli/prompt_set.h"
#include "apps/cli/setup.h"
#include "apps/cli/spec_scheduler.h"

namespace specula::cli {

struct BenchArgs {
  ModelArgs model;
  // A `.jsonl` file is a prompt set (prompt_set.h) whose prompts are used as
  // they are, formatted per prompt_format (prompt_format.h; the first
  // --num-prompts of them, or all); any other file is plain text cut into
  // --prompt-tokens windows.
  std::string prompt_file;
  std::string prompt_format = "text";  // text, chat or code-block (a prompt set only)
  int prompt_tokens = 64;
  int gen_tokens = 64;
  std::vector<int> batches = {1};
  bool batches_given = false;  // else --micro measures 1, 8, 16, 32, 64
  std::vector<int> draft_tokens = {1, 2, 4, 6};
  bool draft_tokens_given = false;  // -k was given (else a block drafter measures its block)
  bool json = false;
  // Device and random-weight models.
  std::string random_weights;   // preset name or config.json path
  bool need_tokenizer = false;  // load one even without --prompt-file (serve)
  uint64_t seed = 1234;
  std::string draft_head = "auto";   // head of a --draft random drafter (auto: as released)
  std::string draft_dtype = "bf16";  // weights of a --draft random / random-dspark drafter
  // --micro: forward timings against the measured copy bandwidth and matrix peak.
  bool micro = false;
  int context = 512;
  int prefill_tokens = 4096;  // unless given: at most the model's context - 1
  bool prefill_tokens_given = false;
  int verify_tokens = 5;
  int reps = 10;
  int64_t copy_mib = 2048;
  int peak_size = 8192;
  bool no_graphs = false;  // run every step directly (no CUDA graphs)
  // CUDA kernel choices under measurement (#30 A/B switches; backends.h).
  bool cuda_tiled_products = false;
  bool cuda_raw_kv_staging = false;
  // Sampling of the end-to-end rows (temperature 0: greedy); request i is seeded with i.
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  bool host_sampling = false;  // logits read back, sampled on the host (A/B)
  bool host_rounds = false;    // drafts read back every draft step (A/B)
  // --serving: a continuous-arrival workload on the engine.
  bool serving = false;
  int num_prompts = 64;            // --serving: requests; a prompt set: the first N prompts
  bool num_prompts_given = false;  // else a prompt set is measured whole
  double request_rate = 0;         // requests per second (Poisson); 0: all at once
  double range_ratio = 0.5;        // lengths uniform in mean × [1 - r, 1 + r]
  int max_num_seqs = 16;
  int64_t max_batch_tokens = 0;
  double kv_memory = 0;
  // The verify scheduler: with a mode other than off each speculative row is
  // measured a second time with it ("spec+sched"), on the same prompts.
  SchedulerArgs scheduler;
  speculative::VerifySchedulerOptions scheduler_resolved;  // set by run_bench once loaded
  // Dump a preset's config.json and exit.
  std::string print_preset_config, print_assistant_config;
};

inline constexpr char kRandomDraft[] = "random";
inline constexpr char kRandomDSpark[] = "random-dspark";

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
double median(std::vector<double> v);
// Linear interpolation between the closest ranks (p in [0, 1]); NaN for no samples.
double percentile(std::vector<double> v, double p);
// NaN for no samples.
double mean(const std::vector<double>& v);
// Wall time of f() with the device drained before and after, so queued work
// of earlier calls is not billed to it and its own work is.
template <typename F>
double timed(Backend& be, F&& f) {
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  be.synchronize();
  return seconds_since(t0);
}

// Deterministic pseudo-random token ids in [3, V) (avoiding pad/eos/bos).
std::vector<int32_t> random_ids(int64_t n, int vocab, uint64_t* state);
// Prompts of --prompt-tokens tokens: windows of the tokenized plain-text
// --prompt-file, or deterministic pseudo-random ids when no file is given (a
// prompt set is read by read_bench_prompt_set instead).
std::vector<std::vector<int32_t>> make_prompts(const BenchArgs& a, const LoadedModels& m,
                                               int count);

// Whether --prompt-file names a prompt set: by extension, `.jsonl` (as
// `specula regen` decides), not by content.
bool is_prompt_set_file(const std::string& path);

// A prompt set for the decode table: its prompts, in file order.
struct BenchPromptSet {
  FormattedPromptSet prompts;             // the first --num-prompts (or all), formatted
  std::vector<std::vector<int32_t>> ids;  // per entry, set by tokenize_bench_prompt_set
};
// read_formatted_prompt_set (prompt_set.h) with bench's --prompt-file,
// --prompt-format and --num-prompts, before any model loads.
BenchPromptSet read_bench_prompt_set(const BenchArgs& a);
// Tokenizes each prompt (tokenize_prompt_set: text and code-block with BOS,
// chat rendered in the target's chat format) and checks that it fits: prompt +
// --gen-tokens within the target's context, else an Error names the file,
// line and lengths.
void tokenize_bench_prompt_set(BenchPromptSet& set, const BenchArgs& a, const LoadedModels& m);

// The target (and drafter) the arguments ask for, on `device`.
LoadedModels load_bench_models(const BenchArgs& a, Device device);

// Accepted / drafted at each draft position.
nlohmann::json acceptance_by_position(const speculative::DecodeStats& s);
// Plain and speculative decoding per batch size and draft length: prints the
// table (unless json) and returns its rows. Without a prompt set each batch
// decodes `batch` prompts of make_prompts(); with one (tokenized), every batch
// size decodes all of its prompts, `batch` at a time in file order.
nlohmann::json decode_table(const BenchArgs& a, const LoadedModels& m,
                            const std::vector<int>& batches,
                            const BenchPromptSet* prompt_set = nullptr);
// The continuous-arrival workload (--serving): prints the table (unless json)
// and returns its rows.
nlohmann::json serving_table(const BenchArgs& a, LoadedModels& m);
// The --micro timings and goals: prints them (unless json) and returns them.
nlohmann::json run_micro(const BenchArgs& a, LoadedModels& m);

}  // namespace specula::cli
