// SPDX-License-Identifier: Apache-2.0
#include "engine/io/quantize.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/core/error.h"
#include "engine/io/weight_table.h"

namespace specula::io {
namespace {

float element(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32:
      return t.data_as<const float>()[i];
    case DType::kBF16:
      return bf16_to_f32(t.data_as<const uint16_t>()[i]);
    default:
      return f16_to_f32(t.data_as<const uint16_t>()[i]);
  }
}

float decode(DType dtype, const uint8_t* codes, int64_t i) {
  return dtype == DType::kI8 ? static_cast<float>(static_cast<int8_t>(codes[i]))
                             : e4m3_to_f32(codes[i]);
}

}  // namespace

QuantizedMatrix quantize_rows(const Tensor& w, DType dtype, const std::string& what) {
  if (!is_quantized(dtype)) fail("quantize {}: {} is not a quantized dtype", what, dtype);
  const DType d = w.dtype();
  if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16)
    fail("quantize {}: expected an f32, bf16 or f16 matrix, got {}", what, w.describe());
  if (w.rank() != 2) fail("quantize {}: expected a matrix (rank 2), got {}", what, w.describe());
  if (!w.device().is_cpu()) fail("quantize {}: the tensor must be in host memory", what);
  check_finite(w, what, "(quantize)");
  const int64_t rows = w.dim(0), cols = w.dim(1);
  QuantizedMatrix out{HostTensor(dtype, {rows, cols}), HostTensor(DType::kF32, {rows})};
  const float qmax = dtype == DType::kI8 ? 127.0f : 448.0f;
  auto* codes = out.q.data<uint8_t>();
  float* scales = out.scales.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(element(w, r * cols + c)));
    const float scale = amax > 0 ? amax / qmax : 1.0f;
    scales[r] = scale;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = element(w, r * cols + c) / scale;
      uint8_t code;
      if (dtype == DType::kI8) {
        // nearbyint: ties to even under the default rounding mode.
        const float q = std::clamp(std::nearbyint(v), -127.0f, 127.0f);
        code = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else {
        code = f32_to_e4m3(v);
      }
      codes[r * cols + c] = code;
    }
  }
  return out;
}

std::vector<QuantizedTensorStats> quantize_checkpoint(const Checkpoint& in,
                                                      const std::vector<std::string>& matrices,
                                                      DType dtype, const std::string& out_file) {
  const std::set<std::string> wanted(matrices.begin(), matrices.end());
  const std::vector<std::string> names = in.names();
  for (const std::string& name : names) {
    const TensorInfo& info = in.info(name);
    const size_t suffix = std::string_view(kScaleSuffix).size();
    const bool scale_of_matrix = name.size() > suffix && name.ends_with(kScaleSuffix) &&
                                 wanted.count(name.substr(0, name.size() - suffix)) != 0;
    if (is_quantized(info.dtype) || scale_of_matrix) {
      fail("{}: tensor {} ({}{}) is already quantized: quantize the original checkpoint",
           in.file_of(name), name, dtype_name(info.dtype), info.shape.str());
    }
  }
  std::vector<QuantizedTensorStats> stats;
  std::vector<QuantizedMatrix> owned;  // outlives the write
  owned.reserve(wanted.size());
  std::vector<NamedTensor> out;
  for (const std::string& name : names) {
    const Tensor t = in.get(name);
    QuantizedTensorStats s{.name = name,
                           .from = t.dtype(),
                           .to = t.dtype(),
                           .bytes_before = static_cast<int64_t>(t.nbytes()),
                           .bytes_after = static_cast<int64_t>(t.nbytes())};
    if (wanted.count(name) == 0) {
      out.push_back({name, t});
      stats.push_back(s);
      continue;
    }
    owned.push_back(quantize_rows(t, dtype, fmt::format("{} ({})", name, in.file_of(name))));
    const QuantizedMatrix& q = owned.back();
    const int64_t cols = t.dim(1);
    const auto* codes = q.q.data<const uint8_t>();
    double sum = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float w = element(t, i);
      const float back = decode(dtype, codes, i) * q.scales.data<const float>()[i / cols];
      const double err = std::fabs(static_cast<double>(w) - back);
      s.max_abs_error = std::max(s.max_abs_error, err);
      sum += err;
    }
    s.mean_abs_error = t.numel() > 0 ? sum / static_cast<double>(t.numel()) : 0;
    s.to = dtype;
    s.bytes_after = static_cast<int64_t>(q.q.view().nbytes() + q.scales.view().nbytes());
    out.push_back({name, q.q.view()});
    out.push_back({name + kScaleSuffix, q.scales.view()});
    stats.push_back(s);
  }
  // Widest elements first: offsets stay multiples of every later tensor's element size.
  std::stable_sort(out.begin(), out.end(), [](const NamedTensor& a, const NamedTensor& b) {
    return dtype_size(a.tensor.dtype()) > dtype_size(b.tensor.dtype());
  });
  write_safetensors(out_file, out,
                    {{"format", "pt"}, {"specula_quantized", quantized_dtype_label(dtype)}});
  return stats;
}

std::vector<QuantizedTensorStats> quantize_folder(const QuantizeFolderParams& p) {
  namespace fs = std::filesystem;
  if (!is_quantized(p.dtype)) fail("quantize: {} is not a quantized dtype", p.dtype);
  const fs::path in(p.in_dir), out(p.out_dir);
  if (!fs::is_directory(in)) fail("quantize: {} is not a folder", p.in_dir);
  std::error_code ec;
  if (fs::exists(out) && fs::equivalent(in, out, ec))
    fail("quantize: --out {} is the drafter folder itself; write to a new folder", p.out_dir);
  if (fs::exists(out) && !(fs::is_directory(out) && fs::is_empty(out)))
    fail("quantize: --out {} exists and is not an empty folder", p.out_dir);
  const fs::path config = in / p.config_file;
  nlohmann::ordered_json j;
  {
    std::ifstream f(config);
    if (!f) fail("quantize: cannot read {}", config.string());
    j = nlohmann::ordered_json::parse(f, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) fail("quantize: {} is not a JSON object", config.string());
  }
  if (j.contains(p.config_field)) {
    fail("quantize: {} already says \"{}\": {}: the folder is quantized; quantize the original",
         config.string(), p.config_field, j[p.config_field].dump());
  }
  const Checkpoint ckpt(p.in_dir);
  fs::create_directories(out);
  std::vector<QuantizedTensorStats> stats =
      quantize_checkpoint(ckpt, p.matrices, p.dtype, (out / "model.safetensors").string());
  j[p.config_field] = quantized_dtype_label(p.dtype);
  {
    std::ofstream f(out / p.config_file);
    f << j.dump(2) << "\n";
    if (!f) fail("quantize: cannot write {}", (out / p.config_file).string());
  }
  for (const fs::directory_entry& e : fs::directory_iterator(in)) {
    const std::string name = e.path().filename().string();
    if (name == p.config_file || name.ends_with(".safetensors") ||
        name == "model.safetensors.index.json" || fs::equivalent(e.path(), out, ec))
      continue;  // (out may lie inside in: never copy it into itself)
    fs::copy(e.path(), out / name, fs::copy_options::recursive, ec);
    if (ec) fail("quantize: cannot copy {} to {}: {}", e.path().string(), p.out_dir, ec.message());
  }
  return stats;
}

DType parse_quantized_dtype(const std::string& text, const char* flag) {
  if (text == "int8" || text == "i8") return DType::kI8;
  if (text == "fp8" || text == "f8e4m3") return DType::kF8E4M3;
  fail("{}: expected int8 or fp8, got '{}'", flag, text);
}

const char* quantized_dtype_label(DType dtype) {
  return dtype == DType::kI8 ? "int8" : "fp8";
}

}  // namespace specula::io
