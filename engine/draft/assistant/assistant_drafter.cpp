// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/assistant/assistant_drafter.h"

#include <cstring>

namespace specula::assistant {
namespace {

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

}  // namespace

AssistantDraftSource::AssistantDraftSource(gemma4::Gemma4Model& target, AssistantDrafter& drafter)
    : target_(target),
      drafter_(drafter),
      backend_(target.backend()),
      donors_(target.backend(), target.config()) {
  if (&drafter.backend() != &target.backend()) {
    fail("assistant drafter on {} cannot draft for a target on {}: both must use one backend",
         drafter.backend().device().str(), target.backend().device().str());
  }
}

Tensor AssistantDraftSource::step(int step_index, std::span<const DraftRow> rows) {
  return draft_step(step_index, rows, nullptr);
}

Tensor AssistantDraftSource::step_on_device(int step_index, std::span<const DraftRow> rows,
                                            const DraftDeviceInputs& inputs) {
  const int64_t B = static_cast<int64_t>(rows.size());
  const int64_t Hb = drafter_.config().backbone_hidden_size;
  const Device dev = backend_.device();
  if (inputs.tokens.dtype() != DType::kI32 || inputs.tokens.shape() != Shape{B} ||
      inputs.tokens.device() != dev) {
    fail("draft step {}: device tokens {} must be i32 [{}] on {}", step_index,
         inputs.tokens.describe(), B, dev.str());
  }
  if (step_index == 0 && (inputs.hidden.dtype() != DType::kF32 ||
                          inputs.hidden.shape() != Shape{B, Hb} || inputs.hidden.device() != dev)) {
    fail("draft step 0: device hiddens {} must be f32 [{}, {}] on {}", inputs.hidden.describe(), B,
         Hb, dev.str());
  }
  return draft_step(step_index, rows, &inputs);
}

Tensor AssistantDraftSource::draft_step(int step_index, std::span<const DraftRow> rows,
                                        const DraftDeviceInputs* device) {
  Backend& be = backend_;
  const int64_t B = static_cast<int64_t>(rows.size());
  const int64_t Hb = drafter_.config().backbone_hidden_size;
  SPECULA_CHECK(B > 0, "draft step {} has no rows", step_index);
  const size_t ids_bytes = aligned(static_cast<size_t>(3 * B) * sizeof(int32_t));
  const size_t rows_bytes = aligned(static_cast<size_t>(B * Hb) * sizeof(float));
  if (B > input_rows_) {
    inputs_ = DeviceBuffer(be, ids_bytes + 2 * rows_bytes);
    input_rows_ = B;
  }
  char* base = static_cast<char*>(inputs_.data());
  // Rows: token ids, positions, and each row's newest target key (the donor
  // attention's query position).
  const Tensor ids_positions(base, DType::kI32, {3, B}, be.device());
  const Tensor embeds(base + ids_bytes, DType::kF32, {B, Hb}, be.device());
  const Tensor gathered(base + ids_bytes + rows_bytes, DType::kF32, {B, Hb}, be.device());

  // Ids and positions: staged on the host, one upload.
  host_ids_.resize(static_cast<size_t>(3 * B));
  kvs_.clear();
  for (int64_t b = 0; b < B; ++b) {
    const DraftRow& r = rows[static_cast<size_t>(b)];
    SPECULA_CHECK(r.target_kv != nullptr && r.target_kv->length() > 0,
                  "draft step {}: request {} needs a prefilled target cache", step_index,
                  r.request);
    host_ids_[static_cast<size_t>(b)] = device ? 0 : r.token;
    host_ids_[static_cast<size_t>(B + b)] = r.position;
    host_ids_[static_cast<size_t>(2 * B + b)] = static_cast<int32_t>(r.target_kv->length() - 1);
    kvs_.push_back(r.target_kv);
  }
  // Queued without a wait: the host goes on to queue the step behind it.
  be.upload_async(host_ids_.data(), ids_positions);
  if (device) be.copy(device->tokens, ids_positions.row(0));

  Tensor hidden;
  if (step_index == 0) {
    // A new round: the chain restarts from the target's hiddens (host pointers
    // or, with device inputs, a device tensor).
    if (chain_.size() < static_cast<size_t>(B * Hb) * sizeof(float)) {
      chain_ = DeviceBuffer(be, static_cast<size_t>(B * Hb) * sizeof(float));
    }
    if (!device) host_hidden_.resize(static_cast<size_t>(B * Hb));
    chain_requests_.clear();
    for (int64_t b = 0; b < B; ++b) {
      const DraftRow& r = rows[static_cast<size_t>(b)];
      if (!device) {
        SPECULA_CHECK(r.target_hidden != nullptr,
                      "draft step 0 of request {} needs the target hidden", r.request);
        std::memcpy(host_hidden_.data() + b * Hb, r.target_hidden,
                    static_cast<size_t>(Hb) * sizeof(float));
      }
      chain_requests_.push_back(r.request);
    }
    slots_.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) slots_[static_cast<size_t>(b)] = b;
    hidden = chain_.view(DType::kF32, {B, Hb});
    if (device) {
      // Copied into the chain rather than read in place: the recorded steps
      // then always see the same buffers (the caller's may move between calls).
      be.copy(device->hidden, hidden);
    } else {
      be.upload_async(host_hidden_.data(), hidden);
    }
  } else {
    // Find each row's chain row (rows keep step 0's order, so the search walks forward).
    slots_.resize(static_cast<size_t>(B));
    size_t next = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int request = rows[static_cast<size_t>(b)].request;
      while (next < chain_requests_.size() && chain_requests_[next] != request) ++next;
      if (next == chain_requests_.size()) {
        fail(
            "draft step {}: request {} was not a row of step 0 of this round (rows must be a "
            "subset of step 0's, in the same order)",
            step_index, request);
      }
      slots_[static_cast<size_t>(b)] = static_cast<int64_t>(next++);
    }
    const Tensor chain =
        chain_.view(DType::kF32, {static_cast<int64_t>(chain_requests_.size()), Hb});
    if (slots_.back() == B - 1) {
      // Rows are the chain's first B rows: read them in place.
      hidden = chain.slice_rows(0, B);
    } else {
      // Gather runs of consecutive chain rows.
      for (int64_t b = 0; b < B;) {
        int64_t e = b + 1;
        while (e < B && slots_[static_cast<size_t>(e)] == slots_[static_cast<size_t>(e - 1)] + 1)
          ++e;
        const int64_t s = slots_[static_cast<size_t>(b)];
        be.copy(chain.slice_rows(s, s + (e - b)), gathered.slice_rows(b, e));
        b = e;
      }
      hidden = gathered;
    }
  }

  // The device work from here on depends on the host only through pointers
  // and shapes: it is recorded the second time its shape is seen and replayed
  // after (like the target's steps).
  const bool graph_ok = be.supports_graphs() && target_.graphs_enabled();
  if (!graph_ok) return run_step(ids_positions, embeds, hidden, B);
  std::vector<int64_t>& key = graph_key_;
  key.clear();
  key.push_back(B);
  key.push_back(step_index == 0);
  key.push_back(reinterpret_cast<intptr_t>(inputs_.data()));
  key.push_back(reinterpret_cast<intptr_t>(chain_.data()));
  key.push_back(static_cast<int64_t>(chain_requests_.size()));
  key.push_back(reinterpret_cast<intptr_t>(drafter_.arena_base()));
  key.push_back(reinterpret_cast<intptr_t>(hidden.data()));
  for (int64_t b = 0; b < B; ++b) {
    const SequenceKv& kv = *kvs_[static_cast<size_t>(b)];
    key.push_back(slots_[static_cast<size_t>(b)]);
    key.push_back(positions_bound_for(kv.length()));  // as TargetCacheDonors::attend
    for (int donor : {target_.config().sliding_donor, target_.config().full_donor}) {
      if (donor < 0) continue;
      key.push_back(reinterpret_cast<intptr_t>(kv.is_ring(donor) ? kv.ring_storage_k(donor).data()
                                                                 : kv.full_keys(donor, 0).data()));
    }
  }
  return graphs_.run(be, key, [&] { return run_step(ids_positions, embeds, hidden, B); });
}

Tensor AssistantDraftSource::run_step(const Tensor& ids_positions, const Tensor& embeds,
                                      const Tensor& hidden, int64_t B) {
  Backend& be = backend_;
  const int64_t Hb = drafter_.config().backbone_hidden_size;
  target_.embed_scaled(ids_positions.row(0), embeds);
  donors_.bind(kvs_, ids_positions.row(2));
  DraftStepOutputs out = drafter_.step(
      {.token_embeds = embeds, .hidden = hidden, .positions = ids_positions.row(1)}, donors_);

  // Chain each row's next hidden back into its chain row, run by run.
  const Tensor chain = chain_.view(DType::kF32, {static_cast<int64_t>(chain_requests_.size()), Hb});
  for (int64_t b = 0; b < B;) {
    int64_t e = b + 1;
    while (e < B && slots_[static_cast<size_t>(e)] == slots_[static_cast<size_t>(e - 1)] + 1) ++e;
    const int64_t s = slots_[static_cast<size_t>(b)];
    be.copy(out.next_hidden.slice_rows(b, e), chain.slice_rows(s, s + (e - b)));
    b = e;
  }
  return out.logits;
}

}  // namespace specula::assistant
