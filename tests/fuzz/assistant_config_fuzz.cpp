// SPDX-License-Identifier: Apache-2.0
// Fuzz target: JSON text -> assistant (MTP) drafter config. Every accepted
// config must satisfy the drafter's architecture rules (no PLE, MoE or
// double-wide MLP; every layer KV-shared) and be a consistent Gemma 4 stack;
// checking it against a target and the centroid head must only ever fail
// with an Error.
#include <nlohmann/json.hpp>
#include <string>

#include "engine/core/error.h"
#include "engine/draft/assistant/assistant_config.h"
#include "engine/io/json_util.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  namespace as = specula::assistant;
  as::AssistantConfig c;
  fz::last_accepted = false;
  try {
    c = as::parse_assistant_config(
        specula::io::parse_json_text(std::string(reinterpret_cast<const char*>(data), size),
                                     "fuzz/config.json"),
        "fuzz/config.json");
  } catch (const specula::Error& e) {
    fz::last_outcome = fz::error_outcome(e.what());
    return 0;
  }
  fz::last_accepted = true;
  const specula::gemma4::Gemma4Config& t = c.text;
  const int n = t.num_hidden_layers;
  SPECULA_FUZZ_ASSERT(n > 0 && t.layers.size() == static_cast<size_t>(n));
  SPECULA_FUZZ_ASSERT(t.num_kv_shared_layers == n && t.first_shared_layer == 0);
  SPECULA_FUZZ_ASSERT(!t.enable_moe_block && !t.use_double_wide_mlp);
  SPECULA_FUZZ_ASSERT(t.hidden_size_per_layer_input == 0);
  SPECULA_FUZZ_ASSERT(c.backbone_hidden_size > 0);
  uint64_t outcome = fz::mix(4, c.use_ordered_embeddings);
  for (const auto& s : t.layers) {
    SPECULA_FUZZ_ASSERT(s.kv_shared && s.head_dim > 0 && s.n_kv_heads > 0);
    outcome = fz::mix(outcome, static_cast<uint64_t>(s.type));
  }
  // The checks load() runs next: against a target shaped like the drafter
  // itself (every layer its own donor), and the centroid head's.
  specula::gemma4::Gemma4Config target = t;
  target.hidden_size = c.backbone_hidden_size;
  target.num_kv_shared_layers = 0;
  try {
    target.finalize("fuzz target");
    as::check_against_target(c, target, "fuzz/config.json");
    outcome = fz::mix(outcome, 1);
  } catch (const specula::Error& e) {
    outcome = fz::mix(outcome, fz::error_outcome(e.what()));
  }
  try {
    as::check_centroids(c, "fuzz/config.json");
    SPECULA_FUZZ_ASSERT(t.vocab_size % c.num_centroids == 0);
    SPECULA_FUZZ_ASSERT(c.centroid_intermediate_top_k >= 1 &&
                        c.centroid_intermediate_top_k <= c.num_centroids);
    outcome = fz::mix(outcome, 2);
  } catch (const specula::Error& e) {
    outcome = fz::mix(outcome, fz::error_outcome(e.what()));
  }
  fz::last_outcome = outcome;
  return 0;
}
