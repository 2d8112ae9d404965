// SPDX-License-Identifier: Apache-2.0
// Fuzz target: the safetensors header parser. The whole input is the header
// JSON, checked against a data region of kDataSize bytes; every accepted header
// must describe in-bounds, correctly sized, non-overlapping tensors.
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/error.h"
#include "engine/io/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

namespace {
constexpr uint64_t kDataSize = 4096;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  const std::string_view header(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string> metadata;
  std::vector<specula::io::TensorInfo> tensors;
  fz::last_accepted = false;
  try {
    tensors =
        specula::io::parse_safetensors_header(header, kDataSize, "fuzz.safetensors", &metadata);
  } catch (const specula::Error& e) {
    fz::last_outcome = fz::error_outcome(e.what());
    return 0;
  }
  fz::last_accepted = true;
  uint64_t outcome = fz::mix(1, metadata.size());
  uint64_t prev_end = 0;
  for (const auto& t : tensors) {
    SPECULA_FUZZ_ASSERT(t.data_begin <= t.data_end && t.data_end <= kDataSize);
    SPECULA_FUZZ_ASSERT(t.data_end - t.data_begin ==
                        static_cast<uint64_t>(t.shape.numel()) * specula::dtype_size(t.dtype));
    if (t.data_begin != t.data_end) {
      SPECULA_FUZZ_ASSERT(t.data_begin >= prev_end);
      prev_end = t.data_end;
    }
    outcome = fz::mix(outcome,
                      static_cast<uint64_t>(t.dtype) * 8 + static_cast<uint64_t>(t.shape.rank()));
  }
  fz::last_outcome = outcome;
  return 0;
}
