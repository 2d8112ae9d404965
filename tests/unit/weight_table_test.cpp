// SPDX-License-Identifier: Apache-2.0
#include "engine/io/weight_table.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "engine/core/buffer.h"
#include "engine/core/error.h"

namespace specula::io {
namespace {

namespace fs = std::filesystem;

class WeightTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::path(::testing::TempDir()) / fmt::format("specula_wt_{}_{}", info->name(), ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    file_ = (dir_ / "model.safetensors").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `model.safetensors` with tensors of the given dtypes and shapes.
  void write(const std::vector<std::tuple<std::string, DType, Shape>>& spec) {
    std::vector<HostTensor> owned;
    std::vector<NamedTensor> named;
    owned.reserve(spec.size());
    for (const auto& [name, dtype, shape] : spec) owned.emplace_back(dtype, shape);
    for (size_t i = 0; i < spec.size(); ++i) named.push_back({std::get<0>(spec[i]), owned[i]});
    write_safetensors(file_, named);
  }

  // The Error message of binding `table`, or "" if it bound.
  std::string bind_error(const WeightTable& table, const Checkpoint& ck) {
    try {
      table.bind(ck);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
  std::string file_;
};

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST_F(WeightTableTest, BindsEveryDeclaredWeight) {
  write({{"m.w", DType::kBF16, {4, 2}}, {"m.n", DType::kF32, {4}}, {"m.ids", DType::kI64, {3}}});
  Checkpoint ck(file_);
  Tensor w, n, ids;
  WeightTable table;
  table.add("m.w", {4, 2}, &w);
  table.add("m.n", {4}, &n);
  table.add_typed("m.ids", {3}, {DType::kI64}, &ids);
  table.bind(ck);
  EXPECT_EQ(w.dtype(), DType::kBF16);
  EXPECT_EQ(w.shape(), Shape({4, 2}));
  EXPECT_EQ(w.data(), ck.get("m.w").data());  // a view into the mapping, not a copy
  EXPECT_EQ(n.dtype(), DType::kF32);
  EXPECT_EQ(ids.dtype(), DType::kI64);
  EXPECT_EQ(table.entries().size(), 3u);
}

TEST_F(WeightTableTest, MissingRequiredWeight) {
  write({{"m.w", DType::kF32, {2}}});
  Checkpoint ck(file_);
  Tensor w, gone;
  WeightTable table;
  table.add("m.w", {2}, &w);
  table.add("m.gone", {3, 3}, &gone);
  const std::string msg = bind_error(table, ck);
  EXPECT_TRUE(contains(msg, file_)) << msg;
  EXPECT_TRUE(contains(msg, "missing: m.gone")) << msg;
  EXPECT_TRUE(contains(msg, "[3, 3]")) << msg;
  EXPECT_TRUE(w.empty()) << "nothing is bound when binding fails";
}

TEST_F(WeightTableTest, OptionalWeightStaysEmptyWhenAbsent) {
  write({{"m.w", DType::kF32, {2}}});
  Checkpoint ck(file_);
  Tensor w, opt;
  HostTensor stale(DType::kF32, {1});
  opt = stale;  // a leftover view must be cleared, not kept
  WeightTable table;
  table.add("m.w", {2}, &w);
  table.add("m.opt", {5}, &opt, /*required=*/false);
  table.bind(ck);
  EXPECT_FALSE(w.empty());
  EXPECT_TRUE(opt.empty());
}

TEST_F(WeightTableTest, OptionalWeightIsStillChecked) {
  write({{"m.opt", DType::kF32, {6}}});
  Checkpoint ck(file_);
  Tensor opt;
  WeightTable table;
  table.add("m.opt", {5}, &opt, /*required=*/false);
  const std::string msg = bind_error(table, ck);
  EXPECT_TRUE(contains(msg, "m.opt: expected [5], got [6] in file " + file_)) << msg;
}

TEST_F(WeightTableTest, ShapeMismatchNamesBothShapesAndFile) {
  write({{"m.w", DType::kF32, {3, 2}}});
  Checkpoint ck(file_);
  Tensor w;
  WeightTable table;
  table.add("m.w", {2, 3}, &w);
  const std::string msg = bind_error(table, ck);
  EXPECT_TRUE(contains(msg, "m.w: expected [2, 3], got [3, 2] in file " + file_)) << msg;
}

TEST_F(WeightTableTest, DtypeNotAccepted) {
  write({{"m.w", DType::kI32, {2}}, {"m.ids", DType::kF32, {2}}});
  Checkpoint ck(file_);
  Tensor w, ids;
  WeightTable table;
  table.add("m.w", {2}, &w);
  table.add_typed("m.ids", {2}, {DType::kI32, DType::kI64}, &ids);
  const std::string msg = bind_error(table, ck);
  EXPECT_TRUE(contains(msg, "m.w: dtype i32 not accepted (expected f32, bf16 or f16)")) << msg;
  EXPECT_TRUE(contains(msg, "m.ids: dtype f32 not accepted (expected i32 or i64)")) << msg;
}

TEST_F(WeightTableTest, UnexpectedIgnoredAndIgnoredPrefix) {
  write({{"m.w", DType::kF32, {2}},
         {"m.layers.3.k_proj", DType::kF32, {2}},
         {"m.vision_tower.a", DType::kF32, {2}},
         {"m.vision_tower.b", DType::kF32, {2}},
         {"m.stray", DType::kF32, {7}}});
  Checkpoint ck(file_);
  Tensor w;
  WeightTable table;
  table.add("m.w", {2}, &w);
  table.ignore("m.layers.3.k_proj");
  table.ignore_prefix("m.vision_tower.");
  std::string msg = bind_error(table, ck);
  EXPECT_TRUE(contains(msg, "1 problem binding")) << msg;
  EXPECT_TRUE(contains(msg, "unexpected: m.stray ([7]) in file " + file_)) << msg;
  EXPECT_FALSE(contains(msg, "vision_tower")) << msg;
  EXPECT_FALSE(contains(msg, "k_proj")) << msg;
  table.ignore("m.stray");
  EXPECT_EQ(bind_error(table, ck), "");
  EXPECT_FALSE(w.empty());
}

TEST_F(WeightTableTest, OneErrorListsEveryKindOfProblem) {
  write(
      {{"m.shape", DType::kF32, {2}}, {"m.dtype", DType::kU8, {2}}, {"m.extra", DType::kF32, {2}}});
  Checkpoint ck(file_);
  Tensor a, b, c;
  WeightTable table;
  table.add("m.shape", {3}, &a);
  table.add("m.dtype", {2}, &b);
  table.add("m.missing", {2}, &c);
  const std::string msg = bind_error(table, ck);
  EXPECT_TRUE(contains(msg, "4 problems binding weights")) << msg;
  EXPECT_TRUE(contains(msg, "m.shape: expected [3], got [2]")) << msg;
  EXPECT_TRUE(contains(msg, "m.dtype: dtype u8 not accepted")) << msg;
  EXPECT_TRUE(contains(msg, "missing: m.missing")) << msg;
  EXPECT_TRUE(contains(msg, "unexpected: m.extra")) << msg;
  EXPECT_TRUE(a.empty() && b.empty() && c.empty());
}

TEST_F(WeightTableTest, LongProblemListsAreCapped) {
  write({{"m.w", DType::kF32, {1}}});
  Checkpoint ck(file_);
  std::vector<Tensor> fields(45);
  WeightTable table;
  for (size_t i = 0; i < fields.size(); ++i)
    table.add(fmt::format("m.missing{}", i), {1}, &fields[i]);
  table.ignore("m.w");
  const std::string msg = bind_error(table, ck);
  EXPECT_TRUE(contains(msg, "45 problems")) << msg;
  EXPECT_TRUE(contains(msg, "m.missing19 ")) << msg;
  EXPECT_FALSE(contains(msg, "m.missing20 ")) << msg;
  EXPECT_TRUE(contains(msg, "and 25 more")) << msg;
}

TEST_F(WeightTableTest, DeclaringANameTwiceIsAnError) {
  Tensor a, b;
  WeightTable table;
  table.add("m.w", {1}, &a);
  EXPECT_THROW(table.add("m.w", {1}, &b), Error);
  EXPECT_THROW(table.add("m.x", {1}, nullptr), Error);
}

TEST(FiniteScan, FindsTheFirstNanOrInfinityInEveryFloatDtype) {
  // Long enough that the hit lies in a later block than the first (4096 elements).
  const int64_t n = 10000;
  HostTensor f32(DType::kF32, {n}), bf16(DType::kBF16, {n}), f16(DType::kF16, {n});
  for (int64_t i = 0; i < n; ++i) {
    f32.data<float>()[i] = 1e30f * static_cast<float>(i % 7 - 3);  // large but finite
    bf16.data<uint16_t>()[i] = f32_to_bf16(-3e38f);                // finite, near bf16's max
    f16.data<uint16_t>()[i] = f32_to_f16(65504.0f);                // f16's max, finite
  }
  EXPECT_FALSE(find_non_finite(f32).has_value());
  EXPECT_FALSE(find_non_finite(bf16).has_value());
  EXPECT_FALSE(find_non_finite(f16).has_value());

  f32.data<float>()[9000] = std::numeric_limits<float>::quiet_NaN();
  f32.data<float>()[9001] = std::numeric_limits<float>::infinity();
  bf16.data<uint16_t>()[4096] = f32_to_bf16(std::numeric_limits<float>::infinity());
  f16.data<uint16_t>()[n - 1] = f32_to_f16(-std::numeric_limits<float>::infinity());
  const auto a = find_non_finite(f32), b = find_non_finite(bf16), c = find_non_finite(f16);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->index, 9000);
  EXPECT_TRUE(std::isnan(a->value));
  EXPECT_EQ(b->index, 4096);
  EXPECT_EQ(b->value, std::numeric_limits<float>::infinity());
  EXPECT_EQ(c->index, n - 1);
  EXPECT_EQ(c->value, -std::numeric_limits<float>::infinity());

  // Integer tensors have no NaN: all-ones bit patterns are ordinary values there.
  HostTensor ids(DType::kI32, {4});
  for (int i = 0; i < 4; ++i) ids.data<int32_t>()[i] = -1;
  EXPECT_FALSE(find_non_finite(ids).has_value());
}

TEST(FiniteScan, CheckFiniteNamesTheTensorTheFileAndTheElement) {
  HostTensor w(DType::kBF16, {3, 4});
  EXPECT_NO_THROW(check_finite(w, "m.w", "/ck/model.safetensors"));
  w.data<uint16_t>()[6] = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  try {
    check_finite(w, "m.w", "/ck/model.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg,
                         "/ck/model.safetensors: weight m.w (bf16 [3, 4]) holds NaN at element "
                         "6 of 12"))
        << msg;
  }
}

}  // namespace
}  // namespace specula::io
