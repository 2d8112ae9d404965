// SPDX-License-Identifier: Apache-2.0
// The output folder of `specula regen`: shards (engine/lab/dspark_shard.h),
// the manifest `regen.json` and the ledger `ledger.txt`, kept consistent
// across interrupted runs.
//
// Commit order for each shard: the shard is written to a .tmp and renamed;
// then its prompts are appended to the ledger, one line each,
// "<prompt index>\t<shard file>\n", in one write; then the manifest is
// rewritten (through a .tmp and a rename). A run killed at any point leaves
// either a shard that the ledger does not name (an orphan: removed at the next
// start, and its prompts are generated again), or a ledger that names it. On
// start, stale .tmp files are removed, a torn last ledger line (no newline) is
// dropped, and the manifest's shard list is rebuilt from the ledger.
#pragma once

#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "engine/lab/dspark_shard.h"

namespace specula::cli {

// What a run writes and a resumed run must share (else it is refused,
// naming the field and both values). The first group is informative only.
struct RegenIdentity {
  std::string target_dir, version, tap_source;
  int64_t prompt_count = 0;
  int64_t num_hidden_layers = 0;
  // Compared on resume.
  std::string config_hash;
  std::vector<int> tap_layers;
  std::string prompt_file, prompt_kind;  // prompt_file absolute
  int chunk_lines = 0;                   // folder sources only (else 0)
  double temperature = 0;
  uint64_t seed = 0;
  int max_tokens = 0;
};

struct ShardRecord {
  std::string file;
  int64_t sequences = 0, tokens = 0, response_tokens = 0;
};

class RegenOutput {
 public:
  inline static const char* kManifest = "regen.json";
  inline static const char* kLedger = "ledger.txt";

  // Opens `dir` (created if missing), refuses it when its manifest's identity
  // differs from `id` or it holds a ledger without a manifest, cleans it up as
  // above and writes the manifest. Errors name the file and the field.
  RegenOutput(std::string dir, RegenIdentity id, bool quiet);

  const std::set<int64_t>& finished() const { return finished_; }
  const std::vector<ShardRecord>& shards() const { return shards_; }
  // Writes `shard` as the next shard file, then records `prompts` (its
  // sequences' prompt indices, in order) in the ledger and the manifest.
  void commit_shard(const lab::DSparkShard& shard, std::span<const int64_t> prompts);

 private:
  std::string path(const std::string& name) const;
  void check_identity(const std::string& manifest_path) const;
  void load_ledger();
  void clean_up(bool quiet);
  void write_manifest() const;

  std::string dir_;
  RegenIdentity id_;
  std::set<int64_t> finished_;
  std::vector<std::string> ledger_shards_;  // distinct, in ledger order
  std::vector<ShardRecord> shards_;
  int64_t next_index_ = 0;
};

}  // namespace specula::cli
