// SPDX-License-Identifier: Apache-2.0
// `specula calibrate`: runs a DSpark drafter unpruned over a prompt set,
// collects its (position, confidence, accepted) samples per verify round,
// fits the seed's pruning thresholds (Fit 1) and STS temperatures (Fit 2) on
// part of the prompts, evaluates both on the rest, and writes both into the
// drafter's dspark.json (engine/lab/calibration.h has the fits).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "apps/cli/commands.h"
#include "apps/cli/confidence_recorder.h"
#include "apps/cli/prompt_set.h"
#include "apps/cli/setup.h"
#include "engine/lab/calibration.h"
#include "engine/lab/plot/plot.h"

namespace specula::cli {
namespace {

struct CalibrateArgs {
  ModelArgs model;
  std::string prompt_file;
  std::string prompt_format = "text";  // text, chat or code-block
  std::optional<int> num_prompts;      // the first N prompts of the file; else all
  double held_out_fraction = 0.25;
  double target = 0.5;
  int64_t min_samples = 50;
  int max_tokens = 64;
  int batch = 8;
  std::string plot;
  bool dry_run = false;
};

// Prompt i is held out when the running count floor((i + 1) · f) steps up:
// the held-out prompts are spread evenly over the file, and the split depends
// only on the prompt count and f.
bool held_out(size_t i, double f) {
  return std::floor(static_cast<double>(i + 1) * f) > std::floor(static_cast<double>(i) * f);
}

// Greedy decoding of `prompts` in batches of `batch` rows through the
// recorder; returns the verify rounds it recorded. Updates the progress line.
std::vector<lab::DraftRound> run_prompts(LoadedModels& m, ConfidenceRecorder& recorder,
                                         const std::vector<std::vector<int32_t>>& prompts,
                                         const SamplingParams& params, int gamma, int batch,
                                         size_t* done, size_t total) {
  const bool tty = isatty(STDERR_FILENO);
  size_t recorded = recorder.rounds().size();
  for (size_t at = 0; at < prompts.size(); at += static_cast<size_t>(batch)) {
    std::vector<speculative::DecodeRequest> reqs;
    for (size_t i = at; i < std::min(prompts.size(), at + static_cast<size_t>(batch)); ++i)
      reqs.push_back({.prompt = prompts[i], .params = params});
    int64_t drafted = 0, accepted = 0;
    for (const speculative::DecodeResult& r :
         speculative::decode(*m.target, &recorder, reqs, {.draft_tokens = gamma})) {
      drafted += r.stats.drafted;
      accepted += r.stats.accepted;
    }
    // The record must agree with the engine's own counters.
    int64_t rec_drafted = 0, rec_accepted = 0;
    for (size_t i = recorded; i < recorder.rounds().size(); ++i) {
      rec_drafted += static_cast<int64_t>(recorder.rounds()[i].confidences.size());
      rec_accepted += recorder.rounds()[i].accepted;
    }
    recorded = recorder.rounds().size();
    SPECULA_CHECK(rec_drafted == drafted && rec_accepted == accepted,
                  "calibration record: {} drafted / {} accepted, the engine counted {} / {}",
                  rec_drafted, rec_accepted, drafted, accepted);
    *done += reqs.size();
    if (tty) fmt::print(stderr, "\rcalibrate: prompts {}/{}", *done, total);
  }
  return recorder.take_rounds();
}

struct HeldOutEval {
  std::vector<double> ece_raw, ece_sts;            // [γ] survival-product ECE per position
  std::vector<int64_t> rounds_at;                  // [γ] held-out rounds that drafted k
  std::vector<int64_t> kept_at, kept_accepted_at;  // [γ] Fit 1 on held-out samples
  double ece_raw_all = 0, ece_sts_all = 0;         // weighted by rounds_at
};

HeldOutEval evaluate(std::span<const lab::DraftRound> held, const lab::ThresholdFit& thr,
                     const lab::StsFit& sts, int gamma) {
  HeldOutEval e;
  const std::vector<double> ones(static_cast<size_t>(gamma), 1.0);
  e.ece_raw = lab::survival_ece(held, ones, gamma);
  e.ece_sts = lab::survival_ece(held, sts.temperatures, gamma);
  e.rounds_at.assign(static_cast<size_t>(gamma), 0);
  e.kept_at.assign(static_cast<size_t>(gamma), 0);
  e.kept_accepted_at.assign(static_cast<size_t>(gamma), 0);
  for (const lab::CalibrationSample& s : lab::samples_from_rounds(held)) {
    const auto k = static_cast<size_t>(s.position);
    ++e.rounds_at[k];
    if (s.confidence >= thr.thresholds[k]) {
      ++e.kept_at[k];
      e.kept_accepted_at[k] += s.accepted ? 1 : 0;
    }
  }
  int64_t n = 0;
  for (size_t k = 0; k < e.rounds_at.size(); ++k) {
    n += e.rounds_at[k];
    e.ece_raw_all += e.ece_raw[k] * static_cast<double>(e.rounds_at[k]);
    e.ece_sts_all += e.ece_sts[k] * static_cast<double>(e.rounds_at[k]);
  }
  if (n > 0) {
    e.ece_raw_all /= static_cast<double>(n);
    e.ece_sts_all /= static_cast<double>(n);
  }
  return e;
}

void print_report(const lab::ThresholdFit& thr, const lab::StsFit& sts, const HeldOutEval& e,
                  size_t fit_prompts, size_t held_prompts, size_t fit_rounds, size_t held_rounds) {
  const int gamma = static_cast<int>(thr.thresholds.size());
  fmt::print(
      "fit on {} prompts ({} rounds, {} samples), evaluated on {} held-out prompts ({} "
      "rounds)\n",
      fit_prompts, fit_rounds, thr.samples, held_prompts, held_rounds);
  fmt::print("{:>3} {:>7} {:>7} {:>9} {:>7} {:>9} {:>9} {:>16}\n", "pos", "fit n", "held n",
             "Fit1 thr", "STS T", "ECE raw", "ECE STS", "Fit1 held prec");
  for (int k = 0; k < gamma; ++k) {
    const auto i = static_cast<size_t>(k);
    const std::string prec = e.kept_at[i] > 0
                                 ? fmt::format("{:.1f}% of {}",
                                               100.0 * static_cast<double>(e.kept_accepted_at[i]) /
                                                   static_cast<double>(e.kept_at[i]),
                                               e.kept_at[i])
                                 : std::string("- (none kept)");
    fmt::print("{:>3} {:>7} {:>7} {:>9.4f} {:>7.2f} {:>8.2f}% {:>8.2f}% {:>16}\n", k, sts.counts[i],
               e.rounds_at[i], thr.thresholds[i], sts.temperatures[i], 100.0 * e.ece_raw[i],
               100.0 * e.ece_sts[i], prec);
  }
  fmt::print(
      "ECE (held-out; survival products a_k = prod c_i against 'positions 0..k all accepted', {} "
      "bins, averaged over positions by rounds): raw {:.2f}% -> STS {:.2f}%\n",
      lab::kDefaultEceBins, 100.0 * e.ece_raw_all, 100.0 * e.ece_sts_all);
  // Fit 1 is a keep/cut rule on c_k, not a probability: it has no ECE. What
  // it promises is precision >= target among the drafts it keeps.
  int positions = 0, holding = 0;
  for (int k = 1; k < gamma; ++k) {
    const auto i = static_cast<size_t>(k);
    if (e.kept_at[i] == 0) continue;
    ++positions;
    if (static_cast<double>(e.kept_accepted_at[i]) >=
        thr.target * static_cast<double>(e.kept_at[i]))
      ++holding;
  }
  fmt::print(
      "Fit 1 (thresholds) is a pruning rule, not a probability, so it has no ECE: on held-out "
      "prompts its kept drafts reach the target precision {:g} at {} of {} positions >= 1 that "
      "kept any\n",
      thr.target, holding, positions);
  if (held_rounds == 0) {
    fmt::print("better calibrated: unknown (no held-out rounds)\n");
  } else if (e.ece_sts_all < e.ece_raw_all) {
    fmt::print("better calibrated: STS (held-out ECE {:.2f}% vs {:.2f}% raw)\n",
               100.0 * e.ece_sts_all, 100.0 * e.ece_raw_all);
  } else {
    fmt::print(
        "better calibrated: the raw confidences (STS does not lower the held-out ECE: "
        "{:.2f}% vs {:.2f}% raw)\n",
        100.0 * e.ece_sts_all, 100.0 * e.ece_raw_all);
  }
}

// One panel per position: the raw and STS survival products (what STS
// calibrates) and the raw conditional c_k against the same label (what
// Fit 1 thresholds, so its marker sits on that axis).
void write_plot(const std::string& path, std::span<const lab::DraftRound> held,
                const lab::ThresholdFit& thr, const lab::StsFit& sts, const std::string& name) {
  const int gamma = static_cast<int>(thr.thresholds.size());
  const std::vector<double> ones(static_cast<size_t>(gamma), 1.0);
  std::vector<lab::CalibrationSample> samples = lab::samples_from_rounds(held);
  lab::ReliabilityChart chart{.title = fmt::format("{}: held-out reliability", name)};
  for (int k = 0; k < gamma; ++k) {
    std::vector<double> predicted;
    std::vector<uint8_t> observed;
    for (const lab::CalibrationSample& s : samples) {
      if (s.position != k) continue;
      predicted.push_back(s.confidence);
      observed.push_back(s.accepted ? 1 : 0);
    }
    lab::ReliabilityPanel panel{.title = fmt::format("position {}", k)};
    panel.series.push_back({"raw a_k", lab::survival_reliability(held, ones, k)});
    panel.series.push_back({"STS a_k", lab::survival_reliability(held, sts.temperatures, k)});
    panel.series.push_back({"raw c_k", lab::reliability_bins(predicted, observed)});
    const double t = thr.thresholds[static_cast<size_t>(k)];
    if (k > 0 && t > 0.0) {
      panel.marker = t;
      panel.marker_label = "Fit 1 threshold (on c_k)";
    }
    chart.panels.push_back(std::move(panel));
  }
  lab::write_reliability_png(chart, path);
}

void run_calibrate(CalibrateArgs a) {
  if (!(a.held_out_fraction > 0 && a.held_out_fraction < 1))
    fail("--held-out-fraction: {} is outside (0, 1)", a.held_out_fraction);
  if (!(a.target > 0 && a.target <= 1)) fail("--target: {} is outside (0, 1]", a.target);
  if (a.min_samples < 0) fail("--min-samples: {} is negative", a.min_samples);
  if (a.max_tokens < 1) fail("--max-tokens: {} must be at least 1", a.max_tokens);
  if (a.batch < 1) fail("--batch: {} must be at least 1", a.batch);
  const std::string dir = a.model.draft;
  if (!dspark::is_dspark_dir(dir)) {
    fail(
        "--draft {}: not a DSpark drafter folder (no {}, nor a {} naming Gemma4DSparkModel); "
        "calibrate needs a drafter with a confidence head",
        dir, dspark::kSpeculaConfigFile, dspark::kDeepSpecConfigFile);
  }
  // DeepSpec folders have no dspark.json, and their loader reads no
  // calibration: writing one elsewhere would look applied and not be.
  const std::string json_path = (std::filesystem::path(dir) / dspark::kSpeculaConfigFile).string();
  if (!a.dry_run && !std::filesystem::exists(json_path)) {
    fail(
        "--draft {}: a DeepSpec-layout drafter has no {} to write the calibration into (and "
        "its config.json carries none); run with --dry-run to fit and report only",
        dir, dspark::kSpeculaConfigFile);
  }
  const FormattedPromptSet prompts =
      read_formatted_prompt_set(a.prompt_file, a.prompt_format, a.num_prompts);
  const PromptSet& set = prompts.set;
  if (set.entries.size() < 2) {
    fail("--prompt-file {}: calibrate needs at least 2 prompts (fit and held-out){}", set.path,
         a.num_prompts
             ? fmt::format("; --num-prompts {} keeps {}", *a.num_prompts, set.entries.size())
             : "");
  }
  a.model.no_draft_prune = true;  // samples of every drafted position
  LoadedModels m = load_models(a.model, /*with_draft=*/true, set.needs_tokenizer(), false);
  auto* dsp = dynamic_cast<dspark::DSparkDrafter*>(m.draft_source.get());
  SPECULA_CHECK(dsp != nullptr && m.dspark, "a DSpark folder loaded as another drafter");
  if (!m.dspark->has_confidence_head())
    fail("--draft {}: the DSpark drafter has no confidence head, nothing to calibrate", dir);
  const int gamma = m.dspark->block_size();
  ConfidenceRecorder recorder(*dsp);

  std::optional<ChatOptions> chat;
  if (prompts.format == PromptFormat::kChat) chat = chat_options(m, /*quiet=*/false);
  const std::vector<std::vector<int32_t>> ids =
      tokenize_prompt_set(prompts, m.tokenizer ? &*m.tokenizer : nullptr,
                          m.target->config().vocab_size, chat ? &*chat : nullptr);
  check_prompts_fit(prompts, ids, a.max_tokens, "--max-tokens", m.target->max_context());
  std::vector<std::vector<int32_t>> fit_prompts, held_prompts;
  for (size_t i = 0; i < ids.size(); ++i)
    (held_out(i, a.held_out_fraction) ? held_prompts : fit_prompts).push_back(ids[i]);
  if (fit_prompts.empty() || held_prompts.empty()) {
    fail("--held-out-fraction {} leaves {} fit and {} held-out prompts of {}; both need one",
         a.held_out_fraction, fit_prompts.size(), held_prompts.size(), ids.size());
  }
  SamplingArgs sampling;
  sampling.params.temperature = 0.0f;
  sampling.params.max_tokens = a.max_tokens;
  const SamplingParams params = sampling_params(sampling, m);
  size_t done = 0;
  const std::vector<lab::DraftRound> fit_rounds =
      run_prompts(m, recorder, fit_prompts, params, gamma, a.batch, &done, ids.size());
  const std::vector<lab::DraftRound> held_rounds =
      run_prompts(m, recorder, held_prompts, params, gamma, a.batch, &done, ids.size());
  if (isatty(STDERR_FILENO)) fmt::print(stderr, "\n");
  if (fit_rounds.empty())
    fail("--prompt-file {}: the fit prompts gave no verify rounds (raise --max-tokens)", set.path);

  const std::vector<lab::CalibrationSample> samples = lab::samples_from_rounds(fit_rounds);
  const lab::ThresholdFit thr = lab::fit_thresholds(
      samples, {.block_size = gamma, .target = a.target, .min_samples = a.min_samples});
  const lab::StsFit sts = lab::fit_sts(fit_rounds, {.block_size = gamma});
  const HeldOutEval e = evaluate(held_rounds, thr, sts, gamma);
  print_report(thr, sts, e, fit_prompts.size(), held_prompts.size(), fit_rounds.size(),
               held_rounds.size());
  if (!a.plot.empty()) {
    write_plot(a.plot, held_rounds, thr, sts, dir);
    fmt::print("wrote {}\n", a.plot);
  }
  if (a.dry_run) {
    fmt::print("--dry-run: {} left unchanged\n", json_path);
  } else {
    lab::write_calibration_file(json_path, thr, sts);
    fmt::print("wrote calibration (thresholds, sts_temperatures) into {}\n", json_path);
  }
}

}  // namespace

void register_calibrate(CLI::App& app) {
  auto args = std::make_shared<CalibrateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Fit a DSpark drafter's pruning thresholds (seed rule) and STS temperatures from its "
      "unpruned runs over a prompt set; report held-out ECE and write both into dspark.json");
  cmd->add_option("--draft,-d", args->model.draft,
                  "DSpark drafter folder (specula layout: its dspark.json gains `calibration`; "
                  "a DeepSpec-layout folder needs --dry-run)")
      ->required();
  cmd->add_option("--prompt-file", args->prompt_file,
                  "Prompts, JSONL: {\"turns\": [\"text\", ...]} (DeepSpec's layout; the first "
                  "turn, BOS added, or as --prompt-format says) or {\"ids\": [token ids]}")
      ->required();
  cmd->add_option("--prompt-format", args->prompt_format, kPromptFormatHelp)->capture_default_str();
  cmd->add_option("--num-prompts", args->num_prompts,
                  "Use the first N prompts of the file (default: all), before the fit/held-out "
                  "split");
  add_model_options(cmd, args->model, /*with_draft=*/false);
  cmd->add_option("--held-out-fraction", args->held_out_fraction,
                  "Share of the prompts held out for evaluation (spread evenly over the file)")
      ->capture_default_str();
  cmd->add_option("--target", args->target,
                  "Fit 1: the Laplace-smoothed precision a threshold must reach")
      ->capture_default_str();
  cmd->add_option("--min-samples", args->min_samples,
                  "Fit 1: positions with fewer samples get threshold 0 (never pruned)")
      ->capture_default_str();
  cmd->add_option("--max-tokens,-n", args->max_tokens, "New tokens per prompt (greedy)")
      ->capture_default_str();
  cmd->add_option("--batch", args->batch, "Prompts decoded together (rows of the engine)")
      ->capture_default_str();
  cmd->add_option("--plot", args->plot,
                  "Write the held-out reliability diagram per position (raw and STS survival "
                  "products, raw c_k with the Fit 1 threshold) as a PNG");
  cmd->add_flag("--dry-run", args->dry_run, "Fit and report, but leave dspark.json unchanged");
  cmd->callback([args] { run_calibrate(*args); });
}

}  // namespace specula::cli
