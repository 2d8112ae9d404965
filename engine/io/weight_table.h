// SPDX-License-Identifier: Apache-2.0
// WeightTable: declare every weight of a model once, as (checkpoint name ->
// field, expected shape, accepted dtypes), then bind them all from a Checkpoint
// in one pass. Binding checks every name, shape and dtype and reports, in one
// Error, all missing, unexpected and mis-shaped tensors by name and file.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/io/safetensors.h"

namespace specula::io {

// Checkpoint name of the per-row scales of quantized weight `name`.
inline constexpr const char* kScaleSuffix = ".scale";

class WeightTable {
 public:
  struct Entry {
    std::string name;           // full checkpoint name, prefix included
    Shape shape;                // expected shape
    std::vector<DType> dtypes;  // accepted dtypes
    Tensor* field = nullptr;    // where the view goes
    bool required = true;       // optional entries stay empty when absent
    // A matrix that may be stored quantized (add_matrix): i8 or f8e4m3 with
    // its per-row scales in "<name>.scale" (f32 [rows]), see kScaleSuffix.
    bool quantizable = false;
  };

  // Declares a weight. Floating weights accept f32, bf16 and f16 by default.
  void add(std::string name, Shape shape, Tensor* field, bool required = true);
  void add_typed(std::string name, Shape shape, std::vector<DType> dtypes, Tensor* field,
                 bool required = true);
  // Declares a weight matrix of linear or embedding [rows, cols] that may also
  // be stored quantized (`specula quantize`): f32, bf16, f16, or i8 / f8e4m3
  // with "<name>.scale" f32 [rows] beside it, which bind() attaches to the
  // view (Tensor::scales). A missing or mis-shaped scale is reported by name.
  void add_matrix(std::string name, Shape shape, Tensor* field, bool required = true);
  // Names that may be present in the checkpoint and are deliberately not used
  // (e.g. k_proj of KV-shared layers), and prefixes whose tensors are ignored
  // (e.g. "model.vision_tower."). Anything else unused is "unexpected".
  void ignore(std::string name) { ignored_.insert(std::move(name)); }
  void ignore_prefix(std::string prefix) { ignored_prefixes_.push_back(std::move(prefix)); }

  // The names of the entries declared with add_matrix, in declaration order.
  std::vector<std::string> matrix_names() const;

  // Binds every entry to a view into `checkpoint`; throws one Error listing
  // every problem (at most 20 lines, then "and N more"), in which case no field
  // is written. Absent optional entries are set to an empty Tensor. Views are
  // read-only and stay valid while the Checkpoint lives.
  void bind(const Checkpoint& checkpoint) const;

  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::vector<Entry> entries_;
  std::set<std::string> ignored_;
  std::vector<std::string> ignored_prefixes_;
};

// The first NaN or infinity of a host tensor of f32, bf16, f16 or f8e4m3 (other
// dtypes have none): its flat index and its value widened to f32. A branch-free pass
// over the exponent bits, memory-bound on one core, so loaders can afford it on
// every weight they read.
struct NonFinite {
  int64_t index = 0;
  float value = 0;
};
std::optional<NonFinite> find_non_finite(const Tensor& host_tensor);

// Throws an Error naming `name`, `file`, the element and its value when
// `host_tensor` holds a NaN or infinity (a corrupt or overflowed checkpoint,
// which would otherwise decode silently into garbage tokens).
void check_finite(const Tensor& host_tensor, const std::string& name, const std::string& file);

}  // namespace specula::io
