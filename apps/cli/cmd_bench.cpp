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
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>

#include <unistd.h>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/backend/backends.h"
#include "engine/model/gemma4/presets.h"
#include "engine/speculative/engine.h"

namespace specula::cli {
namespace {

struct BenchArgs {
  ModelArgs model;
  std::string prompt_file;
  int prompt_tokens = 64;
  int gen_tokens = 64;
  std::vector<int> batches = {1};
  bool batches_given = false;  // else --micro measures 1, 8, 32, 64
  std::vector<int> draft_tokens = {1, 2, 4, 6};
  bool json = false;
  // Device and random-weight models.
  std::string random_weights;  // preset name or config.json path
  uint64_t seed = 1234;
  std::string draft_head = "auto";  // head of a --draft random drafter (auto: as released)
  // --micro: forward timings against the measured copy bandwidth and matrix peak.
  bool micro = false;
  int context = 512;
  int prefill_tokens = 4096;
  int verify_tokens = 5;
  int reps = 10;
  int64_t copy_mib = 2048;
  int peak_size = 8192;
  bool no_graphs = false;  // run every step directly (no CUDA graphs)
  // Sampling of the end-to-end rows (temperature 0: greedy); request i is seeded with i.
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  bool host_sampling = false;  // logits read back, sampled on the host (A/B)
  // Dump a preset's config.json and exit.
  std::string print_preset_config, print_assistant_config;
};

constexpr char kRandomDraft[] = "random";

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  SPECULA_CHECK(!v.empty(), "median of no samples");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

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

// A preset name ("31b") or a config.json file / checkpoint directory.
gemma4::Gemma4Config random_config(const std::string& spec) {
  const std::vector<std::string> names = gemma4::gemma4_preset_names();
  if (std::find(names.begin(), names.end(), spec) != names.end())
    return gemma4::gemma4_preset(spec);
  std::error_code ec;
  if (spec.find('/') != std::string::npos || spec.ends_with(".json") ||
      std::filesystem::exists(spec, ec)) {
    return gemma4::load_gemma4_config(spec);
  }
  fail("--random-weights: '{}' is neither a model preset ({}) nor a config.json file or directory",
       spec, fmt::join(names, ", "));
}

// Deterministic pseudo-random token ids in [3, V) (avoiding pad/eos/bos).
std::vector<int32_t> random_ids(int64_t n, int vocab, uint64_t* state) {
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    ids.push_back(static_cast<int32_t>(3 + (*state >> 33) % static_cast<uint64_t>(vocab - 3)));
  }
  return ids;
}

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
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < count; ++i)
    prompts.push_back(random_ids(a.prompt_tokens, m.target->config().vocab_size, &state));
  return prompts;
}

// ---------------------------------------------------------------------------- loading

// The context the target is built for: what the decode loop needs, and with
// --micro also the prefill and the decode context plus a verify window.
int64_t needed_context(const BenchArgs& a) {
  int64_t ctx = a.model.ctx_size;
  if (a.micro) {
    ctx = std::max<int64_t>(ctx, a.prefill_tokens + 1);
    ctx = std::max<int64_t>(ctx, int64_t{a.context} + a.verify_tokens + 1);
  }
  return ctx;
}

LoadedModels load_bench_models(const BenchArgs& a, Device device) {
  set_threads(a.model.threads);
  backend_for(device);  // an unsupported device fails here, before any loading
  const bool random_draft = a.model.draft == kRandomDraft && !a.model.no_draft;
  const bool need_tokenizer = !a.prompt_file.empty();
  const int64_t max_context = needed_context(a);
  LoadedModels m;
  const bool tty = isatty(STDERR_FILENO);
  const bool quiet = a.json;
  if (a.random_weights.empty() && (device.is_cpu() || a.model.model.empty())) {
    // The established path (embedded default model and drafter included).
    ModelArgs args = a.model;
    args.ctx_size = max_context;
    if (random_draft) {
      args.draft.clear();
      args.no_draft = true;
    }
    m = load_models(args, true, need_tokenizer, quiet);
  } else {
    gemma4::LoadOptions options;
    options.device = device;
    options.max_context = max_context;
    const auto t0 = std::chrono::steady_clock::now();
    if (!a.random_weights.empty()) {
      const gemma4::Gemma4Config config = random_config(a.random_weights);
      m.model_dir = "random:" + a.random_weights;
      if (!quiet)
        fmt::print(stderr, "building {} on {} ...{}", m.model_dir, device.str(), tty ? "" : "\n");
      m.target = gemma4::Gemma4Model::random(config, options, a.seed);
    } else {
      if (a.model.model.empty()) {
        fail(
            "--device {}: give --model DIR or --random-weights (the embedded default model runs "
            "on the CPU)",
            device.str());
      }
      m.model_dir = a.model.model;
      if (!quiet)
        fmt::print(stderr, "loading {} on {} ...{}", m.model_dir, device.str(), tty ? "" : "\n");
      m.target = gemma4::Gemma4Model::load(m.model_dir, options);
    }
    const gemma4::Gemma4Config& c = m.target->config();
    if (!quiet) {
      fmt::print(stderr,
                 "{}target: {} layers, hidden {}, vocab {}, {:.2f} GB of weights ({:.2f} s)\n",
                 tty ? "\r" : "", c.num_hidden_layers, c.hidden_size, c.vocab_size,
                 m.target->weight_bytes() / 1e9, seconds_since(t0));
    }
    if (!a.model.draft.empty() && !a.model.no_draft && !random_draft) {
      m.draft_dir = a.model.draft;
      m.drafter = assistant::AssistantDrafter::load(m.draft_dir, c, m.target->backend());
    }
    if (need_tokenizer) {
      const std::string tok = !a.model.tokenizer.empty() ? a.model.tokenizer
                              : a.random_weights.empty() ? m.model_dir
                                                         : std::string();
      if (tok.empty())
        fail("--prompt-file with --random-weights needs --tokenizer (a random model has none)");
      m.tokenizer.emplace(Tokenizer::load(tok));
    }
  }
  if (random_draft) {
    const gemma4::Gemma4Config& c = m.target->config();
    const auto t1 = std::chrono::steady_clock::now();
    m.draft_dir = fmt::format("random:{}", a.seed + 1);
    m.drafter = assistant::AssistantDrafter::random(
        assistant::assistant_config_for(c), c, m.target->backend(), a.seed + 1,
        /*centroid_head=*/a.draft_head == "centroid" || (a.draft_head == "auto" && c.has_ple()));
    if (!quiet) {
      fmt::print(stderr, "drafter: random ({} layers, hidden {}, {}; {:.2f} s)\n",
                 m.drafter->config().text.num_hidden_layers, m.drafter->config().text.hidden_size,
                 m.drafter->head_description(), seconds_since(t1));
    }
  }
  if (m.drafter && !m.draft_source)
    m.draft_source = std::make_unique<assistant::AssistantDraftSource>(*m.target, *m.drafter);
  return m;
}

// ---------------------------------------------------------------------------- decode loop

// Plain and speculative decoding through speculative::decode, per batch size and draft
// length: prints the table (unless json) and returns the rows.
nlohmann::json decode_table(const BenchArgs& a, const LoadedModels& m,
                            const std::vector<int>& batches) {
  nlohmann::json rows = nlohmann::json::array();
  if (!a.json) {
    fmt::print("{:<12} {:>5} {:>3} {:>12} {:>12} {:>8} {:>8} {:>8}\n", "mode", "batch", "k",
               "prefill t/s", "decode t/s", "tau", "accept", "speedup");
  }
  for (int batch : batches) {
    std::vector<speculative::DecodeRequest> reqs;
    for (auto& p : make_prompts(a, m, batch)) {
      speculative::DecodeRequest r{.prompt = p, .params = {}};
      r.params.temperature = a.temperature;
      r.params.top_p = a.top_p;
      r.params.top_k = a.top_k;
      r.params.min_p = a.min_p;
      r.params.repetition_penalty = a.repetition_penalty;
      r.params.presence_penalty = a.presence_penalty;
      r.params.frequency_penalty = a.frequency_penalty;
      r.params.seed = reqs.size();
      r.params.max_tokens = a.gen_tokens;
      reqs.push_back(std::move(r));
    }
    // Each mode runs twice on one Engine and the second run counts: the first
    // records the step graphs of its shapes (a cost of the first requests,
    // not of decoding), which the second replays. Also counted in the second
    // run: its rounds (of the whole batch) and target forwards replayed.
    struct Measured {
      speculative::DecodeStats stats;
      int64_t rounds = 0, target_replays = 0;
    };
    auto measure = [&](Drafter* drafter, int k) {
      Measured out;
      speculative::Engine engine(*m.target, drafter,
                                 {.schedule = {.draft_tokens = std::max(k, 1)},
                                  .max_rows = batch,
                                  .modes = {.host_sampling = a.host_sampling}});
      for (int run = 0; run < 2; ++run) {
        out = {};
        const int64_t target_replays = m.target->graph_replays();
        for (const auto& r : speculative::decode(engine, reqs)) {
          out.stats.merge(r.stats);
          out.rounds = std::max(out.rounds, r.stats.rounds);
        }
        out.target_replays = m.target->graph_replays() - target_replays;
      }
      return out;
    };
    const Measured plain_run = measure(nullptr, 0);
    const speculative::DecodeStats& plain = plain_run.stats;
    auto report = [&](const char* mode, int k, const Measured& measured) {
      const speculative::DecodeStats& s = measured.stats;
      const double decode_tps =
          s.decode_seconds > 0 ? (s.generated_tokens - batch) / s.decode_seconds : 0;
      const double plain_tps =
          plain.decode_seconds > 0 ? (plain.generated_tokens - batch) / plain.decode_seconds : 0;
      const double prefill_tps = s.prefill_seconds > 0 ? s.prompt_tokens / s.prefill_seconds : 0;
      const double speedup = plain_tps > 0 ? decode_tps / plain_tps : 0;
      rows.push_back({{"mode", mode},
                      {"batch", batch},
                      {"draft_tokens", k},
                      {"prefill_tokens_per_second", prefill_tps},
                      {"decode_tokens_per_second", decode_tps},
                      {"tau", s.mean_accepted_length()},
                      {"acceptance_rate", s.acceptance_rate()},
                      {"speedup", speedup},
                      {"rounds", measured.rounds},
                      {"target_graph_replays", measured.target_replays}});
      if (!a.json) {
        fmt::print("{:<12} {:>5} {:>3} {:>12.1f} {:>12.1f} {:>8.2f} {:>7.1f}% {:>7.2f}x\n", mode,
                   batch, k, prefill_tps, decode_tps, s.mean_accepted_length(),
                   100 * s.acceptance_rate(), speedup);
      }
    };
    report("plain", 0, plain_run);
    if (m.draft_source) {
      for (int k : a.draft_tokens) report("speculative", k, measure(m.draft_source.get(), k));
    }
  }
  return rows;
}

// ---------------------------------------------------------------------------- --micro

// Device-to-device copy bandwidth, counted as 2 × bytes / time (every byte is
// read once and written once): the traffic a memory-bound kernel can reach.
// Best of 5 rounds of `reps` back-to-back copies after a warm-up.
double copy_bandwidth(Backend& be, int64_t bytes, int reps) {
  const int64_t n = bytes / 4;
  DeviceBuffer a(be, static_cast<size_t>(n) * 4), b(be, static_cast<size_t>(n) * 4);
  const Tensor src = a.view(DType::kF32, {n});
  const Tensor dst = b.view(DType::kF32, {n});
  be.fill_uniform(src, 7, -1.0f, 1.0f);
  for (int i = 0; i < 2; ++i) be.copy(src, dst);
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    const double t = timed(be, [&] {
      for (int i = 0; i < reps; ++i) be.copy(src, dst);
    });
    best = std::max(best, 2.0 * static_cast<double>(n * 4) * reps / t);
  }
  return best;
}

// bf16 matrix peak through backend.linear: y f32 [S, S] = x f32 [S, S] · w bf16 [S, S]ᵀ,
// 2·S³ flops per call. Best of 5 rounds of 3 calls after a warm-up.
double matrix_peak(Backend& be, int64_t s) {
  DeviceBuffer xb(be, static_cast<size_t>(s * s) * 4), wb(be, static_cast<size_t>(s * s) * 2),
      yb(be, static_cast<size_t>(s * s) * 4);
  const Tensor x = xb.view(DType::kF32, {s, s});
  const Tensor w = wb.view(DType::kBF16, {s, s});
  const Tensor y = yb.view(DType::kF32, {s, s});
  be.fill_uniform(x, 11, -1.0f, 1.0f);
  be.fill_uniform(w, 12, -0.05f, 0.05f);
  for (int i = 0; i < 2; ++i) be.linear(x, w, y);
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    const double t = timed(be, [&] {
      for (int i = 0; i < 3; ++i) be.linear(x, w, y);
    });
    best = std::max(best, 2.0 * static_cast<double>(s) * s * s * 3 / t);
  }
  return best;
}

// K/V bytes one query at sequence length `len` (itself included) reads, per
// row: every layer reads its cache (a KV-shared layer re-reads its donor's),
// sliding layers min(window, len) rows, full layers len rows; f32 K and V.
int64_t kv_bytes_read(const gemma4::Gemma4Config& c, int64_t len) {
  int64_t bytes = 0;
  for (const gemma4::LayerSpec& l : c.layers) {
    const int64_t rows =
        l.type == gemma4::LayerType::kSliding ? std::min<int64_t>(c.sliding_window, len) : len;
    bytes += rows * l.n_kv_heads * l.head_dim * int64_t{4} * 2;
  }
  return bytes;
}

// Matrix-product parameters one token multiplies by (the lm head excluded):
// q/k/v/o, the dense MLP, PLE gate/projection and the PLE model projection,
// the MoE router and top_k of the experts.
double linear_params_per_token(const gemma4::Gemma4Config& c) {
  const double H = c.hidden_size, P = c.hidden_size_per_layer_input;
  double n = c.has_ple() ? H * c.num_hidden_layers * P : 0;
  for (const gemma4::LayerSpec& l : c.layers) {
    const double D = l.head_dim, q = static_cast<double>(c.num_attention_heads) * D;
    n += 2 * q * H;  // q_proj, o_proj
    if (!l.kv_shared) n += (l.k_eq_v ? 1 : 2) * static_cast<double>(l.n_kv_heads) * D * H;
    n += 3 * H * l.intermediate_size;
    if (c.has_ple()) n += 2 * H * P;
    if (c.enable_moe_block) {
      n += static_cast<double>(c.num_experts) * H +
           static_cast<double>(c.top_k_experts) * 3 * H * c.moe_intermediate_size;
    }
  }
  return n;
}

// Prefill flops of n tokens from position 0 with logits for the last:
// 2·n·linear_params + 2·V·H (lm head) + Σ_layers 4·Nh·D·Σ_i visible(i)
// (QKᵀ and PV; visible(i) = i+1, or min(W, i+1) on sliding layers).
double prefill_flops(const gemma4::Gemma4Config& c, int64_t n) {
  double flops = 2.0 * n * linear_params_per_token(c) + 2.0 * c.vocab_size * c.hidden_size;
  const double W = c.sliding_window, N = static_cast<double>(n);
  const double full = N * (N + 1) / 2;
  const double sliding = N <= W ? full : W * (W + 1) / 2 + (N - W) * W;
  for (const gemma4::LayerSpec& l : c.layers) {
    flops += 4.0 * c.num_attention_heads * l.head_dim *
             (l.type == gemma4::LayerType::kSliding ? sliding : full);
  }
  return flops;
}

struct MicroRunner {
  const BenchArgs& a;
  LoadedModels& m;
  gemma4::Gemma4Model& model;
  Backend& be;
  uint64_t state = 0x51ed270b27a3f1c5ull;

  const gemma4::Gemma4Config& config() const { return model.config(); }

  // A sequence whose cache holds `max_context` positions: smaller than the
  // model's default so that 64 rows of a 31B-shaped model fit beside its weights.
  SequenceKv sequence(int64_t max_context) const {
    KvCacheSpec spec = model.kv_spec();
    spec.max_context = std::min<int64_t>(max_context, model.max_context());
    return SequenceKv(spec);
  }

  // Fills every sequence with `len` random tokens, at most max(prefill, len)
  // tokens per forward (no logits).
  void fill(std::vector<SequenceKv>& seqs, int64_t len) {
    const size_t per_forward =
        static_cast<size_t>(std::max<int64_t>(1, std::max<int64_t>(a.prefill_tokens, len) / len));
    std::vector<std::vector<int32_t>> ids;
    for (size_t i = 0; i < seqs.size(); ++i)
      ids.push_back(random_ids(len, config().vocab_size, &state));
    for (size_t begin = 0; begin < seqs.size(); begin += per_forward) {
      std::vector<gemma4::ForwardRow> rows;
      for (size_t i = begin; i < std::min(seqs.size(), begin + per_forward); ++i)
        rows.push_back({.kv = &seqs[i], .tokens = ids[i], .all_logits = false});
      model.forward(rows, {.compute_logits = false, .prefill = true});
    }
    be.synchronize();
  }

  // Median time of forwarding `tokens` new tokens per row (logits computed),
  // rolling every cache back after each rep so the context stays fixed.
  double step_time(std::vector<SequenceKv>& seqs, int64_t tokens, bool all_logits) {
    std::vector<std::vector<int32_t>> ids;
    for (size_t i = 0; i < seqs.size(); ++i)
      ids.push_back(random_ids(tokens, config().vocab_size, &state));
    std::vector<gemma4::ForwardRow> rows;
    for (size_t i = 0; i < seqs.size(); ++i)
      rows.push_back({.kv = &seqs[i], .tokens = ids[i], .all_logits = all_logits});
    const int64_t len = seqs.front().length();
    auto rollback = [&] {
      for (SequenceKv& s : seqs) s.truncate(len);
    };
    for (int i = 0; i < 2; ++i) {  // warm-up (scratch growth, caches, clocks)
      model.forward(rows);
      rollback();
    }
    std::vector<double> times;
    for (int r = 0; r < a.reps; ++r) {
      times.push_back(timed(be, [&] { model.forward(rows); }));
      rollback();
    }
    return median(times);
  }

  nlohmann::json run() {
    const gemma4::Gemma4Config& c = config();
    nlohmann::json out;
    out["backend"] = be.name();
    model.set_graphs_enabled(!a.no_graphs && model.graphs_enabled());
    out["graphs"] = model.graphs_enabled() && be.supports_graphs();
    out["weight_bytes"] = model.weight_bytes();
    out["context"] = a.context;
    out["reps"] = a.reps;

    // Device references, measured first while nothing else is queued.
    const int64_t copy_bytes = a.copy_mib << 20;
    const double copy_bps = copy_bandwidth(be, copy_bytes, a.reps);
    out["copy"] = {{"bytes", copy_bytes},
                   {"gb_per_second", copy_bps / 1e9},
                   {"definition",
                    "2 x bytes / time of backend.copy (each byte read and written once); best of "
                    "5 rounds"}};
    const double peak = matrix_peak(be, a.peak_size);
    out["matrix_peak"] = {
        {"size", a.peak_size},
        {"tflops", peak / 1e12},
        {"definition", fmt::format("backend.linear x f32[{0},{0}] . w bf16[{0},{0}]^T, 2*{0}^3 "
                                   "flops per call; best of 5 rounds",
                                   a.peak_size)}};
    if (!a.json) {
      fmt::print("device {} ({}), model {} (seed {}), {:.2f} GB of weights\n", be.device().str(),
                 be.name(), m.model_dir, a.seed, model.weight_bytes() / 1e9);
      fmt::print("copy bandwidth   {:>9.1f} GB/s     (2 x {} MiB / time: read + write)\n",
                 copy_bps / 1e9, a.copy_mib);
      fmt::print("bf16 matrix peak {0:>9.4g} TFLOP/s  (linear f32[{1},{1}] x bf16[{1},{1}]^T)\n",
                 peak / 1e12, a.peak_size);
      fmt::print("\ndecode, context {} per row (median of {}; steps {}):\n", a.context, a.reps,
                 model.graphs_enabled() && be.supports_graphs() ? "replayed as CUDA graphs"
                                                                : "run directly");
      fmt::print("{:>5} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9}\n", "batch", "step ms", "tokens/s",
                 "GB wts", "GB kv", "GB/s", "roofline");
    }

    // Decode steps per batch size.
    nlohmann::json decode = nlohmann::json::array();
    double b1_fraction = -1;
    const int64_t seq_context = int64_t{a.context} + a.verify_tokens + 1;
    for (int B : a.batches) {
      std::vector<SequenceKv> seqs;
      for (int b = 0; b < B; ++b) seqs.push_back(sequence(seq_context));
      fill(seqs, a.context);
      const double t = step_time(seqs, 1, false);
      const int64_t wbytes = model.weight_bytes_read(B);
      const int64_t kvbytes = int64_t{B} * kv_bytes_read(c, int64_t{a.context} + 1);
      const double bps = static_cast<double>(wbytes + kvbytes) / t;
      const double fraction = bps / copy_bps;
      if (B == 1) b1_fraction = fraction;
      decode.push_back({{"batch", B},
                        {"step_ms", t * 1e3},
                        {"tokens_per_second", B / t},
                        {"weight_bytes", wbytes},
                        {"kv_bytes", kvbytes},
                        {"gb_per_second", bps / 1e9},
                        {"roofline_fraction", fraction}});
      if (!a.json) {
        fmt::print("{:>5} {:>9.3f} {:>11.1f} {:>9.2f} {:>9.3f} {:>9.1f} {:>8.1f}%\n", B, t * 1e3,
                   B / t, wbytes / 1e9, kvbytes / 1e9, bps / 1e9, 100 * fraction);
      }
    }
    out["decode"] = decode;

    // Verify window vs one decode step, batch 1.
    std::vector<SequenceKv> one;
    one.push_back(sequence(seq_context));
    fill(one, a.context);
    const double t1 = step_time(one, 1, false);
    const double tv = step_time(one, a.verify_tokens, true);
    out["verify"] = {{"tokens", a.verify_tokens},
                     {"step_ms", t1 * 1e3},
                     {"verify_ms", tv * 1e3},
                     {"ratio", tv / t1}};
    if (!a.json) {
      fmt::print("\nverify window of {} tokens: {:.3f} ms vs one decode step {:.3f} ms: {:.3f}x\n",
                 a.verify_tokens, tv * 1e3, t1 * 1e3, tv / t1);
    }

    // One drafter step, batch 1, at the same context.
    std::optional<double> draft_ratio;
    if (m.draft_source) {
      std::vector<int32_t> last = random_ids(1, c.vocab_size, &state);
      const gemma4::ForwardOutput& fo = model.forward(std::vector<gemma4::ForwardRow>{
          {.kv = &one.front(), .tokens = last, .all_logits = false}});
      std::vector<float> hidden(static_cast<size_t>(c.hidden_size));
      be.download(fo.hidden.slice_rows(0, 1), hidden.data());
      const DraftRow row{.request = 0,
                         .token = random_ids(1, c.vocab_size, &state)[0],
                         .position = static_cast<int32_t>(one.front().length()),
                         .target_kv = &one.front(),
                         .target_hidden = hidden.data()};
      auto draft = [&] { m.draft_source->step(0, std::span<const DraftRow>(&row, 1)); };
      for (int i = 0; i < 2; ++i) draft();
      std::vector<double> times;
      for (int r = 0; r < a.reps; ++r) times.push_back(timed(be, draft));
      const double td = median(times);
      draft_ratio = td / t1;
      out["drafter"] = {{"step_ms", td * 1e3}, {"target_step_ms", t1 * 1e3}, {"ratio", td / t1}};
      if (!a.json) {
        fmt::print("drafter step: {:.3f} ms = {:.2f}% of a target decode step\n", td * 1e3,
                   100 * td / t1);
      }
    } else {
      out["drafter"] = nullptr;
    }
    one.clear();

    // Prefill of one fresh row.
    const int64_t n = a.prefill_tokens;
    const std::vector<int32_t> prompt = random_ids(n, c.vocab_size, &state);
    auto prefill_once = [&] {
      SequenceKv kv = sequence(n + 1);
      const gemma4::ForwardRow row{.kv = &kv, .tokens = prompt, .all_logits = false};
      // As the decoder prefills a prompt (ForwardOptions::prefill).
      return timed(be, [&] {
        model.forward(std::span<const gemma4::ForwardRow>(&row, 1), {.prefill = true});
      });
    };
    prefill_once();  // warm-up
    std::vector<double> times;
    for (int r = 0; r < std::min(a.reps, 3); ++r) times.push_back(prefill_once());
    const double tp = median(times);
    const double flops = prefill_flops(c, n);
    out["prefill"] = {{"tokens", n},
                      {"ms", tp * 1e3},
                      {"tokens_per_second", n / tp},
                      {"flops", flops},
                      {"tflops", flops / tp / 1e12},
                      {"peak_fraction", flops / tp / peak},
                      {"formula",
                       "2*n*linear_params_per_token + 2*V*H (lm head, last token) + "
                       "sum_layers 4*Nh*D*sum_i visible(i)"}};
    if (!a.json) {
      fmt::print(
          "prefill of {} tokens: {:.1f} ms, {:.0f} tokens/s, {:.4g} TFLOP/s = {:.1f}% of the "
          "matrix peak\n",
          n, tp * 1e3, n / tp, flops / tp / 1e12, 100 * flops / tp / peak);
    }

    // The acceptance goals of the CUDA backend (set for the 31B shape).
    nlohmann::json goals = nlohmann::json::array();
    auto goal = [&](const char* name, double value, const char* op, double target) {
      const bool met = op[0] == '>' ? value >= target : value <= target;
      goals.push_back({{"goal", name},
                       {"value", value},
                       {"target", fmt::format("{} {}", op, target)},
                       {"met", met}});
      if (!a.json)
        fmt::print("  {:<44} {:>8.3f} (goal {} {}) {}\n", name, value, op, target,
                   met ? "met" : "NOT met");
    };
    if (!a.json) fmt::print("\ngoals (set for the 31b shape):\n");
    if (b1_fraction >= 0) goal("decode batch 1: roofline fraction", b1_fraction, ">=", 0.85);
    goal("verify window / decode step", tv / t1, "<=", 1.15);
    if (draft_ratio) goal("drafter step / target decode step", *draft_ratio, "<=", 0.05);
    goal("prefill: fraction of matrix peak", flops / tp / peak, ">=", 0.5);
    out["goals"] = goals;
    return out;
  }
};

void run_bench(BenchArgs a) {
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
    if (!a.batches_given) a.batches = {1, 8, 32, 64};
    if (a.context < 1) fail("--context must be >= 1, got {}", a.context);
    if (a.prefill_tokens < 1) fail("--prefill-tokens must be >= 1, got {}", a.prefill_tokens);
    if (a.reps < 1) fail("--reps must be >= 1, got {}", a.reps);
    if (a.copy_mib < 1 || a.copy_mib > (int64_t{1} << 20))
      fail("--copy-mib must be in [1, 1048576], got {}", a.copy_mib);
    if (a.peak_size < 1 || a.peak_size > 65536)
      fail("--peak-size must be in [1, 65536], got {}", a.peak_size);
  }

  LoadedModels m = load_bench_models(a, device);
  if (a.micro) {
    // Rolling back a verify window must stay within the sliding rings' slack.
    const int max_window = m.target->kv_spec().max_rollback;
    if (a.verify_tokens < 1 || a.verify_tokens > max_window)
      fail("--verify-tokens must be in [1, {}] (the cache's rollback slack), got {}", max_window,
           a.verify_tokens);
    if (int64_t{a.context} + a.verify_tokens + 1 > m.target->max_context() ||
        int64_t{a.prefill_tokens} + 1 > m.target->max_context()) {
      fail("--context {} / --prefill-tokens {} exceed the model's maximum context of {} tokens",
           a.context, a.prefill_tokens, m.target->max_context());
    }
    MicroRunner runner{a, m, *m.target, m.target->backend()};
    nlohmann::json micro = runner.run();
    // End to end through the decode loop, batch 1, when there is a drafter.
    nlohmann::json e2e = nlohmann::json::array();
    if (m.draft_source) {
      if (!a.json) {
        fmt::print("\nend to end (speculative::decode, batch 1, {}-token prompts, {} new tokens):\n",
                   a.prompt_tokens, a.gen_tokens);
      }
      e2e = decode_table(a, m, {1});
    }
    if (a.json) {
      fmt::print("{}\n", nlohmann::json{{"model", m.model_dir},
                                        {"draft", m.draft_dir},
                                        {"device", device.str()},
                                        {"seed", a.seed},
                                        {"micro", micro},
                                        {"results", e2e}}
                             .dump());
    }
    return;
  }
  nlohmann::json rows = decode_table(a, m, a.batches);
  const bool penalties =
      a.repetition_penalty != 1.0f || a.presence_penalty != 0.0f || a.frequency_penalty != 0.0f;
  const bool plain_greedy = a.temperature == 0 && !penalties;
  if (a.json) {
    fmt::print("{}\n", nlohmann::json{{"model", m.model_dir},
                                      {"draft", m.draft_dir},
                                      {"device", device.str()},
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
  cmd->add_option("--prompt-file", args->prompt_file,
                  "Text file to cut prompts from (default: random token ids)");
  cmd->add_option("--prompt-tokens", args->prompt_tokens, "Tokens per prompt")
      ->capture_default_str();
  cmd->add_option("--gen-tokens", args->gen_tokens, "Tokens generated per prompt")
      ->capture_default_str();
  CLI::Option* batch = cmd->add_option(
      "--batch", args->batches, "Batch sizes (rows decoded together); --micro default: 1 8 32 64");
  batch->capture_default_str();
  cmd->add_option("--draft-tokens,-k", args->draft_tokens, "Draft lengths to measure")
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
  cmd->add_flag(
      "--micro", args->micro,
      "Time model forwards directly: copy bandwidth, matrix peak, decode steps per "
      "batch, a verify window, a drafter step, a prefill; then end to end with a drafter");
  cmd->add_flag("--no-graphs", args->no_graphs,
                "--micro: run decode steps and verify windows directly instead of replaying "
                "recorded CUDA graphs (same results; for comparing launch overhead)");
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
  cmd->add_option("--context", args->context, "--micro: tokens per row before a decode step")
      ->capture_default_str();
  cmd->add_option("--prefill-tokens", args->prefill_tokens, "--micro: tokens of the timed prefill")
      ->capture_default_str();
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
      "--draft random (with --random-weights or --model) builds a random assistant drafter of "
      "the released shape for the target (head: --draft-head).\n"
      "--micro definitions: copy bandwidth = 2 x bytes / time of a device-to-device copy (read + "
      "write); bytes per decode step = weights read (model.weight_bytes_read(batch)) + K/V read "
      "(per row and layer: rows visible (sliding: min(window, context + 1)) x kv heads x head dim "
      "x 4 bytes x 2; KV-shared layers re-read their donor's); roofline = (bytes / step time) / "
      "copy bandwidth; prefill flops = 2 x tokens x matrix parameters per token + 2 x V x H + "
      "attention 4 x heads x head dim x visible keys summed over queries.");
  cmd->callback([args, batch] {
    BenchArgs a = *args;
    a.batches_given = batch->count() > 0;
    run_bench(std::move(a));
  });
}

}  // namespace specula::cli
