// SPDX-License-Identifier: Apache-2.0
#include "engine/io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "engine/core/buffer.h"
#include "engine/core/error.h"

namespace specula::io {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::path(::testing::TempDir()) / fmt::format("specula_st_{}_{}", info->name(), ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// Runs `fn`, which must throw an Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks \"" << p << "\": " << msg;
    }
    return;
  }
  ADD_FAILURE() << "expected an Error";
}

// Writes a file made of the 8-byte length `declared_len`, the header text and `data_bytes` bytes.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes,
               uint64_t declared_len) {
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((declared_len >> (8 * i)) & 0xff));
  out << header << std::string(data_bytes, '\0');
}
void write_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  write_raw(path, header, data_bytes, header.size());
}

// A tensor whose bytes are 0, 1, 2, ... (mod 251), so any misplaced byte shows.
HostTensor patterned(DType dtype, Shape shape, int seed) {
  HostTensor t(dtype, shape);
  auto* bytes = t.data<uint8_t>();
  for (size_t i = 0; i < t.view().nbytes(); ++i) bytes[i] = static_cast<uint8_t>((i + seed) % 251);
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeWithMetadata) {
  const std::vector<std::pair<std::string, DType>> kinds = {
      {"a.f32", DType::kF32}, {"b.bf16", DType::kBF16}, {"c.f16", DType::kF16},
      {"d.i32", DType::kI32}, {"e.i64", DType::kI64},   {"f.u8", DType::kU8}};
  std::vector<HostTensor> owned;
  std::vector<NamedTensor> tensors;
  int seed = 0;
  for (const auto& [name, dtype] : kinds) {
    owned.push_back(patterned(dtype, {3, 5}, seed++));
  }
  // Given out of alphabetical order: data must follow the given order.
  for (int i = static_cast<int>(kinds.size()) - 1; i >= 0; --i) {
    tensors.push_back({kinds[static_cast<size_t>(i)].first, owned[static_cast<size_t>(i)]});
  }
  const std::string file = path("all.safetensors");
  write_safetensors(file, tensors, {{"format", "pt"}, {"note", "x"}});

  // Header padded with spaces so that the data region starts 8-aligned.
  std::ifstream in(file, std::ios::binary);
  uint8_t len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  EXPECT_EQ(header_len % 8, 0u);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_first_not_of(' ', header.rfind('}') + 1), std::string::npos);
  EXPECT_EQ(fs::file_size(file), 8 + header_len + 15 * (4 + 2 + 2 + 4 + 8 + 1));

  SafetensorsFile st(file);
  ASSERT_EQ(st.tensors().size(), kinds.size());
  EXPECT_EQ(st.metadata().at("format"), "pt");
  EXPECT_EQ(st.metadata().at("note"), "x");
  // tensors() is in data order, i.e. the order given to the writer.
  EXPECT_EQ(st.tensors().front().name, "f.u8");
  EXPECT_EQ(st.tensors().front().data_begin, 0u);
  EXPECT_EQ(st.tensors().back().name, "a.f32");
  for (size_t i = 0; i < kinds.size(); ++i) {
    const auto& [name, dtype] = kinds[i];
    ASSERT_TRUE(st.contains(name));
    const Tensor t = st.get(name);
    EXPECT_EQ(t.dtype(), dtype) << name;
    EXPECT_EQ(t.shape(), Shape({3, 5})) << name;
    EXPECT_TRUE(same_bytes(t, owned[i])) << name;
  }
  EXPECT_FALSE(st.contains("nope"));
  expect_error([&] { (void)st.get("nope"); }, {file, "nope"});
}

TEST_F(SafetensorsTest, RoundTripsScalarsAndEmptyTensors) {
  HostTensor scalar = patterned(DType::kF32, Shape{}, 7);
  HostTensor empty(DType::kBF16, {0, 4});
  HostTensor after = patterned(DType::kU8, {3}, 1);
  const std::string file = path("edge.safetensors");
  write_safetensors(file, {{"scalar", scalar}, {"empty", empty}, {"after", after}});
  SafetensorsFile st(file);
  EXPECT_EQ(st.get("scalar").rank(), 0);
  EXPECT_TRUE(same_bytes(st.get("scalar"), scalar));
  EXPECT_EQ(st.get("empty").shape(), Shape({0, 4}));
  EXPECT_FALSE(st.get("empty").empty());  // present, just zero-sized
  EXPECT_TRUE(same_bytes(st.get("after"), after));
  EXPECT_TRUE(st.metadata().empty());
}

TEST_F(SafetensorsTest, MovedFileKeepsItsMapping) {
  HostTensor a = patterned(DType::kF32, {4}, 3);
  write_safetensors(path("a.safetensors"), {{"w", a}});
  write_safetensors(path("b.safetensors"), {{"v", a}});
  SafetensorsFile first(path("a.safetensors"));
  SafetensorsFile moved(std::move(first));
  EXPECT_TRUE(same_bytes(moved.get("w"), a));
  SafetensorsFile other(path("b.safetensors"));
  other = std::move(moved);  // unmaps b, takes over a
  EXPECT_EQ(other.path(), path("a.safetensors"));
  EXPECT_TRUE(same_bytes(other.get("w"), a));
  EXPECT_FALSE(other.contains("v"));
}

TEST_F(SafetensorsTest, WriterRejectsDuplicateNames) {
  HostTensor a(DType::kF32, {2});
  expect_error(
      [&] {
        write_safetensors(path("d.safetensors"), {{"x", a}, {"x", a}});
      },
      {path("d.safetensors"), "'x'"});
}

TEST_F(SafetensorsTest, CheckpointFromSingleFileDirectoryAndPath) {
  HostTensor a = patterned(DType::kBF16, {2, 3}, 1);
  HostTensor b = patterned(DType::kF32, {5}, 2);
  write_safetensors(path("model.safetensors"), {{"model.b", b}, {"model.a", a}});
  for (const std::string& p : {dir_.string(), path("model.safetensors")}) {
    Checkpoint ck(p);
    EXPECT_EQ(ck.names(), (std::vector<std::string>{"model.a", "model.b"}));
    EXPECT_TRUE(same_bytes(ck.get("model.a"), a));
    EXPECT_EQ(ck.info("model.b").shape, Shape({5}));
    EXPECT_EQ(ck.file_of("model.a"), path("model.safetensors"));
    EXPECT_FALSE(ck.contains("model.c"));
    expect_error([&] { (void)ck.get("model.c"); }, {p, "model.c"});
  }
}

void write_index(const std::string& path, const std::string& weight_map) {
  std::ofstream(path) << R"({"metadata": {"total_size": 0}, "weight_map": )" << weight_map << "}";
}

TEST_F(SafetensorsTest, CheckpointFromShardedIndex) {
  HostTensor a = patterned(DType::kF16, {4, 2}, 1);
  HostTensor b = patterned(DType::kF32, {3}, 2);
  HostTensor c = patterned(DType::kI64, {2}, 3);
  write_safetensors(path("model-00001-of-00002.safetensors"), {{"x.a", a}, {"x.c", c}});
  write_safetensors(path("model-00002-of-00002.safetensors"), {{"x.b", b}});
  write_index(
      path("model.safetensors.index.json"),
      R"({"x.a": "model-00001-of-00002.safetensors", "x.b": "model-00002-of-00002.safetensors",
                  "x.c": "model-00001-of-00002.safetensors"})");
  for (const std::string& p : {dir_.string(), path("model.safetensors.index.json")}) {
    Checkpoint ck(p);
    EXPECT_EQ(ck.names(), (std::vector<std::string>{"x.a", "x.b", "x.c"}));
    EXPECT_EQ(ck.file_of("x.b"), path("model-00002-of-00002.safetensors"));
    EXPECT_EQ(ck.file_of("x.c"), path("model-00001-of-00002.safetensors"));
    EXPECT_TRUE(same_bytes(ck.get("x.a"), a));
    EXPECT_TRUE(same_bytes(ck.get("x.b"), b));
    EXPECT_TRUE(same_bytes(ck.get("x.c"), c));
    EXPECT_EQ(ck.info("x.c").dtype, DType::kI64);
  }
}

TEST_F(SafetensorsTest, MissingShardNamesIndexAndShard) {
  HostTensor a(DType::kF32, {1});
  write_safetensors(path("s1.safetensors"), {{"x.a", a}});
  write_index(path("model.safetensors.index.json"),
              R"({"x.a": "s1.safetensors", "x.b": "s2.safetensors"})");
  expect_error([&] { Checkpoint ck(dir_.string()); },
               {path("model.safetensors.index.json"), "s2.safetensors", "x.b", "does not exist"});
}

TEST_F(SafetensorsTest, ShardsAreConfinedToTheCheckpointFolder) {
  // A valid shard outside the folder: only the confinement rule refuses it.
  HostTensor a(DType::kF32, {1});
  const fs::path outside =
      dir_.parent_path() / fmt::format("specula_outside_{}.safetensors", ::getpid());
  write_safetensors(outside.string(), {{"x.a", a}});
  for (const std::string& shard : std::vector<std::string>{
           "../" + outside.filename().string(), outside.string(), "sub/../../etc/passwd"}) {
    SCOPED_TRACE(shard);
    write_index(path("model.safetensors.index.json"), fmt::format(R"({{"x.a": "{}"}})", shard));
    expect_error([&] { Checkpoint ck(dir_.string()); },
                 {path("model.safetensors.index.json"), shard, "outside the checkpoint folder"});
  }
  fs::remove(outside);

  // Subfolders and symlinks to files elsewhere (the Hugging Face cache) are fine.
  fs::create_directories(dir_ / "sub");
  write_safetensors(path("sub/s1.safetensors"), {{"x.a", a}});
  const fs::path blob = dir_.parent_path() / fmt::format("specula_blob_{}", ::getpid());
  write_safetensors(blob.string(), {{"x.b", a}});
  fs::create_symlink(blob, dir_ / "s2.safetensors");
  write_index(path("model.safetensors.index.json"),
              R"({"x.a": "sub/s1.safetensors", "x.b": "s2.safetensors"})");
  Checkpoint ck(dir_.string());
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"x.a", "x.b"}));
  fs::remove(blob);
}

// The index alone, as the safetensors_index fuzz target reads it.
TEST(SafetensorsIndex, ParsesShardsInOrderOfFirstMention) {
  const ShardIndex index = parse_safetensors_index(
      nlohmann::json::parse(R"({"weight_map": {"b": "s2.safetensors", "a": "sub/s1.safetensors",
                                               "c": "s2.safetensors"}})"),
      "/m/model.safetensors.index.json");
  ASSERT_EQ(index.shards.size(), 2u);
  EXPECT_EQ(index.shards[0].file, "sub/s1.safetensors");
  EXPECT_EQ(index.shards[0].first_tensor, "a");
  EXPECT_EQ(index.shards[1].file, "s2.safetensors");
  EXPECT_EQ(index.weight_map.at("c"), "s2.safetensors");
  // A NUL would cut the name short when the shard is opened.
  expect_error(
      [] {
        (void)parse_safetensors_index(
            nlohmann::json::parse(R"({"weight_map": {"a": "s.safetensors\u0000/../../x"}})"),
            "/m/model.safetensors.index.json");
      },
      {"/m/model.safetensors.index.json", "weight_map[\"a\"]", "NUL"});
}

TEST_F(SafetensorsTest, IndexNamingATensorTheShardLacks) {
  HostTensor a(DType::kF32, {1});
  write_safetensors(path("s1.safetensors"), {{"x.a", a}});
  write_index(path("model.safetensors.index.json"),
              R"({"x.a": "s1.safetensors", "x.ghost": "s1.safetensors"})");
  expect_error([&] { Checkpoint ck(dir_.string()); },
               {path("model.safetensors.index.json"), "x.ghost", "s1.safetensors"});
}

TEST_F(SafetensorsTest, DuplicateTensorAcrossShards) {
  HostTensor a(DType::kF32, {1});
  write_safetensors(path("s1.safetensors"), {{"x.a", a}});
  write_safetensors(path("s2.safetensors"), {{"x.a", a}, {"x.b", a}});
  write_index(path("model.safetensors.index.json"),
              R"({"x.a": "s1.safetensors", "x.b": "s2.safetensors"})");
  expect_error([&] { Checkpoint ck(dir_.string()); },
               {"x.a", path("s1.safetensors"), path("s2.safetensors")});
}

TEST_F(SafetensorsTest, BadIndexAndEmptyDirectory) {
  expect_error([&] { Checkpoint ck(dir_.string()); }, {dir_.string(), "model.safetensors"});
  expect_error([&] { Checkpoint ck(path("nowhere")); }, {path("nowhere")});
  std::ofstream(path("model.safetensors.index.json")) << R"({"weight_map": [1, 2]})";
  expect_error([&] { Checkpoint ck(dir_.string()); },
               {path("model.safetensors.index.json"), "weight_map"});
  std::ofstream(path("model.safetensors.index.json")) << R"({"weight_map": {"x": 3}})";
  expect_error([&] { Checkpoint ck(dir_.string()); },
               {path("model.safetensors.index.json"), "weight_map[\"x\"]"});
  std::ofstream(path("model.safetensors.index.json")) << R"({"weight_map": )";
  expect_error([&] { Checkpoint ck(dir_.string()); },
               {path("model.safetensors.index.json"), "invalid JSON"});
}

TEST_F(SafetensorsTest, TruncatedFileSaysHowBigItIs) {
  HostTensor a = patterned(DType::kF32, {16}, 0);
  HostTensor b = patterned(DType::kF32, {16}, 1);
  const std::string file = path("t.safetensors");
  write_safetensors(file, {{"first", a}, {"second", b}});
  const uint64_t full = fs::file_size(file);
  fs::resize_file(file, full - 10);
  expect_error([&] { SafetensorsFile st(file); },
               {file, fmt::format("file is {} bytes but the header says", full - 10), "'second'",
                "truncated"});
  // Cut inside the header: the length field promises more than there is.
  fs::resize_file(file, 20);
  expect_error([&] { SafetensorsFile st(file); }, {file, "file is 20 bytes but the header says"});
  fs::resize_file(file, 5);
  expect_error([&] { SafetensorsFile st(file); }, {file, "5 bytes"});
}

TEST_F(SafetensorsTest, AbsurdHeaderLength) {
  const std::string file = path("absurd.safetensors");
  write_raw(file, "{}", 0, 0x7fffffffffffull);
  expect_error([&] { SafetensorsFile st(file); }, {file, "not a safetensors file"});
}

TEST_F(SafetensorsTest, HeaderLyingAboutOffsetsInAFile) {
  const std::string file = path("lie.safetensors");
  write_raw(file, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8);
  expect_error([&] { SafetensorsFile st(file); }, {file, "'w'", "truncated"});
  write_raw(file, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}})", 16);
  expect_error([&] { SafetensorsFile st(file); }, {file, "'w'", "8 bytes", "span 12 bytes"});
  write_raw(file, R"({"w": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}})", 2);
  expect_error([&] { SafetensorsFile st(file); }, {file, "'w'", "F8_E5M2"});
  write_raw(file, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, )", 8);
  expect_error([&] { SafetensorsFile st(file); }, {file, "invalid JSON"});
}

// The header parser on its own, as the fuzz target drives it.
void expect_header_error(const std::string& header, uint64_t data_size,
                         const std::vector<std::string>& parts) {
  std::vector<std::string> with_origin = parts;
  with_origin.push_back("origin.safetensors");
  expect_error(
      [&] { (void)parse_safetensors_header(header, data_size, "origin.safetensors", nullptr); },
      with_origin);
}

TEST(SafetensorsHeader, ParsesAValidHeader) {
  std::map<std::string, std::string> meta;
  const auto tensors = parse_safetensors_header(
      R"({"__metadata__": {"format": "pt"},
          "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]},
          "a": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
          "z": {"dtype": "U8", "shape": [0], "data_offsets": [8, 8]}})",
      16, "h", &meta);
  ASSERT_EQ(tensors.size(), 3u);
  EXPECT_EQ(tensors[0].name, "a");
  EXPECT_EQ(tensors[1].name, "z");  // empty tensor, sorted by offset then name
  EXPECT_EQ(tensors[2].name, "b");
  EXPECT_EQ(tensors[2].dtype, DType::kBF16);
  EXPECT_EQ(tensors[2].shape, Shape({2, 2}));
  EXPECT_EQ(meta.at("format"), "pt");
}

TEST(SafetensorsHeader, RejectsOffsetsBeyondTheData) {
  expect_header_error(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12,
                      {"'w'", "beyond the data region of 12 bytes"});
}

TEST(SafetensorsHeader, RejectsOverlaps) {
  expect_header_error(R"({"p": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "q": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                      16, {"'p'", "'q'", "overlap"});
  // An empty tensor inside another one's bytes is not an overlap.
  EXPECT_NO_THROW((void)parse_safetensors_header(
      R"({"p": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
          "q": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
      16, "h", nullptr));
}

TEST(SafetensorsHeader, RejectsSizeMismatchWithShape) {
  expect_header_error(R"({"w": {"dtype": "BF16", "shape": [3, 3], "data_offsets": [0, 16]}})", 64,
                      {"'w'", "bf16[3, 3]", "18 bytes", "span 16 bytes"});
}

TEST(SafetensorsHeader, RejectsUnknownDtype) {
  expect_header_error(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8,
                      {"'w'", "unsupported dtype 'F64'"});
  expect_header_error(R"({"w": {"dtype": 3, "shape": [1], "data_offsets": [0, 8]}})", 8,
                      {"'w'", "dtype"});
}

TEST(SafetensorsHeader, RejectsMalformedEntries) {
  expect_header_error("not json", 0, {"invalid JSON"});
  expect_header_error("[1, 2]", 0, {"JSON object", "array"});
  expect_header_error(R"({"w": 5})", 0, {"'w'", "object"});
  expect_header_error(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})", 0,
                      {"'w'", "shape[0]", "-1"});
  expect_header_error(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 0]}})", 0,
                      {"'w'", "shape[0]"});
  expect_header_error(
      R"({"w": {"dtype": "F32", "shape": [1,1,1,1,1,1,1], "data_offsets": [0, 4]}})", 4,
      {"'w'", "rank 7"});
  expect_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8,
                      {"'w'", "[8, 4]"});
  expect_header_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 8,
                      {"'w'", "data_offsets"});
  expect_header_error(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 8, {"'w'", "shape"});
  expect_header_error(
      R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 4]}})",
      8, {"'w'", "too many elements"});
  expect_header_error(R"({"__metadata__": {"k": 1}})", 0, {"__metadata__", "\"k\""});
  expect_header_error(std::string(1000, '[') + std::string(1000, ']'), 0, {"nesting"});
}

}  // namespace
}  // namespace specula::io
