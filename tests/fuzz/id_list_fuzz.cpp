// SPDX-License-Identifier: Apache-2.0
// Fuzz target: --prompt-ids / --ids text -> token ids. Every accepted list is
// non-empty and non-negative, and printing it back as "a,b,c" parses to the
// same ids.
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/io/id_list.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<int32_t> ids;
  fz::last_accepted = false;
  try {
    ids = specula::io::parse_id_list(text, "--prompt-ids");
  } catch (const specula::Error& e) {
    fz::last_outcome = fz::error_outcome(e.what());
    return 0;
  }
  fz::last_accepted = true;
  SPECULA_FUZZ_ASSERT(!ids.empty());
  std::string printed;
  for (const int32_t id : ids) {
    SPECULA_FUZZ_ASSERT(id >= 0);
    printed += (printed.empty() ? "" : ",") + std::to_string(id);
  }
  SPECULA_FUZZ_ASSERT(specula::io::parse_id_list(printed, "--prompt-ids") == ids);
  fz::last_outcome = fz::mix(5, ids.size() < 4 ? ids.size() : 4);
  return 0;
}
