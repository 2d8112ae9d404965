// SPDX-License-Identifier: Apache-2.0
// Fuzz target: model.safetensors.index.json text -> shard index. Every accepted
// index must map each tensor to a listed shard, and every shard path, joined
// to the checkpoint folder, must stay inside it (shard-path confinement).
#include <algorithm>
#include <filesystem>
#include <iterator>
#include <set>
#include <string>

#include "engine/core/error.h"
#include "engine/io/json_util.h"
#include "engine/io/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

namespace fs = std::filesystem;

// True if `p`, made lexically normal, is `dir` itself or lies below it.
bool lexically_within(const fs::path& dir, const fs::path& p) {
  const fs::path rel = p.lexically_normal().lexically_relative(dir.lexically_normal());
  return !rel.empty() && *rel.begin() != ".." && !rel.is_absolute();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  static const fs::path kDir = "/ckpt/model";
  const std::string origin = (kDir / "model.safetensors.index.json").string();
  specula::io::ShardIndex index;
  fz::last_accepted = false;
  try {
    index = specula::io::parse_safetensors_index(
        specula::io::parse_json_text(std::string(reinterpret_cast<const char*>(data), size),
                                     origin),
        origin);
  } catch (const specula::Error& e) {
    fz::last_outcome = fz::error_outcome(e.what());
    return 0;
  }
  fz::last_accepted = true;
  SPECULA_FUZZ_ASSERT(!index.weight_map.empty() && !index.shards.empty());
  SPECULA_FUZZ_ASSERT(index.shards.size() <= index.weight_map.size());
  std::set<std::string> shards;
  uint64_t outcome = fz::mix(3, std::min<size_t>(index.shards.size(), 4));
  for (const auto& s : index.shards) {
    SPECULA_FUZZ_ASSERT(shards.insert(s.file).second);  // each shard listed once
    SPECULA_FUZZ_ASSERT(!s.file.empty() && s.file.find('\0') == std::string::npos);
    SPECULA_FUZZ_ASSERT(index.weight_map.count(s.first_tensor) != 0);
    SPECULA_FUZZ_ASSERT(index.weight_map.at(s.first_tensor) == s.file);
    // Confinement: the path the loader opens (folder / shard) stays in the folder.
    const fs::path opened = kDir / s.file;
    SPECULA_FUZZ_ASSERT(lexically_within(kDir, opened));
    SPECULA_FUZZ_ASSERT(!fs::path(s.file).is_absolute());
    const fs::path name(s.file);
    outcome = fz::mix(outcome, std::min<long>(std::distance(name.begin(), name.end()), 4));
  }
  for (const auto& [tensor, shard] : index.weight_map) {
    SPECULA_FUZZ_ASSERT(shards.count(shard) != 0);
  }
  fz::last_outcome = outcome;
  return 0;
}
