// SPDX-License-Identifier: Apache-2.0
// Small DSpark drafter configs for the tests (tests/unit, tests/cuda): a few
// layers of a small width over any test target, so that a random drafter
// costs little next to the target's own forward.
#pragma once

#include "engine/draft/dspark/dspark_config.h"
#include "engine/model/gemma4/config.h"

namespace specula::testing {

// specula layout: γ `gamma`, width 32, 2 layers of 4 heads, r 8, the seed's taps.
inline dspark::DSparkConfig small_specula_dspark(const gemma4::Gemma4Config& t, int gamma) {
  dspark::DSparkConfig c = dspark::default_specula_config(t);
  c.block_size = gamma;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.head_dim = 8;
  c.intermediate_size = 64;
  c.markov_rank = 8;
  return c;
}

// DeepSpec layout: the target's attention geometry, 2 layers, r 8.
inline dspark::DSparkConfig small_deepspec_dspark(const gemma4::Gemma4Config& t, int gamma) {
  dspark::DSparkConfig c = dspark::default_deepspec_config(t);
  c.block_size = gamma;
  c.markov_rank = 8;
  c.num_layers = 2;
  c.text.num_hidden_layers = 2;
  c.text.layer_types.assign(2, gemma4::LayerType::kFull);
  c.text.finalize("test");
  return c;
}

inline dspark::DSparkConfig small_dspark(dspark::DSparkLayout layout, const gemma4::Gemma4Config& t,
                                         int gamma) {
  return layout == dspark::DSparkLayout::kSpecula ? small_specula_dspark(t, gamma)
                                                  : small_deepspec_dspark(t, gamma);
}

inline const char* layout_name(dspark::DSparkLayout layout) {
  return layout == dspark::DSparkLayout::kSpecula ? "specula" : "deepspec";
}

}  // namespace specula::testing
