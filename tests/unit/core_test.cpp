// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include "engine/core/buffer.h"
#include "engine/core/dtype.h"
#include "engine/core/tensor.h"
#include "engine/memory/arena.h"

namespace specula {
namespace {

TEST(DType, Bf16RoundTripsAndRoundsToNearestEven) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.5f)), 1.5f);
  // sqrt(1536) = 39.19... rounds to 39.25 in bf16 (gemma4-architecture.md §2.3).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(39.191835f)), 39.25f);
  // 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256.0f)), 1.0f);
}

TEST(DType, F16RoundTrips) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f, 3.14159f}) {
    EXPECT_NEAR(f16_to_f32(f32_to_f16(v)), v, std::abs(v) * 1e-3f) << v;
  }
}

TEST(Tensor, ReshapeChecksElementCount) {
  HostTensor t(DType::kF32, {2, 3});
  EXPECT_EQ(t.view().reshape({3, 2}).shape(), Shape({3, 2}));
  try {
    (void)t.view().reshape({4, 2});
    FAIL() << "reshape should throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 2]"), std::string::npos) << e.what();
  }
}

TEST(Tensor, SliceRowsViewsTheRightMemory) {
  HostTensor t(DType::kF32, {4, 2});
  for (int i = 0; i < 8; ++i) t.f32()[static_cast<size_t>(i)] = static_cast<float>(i);
  Tensor rows = t.view().slice_rows(1, 3);
  EXPECT_EQ(rows.shape(), Shape({2, 2}));
  EXPECT_EQ(rows.f32()[0], 2.0f);
  EXPECT_EQ(t.view().row(3).f32()[1], 7.0f);
  EXPECT_THROW((void)t.view().slice_rows(3, 5), Error);
}

TEST(Arena, ResetsAndRefusesToGrow) {
  Arena arena(1024);
  Tensor a = arena.alloc(DType::kF32, {16});
  EXPECT_EQ(a.numel(), 16);
  EXPECT_THROW((void)arena.alloc(DType::kF32, {1024}), Error);
  arena.reset();
  EXPECT_EQ(arena.used(), 0u);
  EXPECT_GE(arena.high_water(), 64u);
}

}  // namespace
}  // namespace specula
