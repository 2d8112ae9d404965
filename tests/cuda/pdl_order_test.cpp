// SPDX-License-Identifier: Apache-2.0
// Programmatic dependent launches read their inputs only after the kernel
// before them has finished. Each op's first kernel may start while its
// predecessor runs (cuda_launch.cuh); here the predecessor is late_copy, which
// writes the op's input some 0.5 ms after letting the op start, over stale
// NaN contents. Any input read before griddepcontrol.wait (or through a
// read-only load the compiler moved above it, as ptxas did with __ldg in the
// decode product) sees the NaN, so each op must give exactly the bits it gives
// on inputs that were written before it was queued.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/late_writer.h"

namespace specula {
namespace {

using test::cpu_be;
using test::gpu_be;
using test::Twin;

cudaStream_t gpu_stream() {
  return static_cast<cuda::CudaBackend&>(gpu_be()).stream();
}

// Fills the device copy of t with NaN (its host copy keeps the real values).
void poison_device(Twin& t) {
  HostTensor nan(t.host.dtype(), t.host.shape());
  float* p = nan.data<float>();
  for (int64_t i = 0; i < nan.numel(); ++i) p[i] = std::numeric_limits<float>::quiet_NaN();
  gpu_be().upload(nan.view().data(), t.dev);
}

// Runs `op` twice and returns its outputs' bits each time: once with every
// input of `late` already holding its values, once with those inputs NaN
// until late_copy writes them while the op is already queued. `outputs` are
// pulled after each run, and poisoned before it unless the op writes only
// part of them (poison_outputs false: a store into a cache).
struct TwoRuns {
  std::vector<HostTensor> ready, late;
};
TwoRuns run_both(std::vector<Twin*> late, std::vector<Twin*> outputs,
                 const std::function<void()>& op, bool poison_outputs = true) {
  TwoRuns r;
  const auto pull_all = [&](std::vector<HostTensor>& into) {
    for (Twin* o : outputs) into.push_back(o->pull());
  };
  if (poison_outputs) {
    for (Twin* o : outputs) poison_device(*o);
  }
  for (Twin* t : late) t->push();
  gpu_be().synchronize();
  op();
  pull_all(r.ready);

  // The late run: the values wait in a side buffer until late_copy moves them.
  std::vector<DeviceBuffer> sources;
  for (Twin* t : late) {
    sources.emplace_back(gpu_be(), t->dev.nbytes());
    gpu_be().upload(t->host.view().data(),
                    Tensor(sources.back().data(), t->dev.dtype(), t->dev.shape(), t->dev.device()));
    poison_device(*t);
  }
  if (poison_outputs) {
    for (Twin* o : outputs) poison_device(*o);
  }
  gpu_be().synchronize();
  for (size_t i = 0; i < late.size(); ++i) {
    test::late_copy(sources[i].data(), late[i]->dev.data(), late[i]->dev.nbytes(), gpu_stream());
  }
  op();
  pull_all(r.late);
  return r;
}

void expect_same_bits(const TwoRuns& r, const char* what) {
  ASSERT_EQ(r.ready.size(), r.late.size());
  for (size_t i = 0; i < r.ready.size(); ++i) {
    const HostTensor& a = r.ready[i];
    const HostTensor& b = r.late[i];
    ASSERT_EQ(a.view().nbytes(), b.view().nbytes());
    const bool finite = [&] {
      const float* p = a.data<float>();
      for (int64_t j = 0; j < a.numel(); ++j) {
        if (!std::isfinite(p[j])) return false;
      }
      return true;
    }();
    EXPECT_TRUE(finite) << what << ": output " << i << " is not finite even with ready inputs";
    EXPECT_EQ(std::memcmp(a.view().data(), b.view().data(), a.view().nbytes()), 0)
        << what << ": output " << i << " differs when its inputs are written late";
  }
}

Twin random_twin(DType dtype, Shape shape, uint64_t seed, float scale = 1.0f) {
  Twin t(dtype, shape);
  t.randomize(seed, -scale, scale);
  return t;
}

// The decode path (one row, x split inside the product; tiles over clusters
// of blocks when they are few), several rows (the split kernel first) and the
// FMA kernels of f32 / f16 weights.
TEST(CudaPdlOrder, ProductsReadTheirInputAfterThePredecessor) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t m, n, k;
    DType w;
  };
  const Case cases[] = {
      {1, 32, 32, DType::kBF16},     {1, 32, 4096, DType::kBF16},    {1, 5376, 64, DType::kBF16},
      {1, 5376, 4096, DType::kBF16}, {1, 40000, 1024, DType::kBF16}, {5, 1024, 4096, DType::kBF16},
      {5, 5376, 4096, DType::kBF16}, {1, 1024, 4096, DType::kF32},   {3, 1024, 4096, DType::kF16},
      {1, 1536, 6144, DType::kBF16}, {1, 2560, 4096, DType::kBF16}};  // the last two: clusters
  uint64_t seed = 900;
  for (const Case& c : cases) {
    Twin x = random_twin(DType::kF32, {c.m, c.k}, ++seed);
    Twin w = random_twin(c.w, {c.n, c.k}, ++seed, 0.05f);
    Twin y(DType::kF32, {c.m, c.n});
    const TwoRuns r = run_both({&x}, {&y}, [&] { gpu_be().linear(x.dev, w.dev, y.dev); });
    const std::string what = "linear m " + std::to_string(c.m) + " n " + std::to_string(c.n) +
                             " k " + std::to_string(c.k) + " w " + std::string(dtype_name(c.w));
    expect_same_bits(r, what.c_str());
  }
}

TEST(CudaPdlOrder, FusedProductsReadTheirInputAfterThePredecessor) {
  SKIP_WITHOUT_CUDA();
  for (int64_t m : {1, 5}) {
    const int64_t h = 2048, inter = 4096;
    Twin x = random_twin(DType::kF32, {m, h}, 950 + m);
    Twin wq = random_twin(DType::kBF16, {h, h}, 960, 0.05f);
    Twin wk = random_twin(DType::kBF16, {256, h}, 961, 0.05f);
    Twin wg = random_twin(DType::kBF16, {inter, h}, 962, 0.05f);
    Twin wu = random_twin(DType::kBF16, {inter, h}, 963, 0.05f);
    Twin q(DType::kF32, {m, h}), k(DType::kF32, {m, 256});
    Twin gate(DType::kF32, {m, inter}), up(DType::kF32, {m, inter});
    const LinearOut outs[2] = {{wq.dev, q.dev}, {wk.dev, k.dev}};
    expect_same_bits(run_both({&x}, {&q, &k}, [&] { gpu_be().linear_multi(x.dev, outs); }),
                     m == 1 ? "linear_multi m 1" : "linear_multi m 5");
    expect_same_bits(
        run_both({&x}, {&gate},
                 [&] { gpu_be().linear_gelu_mul(x.dev, wg.dev, wu.dev, gate.dev, up.dev); }),
        m == 1 ? "linear_gelu_mul m 1" : "linear_gelu_mul m 5");
  }
}

TEST(CudaPdlOrder, NormsAndCacheStoresReadTheirInputAfterThePredecessor) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 3, d = 5376;
  Twin x = random_twin(DType::kF32, {rows, d}, 970);
  Twin w = random_twin(DType::kBF16, {d}, 971);
  Twin nw = random_twin(DType::kBF16, {d}, 972);
  Twin out(DType::kF32, {rows, d});
  expect_same_bits(run_both({&x}, {&out}, [&] { gpu_be().rms_norm(x.dev, w.dev, 1e-6f, out.dev); }),
                   "rms_norm");
  Twin residual = random_twin(DType::kF32, {rows, d}, 973);
  Twin next(DType::kF32, {rows, d});
  Twin residual_start = random_twin(DType::kF32, {rows, d}, 973);
  // The residual is updated in place: restore it before each run.
  const auto op = [&] {
    gpu_be().copy(residual_start.dev, residual.dev);
    gpu_be().rms_norm_add_norm(x.dev, w.dev, 1e-6f, residual.dev, 0.5f, nw.dev, next.dev);
  };
  expect_same_bits(run_both({&x}, {&residual, &next}, op), "rms_norm_add_norm");

  const int64_t n = 5, kv = 2, hd = 256, cache_rows = 64;
  Twin k = random_twin(DType::kF32, {n, kv, hd}, 974);
  Twin v = random_twin(DType::kF32, {n, kv, hd}, 975);
  Twin positions(DType::kI32, {n});
  for (int64_t i = 0; i < n; ++i) positions.host.data<int32_t>()[i] = static_cast<int32_t>(40 + i);
  positions.push();
  Twin cache_k = random_twin(DType::kF32, {cache_rows, kv, hd}, 976);
  Twin cache_v = random_twin(DType::kF32, {cache_rows, kv, hd}, 977);
  expect_same_bits(
      run_both(
          {&k, &v}, {&cache_k, &cache_v},
          [&] { gpu_be().store_kv(k.dev, v.dev, positions.dev, cache_k.dev, cache_v.dev); },
          /*poison_outputs=*/false),
      "store_kv");
}

// A decode step's attention that lets the output product start early
// (product_follows): the product must still read the combine's output, not
// what the buffer held before. This is where the hoisted load was seen.
TEST(CudaPdlOrder, ProductAfterAttentionReadsTheCombinedOutput) {
  SKIP_WITHOUT_CUDA();
  const int64_t heads = 8, kv = 2, d = 256, keys = 301, n_out = 5376;
  Twin q = random_twin(DType::kF32, {1, heads, d}, 980);
  Twin k = random_twin(DType::kF32, {keys, kv, d}, 981);
  Twin v = random_twin(DType::kF32, {keys, kv, d}, 982);
  Twin pos(DType::kI32, {1});
  pos.host.data<int32_t>()[0] = static_cast<int32_t>(keys - 1);
  pos.push();
  Twin attn(DType::kF32, {1, heads, d});
  Twin w_o = random_twin(DType::kBF16, {n_out, heads * d}, 983, 0.05f);
  Twin y(DType::kF32, {1, n_out});
  const auto op = [&] {
    AttentionParams p;
    p.q = q.dev;
    p.k = k.dev;
    p.v = v.dev;
    p.out = attn.dev;
    p.q_positions = pos.dev;
    p.causal = true;
    p.scale = 1.0f;
    p.positions_bound = positions_bound_for(keys);
    p.product_follows = true;
    gpu_be().attention(p);
    gpu_be().linear(attn.dev.reshape({1, heads * d}), w_o.dev, y.dev);
  };
  // attn is written by the attention itself: poisoned before each run, so a
  // product reading it early would see NaN.
  expect_same_bits(run_both({&q}, {&attn, &y}, op), "attention then product");
}

}  // namespace
}  // namespace specula
