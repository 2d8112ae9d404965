// SPDX-License-Identifier: Apache-2.0
// `specula draft-trace`: prefill the target on a prompt, then run K assistant
// draft steps with the candidate-generator semantics of transformers (the
// pending token is the target's greedy token, the first step reads the last
// prompt position's post-norm hidden, the position stays n_cur - 1), writing
// every step's inputs, logits, token and next hidden to a safetensors file.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/io/safetensors.h"

namespace specula::cli {
namespace {

struct TraceArgs {
  ModelArgs model;
  std::string prompt_ids;
  int steps = 4;
  std::string out;
};

void run_trace(const TraceArgs& args) {
  if (args.steps < 1) fail("--steps must be >= 1, got {}", args.steps);
  // The trace stages its inputs in host tensors: a CPU-only debugging tool.
  if (!parse_device(args.model.device).is_cpu()) {
    fail("draft-trace runs on the CPU only (got --device {}); use --device cpu", args.model.device);
  }
  LoadedModels m = load_models(args.model, /*with_draft=*/true, /*with_tokenizer=*/false, false);
  if (!m.drafter) fail("draft-trace needs a drafter: pass --draft DIR");
  const std::vector<int32_t> prompt = parse_id_list(args.prompt_ids, "--prompt-ids");
  gemma4::Gemma4Model& target = *m.target;
  const int64_t Hb = target.config().hidden_size;
  const int64_t V = target.config().vocab_size;

  SequenceKv kv = target.new_sequence();
  gemma4::ForwardRow row{.kv = &kv, .tokens = prompt};
  const gemma4::ForwardOutput& out = target.forward(std::span(&row, 1));
  auto logits = out.logits.f32();
  int32_t token =
      static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  HostTensor hidden(DType::kF32, {1, Hb});
  std::memcpy(hidden.data<float>(), out.hidden.data(), out.hidden.nbytes());

  TargetCacheDonors donors(target.backend(), target.config());
  SequenceKv* kvs[] = {&kv};
  donors.bind(kvs);
  HostTensor ids(DType::kI32, {1}), positions(DType::kI32, {1}), embeds(DType::kF32, {1, Hb});
  positions.data<int32_t>()[0] = static_cast<int32_t>(kv.length());

  std::vector<HostTensor> keep;
  keep.reserve(static_cast<size_t>(args.steps) * 4 + 2);
  std::vector<io::NamedTensor> tensors;
  auto add = [&](std::string name, HostTensor t) {
    keep.push_back(std::move(t));
    tensors.push_back({std::move(name), keep.back()});
  };
  auto copy_of = [](const Tensor& t, Shape shape) {
    HostTensor h(t.dtype(), shape);
    std::memcpy(h.view().data(), t.data(), t.nbytes());
    return h;
  };
  HostTensor input_ids(DType::kI32, {static_cast<int64_t>(prompt.size())});
  std::memcpy(input_ids.data<int32_t>(), prompt.data(), prompt.size() * sizeof(int32_t));
  add("input_ids", std::move(input_ids));
  add("draft.position", copy_of(positions, {1}));
  for (int step = 0; step < args.steps; ++step) {
    ids.data<int32_t>()[0] = token;
    target.embed_scaled(ids, embeds);
    HostTensor inputs(DType::kF32, {1, 2 * Hb});
    std::memcpy(inputs.data<float>(), embeds.data<float>(), static_cast<size_t>(Hb) * 4);
    std::memcpy(inputs.data<float>() + Hb, hidden.data<float>(), static_cast<size_t>(Hb) * 4);
    add(fmt::format("draft.inputs_embeds.{}", step), std::move(inputs));
    auto s =
        m.drafter->step({.token_embeds = embeds, .hidden = hidden, .positions = positions}, donors);
    add(fmt::format("draft.logits.{}", step), copy_of(s.logits, {V}));
    add(fmt::format("draft.next_hidden.{}", step), copy_of(s.next_hidden, {Hb}));
    add(fmt::format("draft.token.{}", step), copy_of(s.tokens, {1}));
    token = s.tokens.i32()[0];
    std::memcpy(hidden.data<float>(), s.next_hidden.data(), s.next_hidden.nbytes());
  }
  io::write_safetensors(args.out, tensors,
                        {{"model", m.model_dir},
                         {"draft", m.draft_dir},
                         {"producer", "specula draft-trace"},
                         {"head", m.drafter->head_description()}});
  fmt::print(stderr, "wrote {} draft steps to {}\n", args.steps, args.out);
}

}  // namespace

void register_draft_trace(CLI::App& app) {
  auto args = std::make_shared<TraceArgs>();
  CLI::App* cmd = app.add_subcommand(
      "draft-trace",
      "Write an assistant drafter's logits, tokens and next hidden for K steps after prefill");
  add_model_options(cmd, args->model, /*with_draft=*/true);
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt token ids, comma-separated")
      ->required();
  cmd->add_option("--steps", args->steps, "Draft steps")->capture_default_str();
  cmd->add_option("--out", args->out, "Output .safetensors file")->required();
  cmd->callback([args] { run_trace(*args); });
}

}  // namespace specula::cli
