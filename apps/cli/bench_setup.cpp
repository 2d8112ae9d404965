// SPDX-License-Identifier: Apache-2.0
// `specula bench`: timing helpers, prompts, and the models it runs on.
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
#include "engine/io/quantize.h"
#include "engine/model/gemma4/presets.h"
#include "engine/speculative/engine.h"

namespace specula::cli {

double median(std::vector<double> v) {
  SPECULA_CHECK(!v.empty(), "median of no samples");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double at = p * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(at));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return NAN;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

namespace {

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

}  // namespace

std::vector<int32_t> random_ids(int64_t n, int vocab, uint64_t* state) {
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    ids.push_back(static_cast<int32_t>(3 + (*state >> 33) % static_cast<uint64_t>(vocab - 3)));
  }
  return ids;
}

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

// ---------------------------------------------------------------------------- prompt sets

bool is_prompt_set_file(const std::string& path) {
  return std::filesystem::path(path).extension() == ".jsonl";
}

BenchPromptSet read_bench_prompt_set(const BenchArgs& a) {
  return {.prompts = read_formatted_prompt_set(
              a.prompt_file, a.prompt_format,
              a.num_prompts_given ? std::optional<int>(a.num_prompts) : std::nullopt),
          .ids = {}};
}

void tokenize_bench_prompt_set(BenchPromptSet& set, const BenchArgs& a, const LoadedModels& m) {
  std::optional<ChatOptions> chat;
  if (set.prompts.format == PromptFormat::kChat) chat = chat_options(m, a.json);
  set.ids = tokenize_prompt_set(set.prompts, m.tokenizer ? &*m.tokenizer : nullptr,
                                m.target->config().vocab_size, chat ? &*chat : nullptr);
  check_prompts_fit(set.prompts, set.ids, a.gen_tokens, "--gen-tokens", m.target->max_context());
}

// ---------------------------------------------------------------------------- loading

namespace {

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

// The weight dtype of a random drafter (--draft-dtype).
DType random_draft_dtype(const BenchArgs& a) {
  return a.draft_dtype == "bf16" ? DType::kBF16
                                 : io::parse_quantized_dtype(a.draft_dtype, "--draft-dtype");
}

// --draft random-dspark[-deepspec][:γ]: a seeded random DSpark drafter of the
// seed's default shape for the target (specula layout) or of DeepSpec's
// released shape, with block size γ when given.
void build_random_dspark(LoadedModels& m, const BenchArgs& a, bool quiet) {
  const std::string& spec = a.model.draft;
  std::string rest = spec.substr(std::string_view(kRandomDSpark).size());
  bool deepspec = false;
  if (rest.starts_with("-deepspec")) {
    deepspec = true;
    rest = rest.substr(9);
  }
  int gamma = 0;
  if (!rest.empty()) {
    const char* begin = rest.data() + 1;
    const char* end = rest.data() + rest.size();
    const auto [ptr, ec] = std::from_chars(begin, end, gamma);
    if (rest[0] != ':' || ec != std::errc() || ptr != end || gamma < 1 || gamma > 64) {
      fail("--draft {}: expected random-dspark[-deepspec][:BLOCK], BLOCK in [1, 64]", spec);
    }
  }
  const gemma4::Gemma4Config& c = m.target->config();
  dspark::DSparkConfig config =
      deepspec ? dspark::default_deepspec_config(c) : dspark::default_specula_config(c);
  if (gamma > 0) config.block_size = gamma;
  const auto t1 = std::chrono::steady_clock::now();
  m.draft_dir = fmt::format("{}:{}", spec, a.seed + 1);
  m.dspark = dspark::DSparkModel::random(config, *m.target, m.target->backend(), a.seed + 1,
                                         random_draft_dtype(a));
  auto drafter = std::make_unique<dspark::DSparkDrafter>(*m.target, *m.dspark);
  const std::string pruning = apply_pruning(*drafter, *m.dspark, a.model);
  m.draft_source = std::move(drafter);
  if (!quiet) {
    fmt::print(stderr, "drafter: random {}; {}, {:.2f} GB of {} weights ({:.2f} s)\n",
               m.dspark->description(), pruning, m.dspark->weight_bytes() / 1e9, a.draft_dtype,
               seconds_since(t1));
  }
}

}  // namespace

LoadedModels load_bench_models(const BenchArgs& a, Device device) {
  set_threads(a.model.threads);
  open_backend(a.model, device);  // an unsupported device fails here, before any loading
  // --draft replay:PROFILE runs a real drafter (the embedded one for the
  // embedded model, else a random one of the target's shape) and replaces its
  // proposals (replay::ReplayDrafter).
  const bool replay = a.model.draft.starts_with("replay:") && !a.model.no_draft;
  const bool embedded = a.random_weights.empty() && a.model.model.empty();
  const bool random_draft =
      (a.model.draft == kRandomDraft || (replay && !embedded)) && !a.model.no_draft;
  const bool random_dspark = a.model.draft.starts_with(kRandomDSpark) && !a.model.no_draft;
  // A prompt set of token ids needs none (run_bench sets need_tokenizer for text).
  const bool need_tokenizer =
      a.need_tokenizer || (!a.prompt_file.empty() && !is_prompt_set_file(a.prompt_file));
  const int64_t max_context = needed_context(a);
  LoadedModels m;
  const bool tty = isatty(STDERR_FILENO);
  const bool quiet = a.json;
  if (a.random_weights.empty() && (device.is_cpu() || a.model.model.empty())) {
    // The established path (embedded default model and drafter included).
    ModelArgs args = a.model;
    args.ctx_size = max_context;
    if (replay) args.draft.clear();  // the embedded drafter
    if (random_draft || random_dspark) {
      args.draft.clear();
      args.no_draft = true;
    }
    m = load_models(args, true, need_tokenizer, quiet);
  } else {
    gemma4::LoadOptions options;
    options.device = device;
    options.max_context = max_context;
    options.scan_weights = !a.model.no_weight_scan;
    options.kv_dtype = parse_kv_dtype(a.model.kv_dtype);
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
      print_kv_capacity(*m.target);
    }
    if (!a.model.draft.empty() && !a.model.no_draft && !random_draft && !random_dspark && !replay) {
      m.draft_dir = a.model.draft;
      if (dspark::is_dspark_dir(m.draft_dir)) {
        load_dspark(m, m.draft_dir, a.model, quiet);
      } else {
        m.drafter = assistant::AssistantModel::load(m.draft_dir, c, m.target->backend(),
                                                    !a.model.no_weight_scan);
      }
    }
    if (need_tokenizer) {
      const std::string tok = !a.model.tokenizer.empty() ? a.model.tokenizer
                              : a.random_weights.empty() ? m.model_dir
                                                         : std::string();
      if (tok.empty())
        fail("{} with --random-weights needs --tokenizer (a random model has none)",
             a.prompt_file.empty() ? "serving" : "--prompt-file");
      m.tokenizer.emplace(Tokenizer::load(tok));
    }
  }
  if (random_draft) {
    const gemma4::Gemma4Config& c = m.target->config();
    const auto t1 = std::chrono::steady_clock::now();
    m.draft_dir = fmt::format("random:{}", a.seed + 1);
    m.drafter = assistant::AssistantModel::random(
        assistant::assistant_config_for(c), c, m.target->backend(), a.seed + 1,
        /*centroid_head=*/a.draft_head == "centroid" || (a.draft_head == "auto" && c.has_ple()),
        random_draft_dtype(a));
    if (!quiet) {
      fmt::print(stderr, "drafter: random ({} layers, hidden {}, {}, {} weights; {:.2f} s)\n",
                 m.drafter->config().text.num_hidden_layers, m.drafter->config().text.hidden_size,
                 m.drafter->head_description(), a.draft_dtype, seconds_since(t1));
    }
  }
  if (random_dspark) build_random_dspark(m, a, quiet);
  if (m.drafter && !m.draft_source)
    m.draft_source = std::make_unique<assistant::AssistantDrafter>(*m.target, *m.drafter);
  if (replay) {
    if (!m.draft_source) fail("--draft {}: no drafter to run beneath the replay", a.model.draft);
    const std::string profile = a.model.draft.substr(7);
    m.inner_draft_source = std::move(m.draft_source);
    auto source = std::make_unique<replay::ReplayDrafter>(
        *m.inner_draft_source, m.target->backend(), replay::parse_acceptance_profile(profile),
        a.seed + 2);
    m.replay = source.get();
    m.draft_source = std::move(source);
    m.draft_dir = fmt::format("replay:{} (SIMULATED acceptance) over {}", profile, m.draft_dir);
    if (!quiet) {
      fmt::print(stderr,
                 "drafter: replay of the target's greedy output at acceptance {} "
                 "(a simulation; the drafter beneath runs for its cost)\n",
                 profile);
    }
  }
  return m;
}

}  // namespace specula::cli
