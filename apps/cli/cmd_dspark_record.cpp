// SPDX-License-Identifier: Apache-2.0
// `specula dspark-record`: one greedy speculative generation with a DSpark
// drafter, recording what the engine hands the drafter: every commit
// (Drafter::on_committed: positions and their tap rows, in commit order) and,
// per round, the anchor (the pending token and its position) and how many
// context rows the drafter had received before the round. The DSpark training
// alignment test (tests/cli/train_alignment.sh) compares this with the
// examples tools/train/dspark_data.py builds from a shard of the same sequence.
//
// Output safetensors:
//   sequence          i32 [N]       prompt + generated tokens
//   prompt_len        i64 [1]
//   committed_pos     i64 [P]       position of each committed row, in commit order
//   committed_taps    f32 [P, m*H]  its taps, concatenated in tap order (the shard layout)
//   round_position    i64 [R]       the anchor's position t
//   round_anchor      i32 [R]       the anchor token (the row's pending token)
//   round_context     i64 [R]       rows committed to the sequence before the round's step 0
// metadata: tap_layers "a,b,c", hidden_size, block_size.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/draft/dspark/dspark_drafter.h"
#include "engine/io/safetensors.h"
#include "engine/speculative/decoder.h"

namespace specula::cli {
namespace {

struct RecordArgs {
  ModelArgs model;
  std::string prompt_ids;
  int max_tokens = 32;
  std::string out;
};

// Forwards every call to a DSparkDrafter and records the commits and rounds
// of one sequence (the engine runs a single request here).
class TapRecorder : public Drafter {
 public:
  TapRecorder(dspark::DSparkDrafter& inner, Backend& backend, int64_t hidden)
      : inner_(inner), backend_(backend), hidden_(hidden) {}

  int64_t vocab_size() const override { return inner_.vocab_size(); }
  Tensor step(int step_index, std::span<const DraftRow> rows) override {
    if (step_index == 0) record_round(rows);
    return inner_.step(step_index, rows);
  }
  Tensor step_on_device(int step_index, std::span<const DraftRow> rows,
                        const DraftDeviceInputs& inputs) override {
    if (step_index == 0) record_round(rows);
    return inner_.step_on_device(step_index, rows, inputs);
  }
  bool proposes_tokens() const override { return inner_.proposes_tokens(); }
  int propose(const DraftRow& row, std::span<int32_t> out) override {
    return inner_.propose(row, out);
  }
  std::span<const int> taps() const override { return inner_.taps(); }
  void on_committed(std::span<const CommittedRow> rows, const Tensor& taps) override {
    const int64_t m = static_cast<int64_t>(inner_.taps().size());
    SPECULA_CHECK(taps.numel() > 0 && taps.dim(0) == m && taps.dim(2) == hidden_,
                  "dspark-record: the commit's taps are not [{}, M, {}]", m, hidden_);
    const int64_t M = taps.dim(1);
    host_.resize(static_cast<size_t>(taps.numel()));
    backend_.download(taps, host_.data());
    for (const CommittedRow& c : rows) {
      SPECULA_CHECK(c.sequence == 0, "dspark-record runs one sequence, got id {}", c.sequence);
      for (int i = 0; i < c.count; ++i) {
        positions_.push_back(c.position + i);
        for (int64_t k = 0; k < m; ++k) {
          const float* src = host_.data() + (k * M + c.tap_row + i) * hidden_;
          taps_.insert(taps_.end(), src, src + hidden_);
        }
      }
    }
    inner_.on_committed(rows, taps);
  }
  void release(int sequence) override { inner_.release(sequence); }
  int max_draft_tokens() const override { return inner_.max_draft_tokens(); }
  bool takes_device_inputs() const override { return inner_.takes_device_inputs(); }
  bool prunes() const override { return inner_.prunes(); }
  void draft_lengths(std::span<const DraftRow> rows, std::span<const int> drafted,
                     std::span<int> keep) override {
    inner_.draft_lengths(rows, drafted, keep);
  }

  std::vector<int64_t> positions_, round_position_, round_context_;
  std::vector<int32_t> round_anchor_;
  std::vector<float> taps_;  // [P, m*H]

 private:
  void record_round(std::span<const DraftRow> rows) {
    for (const DraftRow& r : rows) {
      SPECULA_CHECK(r.sequence == 0 && !r.history.empty(), "dspark-record: unexpected row");
      round_position_.push_back(r.position);
      // history ends with the pending token; DraftRow::token may be stale on device rounds.
      round_anchor_.push_back(r.history.back());
      round_context_.push_back(static_cast<int64_t>(positions_.size()));
    }
  }

  dspark::DSparkDrafter& inner_;
  Backend& backend_;
  int64_t hidden_;
  std::vector<float> host_;
};

template <typename T>
HostTensor host_vector(DType dt, const std::vector<T>& v, std::vector<int64_t> shape) {
  HostTensor t(dt, Shape(std::span<const int64_t>(shape)));
  if (!v.empty()) std::memcpy(t.view().data(), v.data(), v.size() * sizeof(T));
  return t;
}

void run_record(RecordArgs a) {
  if (a.max_tokens < 1) fail("--max-tokens: {} must be at least 1", a.max_tokens);
  if (!dspark::is_dspark_dir(a.model.draft))
    fail("--draft {}: not a DSpark drafter folder", a.model.draft);
  a.model.no_draft_prune = true;  // the whole block every round
  LoadedModels m = load_models(a.model, /*with_draft=*/true, /*with_tokenizer=*/false, true);
  auto* dsp = dynamic_cast<dspark::DSparkDrafter*>(m.draft_source.get());
  SPECULA_CHECK(dsp != nullptr && m.dspark, "a DSpark folder loaded as another drafter");
  const std::vector<int32_t> prompt = parse_id_list(a.prompt_ids, "--prompt-ids");
  const int64_t H = m.target->config().hidden_size;
  const int gamma = m.dspark->block_size();
  TapRecorder rec(*dsp, m.target->backend(), H);

  SamplingArgs sampling;
  sampling.params.temperature = 0.0f;
  sampling.params.max_tokens = a.max_tokens;
  const SamplingParams params = sampling_params(sampling, m);
  std::vector<speculative::DecodeRequest> reqs = {{.prompt = prompt, .params = params}};
  const std::vector<speculative::DecodeResult> res =
      speculative::decode(*m.target, &rec, reqs, {.draft_tokens = gamma});
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), res.at(0).tokens.begin(), res.at(0).tokens.end());

  const std::span<const int> taps = dsp->taps();
  const int64_t P = static_cast<int64_t>(rec.positions_.size());
  const int64_t R = static_cast<int64_t>(rec.round_position_.size());
  const int64_t W = static_cast<int64_t>(taps.size()) * H;
  const std::vector<int64_t> plen = {static_cast<int64_t>(prompt.size())};
  const HostTensor t_seq = host_vector(DType::kI32, seq, {static_cast<int64_t>(seq.size())});
  const HostTensor t_plen = host_vector(DType::kI64, plen, {1});
  const HostTensor t_pos = host_vector(DType::kI64, rec.positions_, {P});
  const HostTensor t_taps = host_vector(DType::kF32, rec.taps_, {P, W});
  const HostTensor t_rpos = host_vector(DType::kI64, rec.round_position_, {R});
  const HostTensor t_ranc = host_vector(DType::kI32, rec.round_anchor_, {R});
  const HostTensor t_rctx = host_vector(DType::kI64, rec.round_context_, {R});
  std::string tap_list;
  for (int t : taps) tap_list += (tap_list.empty() ? "" : ",") + std::to_string(t);
  io::write_safetensors(a.out,
                        {{"sequence", t_seq},
                         {"prompt_len", t_plen},
                         {"committed_pos", t_pos},
                         {"committed_taps", t_taps},
                         {"round_position", t_rpos},
                         {"round_anchor", t_ranc},
                         {"round_context", t_rctx}},
                        {{"producer", "specula dspark-record"},
                         {"tap_layers", tap_list},
                         {"hidden_size", std::to_string(H)},
                         {"block_size", std::to_string(gamma)}});
  fmt::print(stderr, "dspark-record: {} tokens, {} rounds, {} committed rows -> {}\n", seq.size(),
             R, P, a.out);
}

}  // namespace

void register_dspark_record(CLI::App& app) {
  auto args = std::make_shared<RecordArgs>();
  CLI::App* cmd = app.add_subcommand(
      "dspark-record",
      "Greedy speculative generation with a DSpark drafter, recording every commit's tap rows "
      "and every round's anchor (for the training alignment test)");
  add_model_options(cmd, args->model, /*with_draft=*/true);
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt token ids, comma-separated")
      ->required();
  cmd->add_option("--max-tokens,-n", args->max_tokens, "New tokens (greedy)")
      ->capture_default_str();
  cmd->add_option("--out", args->out, "Output .safetensors file")->required();
  cmd->callback([args] { run_record(*args); });
}

}  // namespace specula::cli
