// SPDX-License-Identifier: Apache-2.0
#include "apps/cli/regen_output.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/core/error.h"
#include "engine/io/safetensors.h"

namespace specula::cli {
namespace {

namespace fs = std::filesystem;

// Writes `text` to `path` through a .tmp and a rename; errors name the file.
void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) fail("cannot create '{}': {}", tmp, std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  std::error_code ec;
  if (!ok) {
    fs::remove(tmp, ec);
    fail("cannot write '{}': {}", tmp, std::strerror(err));
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    fail("cannot rename '{}' to '{}': {}", tmp, path, ec.message());
  }
}

// Appends `text` in one write and syncs it; errors name the file.
void append_file(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot open '{}' for appending: {}", path, std::strerror(errno));
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int err = errno;
  const bool synced = ::fsync(fd) == 0;
  const int sync_err = errno;
  const bool closed = ::close(fd) == 0;
  if (n != static_cast<ssize_t>(text.size()))
    fail("cannot append to '{}': {}", path, n < 0 ? std::strerror(err) : "short write");
  if (!synced || !closed)
    fail("cannot append to '{}': {}", path, std::strerror(synced ? errno : sync_err));
}

bool is_shard_name(const std::string& name) {
  return name.size() == std::string("shard_00000.safetensors").size() &&
         name.starts_with("shard_") && name.ends_with(".safetensors");
}

nlohmann::json identity_json(const RegenIdentity& id) {
  return {{"config_hash", id.config_hash},
          {"tap_layers", id.tap_layers},
          {"prompt_file", id.prompt_file},
          {"prompt_kind", id.prompt_kind},
          {"chunk_lines", id.chunk_lines},
          {"temperature", id.temperature},
          {"seed", id.seed},
          {"max_tokens", id.max_tokens}};
}

}  // namespace

RegenOutput::RegenOutput(std::string dir, RegenIdentity id, bool quiet)
    : dir_(std::move(dir)), id_(std::move(id)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_))
    fail("--out {}: cannot create the folder{}{}", dir_, ec ? ": " : "", ec ? ec.message() : "");
  const std::string manifest = path(kManifest);
  if (fs::exists(manifest)) {
    check_identity(manifest);
  } else if (fs::exists(path(kLedger))) {
    fail("--out {}: holds {} but no {}; not a regen folder this run can resume", dir_, kLedger,
         kManifest);
  }
  load_ledger();
  clean_up(quiet);
  write_manifest();  // also proves the folder writable before any work
}

std::string RegenOutput::path(const std::string& name) const {
  return (fs::path(dir_) / name).string();
}

void RegenOutput::check_identity(const std::string& manifest_path) const {
  std::ifstream in(manifest_path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("identity"))
    fail("{}: not a regen manifest (no \"identity\" object)", manifest_path);
  const nlohmann::json want = identity_json(id_);
  std::string diffs;
  for (const auto& [key, value] : want.items()) {
    const auto it = j["identity"].find(key);
    if (it != j["identity"].end() && *it == value) continue;
    diffs += fmt::format("{}{} = {} there, {} here", diffs.empty() ? "" : "; ", key,
                         it == j["identity"].end() ? "(absent)" : it->dump(), value.dump());
  }
  if (!diffs.empty()) {
    fail(
        "--out {}: this folder was written with other settings ({}); use another --out or the "
        "same settings (its target: {})",
        dir_, diffs, j.value("target_dir", std::string("?")));
  }
}

void RegenOutput::load_ledger() {
  const std::string ledger = path(kLedger);
  if (!fs::exists(ledger)) return;
  std::ifstream in(ledger, std::ios::binary);
  if (!in) fail("{}: cannot open the file", ledger);
  std::stringstream buf;
  buf << in.rdbuf();
  std::string text = buf.str();
  const size_t complete = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  if (complete != text.size()) {
    // A torn append (the run was killed mid-write): drop it; its shard is an orphan.
    text.resize(complete);
    write_file_atomic(ledger, text);
  }
  std::istringstream lines(text);
  std::string line;
  for (int n = 1; std::getline(lines, line); ++n) {
    const size_t tab = line.find('\t');
    int64_t index = -1;
    try {
      size_t used = 0;
      index = tab == std::string::npos ? -1 : std::stoll(line.substr(0, tab), &used);
      if (used != tab) index = -1;
    } catch (const std::exception&) {
      index = -1;
    }
    const std::string shard = tab == std::string::npos ? "" : line.substr(tab + 1);
    if (index < 0 || !is_shard_name(shard))
      fail("{}:{}: expected \"<prompt index>\\t<shard file>\", got '{}'", ledger, n, line);
    finished_.insert(index);
    if (std::find(ledger_shards_.begin(), ledger_shards_.end(), shard) == ledger_shards_.end())
      ledger_shards_.push_back(shard);
  }
}

void RegenOutput::clean_up(bool quiet) {
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const bool orphan =
        is_shard_name(name) &&
        std::find(ledger_shards_.begin(), ledger_shards_.end(), name) == ledger_shards_.end();
    if (!name.ends_with(".tmp") && !orphan) continue;
    if (!quiet) fmt::print(stderr, "regen: removing {} left by an interrupted run\n", path(name));
    std::error_code ec;
    fs::remove(path(name), ec);
    if (ec) fail("cannot remove '{}': {}", path(name), ec.message());
  }
  for (const std::string& name : ledger_shards_) {
    if (!fs::exists(path(name)))
      fail(
          "{}: names {}, which is missing; remove its lines from the ledger to generate them again",
          path(kLedger), path(name));
    const io::SafetensorsFile file(path(name));
    ShardRecord r{.file = name};
    r.tokens = file.info("ids").shape.dim(0);
    r.sequences = file.info("resp_starts").shape.dim(0);
    // Copied out: a safetensors tensor's data need not be 8-byte aligned.
    const auto n = static_cast<size_t>(r.sequences);
    std::vector<int64_t> seq(n + 1), resp(n);
    std::memcpy(seq.data(), file.get("seq_starts").data_as<const int64_t>(),
                (n + 1) * sizeof(int64_t));
    std::memcpy(resp.data(), file.get("resp_starts").data_as<const int64_t>(), n * sizeof(int64_t));
    for (size_t s = 0; s < n; ++s) r.response_tokens += seq[s + 1] - resp[s];
    shards_.push_back(r);
    next_index_ = std::max<int64_t>(next_index_, std::stoll(name.substr(6, 5)) + 1);
  }
}

void RegenOutput::write_manifest() const {
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  int64_t sequences = 0, tokens = 0, response_tokens = 0;
  for (const ShardRecord& r : shards_) {
    shards.push_back({{"file", r.file},
                      {"sequences", r.sequences},
                      {"tokens", r.tokens},
                      {"response_tokens", r.response_tokens}});
    sequences += r.sequences;
    tokens += r.tokens;
    response_tokens += r.response_tokens;
  }
  nlohmann::ordered_json j = {
      {"kind", "specula-regen"},
      {"shard_format", lab::kShardFormat},
      {"specula_version", id_.version},
      {"target_dir", id_.target_dir},
      {"target_config_hash", id_.config_hash},
      {"num_hidden_layers", id_.num_hidden_layers},
      {"tap_layers", id_.tap_layers},
      {"tap_source", id_.tap_source},
      {"prompt_file", id_.prompt_file},
      {"prompt_kind", id_.prompt_kind},
      {"prompt_count", id_.prompt_count},
      {"sampling",
       {{"temperature", id_.temperature}, {"seed", id_.seed}, {"max_tokens", id_.max_tokens}}},
      {"identity", identity_json(id_)},
      {"finished_prompts", finished_.size()},
      {"totals",
       {{"sequences", sequences}, {"tokens", tokens}, {"response_tokens", response_tokens}}},
      {"shards", shards}};
  write_file_atomic(path(kManifest), j.dump(2) + "\n");
}

void RegenOutput::commit_shard(const lab::DSparkShard& shard, std::span<const int64_t> prompts) {
  SPECULA_CHECK(static_cast<int64_t>(prompts.size()) == shard.sequences(),
                "regen: {} prompts for a shard of {} sequences", prompts.size(), shard.sequences());
  const std::string name = lab::shard_file_name(next_index_);
  lab::write_shard(path(name), shard);
  std::string lines;
  for (int64_t p : prompts) lines += fmt::format("{}\t{}\n", p, name);
  append_file(path(kLedger), lines);
  ++next_index_;
  finished_.insert(prompts.begin(), prompts.end());
  ShardRecord r{.file = name, .sequences = shard.sequences(), .tokens = shard.rows()};
  for (int64_t s = 0; s < shard.sequences(); ++s) {
    const auto u = static_cast<size_t>(s);
    r.response_tokens += shard.seq_starts[u + 1] - shard.resp_starts[u];
  }
  shards_.push_back(r);
  ledger_shards_.push_back(name);
  write_manifest();
}

}  // namespace specula::cli
