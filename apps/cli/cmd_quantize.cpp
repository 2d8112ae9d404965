// SPDX-License-Identifier: Apache-2.0
// `specula quantize`: weight-only quantization of a drafter folder (the
// Gemma 4 assistant or a DSpark drafter, either layout) into a new folder:
// its matrices and embedding tables to int8 or fp8 e4m3 with per-row f32
// scales (engine/io/quantize.h), everything else copied. Needs no target.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <regex>

#include "apps/cli/commands.h"
#include "apps/cli/setup.h"
#include "engine/draft/assistant/assistant.h"
#include "engine/draft/dspark/dspark_config.h"
#include "engine/draft/dspark/dspark_weights.h"
#include "engine/io/quantize.h"

namespace specula::cli {
namespace {

struct QuantizeArgs {
  std::string draft;
  std::string out;
  std::string dtype = "int8";
  bool verbose = false;
};

std::string mib(int64_t bytes) {
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

// Per tensor class (the name with layer indices replaced by '*'): sizes and
// errors over its tensors, for --verbose.
void print_classes(const std::vector<io::QuantizedTensorStats>& stats) {
  struct Class {
    int count = 0;
    int64_t before = 0, after = 0, elements = 0;
    double max_err = 0, err_sum = 0;
    std::string from, to;
  };
  std::map<std::string, Class> classes;
  const std::regex index(R"(\.\d+\.)");
  for (const io::QuantizedTensorStats& s : stats) {
    Class& c = classes[std::regex_replace(s.name, index, ".*.")];
    const int64_t n = s.bytes_before / static_cast<int64_t>(dtype_size(s.from));
    ++c.count;
    c.before += s.bytes_before;
    c.after += s.bytes_after;
    c.elements += n;
    c.max_err = std::max(c.max_err, s.max_abs_error);
    c.err_sum += s.mean_abs_error * static_cast<double>(n);
    c.from = dtype_name(s.from);
    c.to = dtype_name(s.to);
  }
  fmt::print(stderr, "{:<52} {:>3} {:>7} {:>7} {:>12} {:>12} {:>12} {:>12}\n", "tensor class", "n",
             "from", "to", "before", "after", "max |err|", "mean |err|");
  for (const auto& [name, c] : classes) {
    const bool changed = c.from != c.to;
    fmt::print(stderr, "{:<52} {:>3} {:>7} {:>7} {:>12} {:>12} {:>12} {:>12}\n", name, c.count,
               c.from, c.to, mib(c.before), mib(c.after),
               changed ? fmt::format("{:.3e}", c.max_err) : "-",
               changed ? fmt::format("{:.3e}", c.elements ? c.err_sum / c.elements : 0.0) : "-");
  }
}

void run_quantize(const QuantizeArgs& a) {
  io::QuantizeFolderParams p;
  p.in_dir = a.draft;
  p.out_dir = a.out;
  p.dtype = io::parse_quantized_dtype(a.dtype, "--dtype");
  std::string kind;
  if (dspark::is_dspark_dir(a.draft)) {
    const dspark::DSparkConfig c = dspark::load_dspark_config(a.draft);
    const bool specula = c.layout == dspark::DSparkLayout::kSpecula;
    kind = specula ? "DSpark drafter (specula layout)" : "DSpark drafter (DeepSpec layout)";
    p.matrices = dspark::dspark_matrix_names(a.draft);
    p.config_file = specula ? dspark::kSpeculaConfigFile : dspark::kDeepSpecConfigFile;
    // dspark.json is ours; a Hugging Face config.json gets a prefixed field.
    p.config_field = specula ? "weight_dtype" : "specula_weight_dtype";
  } else {
    kind = "assistant drafter";
    p.matrices = assistant::assistant_matrix_names(a.draft);
    p.config_file = "config.json";
    p.config_field = "specula_weight_dtype";
  }
  const std::vector<io::QuantizedTensorStats> stats = io::quantize_folder(p);
  int64_t before = 0, after = 0, quantized = 0;
  for (const io::QuantizedTensorStats& s : stats) {
    before += s.bytes_before;
    after += s.bytes_after;
    quantized += s.to != s.from ? 1 : 0;
  }
  fmt::print(stderr, "quantize: {} {} -> {}: {} of {} tensors to {}; weights {} -> {} ({:.1f}%)\n",
             kind, a.draft, a.out, quantized, stats.size(), io::quantized_dtype_label(p.dtype),
             mib(before), mib(after), before ? 100.0 * after / before : 0.0);
  if (a.verbose) print_classes(stats);
}

}  // namespace

void register_quantize(CLI::App& app) {
  auto args = std::make_shared<QuantizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Quantize a drafter folder (assistant or DSpark) weight-only: matrices and embedding "
      "tables to int8 or fp8 e4m3 with per-row scales; norms, scalars and the confidence head "
      "stay as they are");
  cmd->add_option("--draft,-d", args->draft, "Drafter folder to quantize")->required();
  cmd->add_option("--out,-o", args->out, "New folder to write (must not exist or be empty)")
      ->required();
  cmd->add_option("--dtype", args->dtype, "int8 or fp8 (e4m3)")->capture_default_str();
  cmd->add_flag("--verbose,-v", args->verbose,
                "Per tensor class: sizes before/after and max/mean abs weight error");
  cmd->callback([args] { run_quantize(*args); });
}

}  // namespace specula::cli
