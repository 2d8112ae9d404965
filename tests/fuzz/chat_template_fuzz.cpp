// SPDX-License-Identifier: Apache-2.0
// Fuzz target: a checkpoint's chat template. The input is taken both as
// template text for check_chat_template (a verdict with a well-formed digest
// for any bytes; normalisation is idempotent) and as tokenizer_config.json
// text for chat_template_from_tokenizer_config (a template or an Error).
#include <string>

#include "engine/chat/chat_template_check.h"
#include "engine/core/error.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = specula::fuzz;
  using Status = specula::ChatTemplateCheck::Status;
  const std::string text(reinterpret_cast<const char*>(data), size);

  const specula::ChatTemplateCheck check = specula::check_chat_template(text);
  SPECULA_FUZZ_ASSERT(check.sha256.size() == 64);
  SPECULA_FUZZ_ASSERT(check.sha256.find_first_not_of("0123456789abcdef") == std::string::npos);
  SPECULA_FUZZ_ASSERT(check.status != Status::kMissing && !check.message.empty());
  SPECULA_FUZZ_ASSERT((check.match != nullptr) == (check.status != Status::kUnknown));
  if (check.match != nullptr) SPECULA_FUZZ_ASSERT(check.match->sha256 == check.sha256);
  const std::string normal = specula::normalize_chat_template(text);
  SPECULA_FUZZ_ASSERT(specula::normalize_chat_template(normal) == normal);
  SPECULA_FUZZ_ASSERT(normal.size() <= text.size());
  SPECULA_FUZZ_ASSERT(normal.find('\r') == std::string::npos);
  uint64_t outcome = fz::mix(6, static_cast<uint64_t>(check.status));

  fz::last_accepted = false;
  try {
    const auto from_config =
        specula::chat_template_from_tokenizer_config(text, "fuzz/tokenizer_config.json");
    fz::last_accepted = true;
    outcome = fz::mix(outcome, from_config.has_value() ? 1 + from_config->empty() : 0);
    if (from_config) (void)specula::check_chat_template(*from_config);
  } catch (const specula::Error& e) {
    outcome = fz::mix(outcome, fz::error_outcome(e.what()));
  }
  fz::last_outcome = outcome;
  return 0;
}
