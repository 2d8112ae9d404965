// SPDX-License-Identifier: Apache-2.0
// bench_ops: times single backend ops at the shapes of a Gemma 4 preset (one
// decoder layer's products, attention, norms), to see where a decode step's
// time goes. Reports time per call and, for products, the weight bandwidth.
//   bench_ops --device cuda --preset 31b --rows 1 5 8 64
//   bench_ops --device cuda --rows 1 --shapes 5376x21504 6336x21504   (products of any NxK)
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/memory/memory_resource.h"
#include "engine/model/gemma4/presets.h"

#include <nlohmann/json.hpp>

namespace {

using namespace specula;

// Seconds per call of `f`: `reps` calls between two synchronizations, best of 3.
double time_per_call(Backend& be, const std::function<void()>& f, int reps) {
  f();
  be.synchronize();
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    be.synchronize();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    best = std::min(best, s);
  }
  return best;
}

struct Buffers {
  Backend& be;
  std::vector<DeviceBuffer> owned;
  Tensor make(DType dtype, Shape shape, uint64_t seed) {
    owned.emplace_back(be, static_cast<size_t>(shape.numel()) * dtype_size(dtype) + 256);
    Tensor t = owned.back().view(dtype, shape);
    if (dtype != DType::kI32 && dtype != DType::kI64) be.fill_uniform(t, seed, -0.05f, 0.05f);
    return t;
  }
};

// "NxK" (say 5376x8192) as {N, K}, both positive; nullopt for anything else.
std::optional<std::pair<int64_t, int64_t>> parse_shape(const std::string& text) {
  const size_t x = text.find('x');
  if (x == std::string::npos) return std::nullopt;
  int64_t n = 0, k = 0;
  const char* end = text.data() + text.size();
  const auto [n_end, n_ec] = std::from_chars(text.data(), text.data() + x, n);
  const auto [k_end, k_ec] = std::from_chars(text.data() + x + 1, end, k);
  if (n_ec != std::errc() || k_ec != std::errc() || n_end != text.data() + x || k_end != end ||
      n <= 0 || k <= 0) {
    return std::nullopt;
  }
  return std::pair{n, k};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Time single backend ops at the shapes of a Gemma 4 preset");
  std::string device = "cuda", preset = "31b";
  std::vector<int> rows = {1, 5, 8, 64};
  int context = 512, reps = 20;
  std::vector<std::string> shapes;
  app.add_option("--device", device, "cpu or cuda")->capture_default_str();
  app.add_option("--preset", preset, "e2b, e4b, 31b or 26b-a4b")->capture_default_str();
  app.add_option("--rows", rows, "Token rows per call")->capture_default_str();
  app.add_option("--context", context, "Keys per decode query")->capture_default_str();
  app.add_option("--reps", reps, "Calls per timing")->capture_default_str();
  app.add_option("--shapes", shapes,
                 "Products of these NxK bf16 weights (say 5376x8192) instead of the preset's");
  CLI11_PARSE(app, argc, argv);
  std::vector<std::pair<int64_t, int64_t>> shape_dims;
  for (const std::string& text : shapes) {
    const auto dims = parse_shape(text);
    if (!dims) {
      fmt::print(stderr, "bench_ops: --shapes {}: expected NxK with N, K > 0, say 5376x8192\n",
                 text);
      return 2;
    }
    shape_dims.push_back(*dims);
  }
  try {
    Backend& be = backend_for(device == "cpu" ? Device::cpu() : Device::cuda(0));
    const gemma4::Gemma4Config c = gemma4::gemma4_preset(preset);
    const int64_t H = c.hidden_size, Nh = c.num_attention_heads, D = c.head_dim;
    const int64_t KV = c.num_key_value_heads, I = c.intermediate_size;
    be.reserve_scratch(context + 64, std::max<int64_t>(I, Nh * c.global_head_dim));
    Buffers buf{be, {}};
    struct Product {
      std::string name;
      int64_t n, k;
    };
    // The assistant drafter's products (released shape for this preset): its
    // hidden size Ha, intermediate Ia, and the tied head over Ha.
    const nlohmann::json draft = gemma4::gemma4_assistant_preset_json(preset);
    const int64_t Ha = draft["text_config"]["hidden_size"].get<int64_t>();
    const int64_t Ia = draft["text_config"]["intermediate_size"].get<int64_t>();
    std::vector<Product> products = {
        {"q_proj", Nh * D, H}, {"k_proj", KV * D, H},    {"o_proj", H, Nh * D},
        {"gate_proj", I, H},   {"down_proj", H, I},      {"lm_head", c.vocab_size, H},
        {"d_pre", Ha, 2 * H},  {"d_q_proj", Nh * D, Ha}, {"d_o_proj", Ha, Nh * D},
        {"d_gate", Ia, Ha},    {"d_down", Ha, Ia},       {"d_head", c.vocab_size, Ha}};
    if (!shapes.empty()) {
      products.clear();
      for (size_t i = 0; i < shapes.size(); ++i) {
        products.push_back({shapes[i], shape_dims[i].first, shape_dims[i].second});
      }
    }
    fmt::print("preset {} on {}: H {} heads {}/{} D {} I {} V {}\n", preset, be.name(), H, Nh, KV,
               D, I, c.vocab_size);
    fmt::print("{:<10} {:>5} {:>10} {:>10}\n", "op", "rows", "us/call", "GB/s(w)");
    for (const Product& p : products) {
      Tensor w = buf.make(DType::kBF16, {p.n, p.k}, 1);
      for (int m : rows) {
        Tensor x = buf.make(DType::kF32, {m, p.k}, 2);
        Tensor y = buf.make(DType::kF32, {m, p.n}, 3);
        const double t = time_per_call(
            be, [&] { be.linear(x, w, y); }, reps);
        fmt::print("{:<10} {:>5} {:>10.1f} {:>10.0f}\n", p.name, m, t * 1e6,
                   static_cast<double>(w.nbytes()) / t / 1e9);
        buf.owned.pop_back();
        buf.owned.pop_back();
      }
      buf.owned.pop_back();
    }
    // Row-wise ops over the vocabulary (the decoder's device argmax, soft-cap).
    for (int m : rows) {
      Tensor logits = buf.make(DType::kF32, {m, c.vocab_size}, 10);
      Tensor ids = buf.make(DType::kI32, {m}, 0);
      const double tm = time_per_call(
          be, [&] { be.argmax_rows(logits, ids); }, reps);
      fmt::print("{:<10} {:>5} {:>10.1f}\n", "argmax", m, tm * 1e6);
      const double ts = time_per_call(
          be, [&] { be.softcap(logits, 30.0f, logits); }, reps);
      fmt::print("{:<10} {:>5} {:>10.1f}\n", "softcap", m, ts * 1e6);
      buf.owned.pop_back();
      buf.owned.pop_back();
    }
    // Sampling on the device: process_logits_rows under several settings, on
    // near-uniform rows (logits within ±0.05: random weights) and spread ones
    // (±20), then sample_rows of the result.
    const std::pair<const char*, RowSampling> settings[] = {
        {"greedy", {.temperature = 0.0f}},
        {"T", {.temperature = 0.8f}},
        {"T+top_k", {.temperature = 0.8f, .top_k = 50}},
        {"T+top_p", {.temperature = 0.8f, .top_p = 0.95f}},
        {"T+k+p+min", {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f, .min_p = 0.05f}}};
    for (int m : rows) {
      Tensor logits = buf.make(DType::kF32, {m, c.vocab_size}, 10);
      Tensor probs = buf.make(DType::kF32, {m, c.vocab_size}, 11);
      Tensor params = buf.make(DType::kI32, {m, 4}, 0);
      Tensor uniforms = buf.make(DType::kI64, {m}, 12);
      Tensor ids = buf.make(DType::kI32, {m}, 0);
      std::vector<int64_t> u(static_cast<size_t>(m), int64_t{1} << 52);
      be.upload(u.data(), uniforms);
      for (float spread : {0.05f, 20.0f}) {
        be.fill_uniform(logits, 10, -spread, spread);
        for (const auto& [name, rs] : settings) {
          const std::vector<RowSampling> per_row(static_cast<size_t>(m), rs);
          be.upload(per_row.data(), params);
          const double t = time_per_call(
              be, [&] { be.process_logits_rows(logits, params, probs); }, reps);
          fmt::print("{:<10} {:>5} {:>10.1f}  process_logits_rows {} (logits ±{})\n", "sampling", m,
                     t * 1e6, name, spread);
        }
        const double ts = time_per_call(
            be, [&] { be.sample_rows(probs, uniforms, ids); }, reps);
        fmt::print("{:<10} {:>5} {:>10.1f}  sample_rows (logits ±{})\n", "sampling", m, ts * 1e6,
                   spread);
      }
      for (int i = 0; i < 5; ++i) buf.owned.pop_back();
    }
    // Attention of `m` queries over `context` keys (sliding layer geometry).
    for (int m : rows) {
      Tensor q = buf.make(DType::kF32, {m, Nh, D}, 4);
      Tensor k = buf.make(DType::kF32, {context + m, KV, D}, 5);
      Tensor v = buf.make(DType::kF32, {context + m, KV, D}, 6);
      Tensor o = buf.make(DType::kF32, {m, Nh, D}, 7);
      Tensor pos = buf.make(DType::kI32, {m}, 0);
      std::vector<int32_t> p(static_cast<size_t>(m));
      for (int i = 0; i < m; ++i) p[static_cast<size_t>(i)] = context + i;
      be.upload(p.data(), pos);
      AttentionParams ap{.q = q,
                         .k = k,
                         .v = v,
                         .out = o,
                         .q_positions = pos,
                         .k_pos0 = 0,
                         .causal = true,
                         .window = c.sliding_window,
                         .scale = 1.0f};
      const double t = time_per_call(
          be, [&] { be.attention(ap); }, reps);
      fmt::print("{:<10} {:>5} {:>10.1f} {:>10.0f}\n", "attention", m, t * 1e6,
                 static_cast<double>(k.nbytes() * 2) / t / 1e9);
      // The layer's attention as the model runs it on one row: q/k/v norms,
      // RoPE and the cache store, then attention over the cache in place, as
      // two ops and as attention_with_inputs (a derived launch).
      {
        Tensor kr = buf.make(DType::kF32, {m, KV, D}, 13);
        Tensor vr = buf.make(DType::kF32, {m, KV, D}, 14);
        Tensor qn = buf.make(DType::kBF16, {D}, 15);
        Tensor kn = buf.make(DType::kBF16, {D}, 16);
        Tensor freq = buf.make(DType::kF32, {D / 2}, 17);
        AttentionInputsParams in{.q = q,
                                 .q_norm = qn,
                                 .k = kr,
                                 .k_norm = kn,
                                 .v = vr,
                                 .positions = pos,
                                 .inv_freq = freq,
                                 .cache_k = k,
                                 .cache_v = v};
        AttentionParams bound = ap;
        bound.window = 0;
        bound.positions_bound = positions_bound_for(context + m);
        const double t2 = time_per_call(
            be,
            [&] {
              be.attention_inputs(in);
              be.attention(bound);
            },
            reps);
        const double tf = time_per_call(
            be, [&] { be.attention_with_inputs(in, bound); }, reps);
        fmt::print("{:<10} {:>5} {:>10.1f}  attention_inputs + attention (full cache, derived)\n",
                   "attn_layer", m, t2 * 1e6);
        fmt::print("{:<10} {:>5} {:>10.1f}  attention_with_inputs\n", "attn_layer", m, tf * 1e6);
        for (int i = 0; i < 5; ++i) buf.owned.pop_back();
      }
      Tensor h = buf.make(DType::kF32, {m, H}, 8);
      Tensor nw = buf.make(DType::kBF16, {H}, 9);
      const double tn = time_per_call(
          be, [&] { be.rms_norm(h, nw, 1e-6f, h); }, reps);
      fmt::print("{:<10} {:>5} {:>10.1f}\n", "rms_norm", m, tn * 1e6);
      const double ta = time_per_call(
          be, [&] { be.add(h, h, h); }, reps);
      fmt::print("{:<10} {:>5} {:>10.1f}\n", "add", m, ta * 1e6);
      const double tc = time_per_call(
          be, [&] { be.copy(q, o); }, reps);
      fmt::print("{:<10} {:>5} {:>10.1f}\n", "copy", m, tc * 1e6);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_ops: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
