// SPDX-License-Identifier: Apache-2.0
// Fuzz target: an HTTP request body -> parse_request, for both endpoints. It
// must never throw (the function's contract), and whatever it accepts must
// satisfy the checks it promises (ranges, limits, a prompt to run).
#include <string_view>
#include <variant>

#include "server/api/openai_request.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

namespace fz = specula::fuzz;
using specula::api::ApiError;
using specula::api::CompletionRequest;
using specula::api::Endpoint;

// Checks one result and folds its outcome into `outcome`; returns whether it was accepted.
bool check(const std::variant<CompletionRequest, ApiError>& result, Endpoint endpoint,
           const specula::api::RequestLimits& limits, uint64_t& outcome) {
  if (const auto* e = std::get_if<ApiError>(&result)) {
    SPECULA_FUZZ_ASSERT(e->status == 400 || e->status == 413);
    SPECULA_FUZZ_ASSERT(!e->message.empty());
    // error_body is what the server sends: it must not throw either.
    SPECULA_FUZZ_ASSERT(!specula::api::error_body(*e).empty());
    outcome = fz::mix(outcome, fz::error_outcome(e->message));
    // The field, without its indices: messages[3] and messages[4] fail alike.
    for (char c : e->param) {
      if (c < '0' || c > '9') outcome = fz::mix(outcome, static_cast<uint8_t>(c));
    }
    return false;
  }
  const CompletionRequest& r = std::get<CompletionRequest>(result);
  SPECULA_FUZZ_ASSERT(r.endpoint == endpoint);
  if (endpoint == Endpoint::kChat) {
    SPECULA_FUZZ_ASSERT(!r.messages.empty());
  } else if (r.prompt_is_ids) {
    SPECULA_FUZZ_ASSERT(!r.prompt_ids.empty());
    for (int32_t id : r.prompt_ids) SPECULA_FUZZ_ASSERT(id >= 0);
  } else {
    SPECULA_FUZZ_ASSERT(!r.prompt.empty());
  }
  SPECULA_FUZZ_ASSERT(r.n >= 1 && r.n <= limits.max_n);
  SPECULA_FUZZ_ASSERT(r.logprobs >= -1 && r.logprobs <= limits.max_logprobs);
  SPECULA_FUZZ_ASSERT(r.params.stop.size() <= static_cast<size_t>(limits.max_stop));
  SPECULA_FUZZ_ASSERT(r.params.max_tokens == 0 || r.params.max_tokens >= 1);
  SPECULA_FUZZ_ASSERT(r.params.temperature >= 0 && r.params.temperature <= 2);
  SPECULA_FUZZ_ASSERT(r.draft_tokens == -1 || r.draft_tokens >= 1);
  SPECULA_FUZZ_ASSERT(!r.include_usage || r.stream);
  outcome = fz::mix(outcome, r.messages.size() * 64 + r.prompt_is_ids * 32 + r.stream * 16 +
                                 r.has_seed * 8 + (r.logprobs >= 0) * 4 + r.speculative * 2 +
                                 r.params.stop.empty());
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  specula::api::RequestLimits limits;
  limits.max_tokens = 4096;
  uint64_t outcome = 0xcbf29ce484222325ull;
  bool accepted = false;
  // parse_request's contract is "never throws": an escaping exception is a
  // finding for the driver, so nothing here catches.
  for (Endpoint endpoint : {Endpoint::kChat, Endpoint::kCompletions}) {
    accepted |=
        check(specula::api::parse_request(body, endpoint, limits), endpoint, limits, outcome);
  }
  fz::last_accepted = accepted;
  fz::last_outcome = outcome;
  return 0;
}
