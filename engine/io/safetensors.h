// SPDX-License-Identifier: Apache-2.0
// safetensors reading (memory-mapped) and writing.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"k": "v"}}, then the data region; offsets are relative to it.
// Every malformed input (truncated file, header that lies about offsets, sizes
// or dtypes, overlapping tensors) is reported as an Error naming the file and
// the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/tensor.h"

namespace specula::io {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t data_begin = 0;  // byte offsets into the data region
  uint64_t data_end = 0;
};

// Parses a safetensors header (the JSON text only, without the 8-byte length)
// against a data region of `data_size` bytes. `origin` names the file in errors.
// Returns the tensors in data order (by offset); fills `metadata` if non-null.
// Exposed separately so the fuzz target can reach it without a file.
std::vector<TensorInfo> parse_safetensors_header(std::string_view header_json, uint64_t data_size,
                                                 const std::string& origin,
                                                 std::map<std::string, std::string>* metadata);

// A sharded checkpoint's `model.safetensors.index.json`, parsed.
struct ShardIndex {
  struct Shard {
    std::string file;          // as the index names it: a relative path
    std::string first_tensor;  // one tensor it holds, for error messages
  };
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file
  std::vector<Shard> shards;                      // distinct shards, in order of first mention
};

// Parses the index JSON (`index_path` names it in errors). Every shard file is
// a non-empty relative path without a ".." component, so it lies in the
// index's folder or below it (the check is lexical: symlinked shards, as in
// the Hugging Face cache, still load). Opens no file; exposed for the fuzz target.
ShardIndex parse_safetensors_index(const nlohmann::json& index, const std::string& index_path);

// One memory-mapped .safetensors file. Move-only; tensors returned by get()
// view the read-only mapping (writing through them faults) and stay valid while
// this object lives. The data region starts 8-aligned in files written by HF
// and write_safetensors, but the format does not pad between tensors, so a
// view is only guaranteed to be aligned to its offset in the file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in data order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // throws naming file+tensor
  // A read-only view (callers must not write through it) of the mapped data.
  Tensor get(const std::string& name) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_region_ = nullptr;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: `model.safetensors`, or the shards listed by
// `model.safetensors.index.json` ({"weight_map": {tensor: shard file}}).
// Also accepts a path to a single .safetensors file.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  Tensor get(const std::string& name) const;
  // The file that holds `name` (for error messages).
  const std::string& file_of(const std::string& name) const;

 private:
  size_t owner_index(const std::string& name) const;  // throws naming the checkpoint+tensor

  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> owner_;  // tensor name -> index into files_
};

// Writes tensors (any dtype, CPU memory) to `path` in safetensors format, in
// the order given. Throws an Error naming the path on I/O failure.
struct NamedTensor {
  std::string name;
  Tensor tensor;
};
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace specula::io
