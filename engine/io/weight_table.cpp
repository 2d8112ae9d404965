// SPDX-License-Identifier: Apache-2.0
#include "engine/io/weight_table.h"

#include <algorithm>

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

}  // namespace

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
