// SPDX-License-Identifier: Apache-2.0
// Memory layer: DeviceBuffer ownership, the caching pool's reuse, arenas over a
// MemoryResource, and the CPU backend's transfer/fill/transpose ops.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/backend/backends.h"
#include "engine/memory/arena.h"
#include "engine/memory/memory_resource.h"
#include "engine/ops/uniform_hash.h"

namespace specula {
namespace {

TEST(CachingPool, ReusesReleasedBlocksOfTheSameSize) {
  Backend& cpu = backend_for(Device::cpu());
  CachingPool pool(cpu);
  void* a = pool.allocate(4096);
  void* b = pool.allocate(8192);
  EXPECT_EQ(pool.upstream_allocations(), 2);
  pool.release(a);
  EXPECT_EQ(pool.cached_bytes(), 4096u);
  void* c = pool.allocate(4096);
  EXPECT_EQ(c, a) << "a released block of the same size is handed out again";
  EXPECT_EQ(pool.upstream_allocations(), 2);
  void* d = pool.allocate(1024);  // no cached block of that size
  EXPECT_EQ(pool.upstream_allocations(), 3);
  pool.release(b);
  pool.release(c);
  pool.release(d);
  pool.release(nullptr);  // ignored
}

TEST(DeviceBuffer, ReleasesOnDestructionAndMoves) {
  Backend& cpu = backend_for(Device::cpu());
  CachingPool pool(cpu);
  {
    DeviceBuffer a(pool, 256);
    DeviceBuffer b = std::move(a);
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_NE(b.data(), nullptr);
    EXPECT_EQ(b.view(DType::kF32, {64}).numel(), 64);
    EXPECT_THROW(b.view(DType::kF32, {65}), Error);
  }
  EXPECT_EQ(pool.cached_bytes(), 256u);
}

TEST(Arena, CarvesFromAMemoryResource) {
  Backend& cpu = backend_for(Device::cpu());
  Arena arena(1024, &cpu);
  EXPECT_EQ(arena.capacity(), 1024u);
  Tensor t = arena.alloc(DType::kF32, {16});
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_NE(t.data(), nullptr);
  EXPECT_THROW(arena.alloc(DType::kF32, {1024}), Error);
}

TEST(CpuBackendMemory, UploadDownloadRoundTripAndCountAllocations) {
  Backend& cpu = backend_for(Device::cpu());
  const int64_t before = cpu.allocation_count();
  DeviceBuffer buf(cpu, 64);
  EXPECT_EQ(cpu.allocation_count(), before + 1);
  Tensor t = buf.view(DType::kI32, {4});
  const int32_t in[4] = {1, -2, 3, 4};
  int32_t out[4] = {};
  cpu.upload(in, t);
  cpu.download(t, out);
  EXPECT_EQ(std::memcmp(in, out, sizeof(in)), 0);
}

TEST(CpuBackendMemory, FillUniformIsSeededBoundedAndRoundsPerDtype) {
  Backend& cpu = backend_for(Device::cpu());
  HostTensor a(DType::kF32, {1000}), b(DType::kF32, {1000}), h(DType::kBF16, {1000});
  cpu.fill_uniform(a, 7, -0.5f, 0.25f);
  cpu.fill_uniform(b, 8, -0.5f, 0.25f);
  cpu.fill_uniform(h, 7, -0.5f, 0.25f);
  int differ = 0;
  for (int i = 0; i < 1000; ++i) {
    const float v = a.data<float>()[i];
    EXPECT_GE(v, -0.5f);
    EXPECT_LT(v, 0.25f);
    EXPECT_EQ(v, uniform_at(7, static_cast<uint64_t>(i), -0.5f, 0.25f));
    EXPECT_EQ(h.data<uint16_t>()[i], f32_to_bf16(v));
    differ += v != b.data<float>()[i];
  }
  EXPECT_GT(differ, 990) << "another seed gives another stream";
}

TEST(CpuBackendMemory, Transpose01SwapsTheLeadingDimensions) {
  Backend& cpu = backend_for(Device::cpu());
  HostTensor x(DType::kF32, {2, 3, 4}), out(DType::kF32, {3, 2, 4});
  for (int i = 0; i < 24; ++i) x.data<float>()[i] = static_cast<float>(i);
  cpu.transpose01(x, out);
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 4; ++c)
        EXPECT_EQ(out.data<float>()[(b * 2 + a) * 4 + c], x.data<float>()[(a * 3 + b) * 4 + c]);
  HostTensor wrong(DType::kF32, {2, 3, 4});
  EXPECT_THROW(cpu.transpose01(x, wrong), Error);
}

}  // namespace
}  // namespace specula

namespace specula {
namespace {

// The composed ops every backend inherits: rms_norm_add is rms_norm, add and
// scale in that order (bit for bit), linear_prefill is linear on the CPU.
TEST(BackendDefaults, RmsNormAddAndLinearPrefillComposeTheBaseOps) {
  Backend& cpu = backend_for(Device::cpu());
  HostTensor x(DType::kF32, {3, 40}), residual(DType::kF32, {3, 40}), w(DType::kBF16, {40});
  cpu.fill_uniform(x, 1, -2.0f, 2.0f);
  cpu.fill_uniform(residual, 2, -1.0f, 1.0f);
  cpu.fill_uniform(w, 3, 0.5f, 1.5f);
  HostTensor x2(DType::kF32, {3, 40}), r2(DType::kF32, {3, 40});
  cpu.copy(x, x2);
  cpu.copy(residual, r2);
  cpu.rms_norm(x2, w, 1e-6f, x2);
  cpu.add(r2, x2, r2);
  cpu.scale(r2, 0.75f, r2);
  cpu.rms_norm_add(x, w, 1e-6f, residual, 0.75f);
  EXPECT_EQ(std::memcmp(residual.view().data(), r2.view().data(), r2.view().nbytes()), 0);

  HostTensor a(DType::kF32, {20, 40}), y1(DType::kF32, {20, 3}), y2(DType::kF32, {20, 3});
  HostTensor m(DType::kBF16, {3, 40});
  cpu.fill_uniform(a, 4, -1.0f, 1.0f);
  cpu.fill_uniform(m, 5, -1.0f, 1.0f);
  cpu.linear(a, m, y1);
  cpu.linear_prefill(a, m, y2);
  EXPECT_EQ(std::memcmp(y1.view().data(), y2.view().data(), y1.view().nbytes()), 0);
}

}  // namespace
}  // namespace specula
