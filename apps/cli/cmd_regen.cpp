// SPDX-License-Identifier: Apache-2.0
// `specula regen`: DSpark training data (docs/dspark.md, "Training data:
// specula regen"). The target answers every prompt of a prompt set itself
// (greedy, or seeded sampling), batched through the engine without a drafter;
// then one tapped forward of each whole sequence (prompt + response) gives the
// hidden states at the drafter's tap layers for every position, which go to
// bf16 shards (engine/lab/dspark_shard.h) with a manifest and a ledger that
// make the run resumable (regen_output.h).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <set>

#include "apps/cli/commands.h"
#include "apps/cli/progress.h"
#include "apps/cli/regen_output.h"
#include "apps/cli/regen_prompts.h"
#include "apps/cli/setup.h"
#include "engine/draft/dspark/dspark_config.h"
#include "engine/lab/dspark_shard.h"
#include "engine/memory/memory_resource.h"

namespace specula::cli {
namespace {

struct RegenArgs {
  ModelArgs model;
  std::string prompt_file, out, draft, tap_layers;
  int max_tokens = 256;
  double temperature = 0;
  uint64_t seed = 0;
  int batch = 8;
  int64_t shard_tokens = 16384;
  int64_t max_prompts = 0;  // 0: all
  int chunk_lines = 40;
  bool quiet = false;
};

// The largest tapped forward, in tokens: bounds the forward's scratch and the
// tap buffer (f32 [m, tokens, H]); a longer sequence runs alone.
constexpr int64_t kTapForwardTokens = 4096;

// The engine taps to record, from --draft (a DSpark checkpoint made for this
// target, either layout) or --tap-layers; `source` says which, for the manifest.
std::vector<int> resolve_taps(const RegenArgs& a, const gemma4::Gemma4Config& target,
                              std::string* source) {
  if (a.draft.empty() == a.tap_layers.empty())
    fail("regen: give exactly one of --draft DSPARK_DIR and --tap-layers a,b,c");
  const int L = target.num_hidden_layers;
  if (!a.draft.empty()) {
    if (!dspark::is_dspark_dir(a.draft)) {
      fail("--draft {}: not a DSpark drafter folder (no {}, nor a {} naming Gemma4DSparkModel)",
           a.draft, dspark::kSpeculaConfigFile, dspark::kDeepSpecConfigFile);
    }
    const dspark::DSparkConfig c = dspark::load_dspark_config(a.draft);
    dspark::check_dspark_config(c, target, a.draft);  // refuses another target's drafter
    *source = c.layout == dspark::DSparkLayout::kSpecula
                  ? fmt::format("{}/{} tap_layers", a.draft, dspark::kSpeculaConfigFile)
                  : fmt::format("{}/{} target_layer_ids + 1", a.draft, dspark::kDeepSpecConfigFile);
    return c.taps;
  }
  std::vector<int> taps = lab::parse_tap_list(a.tap_layers, "--tap-layers");
  std::set<int> seen;
  for (int t : taps) {
    if (t > L) {
      fail("--tap-layers {}: tap {} is outside [0, {}] (0 = embeddings, {} = after the final norm)",
           a.tap_layers, t, L, L);
    }
    if (!seen.insert(t).second) fail("--tap-layers {}: tap {} given twice", a.tap_layers, t);
  }
  *source = "--tap-layers";
  return taps;
}

// One tapped forward over `seqs` (fresh caches, no logits), appending each
// sequence and its taps to `shard`. resp[i] = sequence i's prompt length.
void tap_sequences(gemma4::Gemma4Model& target, std::span<const int> taps,
                   std::span<const std::vector<int32_t>> seqs, std::span<const int64_t> resp,
                   lab::DSparkShard& shard) {
  Backend& be = target.backend();
  const auto m = static_cast<int64_t>(taps.size());
  const int64_t H = target.config().hidden_size;
  int64_t M = 0;
  std::vector<SequenceKv> kvs;
  kvs.reserve(seqs.size());
  std::vector<gemma4::ForwardRow> rows;
  for (const std::vector<int32_t>& s : seqs) {
    kvs.push_back(target.new_sequence());
    rows.push_back({.kv = &kvs.back(), .tokens = s, .all_logits = false});
    M += static_cast<int64_t>(s.size());
  }
  DeviceBuffer buf(be, static_cast<size_t>(m * M * H) * sizeof(float));
  gemma4::ForwardOptions options;
  options.compute_logits = false;
  options.tap_layers = taps;
  options.tap_out = buf.view(DType::kF32, {m, M, H});
  // Fresh caches and buffers every call: a step graph recorded over them is
  // never replayed after they are freed (the backend marks graphs recorded
  // before any device release as stale).
  target.forward(rows, options);
  std::vector<float> host(static_cast<size_t>(m * M * H));
  be.download(options.tap_out, host.data());
  const lab::TapRowsView view{.data = host.data(), .taps = m, .rows = M, .hidden = H};
  int64_t row = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    shard.add_sequence(seqs[i], resp[i], view, row);
    row += static_cast<int64_t>(seqs[i].size());
  }
}

// Generates the responses of `batch` (prompt indices) and appends the
// sequences with their taps to `shard`; returns the tokens generated.
int64_t regen_batch(LoadedModels& m, std::span<const int> taps,
                    const std::vector<std::vector<int32_t>>& ids, std::span<const int64_t> batch,
                    const SamplingParams& params, lab::DSparkShard& shard) {
  std::vector<speculative::DecodeRequest> reqs;
  for (int64_t p : batch) {
    speculative::DecodeRequest r{.prompt = ids[static_cast<size_t>(p)], .params = params};
    r.params.seed = params.seed + static_cast<uint64_t>(p);  // independent of the batching
    reqs.push_back(std::move(r));
  }
  const std::vector<speculative::DecodeResult> results =
      speculative::decode(*m.target, nullptr, reqs, speculative::DraftSchedule{});
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int64_t> resp;
  int64_t generated = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    seqs.push_back(reqs[i].prompt);
    seqs.back().insert(seqs.back().end(), results[i].tokens.begin(), results[i].tokens.end());
    resp.push_back(static_cast<int64_t>(reqs[i].prompt.size()));
    generated += static_cast<int64_t>(results[i].tokens.size());
  }
  // Tapped forwards of at most kTapForwardTokens tokens (one sequence at least).
  for (size_t at = 0; at < seqs.size();) {
    size_t end = at + 1;
    int64_t tokens = static_cast<int64_t>(seqs[at].size());
    while (end < seqs.size() &&
           tokens + static_cast<int64_t>(seqs[end].size()) <= kTapForwardTokens) {
      tokens += static_cast<int64_t>(seqs[end].size());
      ++end;
    }
    tap_sequences(*m.target, taps, std::span(seqs).subspan(at, end - at),
                  std::span(resp).subspan(at, end - at), shard);
    at = end;
  }
  return generated;
}

// Token ids of every prompt, refusing (naming the prompt) one that does not
// fit the context with its response.
std::vector<std::vector<int32_t>> checked_prompt_ids(const RegenPromptSource& src,
                                                     const LoadedModels& m, int max_tokens,
                                                     size_t count) {
  std::vector<std::vector<int32_t>> ids;
  const int64_t ctx = m.target->max_context();
  const int64_t V = m.target->config().vocab_size;
  for (size_t i = 0; i < count; ++i) {
    const RegenPrompt& p = src.prompts[i];
    std::vector<int32_t> t;
    if (p.entry.is_text) {
      t = m.tokenizer->encode(p.entry.text, /*add_special_tokens=*/true);
    } else {
      t = p.entry.ids;
      for (int32_t id : t)
        if (id < 0 || id >= V)
          fail("{}: token id {} is outside the vocabulary [0, {})", p.origin, id, V);
    }
    if (t.empty()) fail("{}: the prompt is empty", p.origin);
    if (static_cast<int64_t>(t.size()) + max_tokens > ctx) {
      fail(
          "{}: prompt {} has {} tokens; with --max-tokens {} it needs {} of context, the target "
          "has {} (raise --ctx-size or lower --max-tokens, or shorten the prompt)",
          p.origin, i, t.size(), max_tokens, static_cast<int64_t>(t.size()) + max_tokens, ctx);
    }
    ids.push_back(std::move(t));
  }
  return ids;
}

void check_args(const RegenArgs& a) {
  if (a.max_tokens < 1) fail("--max-tokens: {} must be at least 1", a.max_tokens);
  if (a.batch < 1) fail("--batch: {} must be at least 1", a.batch);
  if (a.shard_tokens < 1) fail("--shard-tokens: {} must be at least 1", a.shard_tokens);
  if (a.max_prompts < 0) fail("--max-prompts: {} is negative", a.max_prompts);
  if (!(a.temperature >= 0)) fail("--temp: {} must be >= 0 (0 = greedy)", a.temperature);
  if (a.chunk_lines < 1) fail("--chunk-lines: {} must be at least 1", a.chunk_lines);
}

void run_regen(RegenArgs a) {
  check_args(a);
  const RegenPromptSource src = read_regen_prompts(a.prompt_file, a.chunk_lines);
  LoadedModels m = load_models(a.model, /*with_draft=*/false, src.needs_tokenizer(), a.quiet);
  const gemma4::Gemma4Config& cfg = m.target->config();
  RegenIdentity id;
  const std::vector<int> taps = resolve_taps(a, cfg, &id.tap_source);
  const size_t count = a.max_prompts > 0
                           ? std::min(src.prompts.size(), static_cast<size_t>(a.max_prompts))
                           : src.prompts.size();
  const std::vector<std::vector<int32_t>> ids = checked_prompt_ids(src, m, a.max_tokens, count);

  id.target_dir = m.model_dir;
  id.version = SPECULA_VERSION;
  id.prompt_count = static_cast<int64_t>(src.prompts.size());
  id.num_hidden_layers = cfg.num_hidden_layers;
  id.config_hash = dspark::target_config_hash(cfg);
  id.tap_layers = taps;
  id.prompt_file = std::filesystem::absolute(a.prompt_file).lexically_normal().string();
  id.prompt_kind = src.kind;
  id.chunk_lines = src.kind == "folder" ? a.chunk_lines : 0;
  id.temperature = a.temperature;
  id.seed = a.seed;
  id.max_tokens = a.max_tokens;
  RegenOutput out(a.out, id, a.quiet);

  SamplingArgs sampling;
  sampling.params.temperature = static_cast<float>(a.temperature);
  sampling.params.seed = a.seed;
  sampling.params.max_tokens = a.max_tokens;
  const SamplingParams params = sampling_params(sampling, m);

  std::vector<int64_t> pending;
  for (size_t i = 0; i < count; ++i)
    if (!out.finished().contains(static_cast<int64_t>(i)))
      pending.push_back(static_cast<int64_t>(i));
  if (!a.quiet) {
    fmt::print(stderr, "regen: taps {} ({}), {} of {} prompts to do, {} shards so far, into {}\n",
               lab::tap_list(taps), id.tap_source, pending.size(), count, out.shards().size(),
               a.out);
  }
  lab::DSparkShard shard;
  shard.meta = {.tap_layers = taps,
                .hidden_size = cfg.hidden_size,
                .vocab_size = cfg.vocab_size,
                .target_config_hash = id.config_hash,
                .seed = a.seed,
                .temperature = a.temperature};
  std::vector<int64_t> shard_prompts;
  Progress progress("regen", static_cast<int64_t>(count),
                    static_cast<int64_t>(count - pending.size()));
  for (size_t at = 0; at < pending.size(); at += static_cast<size_t>(a.batch)) {
    const std::span<const int64_t> batch =
        std::span(pending).subspan(at, std::min(pending.size() - at, static_cast<size_t>(a.batch)));
    const int64_t generated = regen_batch(m, taps, ids, batch, params, shard);
    shard_prompts.insert(shard_prompts.end(), batch.begin(), batch.end());
    if (shard.rows() >= a.shard_tokens || at + batch.size() == pending.size()) {
      out.commit_shard(shard, shard_prompts);
      shard.clear();
      shard_prompts.clear();
    }
    if (!a.quiet) progress.advance(static_cast<int64_t>(batch.size()), generated);
  }
  if (!a.quiet) progress.finish();
  int64_t tokens = 0;
  for (const ShardRecord& r : out.shards()) tokens += r.tokens;
  fmt::print("regen: {} prompts done, {} shards, {} tokens in {}\n", out.finished().size(),
             out.shards().size(), tokens, a.out);
}

}  // namespace

void register_regen(CLI::App& app) {
  auto args = std::make_shared<RegenArgs>();
  CLI::App* cmd = app.add_subcommand(
      "regen",
      "Write DSpark training shards: the target answers a prompt set itself (greedy or seeded "
      "sampling, batched), and its hidden states at the tap layers for every position of prompt "
      "+ response go to bf16 safetensors shards; resumable (docs/dspark.md)");
  add_model_options(cmd, args->model, /*with_draft=*/false);
  cmd->add_option("--prompt-file", args->prompt_file,
                  "Prompts: a .jsonl file ({\"turns\": [\"text\", ...]}, the first turn, or "
                  "{\"ids\": [...]}), a folder (each file cut into --chunk-lines chunks), or a "
                  "text file (one prompt per blank-line-separated paragraph); text gets BOS, no "
                  "chat template")
      ->required();
  cmd->add_option("--out,-o", args->out,
                  "Output folder: shard_NNNNN.safetensors, regen.json (manifest), ledger.txt; "
                  "rerunning with the same folder resumes")
      ->required();
  cmd->add_option("--draft,-d", args->draft,
                  "A DSpark drafter folder for this target (either layout): its tap layers");
  cmd->add_option("--tap-layers", args->tap_layers,
                  "Engine taps, e.g. 4,6,7,8 (0 = embeddings, l = after layer l, L = after the "
                  "final norm); instead of --draft");
  cmd->add_option("--max-tokens,-n", args->max_tokens, "Response tokens per prompt at most")
      ->capture_default_str();
  cmd->add_option("--temp,--temperature", args->temperature, "0 = greedy; > 0 samples")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Sampling seed (prompt i uses seed + i)")
      ->capture_default_str();
  cmd->add_option("--batch", args->batch, "Prompts decoded together (rows of the engine)")
      ->capture_default_str();
  cmd->add_option("--shard-tokens", args->shard_tokens,
                  "Start a new shard once one holds this many tokens (whole sequences only)")
      ->capture_default_str();
  cmd->add_option("--max-prompts", args->max_prompts,
                  "Use only the first N prompts of the set (0 = all)")
      ->capture_default_str();
  cmd->add_option("--chunk-lines", args->chunk_lines,
                  "Folder prompt sources: lines per prompt chunk")
      ->capture_default_str();
  cmd->add_flag("--quiet,-q", args->quiet, "No loading log or progress on stderr");
  cmd->callback([args] { run_regen(*args); });
}

}  // namespace specula::cli
