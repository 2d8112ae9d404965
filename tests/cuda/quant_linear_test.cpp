// SPDX-License-Identifier: Apache-2.0
// CudaBackend::linear, linear_multi, linear_gelu_mul and embedding with
// quantized weights (i8, f8e4m3 + per-row scales; cuda_linear_quant.h)
// against the CPU reference: several shapes (odd K, N not a multiple of the
// block, M past one row group), bit-exact batch invariance, vectorised and
// scalar loads giving the same bits, and every e4m3 code decoded as the host does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/backend/cuda/cuda_backend.h"
#include "engine/io/quantize.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// f32 accumulation on both sides; only the summation order differs.
constexpr float kTol = 1e-5f;

// A quantized matrix on the host and its copy on the device; the device codes
// start `offset` bytes into their buffer (offset 1: misaligned rows, scalar loads).
struct QuantTwin {
  io::QuantizedMatrix host;
  DeviceBuffer codes, scales;
  Tensor dev;
  QuantTwin(int64_t n, int64_t k, DType dtype, uint64_t seed, size_t offset = 0) {
    HostTensor w(DType::kF32, {n, k});
    cpu_be().fill_uniform(w, seed, -1.0f, 1.0f);
    // Rows of different magnitudes, one of zeros.
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) w.data<float>()[r * k + c] *= r == 2 ? 0.0f : 0.5f + r % 5;
    host = io::quantize_rows(w, dtype, "w");
    codes = DeviceBuffer(gpu_be(), static_cast<size_t>(n * k) + offset + 1);
    scales = DeviceBuffer(gpu_be(), static_cast<size_t>(n) * sizeof(float));
    const Tensor codes_dev(static_cast<char*>(codes.data()) + offset, dtype, {n, k},
                           gpu_be().device());
    const Tensor scales_dev = scales.view(DType::kF32, {n});
    gpu_be().upload(host.q.view().data(), codes_dev);
    gpu_be().upload(host.scales.view().data(), scales_dev);
    dev = codes_dev.with_scales(scales_dev.data_as<const float>());
  }
  Tensor cpu() const { return host.q.view().with_scales(host.scales.data<const float>()); }
};

Twin random_x(int64_t m, int64_t k, uint64_t seed) {
  Twin x(DType::kF32, {m, k});
  x.randomize(seed);
  return x;
}

HostTensor cpu_linear(const Twin& x, const QuantTwin& w) {
  HostTensor y(DType::kF32, {x.host.shape()[0], w.host.q.shape()[0]});
  cpu_be().linear(x.host, w.cpu(), y);
  return y;
}

HostTensor gpu_linear(const Twin& x, const Tensor& w) {
  Twin y(DType::kF32, {x.host.shape()[0], w.dim(0)});
  for (int64_t i = 0; i < y.host.numel(); ++i) y.host.data<float>()[i] = NAN;
  y.push();
  gpu_be().linear(x.dev, w, y.dev);
  return y.pull();
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.view().nbytes() == b.view().nbytes() &&
         std::memcmp(a.view().data(), b.view().data(), a.view().nbytes()) == 0;
}

struct QuantCase {
  DType dtype;
  int64_t m, n, k;
};

class CudaQuantLinear : public ::testing::TestWithParam<QuantCase> {};

TEST_P(CudaQuantLinear, MatchesCpuAndIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  const QuantCase c = GetParam();
  const QuantTwin w(c.n, c.k, c.dtype, 11);
  const Twin x = random_x(c.m, c.k, 12);
  const HostTensor got = gpu_linear(x, w.dev);
  expect_close(got, cpu_linear(x, w), kTol, "quantized linear");
  // Every row alone (a decode step) gives the same bits as within the call.
  for (int64_t r = 0; r < c.m; r += std::max<int64_t>(1, c.m / 3)) {
    Twin x1(DType::kF32, {1, c.k});
    std::memcpy(x1.host.data<float>(), x.host.data<float>() + r * c.k,
                static_cast<size_t>(c.k) * sizeof(float));
    x1.push();
    const HostTensor y1 = gpu_linear(x1, w.dev);
    EXPECT_EQ(std::memcmp(y1.data<float>(), got.data<float>() + r * c.n,
                          static_cast<size_t>(c.n) * sizeof(float)),
              0)
        << "row " << r;
  }
  // Misaligned codes take scalar loads with the same arithmetic.
  const QuantTwin shifted(c.n, c.k, c.dtype, 11, /*offset=*/1);
  EXPECT_TRUE(same_bits(gpu_linear(x, shifted.dev), got)) << "misaligned weights";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaQuantLinear,
    ::testing::Values(QuantCase{DType::kI8, 1, 19, 64}, QuantCase{DType::kI8, 1, 300, 37},
                      QuantCase{DType::kI8, 3, 5, 1}, QuantCase{DType::kI8, 8, 129, 515},
                      QuantCase{DType::kI8, 9, 64, 2048}, QuantCase{DType::kI8, 40, 33, 130},
                      QuantCase{DType::kF8E4M3, 1, 19, 64}, QuantCase{DType::kF8E4M3, 3, 300, 37},
                      QuantCase{DType::kF8E4M3, 9, 129, 515},
                      QuantCase{DType::kF8E4M3, 40, 33, 2048}));

// linear_prefill and the fused entry points run the same kernel per product.
TEST(CudaQuantLinearOps, PrefillMultiAndGeluMulEqualLinear) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
    const int64_t m = 300, n = 40, k = 72;  // m past kInvariantRows: linear_prefill's GEMM rows
    const QuantTwin wa(n, k, dtype, 21), wb(n, k, dtype, 22);
    const Twin x = random_x(m, k, 23);
    const HostTensor ya = gpu_linear(x, wa.dev), yb = gpu_linear(x, wb.dev);
    Twin p(DType::kF32, {m, n});
    gpu_be().linear_prefill(x.dev, wa.dev, p.dev);
    EXPECT_TRUE(same_bits(p.pull(), ya)) << "linear_prefill";
    Twin x4(DType::kF32, {4, k});
    std::memcpy(x4.host.data<float>(), x.host.data<float>(), static_cast<size_t>(4 * k) * 4);
    x4.push();
    const HostTensor ya4 = gpu_linear(x4, wa.dev), yb4 = gpu_linear(x4, wb.dev);
    Twin o1(DType::kF32, {4, n}), o2(DType::kF32, {4, n});
    const LinearOut outs[2] = {{wa.dev, o1.dev}, {wb.dev, o2.dev}};
    gpu_be().linear_multi(x4.dev, outs);
    EXPECT_TRUE(same_bits(o1.pull(), ya4)) << "linear_multi[0]";
    EXPECT_TRUE(same_bits(o2.pull(), yb4)) << "linear_multi[1]";
    Twin gate(DType::kF32, {4, n}), up(DType::kF32, {4, n}), ref(DType::kF32, {4, n});
    gpu_be().linear_gelu_mul(x4.dev, wa.dev, wb.dev, gate.dev, up.dev);
    Twin ga(DType::kF32, {4, n});
    std::memcpy(ga.host.data<float>(), ya4.data<float>(), ya4.view().nbytes());
    ga.push();
    Twin gb(DType::kF32, {4, n});
    std::memcpy(gb.host.data<float>(), yb4.data<float>(), yb4.view().nbytes());
    gb.push();
    gpu_be().gelu_mul(ga.dev, gb.dev, ref.dev);
    EXPECT_TRUE(same_bits(gate.pull(), ref.pull())) << "linear_gelu_mul";
  }
}

// Embedding rows equal the CPU's bit for bit (two f32 products on both sides),
// and every e4m3 code (NaNs included) decodes as the host's e4m3_to_f32.
TEST(CudaQuantEmbedding, MatchesCpuBitForBitAndDecodesEveryE4m3Code) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kI8, DType::kF8E4M3}) {
    const QuantTwin table(50, 37, dtype, 31);
    std::vector<int32_t> ids = {0, 49, 2, 7, 7, 13};
    Twin id(DType::kI32, {6});
    std::memcpy(id.host.data<int32_t>(), ids.data(), ids.size() * 4);
    id.push();
    Twin out(DType::kF32, {6, 37});
    gpu_be().embedding(table.dev, id.dev, 0.75f, out.dev);
    HostTensor want(DType::kF32, {6, 37});
    cpu_be().embedding(table.cpu(), id.host, 0.75f, want);
    EXPECT_TRUE(same_bits(out.pull(), want)) << dtype_name(dtype);
  }
  // One row of all 256 codes with scale 1.
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
  const float one = 1.0f;
  DeviceBuffer c(gpu_be(), 256), s(gpu_be(), 4);
  const Tensor cd = c.view(DType::kF8E4M3, {1, 256});
  gpu_be().upload(codes.data(), cd);
  gpu_be().upload(&one, s.view(DType::kF32, {1}));
  Twin id(DType::kI32, {1});
  id.host.data<int32_t>()[0] = 0;
  id.push();
  Twin out(DType::kF32, {1, 256});
  gpu_be().embedding(cd.with_scales(static_cast<const float*>(s.data())), id.dev, 1.0f, out.dev);
  const HostTensor got = out.pull();
  for (int i = 0; i < 256; ++i) {
    const float want = e4m3_to_f32(static_cast<uint8_t>(i));
    const float g = got.data<float>()[i];
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(g)) << "code " << i;
    } else {
      EXPECT_EQ(std::memcmp(&g, &want, 4), 0) << "code " << i << " got " << g << " want " << want;
    }
  }
}

}  // namespace
}  // namespace specula::test
