// SPDX-License-Identifier: Apache-2.0
// What several verbs share: model/drafter/tokenizer options and loading,
// sampling options, the draft schedule, and the summary line.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/chat/chat_format.h"
#include "engine/draft/assistant/assistant_drafter.h"
#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/draft/ngram/ngram_drafter.h"
#include "engine/draft/replay/replay_drafter.h"
#include "engine/io/id_list.h"
#include "engine/model/gemma4/gemma4.h"
#include "engine/sampling/sampling_params.h"
#include "engine/speculative/decoder.h"
#include "engine/tokenizer/tokenizer.h"

namespace specula::cli {

struct ModelArgs {
  std::string model;  // empty: the embedded default
  // Drafter checkpoint directory (an assistant, or a DSpark drafter in either
  // layout: the kind is read from the folder), or "ngram" (prompt lookup, no
  // model); empty: the default's drafter when the model is the default.
  std::string draft;
  // DSpark confidence pruning: a uniform threshold for positions >= 1 (< 0:
  // the checkpoint's calibration, if any); no_draft_prune turns it off.
  double draft_confidence_threshold = -1;
  bool no_draft_prune = false;
  int prompt_lookup_min = 1;  // --draft ngram: shortest suffix matched
  int prompt_lookup_max = 4;  // --draft ngram: longest suffix matched
  bool no_draft = false;
  std::string tokenizer;  // empty: the model directory
  int64_t ctx_size = 4096;
  int threads = 0;
  std::string device = "cpu";     // cpu, cuda or cuda:N
  bool no_weight_scan = false;    // skip the load-time NaN/inf scan of the weights
  bool cuda_profile = false;      // per-op time table on stderr at exit (Backend::set_op_profile)
  std::string kv_dtype = "auto";  // --kv-dtype: auto, f32, bf16 or fp8 (parse_kv_dtype)
};

// "cpu", "cuda" (= cuda:0) or "cuda:N"; an Error names the flag and the text otherwise.
Device parse_device(const std::string& text);
// --kv-dtype: "auto" (nullopt: the checkpoint's rule, gemma4::LoadOptions::kv_dtype),
// "f32", "bf16" or "fp8" (f8e4m3 with per-(token, head) scales); an Error names the
// flag and the text otherwise.
std::optional<DType> parse_kv_dtype(const std::string& text);
// The target's KV cache: its dtype, bytes a token (full layers, which grow
// with the context) and a sequence (sliding rings, fixed), and how many tokens
// fit in the device's free memory now (ignoring the rings).
struct KvCapacity {
  DType dtype = DType::kF32;
  int64_t bytes_per_token = 0;
  int64_t bytes_per_sequence = 0;
  int64_t free_bytes = 0;
  int64_t tokens = 0;
};
KvCapacity kv_capacity(const gemma4::Gemma4Model& target);
// kv_capacity as one stderr line.
void print_kv_capacity(const gemma4::Gemma4Model& target);
// The process-wide backend of `device` with the options of `args` applied
// (--cuda-profile); an unsupported device fails here, before any loading.
Backend& open_backend(const ModelArgs& args, Device device);
// Where the embedded default models live: $SPECULA_MODELS_DIR, else models/ of
// the source tree the binary was built from.
std::string models_root();

// Everything a verb runs on. The drafter is null without speculation.
struct LoadedModels {
  std::unique_ptr<gemma4::Gemma4Model> target;
  std::unique_ptr<assistant::AssistantModel> drafter;
  std::unique_ptr<dspark::DSparkModel> dspark;  // a DSpark drafter (draft_source wraps it)
  std::unique_ptr<Drafter> draft_source;        // the assistant's, the ngram drafter, or a replay
  // bench --draft replay:...: the drafter draft_source wraps, and the replay itself.
  std::unique_ptr<Drafter> inner_draft_source;
  replay::ReplayDrafter* replay = nullptr;
  std::optional<Tokenizer> tokenizer;
  std::string model_dir, draft_dir;
};

void add_model_options(CLI::App* cmd, ModelArgs& args, bool with_draft);
// Loads the target (and drafter and tokenizer when asked), reporting progress
// on stderr unless quiet.
LoadedModels load_models(const ModelArgs& args, bool with_draft, bool with_tokenizer, bool quiet);

// Loads the drafter `dir` names for models.target into `models` (replacing
// draft_source and draft_dir; drafter or dspark set by kind): "ngram", a
// DSpark folder (either layout, pruning per apply_pruning) or an assistant
// checkpoint. A drafter made for another target throws the loader's Error.
void load_drafter(LoadedModels& models, const std::string& dir, const ModelArgs& args, bool quiet);

struct SamplingArgs {
  SamplingParams params;
  std::vector<int32_t> stop_ids;
  bool ignore_eos = false;
};
void add_sampling_options(CLI::App* cmd, SamplingArgs& args, int default_max_tokens);
// The request's params: CLI values plus EOS ids from the tokenizer or the model config.
SamplingParams sampling_params(const SamplingArgs& args, const LoadedModels& models);

// -k defaults to 0 there, meaning "the drafter's own length": resolve_schedule
// turns it into a DSpark drafter's block size (else 4) once the drafter is known.
void add_draft_options(CLI::App* cmd, speculative::DraftSchedule& schedule);
void resolve_schedule(speculative::DraftSchedule& schedule, const Drafter* drafter);
// Loads the DSpark drafter of `dir` for models.target into `models` (DSpark
// model and its Drafter), with pruning set from the checkpoint's calibration
// or `args`; logs what it loaded unless quiet.
void load_dspark(LoadedModels& models, const std::string& dir, const ModelArgs& args, bool quiet);
// Applies --draft-confidence-threshold / --no-draft-prune and the checkpoint's
// calibration to a DSpark drafter; returns a description for the load log.
std::string apply_pruning(dspark::DSparkDrafter& drafter, const dspark::DSparkModel& model,
                          const ModelArgs& args);

// The chat format of the loaded target (needs m.tokenizer): the template
// family of the checkpoint when it ships a recognised Gemma 4 template (else
// by shape: E2B/E4B carry per-layer embeddings), and the tokenizer's BOS text.
// Unless quiet, a note on stderr says when the checkpoint ships another
// template (or none), since specula renders the released one natively.
ChatOptions chat_options(const LoadedModels& m, bool quiet);

// Parses "1,2,3" (spaces allowed) into token ids; an Error names the bad item.
using io::parse_id_list;
// 0: all cores; an Error names --threads outside [0, 4 x the cores].
void set_threads(int threads);

// "prompt 12 tokens, prefill 850.1 tok/s | generated 64 tokens, decode 95.2 tok/s |
//  drafted 80, accepted 52 (65.0%), tau 3.1"
std::string summary_line(const speculative::DecodeStats& stats, bool speculative);
nlohmann::json stats_json(const speculative::DecodeStats& stats, bool speculative);

}  // namespace specula::cli
