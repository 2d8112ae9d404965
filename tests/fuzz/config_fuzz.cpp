// SPDX-License-Identifier: Apache-2.0
// Fuzz target: JSON text -> Gemma 4 config. Every accepted config must be
// internally consistent (the invariants the forward pass relies on).
#include <nlohmann/json.hpp>
#include <string>

#include "engine/core/error.h"
#include "engine/io/json_util.h"
#include "engine/model/gemma4/config.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  using specula::gemma4::LayerSpec;
  using specula::gemma4::LayerType;
  specula::gemma4::Gemma4Config c;
  fz::last_accepted = false;
  try {
    const nlohmann::json root = specula::io::parse_json_text(
        std::string(reinterpret_cast<const char*>(data), size), "fuzz.json");
    c = specula::gemma4::parse_gemma4_config(root, "fuzz.json");
  } catch (const specula::Error& e) {
    fz::last_outcome = fz::error_outcome(e.what());
    return 0;
  }
  fz::last_accepted = true;
  const int n = c.num_hidden_layers;
  SPECULA_FUZZ_ASSERT(n > 0 && c.layers.size() == static_cast<size_t>(n));
  SPECULA_FUZZ_ASSERT(c.layer_types.size() == static_cast<size_t>(n));
  SPECULA_FUZZ_ASSERT(c.layers.back().type == LayerType::kFull);
  SPECULA_FUZZ_ASSERT(c.first_shared_layer == n - c.num_kv_shared_layers);
  SPECULA_FUZZ_ASSERT(c.sliding_donor < c.first_shared_layer &&
                      c.full_donor < c.first_shared_layer);
  uint64_t outcome = fz::mix(2, c.source_kind.size());
  for (int i = 0; i < n; ++i) {
    const LayerSpec& s = c.layers[static_cast<size_t>(i)];
    SPECULA_FUZZ_ASSERT(s.head_dim > 0 && s.head_dim % 2 == 0);
    SPECULA_FUZZ_ASSERT(s.n_kv_heads > 0 && c.num_attention_heads % s.n_kv_heads == 0);
    SPECULA_FUZZ_ASSERT(s.intermediate_size > 0);
    if (s.kv_shared) {
      SPECULA_FUZZ_ASSERT(s.kv_donor < c.first_shared_layer);
      if (s.kv_donor >= 0) {
        SPECULA_FUZZ_ASSERT(c.layers[static_cast<size_t>(s.kv_donor)].type == s.type);
        SPECULA_FUZZ_ASSERT(c.layers[static_cast<size_t>(s.kv_donor)].is_donor);
      } else {
        SPECULA_FUZZ_ASSERT(c.first_shared_layer == 0);
      }
    } else {
      SPECULA_FUZZ_ASSERT(s.kv_donor == i);
    }
    outcome = fz::mix(outcome, static_cast<uint64_t>(s.type) * 16 + s.kv_shared * 8 + s.k_eq_v * 4 +
                                   s.is_donor * 2 + (s.intermediate_size != c.intermediate_size));
  }
  for (int id : c.eos_token_ids) SPECULA_FUZZ_ASSERT(id >= 0 && id < c.vocab_size);
  if (c.enable_moe_block) {
    SPECULA_FUZZ_ASSERT(c.top_k_experts > 0 && c.top_k_experts <= c.num_experts);
  }
  outcome = fz::mix(
      outcome, c.enable_moe_block * 4 + c.has_ple() * 2 + c.final_logit_softcapping.has_value());
  fz::last_outcome = outcome;
  return 0;
}
