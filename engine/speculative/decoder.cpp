// SPDX-License-Identifier: Apache-2.0
#include "engine/speculative/decoder.h"

#include <algorithm>

#include "engine/speculative/engine.h"

namespace specula::speculative {

void DecodeStats::merge(const DecodeStats& o) {
  prompt_tokens += o.prompt_tokens;
  generated_tokens += o.generated_tokens;
  target_forwards += o.target_forwards;
  rounds += o.rounds;
  drafted += o.drafted;
  accepted += o.accepted;
  pruned += o.pruned;
  scheduled_cut += o.scheduled_cut;
  scheduled_rounds += o.scheduled_rounds;
  if (drafted_at.size() < o.drafted_at.size()) drafted_at.resize(o.drafted_at.size());
  if (accepted_at.size() < o.accepted_at.size()) accepted_at.resize(o.accepted_at.size());
  for (size_t i = 0; i < o.drafted_at.size(); ++i) drafted_at[i] += o.drafted_at[i];
  for (size_t i = 0; i < o.accepted_at.size(); ++i) accepted_at[i] += o.accepted_at[i];
  prefill_seconds = std::max(prefill_seconds, o.prefill_seconds);
  decode_seconds = std::max(decode_seconds, o.decode_seconds);
}

std::vector<DecodeResult> decode(gemma4::Gemma4Model& target, Drafter* drafter,
                                 std::span<const DecodeRequest> requests,
                                 const DraftSchedule& schedule, const TokenCallback& on_tokens,
                                 const RoundModes& modes) {
  if (requests.empty()) fail("decode: no requests");
  const EngineOptions options{.schedule = schedule,
                              .max_rows = static_cast<int>(requests.size()),
                              .max_batch_tokens = 0,
                              .kv_memory = 0,
                              .max_waiting = static_cast<int>(requests.size()),
                              .modes = modes};
  Engine engine(target, drafter, options);
  return decode(engine, requests, on_tokens);
}

std::vector<DecodeResult> decode(Engine& engine, std::span<const DecodeRequest> requests,
                                 const TokenCallback& on_tokens) {
  if (requests.empty()) fail("decode: no requests");
  SPECULA_CHECK(!engine.has_work(), "decode() needs an engine without other requests");
  // Ids are handed out in increasing order: the request behind an id is found
  // by binary search.
  std::vector<int64_t> ids;
  ids.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    Submission sub = engine.submit(requests[i]);
    if (!sub.accepted()) {
      for (int64_t id : ids) engine.cancel(id);
      while (engine.has_work()) engine.step();
      fail("request {}: {}", i, sub.error);
    }
    ids.push_back(sub.id);
  }
  std::vector<DecodeResult> results(requests.size());
  while (engine.has_work()) {
    for (const RequestUpdate& u : engine.step()) {
      const auto i =
          static_cast<size_t>(std::lower_bound(ids.begin(), ids.end(), u.id) - ids.begin());
      SPECULA_CHECK(i < ids.size() && ids[i] == u.id, "an update for unknown request id {}", u.id);
      DecodeResult& r = results[i];
      r.tokens.insert(r.tokens.end(), u.tokens.begin(), u.tokens.end());
      r.token_logprobs.insert(r.token_logprobs.end(), u.token_logprobs.begin(),
                              u.token_logprobs.end());
      r.top_ids.insert(r.top_ids.end(), u.top_ids.begin(), u.top_ids.end());
      r.top_values.insert(r.top_values.end(), u.top_values.begin(), u.top_values.end());
      r.top_logprobs = requests[i].logprobs > 0 ? requests[i].logprobs : 0;
      if (u.finished) {
        r.finish_reason = u.finish_reason;
        r.stats = *u.stats;
      }
      // A callback that says stop cancels the request, even on its last tokens.
      if (on_tokens && !u.tokens.empty() && !on_tokens(static_cast<int>(i), u.tokens)) {
        if (u.finished) {
          r.finish_reason = "cancelled";
        } else {
          engine.cancel(u.id);
        }
      }
    }
  }
  return results;
}

}  // namespace specula::speculative
