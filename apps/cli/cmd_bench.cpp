// SPDX-License-Identifier: Apache-2.0
// `specula bench`: plain vs speculative decoding on the same prompts, per batch
// size and draft length, with a table (or JSON) of tokens/s, τ and acceptance.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"

namespace specula::cli {
namespace {

struct BenchArgs {
  ModelArgs model;
  std::string prompt_file;
  int prompt_tokens = 64;
  int gen_tokens = 64;
  std::vector<int> batches = {1};
  std::vector<int> draft_tokens = {1, 2, 4, 6};
  bool json = false;
};

// Prompts of `len` tokens: consecutive windows of the tokenized file, or
// deterministic pseudo-random ids when no file is given.
std::vector<std::vector<int32_t>> make_prompts(const BenchArgs& a, const LoadedModels& m,
                                               int count) {
  std::vector<std::vector<int32_t>> prompts;
  if (!a.prompt_file.empty()) {
    std::ifstream in(a.prompt_file, std::ios::binary);
    if (!in) fail("--prompt-file: cannot read {}", a.prompt_file);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::vector<int32_t> ids = m.tokenizer->encode(ss.str(), false);
    const size_t stride = static_cast<size_t>(a.prompt_tokens) * 3;
    for (int i = 0; i < count; ++i) {
      const size_t start =
          (static_cast<size_t>(i) * stride) % std::max<size_t>(1, ids.size() - a.prompt_tokens);
      if (ids.size() < static_cast<size_t>(a.prompt_tokens))
        fail("--prompt-file: {} has too few tokens", a.prompt_file);
      std::vector<int32_t> p;
      if (auto bos = m.tokenizer->bos_id()) p.push_back(*bos);
      p.insert(p.end(), ids.begin() + static_cast<std::ptrdiff_t>(start),
               ids.begin() + static_cast<std::ptrdiff_t>(start) + a.prompt_tokens -
                   static_cast<int>(p.size()));
      prompts.push_back(std::move(p));
    }
    return prompts;
  }
  const int V = m.target->config().vocab_size;
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> p;
    for (int j = 0; j < a.prompt_tokens; ++j) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      p.push_back(static_cast<int32_t>(3 + (state >> 33) % static_cast<uint64_t>(V - 3)));
    }
    prompts.push_back(std::move(p));
  }
  return prompts;
}

void run_bench(const BenchArgs& a) {
  LoadedModels m = load_models(a.model, true, !a.prompt_file.empty(), a.json);
  nlohmann::json rows = nlohmann::json::array();
  if (!a.json) {
    fmt::print("{:<12} {:>5} {:>3} {:>12} {:>12} {:>8} {:>8} {:>8}\n", "mode", "batch", "k",
               "prefill t/s", "decode t/s", "tau", "accept", "speedup");
  }
  for (int batch : a.batches) {
    if (batch < 1) fail("--batch values must be >= 1, got {}", batch);
    std::vector<spec::DecodeRequest> reqs;
    for (auto& p : make_prompts(a, m, batch)) {
      spec::DecodeRequest r{.prompt = p, .params = {}};
      r.params.temperature = 0;
      r.params.max_tokens = a.gen_tokens;
      reqs.push_back(std::move(r));
    }
    auto measure = [&](Drafter* drafter, int k) {
      spec::DecodeStats total;
      for (const auto& r : spec::decode(*m.target, drafter, reqs, {.draft_tokens = std::max(k, 1)}))
        total.merge(r.stats);
      return total;
    };
    const spec::DecodeStats plain = measure(nullptr, 0);
    auto report = [&](const char* mode, int k, const spec::DecodeStats& s) {
      const double decode_tps =
          s.decode_seconds > 0 ? (s.generated_tokens - batch) / s.decode_seconds : 0;
      const double plain_tps =
          plain.decode_seconds > 0 ? (plain.generated_tokens - batch) / plain.decode_seconds : 0;
      const double prefill_tps = s.prefill_seconds > 0 ? s.prompt_tokens / s.prefill_seconds : 0;
      const double speedup = plain_tps > 0 ? decode_tps / plain_tps : 0;
      if (a.json) {
        rows.push_back({{"mode", mode},
                        {"batch", batch},
                        {"draft_tokens", k},
                        {"prefill_tokens_per_second", prefill_tps},
                        {"decode_tokens_per_second", decode_tps},
                        {"tau", s.mean_accepted_length()},
                        {"acceptance_rate", s.acceptance_rate()},
                        {"speedup", speedup}});
      } else {
        fmt::print("{:<12} {:>5} {:>3} {:>12.1f} {:>12.1f} {:>8.2f} {:>7.1f}% {:>7.2f}x\n", mode,
                   batch, k, prefill_tps, decode_tps, s.mean_accepted_length(),
                   100 * s.acceptance_rate(), speedup);
      }
    };
    report("plain", 0, plain);
    if (m.draft_source) {
      for (int k : a.draft_tokens) report("speculative", k, measure(m.draft_source.get(), k));
    }
  }
  if (a.json)
    fmt::print(
        "{}\n",
        nlohmann::json{{"model", m.model_dir}, {"draft", m.draft_dir}, {"results", rows}}.dump());
}

}  // namespace

void register_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Measure plain vs speculative decoding (tokens/s, tau, acceptance)");
  add_model_options(cmd, args->model, /*with_draft=*/true);
  cmd->add_option("--prompt-file", args->prompt_file,
                  "Text file to cut prompts from (default: random token ids)");
  cmd->add_option("--prompt-tokens", args->prompt_tokens, "Tokens per prompt")
      ->capture_default_str();
  cmd->add_option("--gen-tokens", args->gen_tokens, "Tokens generated per prompt")
      ->capture_default_str();
  cmd->add_option("--batch", args->batches, "Batch sizes (rows decoded together)")
      ->capture_default_str();
  cmd->add_option("--draft-tokens,-k", args->draft_tokens, "Draft lengths to measure")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of a table");
  cmd->callback([args] { run_bench(*args); });
}

}  // namespace specula::cli
