// SPDX-License-Identifier: Apache-2.0
#include "engine/draft/assistant/assistant_drafter.h"

#include <cstring>
#include <span>

namespace specula::assistant {
namespace {

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Calls f(b, e, s) for each run of rows [b, e) whose chain rows slots[b..e)
// are consecutive, starting at chain row s: one copy a run, not one a row.
template <typename F>
void for_each_chain_run(std::span<const int64_t> slots, F&& f) {
  const auto B = static_cast<int64_t>(slots.size());
  for (int64_t b = 0; b < B;) {
    int64_t e = b + 1;
    while (e < B && slots[static_cast<size_t>(e)] == slots[static_cast<size_t>(e - 1)] + 1) ++e;
    f(b, e, slots[static_cast<size_t>(b)]);
    b = e;
  }
}

}  // namespace

AssistantDrafter::AssistantDrafter(gemma4::Gemma4Model& target, AssistantModel& drafter)
    : target_(target), drafter_(drafter), backend_(target.backend()) {
  if (&drafter.backend() != &target.backend()) {
    fail("assistant drafter on {} cannot draft for a target on {}: both must use one backend",
         drafter.backend().device().str(), target.backend().device().str());
  }
}

Tensor AssistantDrafter::step(int step_index, std::span<const DraftRow> rows) {
  return draft_step(step_index, rows, nullptr);
}

Tensor AssistantDrafter::step_on_device(int step_index, std::span<const DraftRow> rows,
                                            const DraftDeviceInputs& inputs) {
  check_device_inputs(step_index, rows, inputs);
  return draft_step(step_index, rows, &inputs);
}

void AssistantDrafter::check_device_inputs(int step_index, std::span<const DraftRow> rows,
                                               const DraftDeviceInputs& inputs) const {
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
}

Tensor AssistantDrafter::draft_step(int step_index, std::span<const DraftRow> rows,
                                        const DraftDeviceInputs* device) {
  // Run at once, so every step can take input slot 0 (and share recordings).
  stage(step_index, rows, device, /*slot=*/0);
  // The device work depends on the host only through pointers and shapes: it
  // is recorded the second time its shape is seen and replayed after (like
  // the target's steps).
  if (!backend_.supports_graphs() || !target_.graphs_enabled()) return run_staged_step(step_index);
  graph_key_.clear();
  append_step_key(step_index, graph_key_);
  return graphs_.run(backend_, graph_key_, [&] { return run_staged_step(step_index); });
}

AssistantDrafter::InputViews AssistantDrafter::input_views(int slot, int64_t B) const {
  const int64_t Hb = drafter_.config().backbone_hidden_size;
  const size_t ids_bytes = aligned(static_cast<size_t>(3 * input_rows_) * sizeof(int32_t));
  const size_t rows_bytes = aligned(static_cast<size_t>(input_rows_ * Hb) * sizeof(float));
  char* base = static_cast<char*>(inputs_.data());
  char* shared = base + static_cast<size_t>(input_steps_) * ids_bytes;
  const Device dev = backend_.device();
  return {.ids_positions =
              Tensor(base + static_cast<size_t>(slot) * ids_bytes, DType::kI32, {3, B}, dev),
          .embeds = Tensor(shared, DType::kF32, {B, Hb}, dev),
          .gathered = Tensor(shared + rows_bytes, DType::kF32, {B, Hb}, dev)};
}

void AssistantDrafter::stage(int step_index, std::span<const DraftRow> rows,
                                 const DraftDeviceInputs* device, int slot) {
  Backend& be = backend_;
  const int64_t B = static_cast<int64_t>(rows.size());
  const int64_t Hb = drafter_.config().backbone_hidden_size;
  SPECULA_CHECK(B > 0, "draft step {} has no rows", step_index);
  SPECULA_CHECK(step_index >= 0 && (step_index == 0 || step_index <= staged_steps_),
                "draft step {} staged after {} steps of the round", step_index, staged_steps_);
  staged_steps_ = step_index + 1;
  while (static_cast<int64_t>(plans_.size()) < staged_steps_)
    plans_.emplace_back(be, target_.config());
  StepPlan& plan = plans_[static_cast<size_t>(step_index)];
  plan.B = B;
  plan.slot = slot;
  plan.device_tokens = device ? device->tokens : Tensor();
  plan.device_hidden = device && step_index == 0 ? device->hidden : Tensor();

  // Ids and positions: staged on the host, one upload into this step's slot
  // (each step of a round has its own, so all of them may be staged first).
  plan.host_ids.resize(static_cast<size_t>(3 * B));
  plan.kvs.clear();
  for (int64_t b = 0; b < B; ++b) {
    const DraftRow& r = rows[static_cast<size_t>(b)];
    SPECULA_CHECK(r.target_kv != nullptr && r.target_kv->length() > 0,
                  "draft step {}: sequence {} needs a prefilled target cache", step_index,
                  r.sequence);
    plan.host_ids[static_cast<size_t>(b)] = device ? 0 : r.token;
    plan.host_ids[static_cast<size_t>(B + b)] = r.position;
    plan.host_ids[static_cast<size_t>(2 * B + b)] = static_cast<int32_t>(r.target_kv->length() - 1);
    plan.kvs.push_back(r.target_kv);
  }
  if (B > input_rows_ || slot >= input_steps_) {
    // Grown between rounds (more rows) or at a recorded round's longest step
    // so far: the steps staged ahead of this one (not run yet) move with the
    // buffer.
    input_rows_ = std::max(input_rows_, B);
    input_steps_ = std::max<int64_t>(input_steps_, std::max(slot + 1, 4));
    const size_t ids_bytes = aligned(static_cast<size_t>(3 * input_rows_) * sizeof(int32_t));
    const size_t rows_bytes = aligned(static_cast<size_t>(input_rows_ * Hb) * sizeof(float));
    inputs_ = DeviceBuffer(be, static_cast<size_t>(input_steps_) * ids_bytes + 2 * rows_bytes);
    for (int j = 0; slot > 0 && j < step_index; ++j) {
      StepPlan& earlier = plans_[static_cast<size_t>(j)];
      const Tensor moved = input_views(earlier.slot, earlier.B).ids_positions;
      be.upload_async(earlier.host_ids.data(), moved);
      earlier.donors.bind(earlier.kvs, moved.row(2));
    }
  }
  // Queued without a wait: the host goes on to queue the step behind it.
  be.upload_async(plan.host_ids.data(), input_views(slot, B).ids_positions);

  if (step_index == 0) {
    // A new round: the chain restarts from the target's hiddens (host pointers
    // or, with device inputs, a device tensor copied in by the device half).
    if (chain_.size() < static_cast<size_t>(B * Hb) * sizeof(float)) {
      chain_ = DeviceBuffer(be, static_cast<size_t>(B * Hb) * sizeof(float));
    }
    chain_requests_.clear();
    for (const DraftRow& r : rows) chain_requests_.push_back(r.sequence);
    plan.slots.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) plan.slots[static_cast<size_t>(b)] = b;
    if (!device) {
      host_hidden_.resize(static_cast<size_t>(B * Hb));
      for (int64_t b = 0; b < B; ++b) {
        const DraftRow& r = rows[static_cast<size_t>(b)];
        SPECULA_CHECK(r.target_hidden != nullptr,
                      "draft step 0 of sequence {} needs the target hidden", r.sequence);
        std::memcpy(host_hidden_.data() + b * Hb, r.target_hidden,
                    static_cast<size_t>(Hb) * sizeof(float));
      }
      be.upload_async(host_hidden_.data(), chain_.view(DType::kF32, {B, Hb}));
    }
  } else {
    // Find each row's chain row (rows keep step 0's order, so the search walks forward).
    plan.slots.resize(static_cast<size_t>(B));
    size_t next = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int request = rows[static_cast<size_t>(b)].sequence;
      while (next < chain_requests_.size() && chain_requests_[next] != request) ++next;
      if (next == chain_requests_.size()) {
        fail(
            "draft step {}: request {} was not a row of step 0 of this round (rows must be a "
            "subset of step 0's, in the same order)",
            step_index, request);
      }
      plan.slots[static_cast<size_t>(b)] = static_cast<int64_t>(next++);
    }
  }
  // This step's own donors (steps staged ahead of a round each keep theirs);
  // the newest keys are read from the step's uploaded row 2. A verify window
  // staged before the step runs commits nothing until it finishes, so the
  // lengths attend() reads stay the step's.
  plan.donors.bind(plan.kvs, input_views(slot, B).ids_positions.row(2));
}

void AssistantDrafter::append_step_key(int step_index, std::vector<int64_t>& key) const {
  SPECULA_CHECK(step_index >= 0 && step_index < staged_steps_, "draft step {} is not staged",
                step_index);
  const StepPlan& plan = plans_[static_cast<size_t>(step_index)];
  key.push_back(plan.B);
  key.push_back(step_index == 0);
  key.push_back(plan.slot);
  key.push_back(reinterpret_cast<intptr_t>(inputs_.data()));
  key.push_back(input_rows_);
  key.push_back(input_steps_);
  key.push_back(reinterpret_cast<intptr_t>(chain_.data()));
  key.push_back(static_cast<int64_t>(chain_requests_.size()));
  key.push_back(reinterpret_cast<intptr_t>(drafter_.arena_base()));
  key.push_back(reinterpret_cast<intptr_t>(plan.device_tokens.data()));
  key.push_back(reinterpret_cast<intptr_t>(plan.device_hidden.data()));
  for (int64_t b = 0; b < plan.B; ++b) {
    const SequenceKv& kv = *plan.kvs[static_cast<size_t>(b)];
    key.push_back(plan.slots[static_cast<size_t>(b)]);
    key.push_back(positions_bound_for(kv.length()));  // as TargetCacheDonors::attend
    for (int donor : {target_.config().sliding_donor, target_.config().full_donor}) {
      if (donor < 0) continue;
      // Keys and values: separate buffers, which a pool may hand out in any pairing.
      const bool ring = kv.is_ring(donor);
      key.push_back(reinterpret_cast<intptr_t>(ring ? kv.ring_storage_k(donor).data()
                                                    : kv.full_keys(donor, 0).data()));
      key.push_back(reinterpret_cast<intptr_t>(ring ? kv.ring_storage_v(donor).data()
                                                    : kv.full_values(donor, 0).data()));
    }
  }
}

Tensor AssistantDrafter::run_staged_step(int step_index) {
  SPECULA_CHECK(step_index >= 0 && step_index < staged_steps_, "draft step {} is not staged",
                step_index);
  Backend& be = backend_;
  StepPlan& plan = plans_[static_cast<size_t>(step_index)];
  const int64_t B = plan.B;
  const int64_t Hb = drafter_.config().backbone_hidden_size;
  const InputViews in = input_views(plan.slot, B);
  if (!plan.device_tokens.empty()) be.copy(plan.device_tokens, in.ids_positions.row(0));
  const Tensor chain = chain_.view(DType::kF32, {static_cast<int64_t>(chain_requests_.size()), Hb});
  Tensor hidden;
  if (step_index == 0) {
    hidden = chain.slice_rows(0, B);
    // Copied into the chain rather than read in place: the recorded steps
    // then always see the same buffers (the caller's may move between calls).
    if (!plan.device_hidden.empty()) be.copy(plan.device_hidden, hidden);
  } else if (plan.slots.back() == B - 1) {
    // Rows are the chain's first B rows: read them in place.
    hidden = chain.slice_rows(0, B);
  } else {
    for_each_chain_run(plan.slots, [&](int64_t b, int64_t e, int64_t s) {
      be.copy(chain.slice_rows(s, s + (e - b)), in.gathered.slice_rows(b, e));
    });
    hidden = in.gathered;
  }

  target_.embed_scaled(in.ids_positions.row(0), in.embeds);
  DraftStepOutputs out = drafter_.step(
      {.token_embeds = in.embeds, .hidden = hidden, .positions = in.ids_positions.row(1)},
      plan.donors);

  // Chain each row's next hidden back into its chain row, run by run.
  for_each_chain_run(plan.slots, [&](int64_t b, int64_t e, int64_t s) {
    be.copy(out.next_hidden.slice_rows(b, e), chain.slice_rows(s, s + (e - b)));
  });
  return out.logits;
}

}  // namespace specula::assistant
