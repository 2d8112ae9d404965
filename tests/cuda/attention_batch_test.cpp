// SPDX-License-Identifier: Apache-2.0
// attention_batch and store_kv_batch on CUDA (issue #30: the sequences of a
// batched step attend and store in one launch each). What must hold:
// - attention_batch writes, bit for bit, what attention() writes for each
//   entry alone, for every cache dtype (f32, bf16, fp8), full caches and
//   sliding rings, decode rows and verify windows (one and several pair tiles
//   a sequence), batches past the 64 sequences of one launch, and entries that
//   cannot share a launch (they fall back to attention());
// - over f32 caches it matches the CPU's attention within the f32 tolerance;
// - store_kv_batch writes the bytes (codes and scales) that the CPU's
//   store_kv writes entry by entry, into caches of different row counts.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/core/dtype.h"
#include "engine/ops/backend.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

constexpr float kAttentionTol = 1e-5f;  // as tests/cuda/attention_test.cpp
constexpr int kWindow = 64;             // sliding cases
constexpr int64_t kRingRows = 80;       // >= window + 5 - 1 (verify windows of 5)

struct BatchCase {
  DType cache;
  bool ring;
  int64_t s;  // queries a sequence
  int64_t heads, kv, d;
  int64_t seqs;
};

// One sequence's cache on the device in dtype `dt` (fp8 with one scale per
// (row, kv head)), converted by the GPU from random f32 rows; `rows_f32` keeps
// the f32 rows (for the CPU reference of f32 caches).
struct DeviceCache {
  Twin rows_f32;
  DeviceBuffer codes;
  DeviceBuffer scales;
  Tensor t;
  DeviceCache(DType dt, Shape shape, uint64_t seed) : rows_f32(DType::kF32, shape) {
    rows_f32.randomize(seed);
    codes = DeviceBuffer(gpu_be(), static_cast<size_t>(shape.numel()) * dtype_size(dt));
    t = codes.view(dt, shape);
    if (dt == DType::kF8E4M3) {
      scales = DeviceBuffer(gpu_be(), static_cast<size_t>(shape[0] * shape[1]) * sizeof(float));
      t = t.with_scales(static_cast<const float*>(scales.data()));
    }
    gpu_be().convert(rows_f32.dev, t);
  }
};

// A batch of c.seqs sequences: each its own k and v caches and its last
// position (all different, so their keys and positions_bound differ); the
// queries, outputs and positions of all sequences in one buffer each.
struct Batch {
  BatchCase c;
  std::vector<std::unique_ptr<DeviceCache>> k, v;
  std::vector<int64_t> last;  // each sequence's last query position
  Twin q, pos;

  explicit Batch(const BatchCase& bc)
      : c(bc),
        q(DType::kF32, {bc.seqs * bc.s, bc.heads, bc.d}),
        pos(DType::kI32, {bc.seqs * bc.s}) {
    q.randomize(1000 + static_cast<uint64_t>(bc.seqs));
    for (int64_t b = 0; b < c.seqs; ++b) {
      last.push_back(c.s - 1 + (37 * b + 11) % 290);
      for (int64_t i = 0; i < c.s; ++i) {
        pos.host.data<int32_t>()[b * c.s + i] = static_cast<int32_t>(last[b] - c.s + 1 + i);
      }
      const int64_t rows = c.ring ? kRingRows : last[b] + 1;
      const uint64_t seed = 7 + 2 * static_cast<uint64_t>(b);
      k.push_back(std::make_unique<DeviceCache>(c.cache, Shape{rows, c.kv, c.d}, seed));
      v.push_back(std::make_unique<DeviceCache>(c.cache, Shape{rows, c.kv, c.d}, seed + 1));
    }
    pos.push();
  }

  // Sequence b's attention, writing into rows of `out` (device, [seqs·s, H, D]);
  // host: the same over the f32 rows on the CPU.
  AttentionParams entry(int64_t b, const Tensor& out, bool host = false) const {
    const int64_t first = last[b] - c.s + 1;
    const int64_t k_pos0 = c.ring ? std::max<int64_t>(0, first - kWindow + 1) : 0;
    const Twin& kr = k[b]->rows_f32;
    const Twin& vr = v[b]->rows_f32;
    return AttentionParams{
        .q = (host ? q.host.view() : q.dev).slice_rows(b * c.s, (b + 1) * c.s),
        .k = host ? kr.host.view() : k[b]->t,
        .v = host ? vr.host.view() : v[b]->t,
        .out = out.slice_rows(b * c.s, (b + 1) * c.s),
        .q_positions = (host ? pos.host.view() : pos.dev).slice_rows(b * c.s, (b + 1) * c.s),
        .k_pos0 = k_pos0,
        .window = c.ring ? kWindow : 0,
        .scale = 1.0f / std::sqrt(static_cast<float>(c.d)),
        .ring_keys = c.ring ? last[b] - k_pos0 + 1 : -1,
        .positions_bound = positions_bound_for(last[b] + 1)};
  }
};

void expect_same_bits(const HostTensor& a, const HostTensor& b, const std::string& what) {
  ASSERT_EQ(a.view().nbytes(), b.view().nbytes()) << what;
  EXPECT_EQ(std::memcmp(a.view().data(), b.view().data(), a.view().nbytes()), 0) << what;
}

std::string describe(const BatchCase& c) {
  return fmt::format("{} {} s {} heads {}/{} d {} seqs {}", dtype_name(c.cache),
                     c.ring ? "ring" : "full", c.s, c.heads, c.kv, c.d, c.seqs);
}

const BatchCase kCases[] = {
    // Decode rows (31B's sliding and full layers' shapes, scaled down).
    {DType::kF32, false, 1, 8, 4, 256, 3},
    {DType::kBF16, false, 1, 8, 4, 256, 8},
    {DType::kF8E4M3, false, 1, 8, 4, 256, 5},
    {DType::kF32, true, 1, 8, 4, 256, 6},
    {DType::kBF16, true, 1, 8, 4, 256, 70},  // two launches: 64 + 6 sequences
    {DType::kF8E4M3, true, 1, 8, 4, 256, 4},
    // Verify windows of 5: one pair tile a sequence, and (group 8) two.
    {DType::kBF16, true, 5, 8, 4, 256, 4},
    {DType::kF32, false, 5, 8, 1, 512, 3},
    {DType::kBF16, false, 5, 8, 1, 512, 66},
    // Prefill-like rows: several pair tiles and chunks a sequence.
    {DType::kBF16, false, 40, 8, 4, 256, 2},
    {DType::kF8E4M3, false, 40, 8, 4, 256, 2},
    {DType::kF8E4M3, true, 5, 8, 1, 512, 3},
    // An odd head dimension (rows not float4-aligned).
    {DType::kF32, false, 1, 4, 2, 30, 5},
};

TEST(CudaAttentionBatch, EqualsSeparateCallsBitForBit) {
  SKIP_WITHOUT_CUDA();
  for (const BatchCase& c : kCases) {
    SCOPED_TRACE(describe(c));
    const Batch batch(c);
    Twin together(DType::kF32, {c.seqs * c.s, c.heads, c.d});
    Twin alone(DType::kF32, {c.seqs * c.s, c.heads, c.d});
    std::vector<AttentionParams> entries;
    for (int64_t b = 0; b < c.seqs; ++b) entries.push_back(batch.entry(b, together.dev));
    gpu_be().attention_batch(entries);
    for (int64_t b = 0; b < c.seqs; ++b) gpu_be().attention(batch.entry(b, alone.dev));
    expect_same_bits(together.pull(), alone.pull(), "attention_batch against attention()");
  }
}

TEST(CudaAttentionBatch, MatchesCpuOverF32Caches) {
  SKIP_WITHOUT_CUDA();
  for (const BatchCase& c : kCases) {
    if (c.cache != DType::kF32) continue;
    SCOPED_TRACE(describe(c));
    const Batch batch(c);
    Twin out(DType::kF32, {c.seqs * c.s, c.heads, c.d});
    std::vector<AttentionParams> entries;
    for (int64_t b = 0; b < c.seqs; ++b) entries.push_back(batch.entry(b, out.dev));
    gpu_be().attention_batch(entries);
    for (int64_t b = 0; b < c.seqs; ++b) cpu_be().attention(batch.entry(b, out.host.view(), true));
    expect_close(out.pull(), out.host, kAttentionTol, "attention_batch against the CPU");
  }
}

// The raw staging under measurement (CudaKernelChoices::raw_kv_staging: bf16
// or fp8 cache bytes copied as they are, widened or dequantized where the loops
// read them) gives the default staging's bits, batched and alone.
TEST(CudaAttentionBatch, RawKvStagingKeepsTheBits) {
  SKIP_WITHOUT_CUDA();
  for (const BatchCase& c : kCases) {
    if (c.cache == DType::kF32) continue;
    SCOPED_TRACE(describe(c));
    const Batch batch(c);
    const Shape shape{c.seqs * c.s, c.heads, c.d};
    Twin base = poisoned_output(shape), raw = poisoned_output(shape);
    Twin raw_alone = poisoned_output(shape);
    std::vector<AttentionParams> entries;
    for (int64_t b = 0; b < c.seqs; ++b) entries.push_back(batch.entry(b, base.dev));
    gpu_be().attention_batch(entries);
    {
      const ScopedKernelChoices on({.raw_kv_staging = true});
      entries.clear();
      for (int64_t b = 0; b < c.seqs; ++b) entries.push_back(batch.entry(b, raw.dev));
      gpu_be().attention_batch(entries);
      for (int64_t b = 0; b < c.seqs; ++b) gpu_be().attention(batch.entry(b, raw_alone.dev));
    }
    const HostTensor want = base.pull();
    expect_same_bits(raw.pull(), want, "raw staging, batched");
    expect_same_bits(raw_alone.pull(), want, "raw staging, alone");
  }
}

// Entries whose buffers do not follow one another (here: in reverse order)
// cannot share a launch; each is then an attention() call, with its bits.
TEST(CudaAttentionBatch, EntriesThatCannotShareALaunchFallBack) {
  SKIP_WITHOUT_CUDA();
  const BatchCase c{DType::kBF16, true, 1, 8, 4, 256, 5};
  const Batch batch(c);
  Twin together(DType::kF32, {c.seqs * c.s, c.heads, c.d});
  Twin alone(DType::kF32, {c.seqs * c.s, c.heads, c.d});
  std::vector<AttentionParams> entries;
  for (int64_t b = c.seqs - 1; b >= 0; --b) entries.push_back(batch.entry(b, together.dev));
  // A derived launch next to one that is not (no positions_bound).
  entries[2].positions_bound = 0;
  gpu_be().attention_batch(entries);
  for (int64_t b = 0; b < c.seqs; ++b) gpu_be().attention(batch.entry(b, alone.dev));
  expect_same_bits(together.pull(), alone.pull(), "fallback against attention()");
}

// store_kv_batch: the new rows of `seqs` sequences of n rows each (k, v and
// positions one buffer each), each into its own caches of its own row count.
TEST(CudaStoreKvBatch, WritesTheCpusBytes) {
  SKIP_WITHOUT_CUDA();
  const int64_t kv = 4, d = 96;
  for (const DType dt : {DType::kF32, DType::kBF16, DType::kF8E4M3}) {
    for (const int64_t n : {int64_t{1}, int64_t{5}}) {
      for (const int64_t seqs : {int64_t{3}, int64_t{67}}) {
        SCOPED_TRACE(fmt::format("{} n {} seqs {}", dtype_name(dt), n, seqs));
        Twin k(DType::kF32, {seqs * n, kv, d});
        Twin v(DType::kF32, {seqs * n, kv, d});
        k.randomize(3, -3.0f, 3.0f);
        v.randomize(4, -3.0f, 3.0f);
        k.host.data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
        v.host.data<float>()[d + 1] = std::numeric_limits<float>::infinity();
        k.push();
        v.push();
        Twin pos(DType::kI32, {seqs * n});
        std::vector<int64_t> rows;
        for (int64_t b = 0; b < seqs; ++b) {
          rows.push_back(20 + b % 7);
          for (int64_t i = 0; i < n; ++i) {
            pos.host.data<int32_t>()[b * n + i] = static_cast<int32_t>(3 * b + 50 + i);
          }
        }
        pos.push();
        // Caches: codes and scales, zeroed on both sides.
        struct Cache {
          Twin codes, scales;
          Cache(DType dt, Shape shape)
              : codes(dt, shape), scales(DType::kF32, {shape[0] * shape[1]}) {
            std::memset(codes.host.view().data(), 0, codes.host.view().nbytes());
            std::memset(scales.host.data<float>(), 0, scales.host.view().nbytes());
            codes.push();
            scales.push();
          }
          Tensor dev() const {
            return codes.dev.dtype() == DType::kF8E4M3
                       ? codes.dev.with_scales(scales.dev.data_as<float>())
                       : codes.dev;
          }
          Tensor host() const {
            return codes.host.view().dtype() == DType::kF8E4M3
                       ? codes.host.view().with_scales(scales.host.data<float>())
                       : codes.host.view();
          }
        };
        std::vector<std::unique_ptr<Cache>> ck, cv;
        std::vector<StoreKvParams> entries;
        for (int64_t b = 0; b < seqs; ++b) {
          ck.push_back(std::make_unique<Cache>(dt, Shape{rows[b], kv, d}));
          cv.push_back(std::make_unique<Cache>(dt, Shape{rows[b], kv, d}));
          entries.push_back({.k = k.dev.slice_rows(b * n, (b + 1) * n),
                             .v = v.dev.slice_rows(b * n, (b + 1) * n),
                             .positions = pos.dev.slice_rows(b * n, (b + 1) * n),
                             .cache_k = ck.back()->dev(),
                             .cache_v = cv.back()->dev()});
          cpu_be().store_kv(k.host.view().slice_rows(b * n, (b + 1) * n),
                            v.host.view().slice_rows(b * n, (b + 1) * n),
                            pos.host.view().slice_rows(b * n, (b + 1) * n), ck.back()->host(),
                            cv.back()->host());
        }
        gpu_be().store_kv_batch(entries);
        for (int64_t b = 0; b < seqs; ++b) {
          for (const Cache* cache : {ck[b].get(), cv[b].get()}) {
            expect_same_bits(cache->codes.pull(), cache->codes.host, "cache rows");
            if (dt == DType::kF8E4M3) {
              expect_same_bits(cache->scales.pull(), cache->scales.host, "cache scales");
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace specula::test
