// SPDX-License-Identifier: Apache-2.0
#include "engine/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "engine/core/error.h"
#include "engine/io/json_util.h"

namespace specula::io {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; a larger length
// field means the file is not safetensors at all (or its first bytes are garbage).
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;
constexpr char kSupportedDtypes[] = "F32, BF16, F16, I32, I64, U8, I8, F8_E4M3";

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A JSON integer >= 0 (floats, negatives and other types are rejected).
bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_size,
                       const std::string& origin) {
  if (!entry.is_object()) {
    fail("{}: tensor '{}': header entry must be an object, got {} {}", origin, name,
         json_type_name(entry), json_excerpt(entry));
  }
  TensorInfo info;
  info.name = name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) fail("{}: tensor '{}' has no \"dtype\"", origin, name);
  if (!dtype_it->is_string()) {
    fail("{}: tensor '{}': dtype must be a string, got {}", origin, name, json_excerpt(*dtype_it));
  }
  const std::string dtype_str = dtype_it->get<std::string>();
  if (!dtype_from_safetensors(dtype_str, &info.dtype)) {
    fail("{}: tensor '{}' has unsupported dtype '{}' (supported: {})", origin, name, dtype_str,
         kSupportedDtypes);
  }

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) fail("{}: tensor '{}' has no \"shape\"", origin, name);
  if (!shape_it->is_array()) {
    fail("{}: tensor '{}': shape must be an array, got {}", origin, name, json_excerpt(*shape_it));
  }
  if (shape_it->size() > static_cast<size_t>(Shape::kMaxDims)) {
    fail("{}: tensor '{}': shape {} has rank {}, above the supported maximum {}", origin, name,
         json_excerpt(*shape_it), shape_it->size(), Shape::kMaxDims);
  }
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  bool numel_overflow = false;
  for (size_t i = 0; i < shape_it->size(); ++i) {
    uint64_t d = 0;
    if (!as_u64((*shape_it)[i], &d) ||
        d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail("{}: tensor '{}': shape[{}] must be a non-negative integer, got {}", origin, name, i,
           json_excerpt((*shape_it)[i]));
    }
    dims.push_back(static_cast<int64_t>(d));
    numel_overflow = numel_overflow || __builtin_mul_overflow(numel, d, &numel);
  }
  // A zero extent makes any overflow above irrelevant.
  if (std::find(dims.begin(), dims.end(), 0) != dims.end()) {
    numel = 0;
    numel_overflow = false;
  }
  uint64_t nbytes = 0;
  if (numel_overflow || numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
      __builtin_mul_overflow(numel, dtype_size(info.dtype), &nbytes)) {
    fail("{}: tensor '{}': shape {} has too many elements", origin, name, json_excerpt(*shape_it));
  }
  info.shape = Shape(std::span<const int64_t>(dims));

  const auto off_it = entry.find("data_offsets");
  if (off_it == entry.end()) fail("{}: tensor '{}' has no \"data_offsets\"", origin, name);
  if (!off_it->is_array() || off_it->size() != 2 || !as_u64((*off_it)[0], &info.data_begin) ||
      !as_u64((*off_it)[1], &info.data_end)) {
    fail("{}: tensor '{}': data_offsets must be [begin, end] with non-negative integers, got {}",
         origin, name, json_excerpt(*off_it));
  }
  if (info.data_begin > info.data_end) {
    fail("{}: tensor '{}': data_offsets [{}, {}] end before they begin", origin, name,
         info.data_begin, info.data_end);
  }
  if (info.data_end > data_size) {
    fail("{}: tensor '{}': data_offsets [{}, {}] reach beyond the data region of {} bytes", origin,
         name, info.data_begin, info.data_end, data_size);
  }
  if (info.data_end - info.data_begin != nbytes) {
    fail("{}: tensor '{}' is {}{} ({} bytes) but data_offsets [{}, {}] span {} bytes", origin, name,
         dtype_name(info.dtype), info.shape.str(), nbytes, info.data_begin, info.data_end,
         info.data_end - info.data_begin);
  }
  return info;
}

void parse_metadata(const json& value, const std::string& origin,
                    std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    fail("{}: __metadata__ must be an object of strings, got {}", origin, json_excerpt(value));
  }
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      fail("{}: __metadata__[\"{}\"] must be a string, got {}", origin, key, json_excerpt(v));
    }
    if (metadata != nullptr) (*metadata)[key] = v.get<std::string>();
  }
}

// Closes a file descriptor on scope exit.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::vector<TensorInfo> parse_safetensors_header(std::string_view header_json, uint64_t data_size,
                                                 const std::string& origin,
                                                 std::map<std::string, std::string>* metadata) {
  const json root = parse_json_text(std::string(header_json), origin + " (safetensors header)");
  if (!root.is_object()) {
    fail("{}: safetensors header must be a JSON object, got {}", origin, json_type_name(root));
  }
  std::vector<TensorInfo> tensors;
  tensors.reserve(root.size());
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      parse_metadata(entry, origin, metadata);
      continue;
    }
    tensors.push_back(parse_entry(name, entry, data_size, origin));
  }

  // File order; names break ties so the order is deterministic for empty tensors.
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.data_begin != b.data_begin) return a.data_begin < b.data_begin;
    if (a.data_end != b.data_end) return a.data_end < b.data_end;
    return a.name < b.name;
  });
  // Empty tensors occupy no bytes and cannot overlap anything.
  const TensorInfo* furthest = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.data_begin == t.data_end) continue;
    if (furthest != nullptr && t.data_begin < furthest->data_end) {
      fail("{}: tensors '{}' (bytes [{}, {})) and '{}' (bytes [{}, {})) overlap in the data region",
           origin, furthest->name, furthest->data_begin, furthest->data_end, t.name, t.data_begin,
           t.data_end);
    }
    if (furthest == nullptr || t.data_end > furthest->data_end) furthest = &t;
  }
  return tensors;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  FdGuard fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) fail("cannot open safetensors file '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail("cannot stat '{}': {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("{}: not a regular file", path);
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    fail("{}: file is {} bytes, too short for the 8-byte header length of a safetensors file", path,
         file_size);
  }
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (map == MAP_FAILED) fail("{}: cannot map {} bytes: {}", path, file_size, std::strerror(errno));
  map_ = map;
  map_size_ = file_size;

  // The destructor does not run for a constructor that throws: unmap here.
  try {
    const auto* bytes = static_cast<const uint8_t*>(map_);
    const uint64_t header_size = read_u64_le(bytes);
    if (header_size > kMaxHeaderBytes) {
      fail(
          "{}: header length field says {} bytes, above the {}-byte limit (file is {} bytes): not "
          "a "
          "safetensors file",
          path, header_size, kMaxHeaderBytes, file_size);
    }
    if (header_size > file_size - 8) {
      fail(
          "{}: file is {} bytes but the header says its JSON header alone is {} bytes: the file is "
          "truncated",
          path, file_size, header_size);
    }
    const uint64_t data_size = file_size - 8 - header_size;
    data_region_ = bytes + 8 + header_size;
    const std::string_view header(reinterpret_cast<const char*>(bytes + 8), header_size);
    // Offsets are first parsed against an unbounded region so that a short file
    // is reported as truncated (with its size) rather than as a lying header.
    tensors_ =
        parse_safetensors_header(header, std::numeric_limits<uint64_t>::max(), path, &metadata_);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const TensorInfo& t = tensors_[i];
      if (t.data_end > data_size) {
        fail(
            "{}: file is {} bytes but the header says tensor '{}' ends {} bytes into the data "
            "region, which starts at byte {} and holds {} bytes: the file is truncated",
            path, file_size, t.name, t.data_end, 8 + header_size, data_size);
      }
      index_[t.name] = i;
    }
  } catch (...) {
    ::munmap(map_, map_size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      data_region_(std::exchange(other.data_region_, nullptr)),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_size_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    data_region_ = std::exchange(other.data_region_, nullptr);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

bool SafetensorsFile::contains(const std::string& name) const {
  return index_.count(name) != 0;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) fail("{}: no tensor named '{}'", path_, name);
  return tensors_[it->second];
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo& t = info(name);
  // The mapping is read-only; Tensor has no const flavour, so the contract
  // (callers never write through weight views) is documented, not typed.
  auto* data = const_cast<uint8_t*>(data_region_ + t.data_begin);
  return Tensor(data, t.dtype, t.shape);
}

ShardIndex parse_safetensors_index(const nlohmann::json& index, const std::string& index_path) {
  if (!index.is_object())
    fail("{}: must be a JSON object, got {}", index_path, json_type_name(index));
  const auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    fail("{}: has no \"weight_map\" object mapping tensor names to shard files", index_path);
  }
  if (wm->empty()) fail("{}: weight_map is empty", index_path);

  ShardIndex out;
  std::set<std::string> seen;
  for (const auto& [tensor, shard] : wm->items()) {
    if (!shard.is_string() || shard.get<std::string>().empty()) {
      fail("{}: weight_map[\"{}\"] must be a shard file name, got {}", index_path, tensor,
           json_excerpt(shard));
    }
    const std::string& file = shard.get_ref<const std::string&>();
    // A NUL would cut the name short when the shard is opened.
    if (file.find('\0') != std::string::npos) {
      fail("{}: weight_map[\"{}\"] names shard {}, which holds a NUL character", index_path, tensor,
           json_excerpt(shard));
    }
    // Shards lie in the index's folder or below it: no absolute path, no "..".
    // The check is lexical, so symlinked shards (the Hugging Face cache's
    // snapshots link to ../../blobs) still load.
    const std::filesystem::path name(file);
    const bool escapes = name.has_root_path() || std::any_of(name.begin(), name.end(),
                                                             [](const std::filesystem::path& part) {
                                                               return part == "..";
                                                             });
    if (escapes) {
      fail(
          "{}: weight_map[\"{}\"] names shard '{}', outside the checkpoint folder {} (shards must "
          "be relative paths within it)",
          index_path, tensor, file, std::filesystem::path(index_path).parent_path().string());
    }
    if (seen.insert(file).second) out.shards.push_back({file, tensor});
    out.weight_map.emplace(tensor, file);
  }
  return out;
}

namespace {

namespace fs = std::filesystem;

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// Adds every tensor of `file` to `owner`; a name already owned by another file is an error.
void add_file(const std::string& checkpoint, std::unique_ptr<SafetensorsFile> file,
              std::vector<std::unique_ptr<SafetensorsFile>>* files,
              std::map<std::string, size_t>* owner) {
  const size_t index = files->size();
  for (const TensorInfo& t : file->tensors()) {
    const auto [it, inserted] = owner->emplace(t.name, index);
    if (!inserted) {
      fail("{}: tensor '{}' appears in both {} and {}", checkpoint, t.name,
           (*files)[it->second]->path(), file->path());
    }
  }
  files->push_back(std::move(file));
}

void load_index(const std::string& checkpoint, const fs::path& index_path,
                std::vector<std::unique_ptr<SafetensorsFile>>* files,
                std::map<std::string, size_t>* owner) {
  const std::string index_name = index_path.string();
  const ShardIndex index = parse_safetensors_index(read_json_file(index_name), index_name);
  const fs::path dir = index_path.parent_path();
  std::map<std::string, std::string> shard_path;  // shard name -> path as opened
  for (const auto& [shard, tensor] : index.shards) {
    const fs::path p = dir / shard;
    if (!is_file(p)) {
      fail("{}: shard '{}' (listed for tensor '{}') does not exist at {}", index_name, shard,
           tensor, p.string());
    }
    shard_path[shard] = p.string();
    add_file(checkpoint, std::make_unique<SafetensorsFile>(p.string()), files, owner);
  }

  std::vector<std::string> problems;
  for (const auto& [tensor, shard] : index.weight_map) {
    const auto it = owner->find(tensor);
    const std::string& expected = shard_path[shard];
    if (it == owner->end()) {
      problems.push_back(
          fmt::format("tensor '{}' is listed in shard '{}' but {} has no such tensor", tensor,
                      shard, expected));
    } else if ((*files)[it->second]->path() != expected) {
      problems.push_back(fmt::format("tensor '{}' is listed in shard '{}' but is in {}", tensor,
                                     shard, (*files)[it->second]->path()));
    }
  }
  if (!problems.empty()) {
    constexpr size_t kShown = 10;
    std::string list;
    for (size_t i = 0; i < problems.size() && i < kShown; ++i) list += "\n  " + problems[i];
    if (problems.size() > kShown) list += fmt::format("\n  and {} more", problems.size() - kShown);
    fail("{}: weight_map disagrees with the shards:{}", index_name, list);
  }
}

}  // namespace

Checkpoint::Checkpoint(const std::string& path) : path_(path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail("checkpoint '{}' does not exist", path);
  if (fs::is_directory(st)) {
    const fs::path index = fs::path(path) / "model.safetensors.index.json";
    const fs::path single = fs::path(path) / "model.safetensors";
    if (is_file(index)) {
      load_index(path_, index, &files_, &owner_);
    } else if (is_file(single)) {
      add_file(path_, std::make_unique<SafetensorsFile>(single.string()), &files_, &owner_);
    } else {
      fail("{}: directory holds neither model.safetensors.index.json nor model.safetensors", path);
    }
  } else if (fs::path(path).extension() == ".json") {
    load_index(path_, fs::path(path), &files_, &owner_);
  } else {
    add_file(path_, std::make_unique<SafetensorsFile>(path), &files_, &owner_);
  }
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(owner_.size());
  for (const auto& [name, index] : owner_) out.push_back(name);
  return out;
}

bool Checkpoint::contains(const std::string& name) const {
  return owner_.count(name) != 0;
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  return files_[owner_index(name)]->info(name);
}

Tensor Checkpoint::get(const std::string& name) const {
  return files_[owner_index(name)]->get(name);
}

const std::string& Checkpoint::file_of(const std::string& name) const {
  return files_[owner_index(name)]->path();
}

size_t Checkpoint::owner_index(const std::string& name) const {
  const auto it = owner_.find(name);
  if (it == owner_.end()) fail("{}: checkpoint has no tensor named '{}'", path_, name);
  return it->second;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const NamedTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      fail("{}: cannot write a tensor named '{}'", path, t.name);
    }
    if (!names.insert(t.name).second) fail("{}: tensor '{}' given twice", path, t.name);
    if (!t.tensor.device().is_cpu()) {
      fail("{}: tensor '{}' is on {}; only CPU tensors can be written", path, t.name,
           t.tensor.device().str());
    }
    if (t.tensor.empty() && t.tensor.numel() != 0) {
      fail("{}: tensor '{}' ({}) has no data", path, t.name, t.tensor.describe());
    }
    const uint64_t nbytes = t.tensor.nbytes();
    header[t.name] = {{"dtype", dtype_safetensors_name(t.tensor.dtype())},
                      {"shape", t.tensor.shape().to_vector()},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: cannot encode the header (tensor names must be UTF-8): {}", path, e.what());
  }
  // Like the reference writer, pad with spaces so the data region starts 8-aligned.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) fail("cannot create '{}': {}", path, std::strerror(errno));
  bool ok = true;
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  ok = ok && std::fwrite(len, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const NamedTensor& t : tensors) {
    const size_t nbytes = t.tensor.nbytes();
    if (nbytes != 0) ok = ok && std::fwrite(t.tensor.data(), 1, nbytes, f) == nbytes;
  }
  const int write_errno = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) fail("cannot write '{}': {}", path, std::strerror(write_errno ? write_errno : errno));
}

}  // namespace specula::io
