// SPDX-License-Identifier: Apache-2.0
// `specula score`: one forward over a prompt, writing the logits of every
// position (and optionally hidden states and donor K/V) to a safetensors file,
// named as in tests/golden/README.md so any implementation can be compared.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/io/safetensors.h"
#include "engine/model/gemma4/gemma4.h"

namespace specula::cli {
namespace {

struct ScoreArgs {
  ModelArgs model;
  std::string prompt_ids;
  std::string out;
  bool hidden = false;
  bool layer_hidden = false;
  bool donor_kv = false;
};

// [T, kv, D] (engine layout) -> [kv, T, D] (Hugging Face layout).
HostTensor heads_first(const Tensor& t) {
  const int64_t T = t.dim(0), KV = t.dim(1), D = t.dim(2);
  HostTensor out(DType::kF32, {KV, T, D});
  const float* src = t.data_as<const float>();
  float* dst = out.data<float>();
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t h = 0; h < KV; ++h) {
      std::memcpy(dst + (h * T + i) * D, src + (i * KV + h) * D,
                  static_cast<size_t>(D) * sizeof(float));
    }
  }
  return out;
}

void run_score(const ScoreArgs& args) {
  const std::vector<int32_t> prompt = parse_id_list(args.prompt_ids, "--prompt-ids");
  ModelArgs model_args = args.model;
  model_args.ctx_size = std::max<int64_t>(model_args.ctx_size, static_cast<int64_t>(prompt.size()));
  LoadedModels m =
      load_models(model_args, /*with_draft=*/false, /*with_tokenizer=*/false, /*quiet=*/true);
  gemma4::Gemma4Model* model = m.target.get();
  SequenceKv kv = model->new_sequence();
  gemma4::ForwardRow row{.kv = &kv, .tokens = prompt, .all_logits = true};
  gemma4::ForwardOptions options;
  options.capture_layer_hidden = args.layer_hidden;
  options.capture_donor_kv = args.donor_kv;
  const gemma4::ForwardOutput& out = model->forward(std::span(&row, 1), options);

  HostTensor ids(DType::kI32, {static_cast<int64_t>(prompt.size())});
  std::memcpy(ids.data<int32_t>(), prompt.data(), prompt.size() * sizeof(int32_t));
  // Logits and hidden states live on the model's device: bring them to the host.
  Backend& be = model->backend();
  HostTensor logits(DType::kF32, out.logits.shape()), hidden(DType::kF32, out.hidden.shape());
  be.download(out.logits, logits.view().data());
  if (args.hidden) be.download(out.hidden, hidden.view().data());
  std::vector<io::NamedTensor> tensors = {{"input_ids", ids}, {"logits", logits}};
  if (args.hidden) tensors.push_back({"final_hidden", hidden});
  for (size_t i = 0; i < out.layer_hidden.size(); ++i) {
    tensors.push_back({fmt::format("hidden_states.{}", i), out.layer_hidden[i]});
  }
  std::vector<HostTensor> keep;
  auto add_donor = [&](const std::optional<gemma4::ForwardOutput::DonorKv>& d, const char* type) {
    if (!d) return;
    keep.push_back(heads_first(d->k));
    tensors.push_back({fmt::format("shared_kv.{}.k", type), keep.back()});
    keep.push_back(heads_first(d->v));
    tensors.push_back({fmt::format("shared_kv.{}.v", type), keep.back()});
  };
  keep.reserve(4);
  add_donor(out.sliding_donor, "sliding_attention");
  add_donor(out.full_donor, "full_attention");
  io::write_safetensors(args.out, tensors, {{"model", m.model_dir}, {"producer", "specula score"}});
  fmt::print(stderr, "wrote {} tensors for {} positions to {}\n", tensors.size(), prompt.size(),
             args.out);
}

}  // namespace

void register_score(CLI::App& app) {
  auto args = std::make_shared<ScoreArgs>();
  CLI::App* cmd = app.add_subcommand(
      "score",
      "Run one forward over a prompt and write every position's logits to a safetensors file");
  add_model_options(cmd, args->model, /*with_draft=*/false);
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt token ids, comma-separated")
      ->required();
  cmd->add_option("--out", args->out, "Output .safetensors file")->required();
  cmd->add_flag("--hidden", args->hidden,
                "Also write the post-final-norm hidden states (final_hidden)");
  cmd->add_flag(
      "--layer-hidden", args->layer_hidden,
      "Also write hidden_states.0..L (input of layer 0, each layer's output, [L] post-norm)");
  cmd->add_flag(
      "--donor-kv", args->donor_kv,
      "Also write the donor layers' K/V (shared_kv.<layer type>.k/.v, [kv_heads, T, head_dim])");
  cmd->callback([args] { run_score(*args); });
}

}  // namespace specula::cli
