// SPDX-License-Identifier: Apache-2.0
#include "engine/io/weight_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/core/error.h"

namespace specula::io {
namespace {

// Enough lines to show the pattern of a mistake (e.g. a wrong prefix) without
// burying the message under thousands of tensor names.
constexpr size_t kMaxListedProblems = 20;

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::string out;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i > 0) out += i + 1 == dtypes.size() ? " or " : ", ";
    out += dtype_name(dtypes[i]);
  }
  return out;
}

// The index of the first element of `bits[0, n)` whose exponent field is all
// ones (NaN or infinity), or -1. Blocks are reduced without branches (the
// compiler vectorizes the inner loop); only a block that holds one is searched.
template <typename U>
int64_t first_all_ones_exponent(const U* bits, int64_t n, U exponent_mask) {
  constexpr int64_t kBlock = 4096;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = std::min(n, begin + kBlock);
    U hit = 0;
    for (int64_t i = begin; i < end; ++i)
      hit |= static_cast<U>((bits[i] & exponent_mask) == exponent_mask);
    if (hit == 0) continue;
    for (int64_t i = begin; i < end; ++i)
      if ((bits[i] & exponent_mask) == exponent_mask) return i;
  }
  return -1;
}

}  // namespace

std::optional<NonFinite> find_non_finite(const Tensor& t) {
  const int64_t n = t.numel();
  int64_t at = -1;
  switch (t.dtype()) {
    case DType::kF32:
      at = first_all_ones_exponent(t.data_as<const uint32_t>(), n, uint32_t{0x7f800000u});
      if (at < 0) return std::nullopt;
      {
        float v;
        std::memcpy(&v, t.data_as<const uint32_t>() + at, 4);
        return NonFinite{at, v};
      }
    case DType::kBF16:
      at = first_all_ones_exponent(t.data_as<const uint16_t>(), n, uint16_t{0x7f80u});
      if (at < 0) return std::nullopt;
      return NonFinite{at, bf16_to_f32(t.data_as<const uint16_t>()[at])};
    case DType::kF16:
      at = first_all_ones_exponent(t.data_as<const uint16_t>(), n, uint16_t{0x7c00u});
      if (at < 0) return std::nullopt;
      return NonFinite{at, f16_to_f32(t.data_as<const uint16_t>()[at])};
    case DType::kF8E4M3:  // no infinities; S.1111.111 is NaN
      at = first_all_ones_exponent(t.data_as<const uint8_t>(), n, uint8_t{0x7f});
      if (at < 0) return std::nullopt;
      return NonFinite{at, e4m3_to_f32(t.data_as<const uint8_t>()[at])};
    default:
      return std::nullopt;
  }
}

void check_finite(const Tensor& t, const std::string& name, const std::string& file) {
  const std::optional<NonFinite> bad = find_non_finite(t);
  if (!bad) return;
  fail(
      "{}: weight {} ({} {}) holds {} at element {} of {}: the checkpoint is corrupt or overflowed",
      file, name, dtype_name(t.dtype()), t.shape().str(),
      std::isnan(bad->value) ? "NaN" : (bad->value > 0 ? "+inf" : "-inf"), bad->index, t.numel());
}

void WeightTable::add(std::string name, Shape shape, Tensor* field, bool required) {
  add_typed(std::move(name), shape, {DType::kF32, DType::kBF16, DType::kF16}, field, required);
}

void WeightTable::add_typed(std::string name, Shape shape, std::vector<DType> dtypes, Tensor* field,
                            bool required) {
  // These are programming errors in a model's weight declarations, not bad input.
  if (field == nullptr) fail("weight table: '{}' declared without a field to bind to", name);
  if (dtypes.empty()) fail("weight table: '{}' declared without any accepted dtype", name);
  for (const Entry& e : entries_) {
    if (e.name == name) fail("weight table: '{}' declared twice", name);
  }
  entries_.push_back(Entry{std::move(name), shape, std::move(dtypes), field, required});
}

void WeightTable::add_matrix(std::string name, Shape shape, Tensor* field, bool required) {
  add_typed(std::move(name), shape,
            {DType::kF32, DType::kBF16, DType::kF16, DType::kI8, DType::kF8E4M3}, field, required);
  entries_.back().quantizable = true;
}

std::vector<std::string> WeightTable::matrix_names() const {
  std::vector<std::string> names;
  for (const Entry& e : entries_)
    if (e.quantizable) names.push_back(e.name);
  return names;
}

namespace {

// The scales of quantized entry `e` (whose tensor is in `checkpoint`): their
// view, or empty after adding the problem to `problems`.
Tensor bind_scales(const WeightTable::Entry& e, const Checkpoint& checkpoint, DType dtype,
                   std::vector<std::string>* problems) {
  const std::string name = e.name + kScaleSuffix;
  const Shape want{e.shape.rank() > 0 ? e.shape[0] : 0};
  if (!checkpoint.contains(name)) {
    problems->push_back(fmt::format("missing: {} (expected f32{}: the per-row scales of {} {})",
                                    name, want.str(), dtype_name(dtype), e.name));
    return Tensor();
  }
  const TensorInfo& info = checkpoint.info(name);
  if (info.dtype != DType::kF32 || info.shape != want) {
    problems->push_back(fmt::format("{}: expected f32{}, got {}{} in file {}", name, want.str(),
                                    dtype_name(info.dtype), info.shape.str(),
                                    checkpoint.file_of(name)));
    return Tensor();
  }
  return checkpoint.get(name);
}

}  // namespace

void WeightTable::bind(const Checkpoint& checkpoint) const {
  std::vector<std::string> problems;
  std::vector<Tensor> views(entries_.size());
  std::set<std::string> declared;

  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    declared.insert(e.name);
    if (!checkpoint.contains(e.name)) {
      if (e.required) {
        problems.push_back(fmt::format("missing: {} (expected {}{})", e.name, dtype_list(e.dtypes),
                                       e.shape.str()));
      }
      continue;
    }
    const TensorInfo& info = checkpoint.info(e.name);
    const std::string& file = checkpoint.file_of(e.name);
    bool ok = true;
    if (info.shape != e.shape) {
      problems.push_back(fmt::format("{}: expected {}, got {} in file {}", e.name, e.shape.str(),
                                     info.shape.str(), file));
      ok = false;
    }
    if (std::find(e.dtypes.begin(), e.dtypes.end(), info.dtype) == e.dtypes.end()) {
      problems.push_back(fmt::format("{}: dtype {} not accepted (expected {}) in file {}", e.name,
                                     dtype_name(info.dtype), dtype_list(e.dtypes), file));
      ok = false;
    }
    // A quantized tensor's scales belong to it even when it is refused (not "unexpected").
    if (is_quantized(info.dtype)) declared.insert(e.name + kScaleSuffix);
    if (ok && is_quantized(info.dtype)) {
      const Tensor scales = bind_scales(e, checkpoint, info.dtype, &problems);
      if (scales.empty()) continue;
      views[i] = checkpoint.get(e.name).with_scales(scales.data_as<const float>());
      continue;
    }
    if (ok) views[i] = checkpoint.get(e.name);
  }

  for (const std::string& name : checkpoint.names()) {
    if (declared.count(name) != 0 || ignored_.count(name) != 0) continue;
    const bool under_ignored_prefix =
        std::any_of(ignored_prefixes_.begin(), ignored_prefixes_.end(),
                    [&](const std::string& p) { return name.compare(0, p.size(), p) == 0; });
    if (under_ignored_prefix) continue;
    problems.push_back(fmt::format("unexpected: {} ({}) in file {}", name,
                                   checkpoint.info(name).shape.str(), checkpoint.file_of(name)));
  }

  if (!problems.empty()) {
    std::string list;
    for (size_t i = 0; i < problems.size() && i < kMaxListedProblems; ++i)
      list += "\n  " + problems[i];
    if (problems.size() > kMaxListedProblems) {
      list += fmt::format("\n  and {} more", problems.size() - kMaxListedProblems);
    }
    fail("{}: {} problem{} binding weights:{}", checkpoint.path(), problems.size(),
         problems.size() == 1 ? "" : "s", list);
  }
  // All or nothing: fields are written only once every entry checked out.
  for (size_t i = 0; i < entries_.size(); ++i) *entries_[i].field = views[i];
}

}  // namespace specula::io
