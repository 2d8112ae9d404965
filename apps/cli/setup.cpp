// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/setup.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "engine/backend/backends.h"
#include "engine/chat/chat_template_check.h"

namespace specula::cli {
namespace {

constexpr const char* kDefaultTarget = "gemma4-tiny-py";
constexpr const char* kDefaultDrafter = "gemma4-tiny-py-assistant";

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// The embedded default family (models/ in the source tree), overridable by
// SPECULA_MODELS_DIR for installed binaries.
std::string models_root() {
  if (const char* env = std::getenv("SPECULA_MODELS_DIR")) return env;
  return SPECULA_DEFAULT_MODELS_DIR;
}

Backend& open_backend(const ModelArgs& args, Device device) {
  Backend& be = backend_for(device);
  if (args.cuda_profile) {
    if (device.is_cpu()) fail("--cuda-profile: needs --device cuda (got {})", device.str());
    be.set_op_profile(true);
  }
  return be;
}

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.starts_with("cuda:")) {
    int index = -1;
    const char* begin = text.data() + 5;
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(begin, end, index);
    if (ec == std::errc() && ptr == end && begin != end && index >= 0) return Device::cuda(index);
  }
  fail("--device: '{}' is not a device (expected cpu, cuda or cuda:N)", text);
}

std::optional<DType> parse_kv_dtype(const std::string& text) {
  if (text == "auto") return std::nullopt;
  if (text == "f32") return DType::kF32;
  if (text == "bf16") return DType::kBF16;
  if (text == "fp8") return DType::kF8E4M3;
  fail("--kv-dtype: '{}' is not a KV cache dtype (expected auto, f32, bf16 or fp8)", text);
}

KvCapacity kv_capacity(const gemma4::Gemma4Model& target) {
  const KvCacheSpec& spec = target.kv_spec();
  KvCapacity k;
  k.dtype = spec.dtype;
  // Full layers grow by one row a token; sliding rings are a fixed cost per sequence.
  KvCacheSpec rings = spec;
  for (KvLayerSpec& l : rings.layers) {
    if (l.owns_cache && l.window == 0) {
      k.bytes_per_token += 2 * int64_t{l.n_kv_heads} * kv_head_row_bytes(spec.dtype, l.head_dim);
      l.owns_cache = false;
    }
  }
  k.bytes_per_sequence = kv_bytes_per_sequence(rings);
  k.free_bytes = target.backend().memory_info().free_bytes;
  k.tokens = k.bytes_per_token > 0 ? k.free_bytes / k.bytes_per_token : 0;
  return k;
}

void print_kv_capacity(const gemma4::Gemma4Model& target) {
  const KvCapacity k = kv_capacity(target);
  fmt::print(stderr,
             "KV cache: {}, {:.1f} KiB a token (full layers) + {:.1f} MiB a sequence (sliding "
             "rings); {} tokens fit in the {:.1f} GiB free on {}\n",
             dtype_name(k.dtype), k.bytes_per_token / 1024.0, k.bytes_per_sequence / 1048576.0,
             k.tokens, k.free_bytes / 1073741824.0, target.backend().device().str());
}

void add_model_options(CLI::App* cmd, ModelArgs& args, bool with_draft) {
  cmd->add_option(
      "--model,-m", args.model,
      fmt::format("Checkpoint directory (config.json + safetensors); default: the embedded {}",
                  kDefaultTarget));
  if (with_draft) {
    cmd->add_option("--draft,-d", args.draft,
                    "Drafter: a checkpoint directory (a Gemma 4 assistant, a specula DSpark "
                    "drafter with dspark.json, or a DeepSpec Gemma4DSparkModel; the kind is read "
                    "from the folder and logged), or 'ngram' (prompt lookup: drafts what followed "
                    "the latest earlier match of the last tokens; no model). Turns speculative "
                    "decoding on (default: the embedded drafter when the model is the embedded "
                    "default)");
    cmd->add_option("--draft-confidence-threshold", args.draft_confidence_threshold,
                    "DSpark drafters: cut each draft block at the first position (after the "
                    "first) whose confidence is below this value, in [0, 1]; replaces the "
                    "checkpoint's calibrated thresholds (default: those, if it has any)");
    cmd->add_flag("--no-draft-prune", args.no_draft_prune,
                  "DSpark drafters: verify whole blocks, ignoring the checkpoint's calibrated "
                  "thresholds");
    cmd->add_option("--prompt-lookup-min", args.prompt_lookup_min,
                    "--draft ngram: the shortest suffix matched, in tokens")
        ->capture_default_str();
    cmd->add_option("--prompt-lookup-max", args.prompt_lookup_max,
                    "--draft ngram: the longest suffix matched, in tokens")
        ->capture_default_str();
    cmd->add_flag("--no-draft", args.no_draft,
                  "Decode without speculation even when a drafter is available");
  }
  cmd->add_option("--tokenizer", args.tokenizer,
                  "tokenizer.json file or directory (default: the model directory)");
  cmd->add_option("--ctx-size,-c", args.ctx_size, "Context size per sequence, in tokens")
      ->capture_default_str();
  cmd->add_option("--threads,-t", args.threads,
                  "CPU threads (0 = all cores; at most 4 x the cores)")
      ->capture_default_str();
  cmd->add_option("--device", args.device,
                  "Device to run on: cpu, cuda or cuda:N (cuda needs a build with SPECULA_CUDA)")
      ->capture_default_str();
  cmd->add_option("--kv-dtype,--kv-cache-dtype", args.kv_dtype,
                  "KV cache element type: auto (bf16 for a checkpoint whose product weights are "
                  "all bf16, f32 otherwise), f32, bf16 (half the memory: twice the tokens fit; "
                  "keys and values are rounded to bf16 as they are stored, attention still "
                  "computes in f32) or fp8 (e4m3 with one f32 scale per token and kv head: "
                  "about a quarter of f32's memory; lossy, attention dequantizes to f32)")
      ->capture_default_str();
  cmd->add_flag("--no-weight-scan", args.no_weight_scan,
                "Skip the load-time check that every weight is finite (no NaN or inf); it reads "
                "the weights once, as they are uploaded");
  cmd->add_flag("--cuda-profile", args.cuda_profile,
                "Time every CUDA op (waiting for the device before and after each; no CUDA "
                "graphs) and print the table per op to stderr at exit. For finding where a "
                "step's time goes, not for throughput");
}

LoadedModels load_models(const ModelArgs& args, bool with_draft, bool with_tokenizer, bool quiet) {
  set_threads(args.threads);
  if (args.ctx_size <= 0)
    fail("--ctx-size: {} is not a context size (expected tokens > 0)", args.ctx_size);
  LoadedModels m;
  const bool is_default = args.model.empty();
  m.model_dir = is_default ? models_root() + "/" + kDefaultTarget : args.model;
  if (is_default && !std::filesystem::exists(m.model_dir)) {
    fail(
        "no --model given and the embedded default model is missing at {} (set SPECULA_MODELS_DIR "
        "or pass --model)",
        m.model_dir);
  }
  const bool tty = isatty(STDERR_FILENO);
  auto t0 = std::chrono::steady_clock::now();
  if (!quiet) fmt::print(stderr, "loading {} ...{}", m.model_dir, tty ? "" : "\n");
  gemma4::LoadOptions options;
  options.max_context = args.ctx_size;
  options.device = parse_device(args.device);
  options.scan_weights = !args.no_weight_scan;
  options.kv_dtype = parse_kv_dtype(args.kv_dtype);
  open_backend(args, options.device);  // an unsupported device fails here, before loading
  m.target = gemma4::Gemma4Model::load(m.model_dir, options);
  const auto& c = m.target->config();
  if (!quiet) {
    fmt::print(stderr, "{}target: {} layers, hidden {}, vocab {} ({:.2f} s)\n", tty ? "\r" : "",
               c.num_hidden_layers, c.hidden_size, c.vocab_size, seconds_since(t0));
    print_kv_capacity(*m.target);
  }
  if (with_draft && !args.no_draft) {
    m.draft_dir = args.draft;
    if (m.draft_dir.empty() && is_default) m.draft_dir = models_root() + "/" + kDefaultDrafter;
    if (!m.draft_dir.empty()) load_drafter(m, m.draft_dir, args, quiet);
  }
  if (with_tokenizer) {
    const std::string tokenizer_path = args.tokenizer.empty() ? m.model_dir : args.tokenizer;
    m.tokenizer.emplace(Tokenizer::load(tokenizer_path));
    // An id past the embedding would be refused per request at best; refuse the pair here.
    if (m.tokenizer->vocab_size() > c.vocab_size) {
      fail(
          "tokenizer {} has ids up to {} but the model {} has a vocabulary of {} (vocab_size in "
          "config.json): they do not belong together",
          tokenizer_path, m.tokenizer->vocab_size() - 1, m.model_dir, c.vocab_size);
    }
  }
  return m;
}

void load_drafter(LoadedModels& m, const std::string& dir, const ModelArgs& args, bool quiet) {
  const gemma4::Gemma4Config& c = m.target->config();
  m.draft_dir = dir;
  if (dir == "ngram") {
    m.draft_source = std::make_unique<ngram::NgramDrafter>(
        c.vocab_size,
        ngram::NgramOptions{.min_n = args.prompt_lookup_min, .max_n = args.prompt_lookup_max});
    if (!quiet) {
      fmt::print(stderr, "drafter: ngram (prompt lookup, suffixes of {}..{} tokens)\n",
                 args.prompt_lookup_min, args.prompt_lookup_max);
    }
  } else if (dspark::is_dspark_dir(dir)) {
    load_dspark(m, dir, args, quiet);
  } else {
    auto t1 = std::chrono::steady_clock::now();
    m.drafter = assistant::AssistantModel::load(dir, c, m.target->backend(), !args.no_weight_scan);
    m.draft_source = std::make_unique<assistant::AssistantDrafter>(*m.target, *m.drafter);
    if (!quiet) {
      fmt::print(stderr, "drafter: assistant {} ({} layers, hidden {}, {}; {:.2f} s)\n", dir,
                 m.drafter->config().text.num_hidden_layers, m.drafter->config().text.hidden_size,
                 m.drafter->head_description(), seconds_since(t1));
    }
  }
}

void add_sampling_options(CLI::App* cmd, SamplingArgs& args, int default_max_tokens) {
  SamplingParams& p = args.params;
  p.temperature = 0.0f;
  p.max_tokens = default_max_tokens;
  cmd->add_option("--max-tokens,-n", p.max_tokens, "Maximum number of new tokens")
      ->capture_default_str();
  cmd->add_option("--temperature", p.temperature, "Sampling temperature; 0 = greedy")
      ->capture_default_str();
  cmd->add_option("--top-k", p.top_k, "Keep the k most likely tokens (0 = off)")
      ->capture_default_str();
  cmd->add_option("--top-p", p.top_p, "Nucleus sampling mass in (0, 1]")->capture_default_str();
  cmd->add_option("--min-p", p.min_p, "Drop tokens below min-p x the top probability")
      ->capture_default_str();
  cmd->add_option("--repetition-penalty", p.repetition_penalty,
                  "Hugging Face repetition penalty (1 = off)")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", p.presence_penalty, "OpenAI presence penalty")
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", p.frequency_penalty, "OpenAI frequency penalty")
      ->capture_default_str();
  cmd->add_option("--seed", p.seed, "Seed for reproducible sampling")->capture_default_str();
  cmd->add_option("--stop", p.stop, "Stop string (repeatable); not included in the output");
  cmd->add_option("--stop-id", args.stop_ids, "Stop token id (repeatable), in addition to EOS");
  cmd->add_flag("--ignore-eos", args.ignore_eos, "Do not stop at the end-of-sequence token");
}

SamplingParams sampling_params(const SamplingArgs& args, const LoadedModels& models) {
  SamplingParams p = args.params;
  p.stop_token_ids = args.stop_ids;
  if (!args.ignore_eos) {
    const std::vector<int32_t>& eos = models.tokenizer && !models.tokenizer->eos_ids().empty()
                                          ? models.tokenizer->eos_ids()
                                          : models.target->config().eos_token_ids;
    p.stop_token_ids.insert(p.stop_token_ids.end(), eos.begin(), eos.end());
  }
  p.validate();
  return p;
}

void add_draft_options(CLI::App* cmd, speculative::DraftSchedule& schedule) {
  schedule.draft_tokens = 0;  // resolve_schedule() picks the drafter's own length
  cmd->add_option("--draft-tokens,-k", schedule.draft_tokens,
                  "Draft tokens per round (the start value with --adaptive-draft; default: a "
                  "DSpark drafter's block size, else 4)");
  cmd->add_flag(
      "--adaptive-draft", schedule.adaptive,
      "Adapt the draft length per sequence: +2 after a fully accepted round, -1 otherwise");
  cmd->add_option("--max-draft-tokens", schedule.max_draft_tokens,
                  "Upper bound for --adaptive-draft")
      ->capture_default_str();
}

void resolve_schedule(speculative::DraftSchedule& schedule, const Drafter* drafter) {
  if (schedule.draft_tokens < 0)
    fail("--draft-tokens: {} is not a draft length", schedule.draft_tokens);
  if (schedule.draft_tokens != 0) return;
  const int natural = drafter != nullptr ? drafter->max_draft_tokens() : 0;
  schedule.draft_tokens = natural > 0 ? natural : 4;
}

std::string apply_pruning(dspark::DSparkDrafter& drafter, const dspark::DSparkModel& model,
                          const ModelArgs& args) {
  const int G = model.block_size();
  if (args.no_draft_prune) return "pruning off (--no-draft-prune)";
  const double t = args.draft_confidence_threshold;
  if (t >= 0 || std::isnan(t)) {
    if (!(t >= 0 && t <= 1)) fail("--draft-confidence-threshold: {} is outside [0, 1]", t);
    if (!model.has_confidence_head()) {
      fail("--draft-confidence-threshold: the DSpark drafter {} has no confidence head",
           model.description());
    }
    std::vector<float> thr(static_cast<size_t>(G), static_cast<float>(t));
    thr[0] = 0.0f;
    drafter.set_thresholds(std::move(thr));
    return fmt::format("pruning below confidence {:g}", t);
  }
  const std::vector<float>& cal = model.config().thresholds;
  if (cal.empty() || !model.has_confidence_head()) return "no pruning (uncalibrated)";
  drafter.set_thresholds(cal);
  return fmt::format("pruning at calibrated thresholds [{:.2f}]", fmt::join(cal, ", "));
}

void load_dspark(LoadedModels& m, const std::string& dir, const ModelArgs& args, bool quiet) {
  const auto t1 = std::chrono::steady_clock::now();
  m.dspark = dspark::DSparkModel::load(dir, *m.target, m.target->backend(), !args.no_weight_scan);
  auto drafter = std::make_unique<dspark::DSparkDrafter>(*m.target, *m.dspark);
  std::string pruning = apply_pruning(*drafter, *m.dspark, args);
  if (const std::vector<float>& sts = m.dspark->config().sts_temperatures;
      !sts.empty() && m.dspark->has_confidence_head()) {
    // Only the verify scheduler reads them (--spec-scheduler).
    drafter->set_sts_temperatures(sts);
    pruning += "; STS temperatures for the verify scheduler";
  }
  m.draft_source = std::move(drafter);
  if (!quiet) {
    fmt::print(stderr, "drafter: {} from {}; {} ({:.2f} s)\n", m.dspark->description(), dir,
               pruning, seconds_since(t1));
  }
}

void set_threads(int threads) {
  // More threads than this only oversubscribes the cores.
  const int max_threads = 4 * cpu_cores();
  if (threads < 0 || threads > max_threads) {
    fail("--threads: {} is out of range (0 = all cores, at most {}: 4 x the {} cores)", threads,
         max_threads, cpu_cores());
  }
  set_cpu_threads(threads);
}

ChatOptions chat_options(const LoadedModels& m, bool quiet) {
  SPECULA_CHECK(m.tokenizer.has_value(), "the chat format needs a tokenizer");
  ChatOptions options;
  options.family =
      m.target->config().has_ple() ? ChatTemplateFamily::kEdge : ChatTemplateFamily::kLarge;
  const ChatTemplateCheck check = check_checkpoint_chat_template(m.model_dir);
  if (check.status == ChatTemplateCheck::Status::kCurrent ||
      check.status == ChatTemplateCheck::Status::kOlderOfficial) {
    options.family = check.family;
  }
  if (!quiet && check.status != ChatTemplateCheck::Status::kCurrent)
    fmt::print(stderr, "note: {}\n", check.message);
  if (auto bos = m.tokenizer->bos_id())
    options.bos_token = m.tokenizer->id_to_token(*bos).value_or("<bos>");
  return options;
}

std::string summary_line(const speculative::DecodeStats& s, bool speculative) {
  std::string line = fmt::format(
      "prompt {} tokens, prefill {:.1f} tok/s | generated {} tokens, decode {:.1f} tok/s",
      s.prompt_tokens, s.prefill_tokens_per_second(), s.generated_tokens,
      s.decode_tokens_per_second());
  if (speculative) {
    line += fmt::format(" | drafted {}, accepted {} ({:.1f}%), tau {:.2f}", s.drafted, s.accepted,
                        100.0 * s.acceptance_rate(), s.mean_accepted_length());
    if (s.pruned > 0) line += fmt::format(", pruned {}", s.pruned);
    if (s.scheduled_cut > 0) line += fmt::format(", scheduler cut {}", s.scheduled_cut);
  }
  return line;
}

nlohmann::json stats_json(const speculative::DecodeStats& s, bool speculative) {
  nlohmann::json j = {{"prompt_tokens", s.prompt_tokens},
                      {"generated_tokens", s.generated_tokens},
                      {"target_forwards", s.target_forwards},
                      {"prefill_seconds", s.prefill_seconds},
                      {"decode_seconds", s.decode_seconds},
                      {"prefill_tokens_per_second", s.prefill_tokens_per_second()},
                      {"decode_tokens_per_second", s.decode_tokens_per_second()},
                      {"speculative", speculative}};
  if (speculative) {
    j["rounds"] = s.rounds;
    j["drafted"] = s.drafted;
    j["accepted"] = s.accepted;
    j["pruned"] = s.pruned;
    j["scheduled_cut"] = s.scheduled_cut;
    j["acceptance_rate"] = s.acceptance_rate();
    j["mean_accepted_length"] = s.mean_accepted_length();
    nlohmann::json by_pos = nlohmann::json::array();
    for (size_t i = 0; i < s.drafted_at.size(); ++i) {
      by_pos.push_back(s.drafted_at[i] ? static_cast<double>(s.accepted_at[i]) / s.drafted_at[i]
                                       : 0.0);
    }
    j["acceptance_by_position"] = by_pos;
  }
  return j;
}

}  // namespace specula::cli
