// SPDX-License-Identifier: Apache-2.0
// Presets: the text-decoder shapes of the released Gemma 4 models
// (gemma4-architecture.md §8) and of their assistant drafters (§10.1), as the
// config.json a checkpoint of that shape would carry. Benchmarks build
// random-weight models from them (`specula bench --random-weights 31b`), so the
// released shapes can be measured without downloading a checkpoint.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "engine/model/gemma4/config.h"

namespace specula::gemma4 {

// The preset names, in size order: "e2b", "e4b", "31b", "26b-a4b".
std::vector<std::string> gemma4_preset_names();

// The target's config.json (model_type gemma4_text, flat form: global_head_dim,
// num_global_key_value_heads) of preset `name`. An unknown name throws an Error
// listing the valid ones.
nlohmann::json gemma4_preset_json(std::string_view name);

// gemma4_preset_json(name) parsed by parse_gemma4_config (origin "preset:<name>").
Gemma4Config gemma4_preset(std::string_view name);

// The config.json (model_type gemma4_assistant) of the assistant drafter
// released for preset `name` (§10.1): 4 layers [S,S,S,F] whose attention
// geometry mirrors the target's donor layers, centroid head (2048 centroids,
// top-32) for e2b/e4b, tied dense head for 31b/26b-a4b. For tools that build
// the same drafter elsewhere (tools/gpu/torch_bench.py).
nlohmann::json gemma4_assistant_preset_json(std::string_view name);

}  // namespace specula::gemma4
