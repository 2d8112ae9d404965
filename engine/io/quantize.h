// SPDX-License-Identifier: Apache-2.0
// Weight-only quantization of checkpoint matrices (`specula quantize`):
// symmetric, one f32 scale per row (output channel of a linear, token of an
// embedding table), round to nearest even.
//   int8:   scale = max|w_row| / 127, q = clamp(round(w / scale), -127, 127)
//   fp8:    scale = max|w_row| / 448, q = e4m3(w / scale) (f32_to_e4m3)
// A row of zeros gets scale 1 and zero codes. The stored layout is "<name>"
// (i8 | f8e4m3 [rows, cols]) and "<name>.scale" (f32 [rows]); a loader binds
// both through WeightTable::add_matrix, and every backend op that takes a
// weight reads decode(q) · scale (docs/architecture.md, "Quantized drafters").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/core/buffer.h"
#include "engine/io/safetensors.h"

namespace specula::io {

struct QuantizedMatrix {
  HostTensor q;       // i8 | f8e4m3 [rows, cols]
  HostTensor scales;  // f32 [rows]
};

// Quantizes a host matrix of f32, bf16 or f16 [rows, cols] to `dtype` (kI8 or
// kF8E4M3). `what` names the tensor in errors (a NaN or infinity, a wrong
// dtype or rank).
QuantizedMatrix quantize_rows(const Tensor& w, DType dtype, const std::string& what);

// How one checkpoint tensor came through quantize_checkpoint.
struct QuantizedTensorStats {
  std::string name;
  DType from = DType::kF32, to = DType::kF32;  // to == from: copied unchanged
  int64_t bytes_before = 0, bytes_after = 0;   // after: codes + scales
  double max_abs_error = 0;                    // over the elements, |w - decode(q)·scale|
  double mean_abs_error = 0;
};

// Writes every tensor of `in` to the safetensors file `out_file`: those named
// in `matrices` quantized to `dtype` (plus their ".scale"), the rest copied
// bit for bit (names in `matrices` the checkpoint lacks, optional weights, are
// skipped). Refuses, with an Error naming the tensor, a checkpoint that already
// holds a quantized tensor or a ".scale" of a matrix, and a matrix that is not
// a finite float matrix. Tensors are written widest dtype first so that every
// view of the output stays aligned to its element size.
std::vector<QuantizedTensorStats> quantize_checkpoint(const Checkpoint& in,
                                                      const std::vector<std::string>& matrices,
                                                      DType dtype, const std::string& out_file);

// A drafter folder quantized into another (`specula quantize`).
struct QuantizeFolderParams {
  std::string in_dir;                 // the original drafter folder
  std::string out_dir;                // created; must not exist or be empty, and not be in_dir
  std::vector<std::string> matrices;  // checkpoint names to quantize (the drafter's add_matrix)
  DType dtype = DType::kI8;           // kI8 or kF8E4M3
  std::string config_file;            // the config in in_dir to mark ("dspark.json", "config.json")
  std::string config_field;           // the field it gains: "<field>": "int8" | "fp8"
};
// Writes out_dir/model.safetensors (quantize_checkpoint of in_dir's
// checkpoint, shards merged), the config with config_field set (other fields
// kept in their order), and a copy of every other file and folder of in_dir
// (tokenizer, chat template, ...) except the original safetensors and shard
// index. Refuses, naming the path, a folder whose config already has the field
// or whose tensors are already quantized, and an out_dir that is in_dir or not
// empty. Returns the per-tensor stats.
std::vector<QuantizedTensorStats> quantize_folder(const QuantizeFolderParams& p);

// "int8" -> kI8, "fp8" -> kF8E4M3 (also "i8", "f8e4m3"); an Error names `flag`
// and the text otherwise.
DType parse_quantized_dtype(const std::string& text, const char* flag);
// "int8" or "fp8": the spelling configs record (weight_dtype).
const char* quantized_dtype_label(DType dtype);

}  // namespace specula::io
