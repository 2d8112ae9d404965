// SPDX-License-Identifier: Apache-2.0
// The DSpark training shard (engine/lab/dspark_shard.h): a write/read round
// trip keeps every tensor and metadata field exactly, the tap-major forward
// layout is transposed into per-position rows, writes go through a temporary
// file and a rename, and malformed shards are refused naming the field.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "engine/core/buffer.h"
#include "engine/core/dtype.h"
#include "engine/core/error.h"
#include "engine/core/tensor.h"
#include "engine/io/safetensors.h"
#include "engine/lab/dspark_shard.h"
#include "tests/unit/lab/lab_test_util.h"

namespace specula::lab {
namespace {

using testing::ScratchDir;

ShardMeta test_meta() {
  return {.tap_layers = {1, 3, 4},
          .hidden_size = 4,
          .vocab_size = 50,
          .target_config_hash = "abc123",
          .seed = 7,
          .temperature = 0.7};
}

// taps f32 [m, rows, H] whose value names (tap, row, h) exactly in bf16.
std::vector<float> tap_values(int64_t m, int64_t rows, int64_t H) {
  std::vector<float> v(static_cast<size_t>(m * rows * H));
  for (int64_t k = 0; k < m; ++k)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < H; ++h)
        v[static_cast<size_t>((k * rows + r) * H + h)] = static_cast<float>(k * 100 + r * 4 + h);
  return v;
}

DSparkShard two_sequences() {
  DSparkShard s;
  s.meta = test_meta();
  const std::vector<float> taps = tap_values(3, 9, 4);
  const TapRowsView view{.data = taps.data(), .taps = 3, .rows = 9, .hidden = 4};
  const std::vector<int32_t> a = {2, 10, 11, 12, 40}, b = {2, 20, 21, 1};
  s.add_sequence(a, 3, view, 0);  // rows 0..4 of the forward
  s.add_sequence(b, 2, view, 5);  // rows 5..8
  return s;
}

TEST(DSparkShard, AddSequenceLaysOutTapsPerPosition) {
  const DSparkShard s = two_sequences();
  ASSERT_EQ(s.rows(), 9);
  ASSERT_EQ(s.sequences(), 2);
  EXPECT_EQ(s.seq_starts, (std::vector<int64_t>{0, 5, 9}));
  EXPECT_EQ(s.resp_starts, (std::vector<int64_t>{3, 7}));
  // Row p, tap k, feature h = k·100 + p·4 + h (rows of the forward = rows of the shard here).
  for (int64_t p = 0; p < 9; ++p)
    for (int64_t k = 0; k < 3; ++k)
      for (int64_t h = 0; h < 4; ++h)
        EXPECT_EQ(bf16_to_f32(s.hidden[static_cast<size_t>(p * 12 + k * 4 + h)]),
                  static_cast<float>(k * 100 + p * 4 + h))
            << p << " " << k << " " << h;
}

TEST(DSparkShard, RoundTripKeepsEverything) {
  ScratchDir dir("shard_roundtrip");
  const DSparkShard s = two_sequences();
  const std::string path = dir.file(shard_file_name(3));
  EXPECT_EQ(std::filesystem::path(path).filename(), "shard_00003.safetensors");
  write_shard(path, s);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  const DSparkShard r = read_shard(path);
  EXPECT_EQ(r.meta, s.meta);
  EXPECT_EQ(r.hidden, s.hidden);
  EXPECT_EQ(r.ids, s.ids);
  EXPECT_EQ(r.seq_starts, s.seq_starts);
  EXPECT_EQ(r.resp_starts, s.resp_starts);
  // The fixed names, dtypes and metadata strings the trainer reads.
  const io::SafetensorsFile file(path);
  EXPECT_EQ(file.info("hidden").dtype, DType::kBF16);
  EXPECT_EQ(file.info("hidden").shape.to_vector(), (std::vector<int64_t>{9, 12}));
  EXPECT_EQ(file.info("ids").dtype, DType::kI32);
  EXPECT_EQ(file.info("seq_starts").dtype, DType::kI64);
  EXPECT_EQ(file.info("resp_starts").dtype, DType::kI64);
  EXPECT_EQ(file.metadata().at("format"), "specula-dspark-shard-v1");
  EXPECT_EQ(file.metadata().at("tap_layers"), "1,3,4");
  EXPECT_EQ(file.metadata().at("hidden_size"), "4");
  EXPECT_EQ(file.metadata().at("vocab_size"), "50");
  EXPECT_EQ(file.metadata().at("target_config_hash"), "abc123");
  EXPECT_EQ(file.metadata().at("seed"), "7");
  EXPECT_EQ(file.metadata().at("temperature"), "0.7");
}

TEST(DSparkShard, UnwritableFolderFailsCleanly) {
  ScratchDir dir("shard_unwritable");
  const std::string path = dir.file("missing/shard_00000.safetensors");
  try {
    write_shard(path, two_sequences());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing/shard_00000.safetensors.tmp"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(DSparkShard, FullDiskFailsWithoutLeavingFiles) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  // A .tmp that is a symlink to /dev/full: the write fails on flush/close.
  ScratchDir dir("shard_full");
  const std::string path = dir.file("shard_00000.safetensors");
  std::filesystem::create_symlink("/dev/full", path + ".tmp");
  EXPECT_THROW(write_shard(path, two_sequences()), Error);
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(DSparkShard, RefusesInconsistentShards) {
  DSparkShard s = two_sequences();
  s.resp_starts[1] = 4;  // inside sequence 0
  EXPECT_THROW(check_shard(s, "x"), Error);
  s = two_sequences();
  s.ids[2] = 50;  // == vocab
  EXPECT_THROW(check_shard(s, "x"), Error);
  s = two_sequences();
  s.hidden.pop_back();
  EXPECT_THROW(check_shard(s, "x"), Error);
}

TEST(DSparkShard, ReadRefusesOtherFiles) {
  ScratchDir dir("shard_other");
  const std::string path = dir.file("other.safetensors");
  HostTensor t(DType::kF32, {2});
  io::write_safetensors(path, {{"x", t}}, {{"format", "something-else"}});
  try {
    read_shard(path);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("something-else"), std::string::npos) << e.what();
  }
}

TEST(DSparkShard, TapListParsing) {
  EXPECT_EQ(parse_tap_list("4, 6,7,8", "--tap-layers"), (std::vector<int>{4, 6, 7, 8}));
  EXPECT_EQ(tap_list(std::vector<int>{4, 6}), "4,6");
  EXPECT_THROW(parse_tap_list("4,x", "--tap-layers"), Error);
  EXPECT_THROW(parse_tap_list("4,,5", "--tap-layers"), Error);
  EXPECT_THROW(parse_tap_list("-1", "--tap-layers"), Error);
}

}  // namespace
}  // namespace specula::lab
