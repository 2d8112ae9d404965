// SPDX-License-Identifier: Apache-2.0
// CUDA fused layer steps (cuda_fused.cu): store_kv, rms_norm_add_norm and
// attention_inputs. Each must equal the CUDA composition of the base ops byte
// for byte (what makes switching the model over to them safe) and the CPU
// backend (which runs the default composition) within the norm / RoPE
// tolerances; plus batch invariance, negative positions and shape errors.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "tests/cuda/cuda_test_util.h"

namespace specula::test {
namespace {

// Tolerances against the CPU (relative to the largest reference magnitude, see
// expect_close). store_kv only moves floats: exact.
constexpr float kExactTol = 0.0f;
// rms_norm: the double sum of squares agrees; (mean + eps)^-1/2 may be one ulp
// apart, and a second norm of a residual one ulp apart stays within this.
constexpr float kNormTol = 1e-6f;
// A norm then RoPE: CUDA's sincosf may be two ulp from glibc's sinf/cosf.
constexpr float kNormRopeTol = 2e-5f;

const char* dtype_str(DType d) {
  return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16";
}

// Byte equality of two host tensors.
void expect_bits_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.nbytes(), want.nbytes()) << what;
  if (std::memcmp(got.data(), want.data(), want.nbytes()) == 0) return;
  const auto* g = static_cast<const unsigned char*>(got.data());
  const auto* w = static_cast<const unsigned char*>(want.data());
  size_t i = 0;
  while (g[i] == w[i]) ++i;
  ADD_FAILURE() << what << ": first differing byte " << i << " (element "
                << i / dtype_size(want.dtype()) << ")";
}

// A new twin holding a device copy of t's device contents (host side zeros).
std::unique_ptr<Twin> clone(const Twin& t) {
  auto c = std::make_unique<Twin>(t.host.dtype(), t.host.shape());
  gpu_be().copy(t.dev, c->dev);
  return c;
}

// Default RoPE frequencies over d/2 pairs, the upper quarter zeroed as partial
// rotary does (zero frequencies leave a pair unrotated).
void fill_inv_freq(Twin& freq, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    freq.host.data<float>()[j] =
        j >= half * 3 / 4 && half > 1
            ? 0.0f
            : static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(j) / d));
  }
  freq.push();
}

void set_positions(Twin& pos, const std::vector<int32_t>& values) {
  for (size_t i = 0; i < values.size(); ++i) pos.host.data<int32_t>()[i] = values[i];
  pos.push();
}

// ---- store_kv ----

// The store is a copy: the CPU result exactly, over rings that wrap, full
// caches and rows that are not float4 multiples (KV·D = 6) or not 16-byte aligned.
TEST(CudaFused, StoreKvMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t n, kv, d, cache_rows, first_pos;
  };
  const Case cases[] = {
      {1, 2, 64, 8, 3},     {5, 2, 256, 8, 30},  // ring: 30..34 -> slots 6, 7, 0, 1, 2
      {17, 16, 64, 17, 40},                      // every row of the cache written
      {17, 2, 512, 64, 0},  {3, 1, 6, 4, 2},     // scalar path
  };
  uint64_t seed = 1000;
  for (const Case& c : cases) {
    for (bool misaligned : {false, true}) {
      const std::string what = "store_kv n " + std::to_string(c.n) + " kv " + std::to_string(c.kv) +
                               " d " + std::to_string(c.d) + " R " + std::to_string(c.cache_rows) +
                               (misaligned ? " misaligned" : "");
      // Rows 1..n of an (n + 1)-row buffer: 4·KV·D bytes in, 16-byte aligned only
      // when KV·D is a multiple of 4.
      Twin k_all(DType::kF32, {c.n + 1, c.kv, c.d}), v_all(DType::kF32, {c.n + 1, c.kv, c.d});
      k_all.randomize(seed++);
      v_all.randomize(seed++);
      const int64_t first = misaligned ? 1 : 0;
      const Tensor k_host = k_all.host.view().slice_rows(first, first + c.n);
      const Tensor v_host = v_all.host.view().slice_rows(first, first + c.n);
      const Tensor k_dev = k_all.dev.slice_rows(first, first + c.n);
      const Tensor v_dev = v_all.dev.slice_rows(first, first + c.n);
      Twin pos(DType::kI32, {c.n});
      std::vector<int32_t> p(c.n);
      for (int64_t i = 0; i < c.n; ++i) p[i] = static_cast<int32_t>(c.first_pos + i);
      set_positions(pos, p);
      Twin ck(DType::kF32, {c.cache_rows, c.kv, c.d}), cv(DType::kF32, {c.cache_rows, c.kv, c.d});
      ck.randomize(seed++);
      cv.randomize(seed++);
      cpu_be().store_kv(k_host, v_host, pos.host, ck.host, cv.host);
      gpu_be().store_kv(k_dev, v_dev, pos.dev, ck.dev, cv.dev);
      expect_close(ck.pull(), ck.host, kExactTol, (what + " cache_k").c_str());
      expect_close(cv.pull(), cv.host, kExactTol, (what + " cache_v").c_str());
    }
  }
}

// A negative position cannot throw on the device: that row is not written.
TEST(CudaFused, StoreKvSkipsNegativePositions) {
  SKIP_WITHOUT_CUDA();
  Twin k(DType::kF32, {3, 2, 64}), v(DType::kF32, {3, 2, 64});
  k.randomize(1);
  v.randomize(2);
  Twin ck(DType::kF32, {4, 2, 64}), cv(DType::kF32, {4, 2, 64});
  ck.randomize(3);
  cv.randomize(4);
  Twin pos(DType::kI32, {3});
  set_positions(pos, {5, -1, 2});
  gpu_be().store_kv(k.dev, v.dev, pos.dev, ck.dev, cv.dev);
  const HostTensor got_k = ck.pull(), got_v = cv.pull();
  // Expected: rows 1 and 2 of the cache hold rows 0 and 2 of k/v; rows 0 and 3 untouched.
  const int64_t row = 2 * 64;
  auto expect_row = [&](const HostTensor& got, const Tensor& want, int64_t slot, const char* what) {
    EXPECT_EQ(std::memcmp(got.data<float>() + slot * row, want.data_as<const float>(),
                          row * sizeof(float)),
              0)
        << what << " slot " << slot;
  };
  expect_row(got_k, k.host.view().slice_rows(0, 1), 1, "k row 0");
  expect_row(got_k, k.host.view().slice_rows(2, 3), 2, "k row 2");
  expect_row(got_v, v.host.view().slice_rows(0, 1), 1, "v row 0");
  expect_row(got_v, v.host.view().slice_rows(2, 3), 2, "v row 2");
  expect_row(got_k, ck.host.view().slice_rows(0, 1), 0, "k untouched");
  expect_row(got_k, ck.host.view().slice_rows(3, 4), 3, "k untouched");
  expect_row(got_v, cv.host.view().slice_rows(0, 1), 0, "v untouched");
  expect_row(got_v, cv.host.view().slice_rows(3, 4), 3, "v untouched");
}

TEST(CudaFused, StoreKvRejectsBadArguments) {
  SKIP_WITHOUT_CUDA();
  Twin k(DType::kF32, {3, 2, 8}), v(DType::kF32, {3, 2, 8});
  Twin pos(DType::kI32, {3});
  Twin ck(DType::kF32, {4, 2, 8}), cv(DType::kF32, {4, 2, 8});
  Twin v_bad(DType::kF32, {3, 2, 4});
  EXPECT_THROW(gpu_be().store_kv(k.dev, v_bad.dev, pos.dev, ck.dev, cv.dev), Error);
  Twin pos_bad(DType::kI32, {2});
  EXPECT_THROW(gpu_be().store_kv(k.dev, v.dev, pos_bad.dev, ck.dev, cv.dev), Error);
  Twin ck_bad(DType::kF32, {4, 1, 8}), cv_bad(DType::kF32, {4, 1, 8});
  EXPECT_THROW(gpu_be().store_kv(k.dev, v.dev, pos.dev, ck_bad.dev, cv_bad.dev), Error);
  // More rows than the cache has: they cannot land on distinct rows.
  Twin ck_small(DType::kF32, {2, 2, 8}), cv_small(DType::kF32, {2, 2, 8});
  EXPECT_THROW(gpu_be().store_kv(k.dev, v.dev, pos.dev, ck_small.dev, cv_small.dev), Error);
  // The cache aliasing its input, or cache_k aliasing cache_v.
  Twin big(DType::kF32, {4, 2, 8});
  EXPECT_THROW(gpu_be().store_kv(big.dev.slice_rows(0, 3), v.dev, pos.dev, big.dev, cv.dev), Error);
  EXPECT_THROW(gpu_be().store_kv(k.dev, v.dev, pos.dev, ck.dev, ck.dev), Error);
  Twin ck_bf16(DType::kBF16, {4, 2, 8});
  EXPECT_THROW(gpu_be().store_kv(k.dev, v.dev, pos.dev, ck_bf16.dev, cv.dev), Error);
  // Host tensors handed to the GPU backend.
  EXPECT_THROW(gpu_be().store_kv(k.host, v.host, pos.host, ck.host, cv.host), Error);
}

// ---- rms_norm_add_norm ----

// Equal to rms_norm_add then rms_norm on the GPU byte for byte, and to the CPU
// within the norm tolerance: rows of a warp (d <= 1024) and of a block (in
// registers up to 6,144 elements, past that looping over memory).
TEST(CudaFused, RmsNormAddNormEqualsTheComposition) {
  SKIP_WITHOUT_CUDA();
  const Shape shapes[] = {{3, 64},   {5, 1024}, {17, 1536}, {2, 5376},
                          {1, 2, 7}, {2, 6144}, {3, 6145}};
  const DType next_dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  uint64_t seed = 2000;
  for (const Shape& shape : shapes) {
    const int64_t d = shape.dim(-1);
    for (DType wd : {DType::kF32, DType::kBF16}) {
      for (int nw = -1; nw < 3; ++nw) {  // -1: no next weight
        for (float post_scale : {1.0f, 0.5f}) {
          const std::string what = "rms_norm_add_norm " + shape.str() + " w " + dtype_str(wd) +
                                   " next " + (nw < 0 ? "none" : dtype_str(next_dtypes[nw])) +
                                   " post_scale " + std::to_string(post_scale);
          Twin x(DType::kF32, shape), residual(DType::kF32, shape), out(DType::kF32, shape);
          x.randomize(seed++, -3.0f, 3.0f);
          residual.randomize(seed++, -2.0f, 2.0f);
          out.randomize(seed++);
          Twin w(wd, {d});
          w.randomize(seed++, 0.5f, 1.5f);
          std::unique_ptr<Twin> next_w;
          if (nw >= 0) {
            next_w = std::make_unique<Twin>(next_dtypes[nw], Shape{d});
            next_w->randomize(seed++, 0.5f, 1.5f);
          }
          const Tensor nw_dev = next_w ? next_w->dev : Tensor();
          const Tensor nw_host = next_w ? Tensor(next_w->host) : Tensor();
          // The composition on copies.
          auto r2 = clone(residual);
          auto out2 = clone(out);
          gpu_be().rms_norm_add(x.dev, w.dev, 1e-6f, r2->dev, post_scale);
          gpu_be().rms_norm(r2->dev, nw_dev, 1e-6f, out2->dev);
          gpu_be().rms_norm_add_norm(x.dev, w.dev, 1e-6f, residual.dev, post_scale, nw_dev,
                                     out.dev);
          expect_bits_equal(residual.pull(), r2->pull(), what + " residual");
          expect_bits_equal(out.pull(), out2->pull(), what + " next_out");
          cpu_be().rms_norm_add_norm(x.host, w.host, 1e-6f, residual.host, post_scale, nw_host,
                                     out.host);
          expect_close(residual.pull(), residual.host, kNormTol, (what + " residual").c_str());
          expect_close(out.pull(), out.host, kNormTol, (what + " next_out").c_str());
        }
      }
    }
  }
  // No weights at all.
  Twin x(DType::kF32, {4, 256}), residual(DType::kF32, {4, 256}), out(DType::kF32, {4, 256});
  x.randomize(1);
  residual.randomize(2);
  auto r2 = clone(residual);
  auto out2 = clone(out);
  gpu_be().rms_norm_add(x.dev, Tensor(), 1e-6f, r2->dev, 1.0f);
  gpu_be().rms_norm(r2->dev, Tensor(), 1e-6f, out2->dev);
  gpu_be().rms_norm_add_norm(x.dev, Tensor(), 1e-6f, residual.dev, 1.0f, Tensor(), out.dev);
  expect_bits_equal(residual.pull(), r2->pull(), "weightless residual");
  expect_bits_equal(out.pull(), out2->pull(), "weightless next_out");
}

TEST(CudaFused, RmsNormAddNormRowIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {256, 2816}) {
    constexpr int64_t kRows = 37;
    Twin x(DType::kF32, {kRows, d}), residual(DType::kF32, {kRows, d});
    x.randomize(11, -4.0f, 4.0f);
    residual.randomize(12);
    Twin w(DType::kBF16, {d}), nw(DType::kBF16, {d});
    w.randomize(13, 0.5f, 1.5f);
    nw.randomize(14, 0.5f, 1.5f);
    auto r_all = clone(residual);
    Twin out_all(DType::kF32, {kRows, d});
    gpu_be().rms_norm_add_norm(x.dev, w.dev, 1e-6f, r_all->dev, 0.5f, nw.dev, out_all.dev);
    const HostTensor r_host = r_all->pull(), out_host = out_all.pull();
    for (int64_t r : {int64_t{0}, int64_t{9}, kRows - 1}) {
      Twin r_one(DType::kF32, {1, d}), out_one(DType::kF32, {1, d});
      gpu_be().copy(residual.dev.slice_rows(r, r + 1), r_one.dev);
      gpu_be().rms_norm_add_norm(x.dev.slice_rows(r, r + 1), w.dev, 1e-6f, r_one.dev, 0.5f, nw.dev,
                                 out_one.dev);
      const std::string what = "row " + std::to_string(r) + " of d " + std::to_string(d);
      expect_bits_equal(r_one.pull(), r_host.view().slice_rows(r, r + 1), what + " residual");
      expect_bits_equal(out_one.pull(), out_host.view().slice_rows(r, r + 1), what + " next_out");
    }
  }
}

// For a few rows, rms_norm_add_norm (and the fused gelu product) also leave
// their output's bf16 split for the product right after it (which then runs
// no split kernel): every product kind must give the bits it gives for the
// same x split afresh, with odd
// widths (zero padding of the last step) and the second 8-row tile; and an op
// in between (here one rewriting next_out) must make the product split again.
TEST(CudaFused, ProductsAfterTheNormReadItsSplitExactly) {
  SKIP_WITHOUT_CUDA();
  for (int64_t rows : {int64_t{2}, int64_t{5}, int64_t{13}}) {
    for (int64_t d : {int64_t{256}, int64_t{200}, int64_t{1100}}) {
      const std::string what = "rows " + std::to_string(rows) + " d " + std::to_string(d);
      const int64_t n = 40;
      Twin x(DType::kF32, {rows, d});
      Twin residual(DType::kF32, {rows, d});
      Twin w(DType::kBF16, {d});
      Twin nw(DType::kBF16, {d});
      Twin wq(DType::kBF16, {n, d});
      Twin wk(DType::kBF16, {n / 2, d});
      Twin wu(DType::kBF16, {n, d});
      x.randomize(70 + rows);
      residual.randomize(71 + d, -2.0f, 2.0f);
      w.randomize(72, 0.5f, 1.5f);
      nw.randomize(73, 0.5f, 1.5f);
      wq.randomize(74, -0.5f, 0.5f);
      wk.randomize(75, -0.5f, 0.5f);
      wu.randomize(76, -0.5f, 0.5f);
      Twin out(DType::kF32, {rows, d});
      Twin copy(DType::kF32, {rows, d});
      Twin y(DType::kF32, {rows, n}), y_ref(DType::kF32, {rows, n});
      Twin yk(DType::kF32, {rows, n / 2}), yk_ref(DType::kF32, {rows, n / 2});
      Twin up(DType::kF32, {rows, n});
      // A fresh product of the same values (copied: the split comes from its own kernel).
      auto norm = [&] {
        residual.push();
        gpu_be().rms_norm_add_norm(x.dev, w.dev, 1e-6f, residual.dev, 1.0f, nw.dev, out.dev);
      };
      norm();
      gpu_be().linear(out.dev, wq.dev, y.dev);
      gpu_be().copy(out.dev, copy.dev);
      gpu_be().linear(copy.dev, wq.dev, y_ref.dev);
      expect_bits_equal(y.pull(), y_ref.pull(), "linear after the norm, " + what);

      norm();
      gpu_be().linear_multi(out.dev, std::vector<LinearOut>{{wq.dev, y.dev}, {wk.dev, yk.dev}});
      gpu_be().linear_multi(copy.dev,
                            std::vector<LinearOut>{{wq.dev, y_ref.dev}, {wk.dev, yk_ref.dev}});
      expect_bits_equal(y.pull(), y_ref.pull(), "linear_multi after the norm, " + what);
      expect_bits_equal(yk.pull(), yk_ref.pull(), "linear_multi after the norm, " + what);

      norm();
      gpu_be().linear_gelu_mul(out.dev, wq.dev, wu.dev, y.dev, up.dev);
      gpu_be().linear_gelu_mul(copy.dev, wq.dev, wu.dev, y_ref.dev, up.dev);
      expect_bits_equal(y.pull(), y_ref.pull(), "linear_gelu_mul after the norm, " + what);

      // The fused gelu product leaves its output's split (padded past n) for
      // the product after it, as down_proj follows the MLP.
      Twin g(DType::kF32, {rows, n});
      Twin g_copy(DType::kF32, {rows, n});
      Twin wd(DType::kBF16, {d, n});
      wd.randomize(77, -0.5f, 0.5f);
      Twin z(DType::kF32, {rows, d});
      Twin z_ref(DType::kF32, {rows, d});
      gpu_be().linear_gelu_mul(out.dev, wq.dev, wu.dev, g.dev, up.dev);
      gpu_be().linear(g.dev, wd.dev, z.dev);
      gpu_be().copy(g.dev, g_copy.dev);
      gpu_be().linear(g_copy.dev, wd.dev, z_ref.dev);
      expect_bits_equal(z.pull(), z_ref.pull(), "linear after linear_gelu_mul, " + what);

      // An op between the norm and the product: the product must split the new x.
      norm();
      gpu_be().scale(out.dev, 3.0f, out.dev);
      gpu_be().linear(out.dev, wq.dev, y.dev);
      gpu_be().scale(copy.dev, 3.0f, copy.dev);
      gpu_be().linear(copy.dev, wq.dev, y_ref.dev);
      expect_bits_equal(y.pull(), y_ref.pull(), "linear after norm + scale, " + what);
    }
  }
}

TEST(CudaFused, RmsNormAddNormRejectsBadArguments) {
  SKIP_WITHOUT_CUDA();
  Twin x(DType::kF32, {2, 8}), residual(DType::kF32, {2, 8}), out(DType::kF32, {2, 8});
  Twin w(DType::kF32, {8}), w_bad(DType::kF32, {7});
  auto call = [&](const Tensor& xx, const Tensor& ww, const Tensor& rr, const Tensor& nw,
                  const Tensor& oo) {
    gpu_be().rms_norm_add_norm(xx, ww, 1e-6f, rr, 1.0f, nw, oo);
  };
  EXPECT_NO_THROW(call(x.dev, w.dev, residual.dev, w.dev, out.dev));
  EXPECT_THROW(call(x.dev, w_bad.dev, residual.dev, w.dev, out.dev), Error);
  EXPECT_THROW(call(x.dev, w.dev, residual.dev, w_bad.dev, out.dev), Error);
  Twin out_bad(DType::kF32, {2, 9});
  EXPECT_THROW(call(x.dev, w.dev, residual.dev, w.dev, out_bad.dev), Error);
  Twin res_bad(DType::kF32, {3, 8});
  EXPECT_THROW(call(x.dev, w.dev, res_bad.dev, w.dev, out.dev), Error);
  // x and residual the same buffer; next_out aliasing x or residual.
  EXPECT_THROW(call(x.dev, w.dev, x.dev, w.dev, out.dev), Error);
  EXPECT_THROW(call(x.dev, w.dev, residual.dev, w.dev, residual.dev), Error);
  EXPECT_THROW(call(x.dev, w.dev, residual.dev, w.dev, x.dev), Error);
  Twin big(DType::kF32, {3, 8});
  EXPECT_THROW(call(x.dev, w.dev, big.dev.slice_rows(0, 2), w.dev, big.dev.slice_rows(1, 3)),
               Error);
  Twin w_i32(DType::kI32, {8});
  EXPECT_THROW(call(x.dev, w.dev, residual.dev, w_i32.dev, out.dev), Error);
  EXPECT_THROW(call(x.host, w.host, residual.host, w.host, out.host), Error);
}

// ---- attention_inputs ----

enum class KMode { kQOnly, kSeparateV, kVFromK };
enum class CacheMode { kNone, kRing, kFull, kExact };

const char* kmode_str(KMode m) {
  return m == KMode::kQOnly ? "q only" : m == KMode::kSeparateV ? "separate v" : "v from k";
}
const char* cache_str(CacheMode c) {
  switch (c) {
    case CacheMode::kNone:
      return "no cache";
    case CacheMode::kRing:
      return "ring";
    case CacheMode::kFull:
      return "full cache";
    default:
      return "exact cache";
  }
}

struct AttnCase {
  int64_t m, heads, kv_heads, d;
  DType q_dtype, k_dtype;
  KMode kmode;
  CacheMode cache;
};

std::string describe(const AttnCase& c) {
  return "attention_inputs M " + std::to_string(c.m) + " heads " + std::to_string(c.heads) + "/" +
         std::to_string(c.kv_heads) + " D " + std::to_string(c.d) + " norms " +
         dtype_str(c.q_dtype) + "/" + dtype_str(c.k_dtype) + ", " + kmode_str(c.kmode) + ", " +
         cache_str(c.cache);
}

// The contract of AttentionInputsParams spelt out with the base ops.
void compose(Backend& be, const AttentionInputsParams& p) {
  be.rms_norm(p.q, p.q_norm, p.eps, p.q);
  be.rope(p.q, p.positions, p.inv_freq);
  if (p.k.empty()) return;
  if (p.v_from_k) be.copy(p.k, p.v);
  be.rms_norm(p.k, p.k_norm, p.eps, p.k);
  be.rope(p.k, p.positions, p.inv_freq);
  be.rms_norm(p.v, Tensor(), p.eps, p.v);
  if (!p.cache_k.empty()) be.store_kv(p.k, p.v, p.positions, p.cache_k, p.cache_v);
}

// The tensors of one case: originals (host and device alike) and the device
// copies the fused op and the composition run on.
struct AttnData {
  std::unique_ptr<Twin> q, q_norm, k, k_norm, v, pos, freq, cache_k, cache_v;
  int64_t cache_rows = 0;

  AttentionInputsParams params(bool on_device, bool v_from_k) const {
    auto pick = [&](const std::unique_ptr<Twin>& t) {
      return !t ? Tensor() : on_device ? t->dev : Tensor(t->host);
    };
    AttentionInputsParams p;
    p.q = pick(q);
    p.q_norm = pick(q_norm);
    p.k = pick(k);
    p.k_norm = pick(k_norm);
    p.v = pick(v);
    p.v_from_k = v_from_k;
    p.positions = pick(pos);
    p.inv_freq = pick(freq);
    p.eps = 1e-6f;
    p.cache_k = pick(cache_k);
    p.cache_v = pick(cache_v);
    return p;
  }
  // Device copies of the tensors the op writes (inputs are shared).
  AttnData clone_outputs() const {
    AttnData c;
    auto copy_of = [](const std::unique_ptr<Twin>& t) { return t ? clone(*t) : nullptr; };
    c.q = copy_of(q);
    c.k = copy_of(k);
    c.v = copy_of(v);
    c.cache_k = copy_of(cache_k);
    c.cache_v = copy_of(cache_v);
    c.cache_rows = cache_rows;
    return c;
  }
  // This copy's outputs with the shared inputs of `orig`, as device params.
  AttentionInputsParams device_params(const AttnData& orig, bool v_from_k) const {
    AttentionInputsParams p = orig.params(true, v_from_k);
    p.q = q->dev;
    if (k) {
      p.k = k->dev;
      p.v = v->dev;
    }
    if (cache_k) {
      p.cache_k = cache_k->dev;
      p.cache_v = cache_v->dev;
    }
    return p;
  }
};

AttnData make_data(const AttnCase& c, uint64_t& seed) {
  AttnData t;
  t.q = std::make_unique<Twin>(DType::kF32, Shape{c.m, c.heads, c.d});
  t.q->randomize(seed++, -3.0f, 3.0f);
  t.q_norm = std::make_unique<Twin>(c.q_dtype, Shape{c.d});
  t.q_norm->randomize(seed++, 0.5f, 1.5f);
  t.freq = std::make_unique<Twin>(DType::kF32, Shape{c.d / 2});
  fill_inv_freq(*t.freq, c.d);
  t.pos = std::make_unique<Twin>(DType::kI32, Shape{c.m});
  std::vector<int32_t> p(c.m);
  switch (c.cache) {
    case CacheMode::kNone:
      // Long-context positions, descending (rope's large-angle path).
      for (int64_t i = 0; i < c.m; ++i) p[i] = static_cast<int32_t>(131071 - 977 * i);
      break;
    case CacheMode::kRing:
      // Positions far beyond R, crossing the ring's end after two rows.
      t.cache_rows = c.m + 3;
      for (int64_t i = 0; i < c.m; ++i) p[i] = static_cast<int32_t>(t.cache_rows * 1000 - 2 + i);
      break;
    case CacheMode::kFull:
      t.cache_rows = 64;
      for (int64_t i = 0; i < c.m; ++i) p[i] = static_cast<int32_t>(9 + i);
      break;
    case CacheMode::kExact:
      // M == R: every row of the cache is written once.
      t.cache_rows = c.m;
      for (int64_t i = 0; i < c.m; ++i) p[i] = static_cast<int32_t>(5 * c.m + 1 + i);
      break;
  }
  set_positions(*t.pos, p);
  if (c.kmode == KMode::kQOnly) return t;
  t.k = std::make_unique<Twin>(DType::kF32, Shape{c.m, c.kv_heads, c.d});
  t.k->randomize(seed++, -3.0f, 3.0f);
  t.v = std::make_unique<Twin>(DType::kF32, Shape{c.m, c.kv_heads, c.d});
  t.v->randomize(seed++, -2.0f, 2.0f);
  t.k_norm = std::make_unique<Twin>(c.k_dtype, Shape{c.d});
  t.k_norm->randomize(seed++, 0.5f, 1.5f);
  if (c.cache != CacheMode::kNone) {
    t.cache_k = std::make_unique<Twin>(DType::kF32, Shape{t.cache_rows, c.kv_heads, c.d});
    t.cache_v = std::make_unique<Twin>(DType::kF32, Shape{t.cache_rows, c.kv_heads, c.d});
    t.cache_k->randomize(seed++);
    t.cache_v->randomize(seed++);
  }
  return t;
}

// Fused vs the GPU composition (bytes) vs the CPU (tolerance), every output.
void check_case(const AttnCase& c, uint64_t& seed) {
  const std::string what = describe(c);
  SCOPED_TRACE(what);
  const bool v_from_k = c.kmode == KMode::kVFromK;
  AttnData orig = make_data(c, seed);
  AttnData fused = orig.clone_outputs();
  AttnData composed = orig.clone_outputs();
  gpu_be().attention_inputs(fused.device_params(orig, v_from_k));
  compose(gpu_be(), composed.device_params(orig, v_from_k));
  cpu_be().attention_inputs(orig.params(false, v_from_k));
  auto compare = [&](const std::unique_ptr<Twin>& got, const std::unique_ptr<Twin>& same,
                     const std::unique_ptr<Twin>& ref, float tol, const char* name) {
    if (!ref) return;
    const HostTensor g = got->pull();
    expect_bits_equal(g, same->pull(), what + " " + name + " vs the composition");
    expect_close(g, ref->host, tol, (what + " " + name + " vs cpu").c_str());
  };
  compare(fused.q, composed.q, orig.q, kNormRopeTol, "q");
  compare(fused.k, composed.k, orig.k, kNormRopeTol, "k");
  compare(fused.v, composed.v, orig.v, kNormTol, "v");
  compare(fused.cache_k, composed.cache_k, orig.cache_k, kNormRopeTol, "cache_k");
  compare(fused.cache_v, composed.cache_v, orig.cache_v, kNormTol, "cache_v");
}

struct HeadsCase {
  int64_t heads, kv_heads;
};
constexpr int64_t kTokens[] = {1, 5, 17};
constexpr HeadsCase kHeads[] = {{8, 2}, {32, 16}};
// 64, 256, 512 as the models use; 80 pairs element j with j + 40, held by another lane.
constexpr int64_t kHeadDims[] = {64, 80, 256, 512};
constexpr DType kNormDtypes[] = {DType::kF32, DType::kBF16};
constexpr CacheMode kCacheModes[] = {CacheMode::kNone, CacheMode::kRing, CacheMode::kFull,
                                     CacheMode::kExact};

void check_all_shapes(KMode kmode, uint64_t seed) {
  for (int64_t m : kTokens) {
    for (const HeadsCase& h : kHeads) {
      for (int64_t d : kHeadDims) {
        for (DType wd : kNormDtypes) {
          for (CacheMode cache : kCacheModes) {
            if (kmode == KMode::kQOnly && cache != CacheMode::kNone) continue;
            check_case({m, h.heads, h.kv_heads, d, wd, wd, kmode, cache}, seed);
          }
        }
      }
    }
  }
}

TEST(CudaFused, AttentionInputsQOnly) {
  SKIP_WITHOUT_CUDA();
  check_all_shapes(KMode::kQOnly, 3000);
}

TEST(CudaFused, AttentionInputsSeparateV) {
  SKIP_WITHOUT_CUDA();
  check_all_shapes(KMode::kSeparateV, 4000);
}

TEST(CudaFused, AttentionInputsVFromK) {
  SKIP_WITHOUT_CUDA();
  check_all_shapes(KMode::kVFromK, 5000);
}

// Mixed norm dtypes (f16 too), and head dimensions the fused kernel hands to the
// composition (above 512) or that are tiny.
TEST(CudaFused, AttentionInputsOtherDtypesAndHeadDims) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 6000;
  check_case({5, 8, 2, 256, DType::kF16, DType::kBF16, KMode::kSeparateV, CacheMode::kRing}, seed);
  check_case({5, 8, 2, 512, DType::kBF16, DType::kF32, KMode::kVFromK, CacheMode::kFull}, seed);
  check_case({3, 4, 2, 1024, DType::kBF16, DType::kBF16, KMode::kVFromK, CacheMode::kRing}, seed);
  check_case({3, 4, 1, 2, DType::kF32, DType::kF32, KMode::kSeparateV, CacheMode::kExact}, seed);
}

// A token's rows come out the same whether it is processed alone or with others.
TEST(CudaFused, AttentionInputsRowIsBatchInvariant) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 7000;
  const AttnCase c{17, 8, 2, 256, DType::kBF16, DType::kBF16, KMode::kSeparateV, CacheMode::kRing};
  AttnData orig = make_data(c, seed);
  AttnData all = orig.clone_outputs();
  gpu_be().attention_inputs(all.device_params(orig, false));
  const HostTensor q_all = all.q->pull(), k_all = all.k->pull(), v_all = all.v->pull();
  const HostTensor ck_all = all.cache_k->pull(), cv_all = all.cache_v->pull();
  const int32_t* pos = orig.pos->host.data<int32_t>();
  for (int64_t t : {int64_t{0}, int64_t{7}, c.m - 1}) {
    Twin q(DType::kF32, {1, c.heads, c.d}), k(DType::kF32, {1, c.kv_heads, c.d}),
        v(DType::kF32, {1, c.kv_heads, c.d});
    gpu_be().copy(orig.q->dev.slice_rows(t, t + 1), q.dev);
    gpu_be().copy(orig.k->dev.slice_rows(t, t + 1), k.dev);
    gpu_be().copy(orig.v->dev.slice_rows(t, t + 1), v.dev);
    auto ck = clone(*orig.cache_k);
    auto cv = clone(*orig.cache_v);
    AttentionInputsParams p = orig.params(true, false);
    p.q = q.dev;
    p.k = k.dev;
    p.v = v.dev;
    p.positions = orig.pos->dev.slice_rows(t, t + 1);
    p.cache_k = ck->dev;
    p.cache_v = cv->dev;
    gpu_be().attention_inputs(p);
    const std::string what = "token " + std::to_string(t);
    expect_bits_equal(q.pull(), q_all.view().slice_rows(t, t + 1), what + " q");
    expect_bits_equal(k.pull(), k_all.view().slice_rows(t, t + 1), what + " k");
    expect_bits_equal(v.pull(), v_all.view().slice_rows(t, t + 1), what + " v");
    const int64_t slot = pos[t] % orig.cache_rows;
    expect_bits_equal(ck->pull().view().slice_rows(slot, slot + 1),
                      ck_all.view().slice_rows(slot, slot + 1), what + " cache_k row");
    expect_bits_equal(cv->pull().view().slice_rows(slot, slot + 1),
                      cv_all.view().slice_rows(slot, slot + 1), what + " cache_v row");
  }
}

// A negative position: q and k still rotate by it; its cache rows are left as
// they were, as store_kv does on the GPU.
TEST(CudaFused, AttentionInputsNegativePositionSkipsTheCacheStore) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 8000;
  const AttnCase c{3, 8, 2, 64, DType::kF32, DType::kF32, KMode::kVFromK, CacheMode::kFull};
  AttnData orig = make_data(c, seed);
  set_positions(*orig.pos, {5, -1, 7});
  AttnData fused = orig.clone_outputs();
  AttnData composed = orig.clone_outputs();
  gpu_be().attention_inputs(fused.device_params(orig, true));
  compose(gpu_be(), composed.device_params(orig, true));
  for (const auto& [name, got, want] :
       {std::tuple<const char*, Twin*, Twin*>{"q", fused.q.get(), composed.q.get()},
        {"k", fused.k.get(), composed.k.get()},
        {"v", fused.v.get(), composed.v.get()},
        {"cache_k", fused.cache_k.get(), composed.cache_k.get()},
        {"cache_v", fused.cache_v.get(), composed.cache_v.get()}}) {
    expect_bits_equal(got->pull(), want->pull(), std::string("negative position ") + name);
  }
  // Only cache rows 5 and 7 changed.
  const HostTensor ck = fused.cache_k->pull();
  for (int64_t r = 0; r < orig.cache_rows; ++r) {
    if (r == 5 || r == 7) continue;
    expect_bits_equal(ck.view().slice_rows(r, r + 1),
                      orig.cache_k->host.view().slice_rows(r, r + 1),
                      "untouched cache_k row " + std::to_string(r));
  }
}

TEST(CudaFused, AttentionInputsRejectsBadArguments) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 9000;
  const AttnCase c{3, 4, 2, 64, DType::kF32, DType::kF32, KMode::kSeparateV, CacheMode::kFull};
  AttnData d = make_data(c, seed);
  EXPECT_NO_THROW(gpu_be().attention_inputs(d.params(true, false)));
  auto expect_error = [&](auto&& edit, const char* what) {
    AttentionInputsParams p = d.params(true, false);
    edit(p);
    EXPECT_THROW(gpu_be().attention_inputs(p), Error) << what;
  };
  Twin w_bad(DType::kF32, {32});
  expect_error([&](AttentionInputsParams& p) { p.q_norm = w_bad.dev; }, "q_norm size");
  expect_error([&](AttentionInputsParams& p) { p.k_norm = w_bad.dev; }, "k_norm size");
  Twin freq_bad(DType::kF32, {64});  // must be D/2 = 32
  expect_error([&](AttentionInputsParams& p) { p.inv_freq = freq_bad.dev; }, "inv_freq size");
  Twin pos_bad(DType::kI32, {2});
  expect_error([&](AttentionInputsParams& p) { p.positions = pos_bad.dev; }, "positions size");
  Twin k_bad(DType::kF32, {3, 2, 32});
  expect_error([&](AttentionInputsParams& p) { p.k = k_bad.dev; }, "k head dim");
  Twin v_bad(DType::kF32, {3, 1, 64});
  expect_error([&](AttentionInputsParams& p) { p.v = v_bad.dev; }, "v shape");
  Twin small_k(DType::kF32, {2, 2, 64}), small_v(DType::kF32, {2, 2, 64});
  expect_error(
      [&](AttentionInputsParams& p) {
        p.cache_k = small_k.dev;
        p.cache_v = small_v.dev;
      },
      "M > R");
  Twin v4(DType::kF32, {3, 4, 64});
  expect_error(
      [&](AttentionInputsParams& p) {
        p.k = p.q;  // the same buffer: k would be normalised twice
        p.v = v4.dev;
        p.cache_k = Tensor();
        p.cache_v = Tensor();
      },
      "k aliasing q");
  expect_error([&](AttentionInputsParams& p) { p.cache_v = p.cache_k; },
               "cache_v aliasing cache_k");
  expect_error(
      [&](AttentionInputsParams& p) {
        p.k = Tensor();
        p.v = Tensor();
      },
      "a cache store without k");
  Twin q_odd(DType::kF32, {3, 4, 63});
  expect_error([&](AttentionInputsParams& p) { p.q = q_odd.dev; }, "odd head dim");
  expect_error([&](AttentionInputsParams& p) { p.q = d.q->host; }, "host q");
}

}  // namespace
}  // namespace specula::test
