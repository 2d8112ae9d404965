// SPDX-License-Identifier: Apache-2.0
// CpuBackend construction, argument checks shared by all CPU ops, and copy.
#include "engine/backend/cpu/cpu_backend.h"

#include <unistd.h>

#include <algorithm>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "engine/backend/backends.h"
#include "engine/ops/uniform_hash.h"

namespace specula {

CpuBackend::CpuBackend() = default;

void* CpuBackend::allocate(size_t bytes) {
  void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  if (p == nullptr) fail("cpu: out of host memory allocating {} bytes", bytes);
  ++allocations_;
  return p;
}

MemoryInfo CpuBackend::memory_info() const {
  const long page = sysconf(_SC_PAGESIZE);
  const long avail = sysconf(_SC_AVPHYS_PAGES);
  const long total = sysconf(_SC_PHYS_PAGES);
  return {.free_bytes = static_cast<int64_t>(avail) * page,
          .total_bytes = static_cast<int64_t>(total) * page};
}

void CpuBackend::release(void* p) noexcept {
  std::free(p);
}

void CpuBackend::upload(const void* host, const Tensor& dst) {
  cpu::check_host("upload", "dst", dst);
  if (dst.nbytes()) std::memcpy(dst.data(), host, dst.nbytes());
}

void CpuBackend::download(const Tensor& src, void* host) {
  cpu::check_host("download", "src", src);
  ++readbacks_;
  if (src.nbytes()) std::memcpy(host, src.data(), src.nbytes());
}

void CpuBackend::fill_uniform(const Tensor& t, uint64_t seed, float lo, float hi) {
  cpu::check_host("fill_uniform", "t", t);
  cpu::check_float("fill_uniform", "t", t);
  const int64_t n = t.numel();
  cpu::parallel_for_each(n, true, [&](int64_t i, int) {
    const float v = uniform_at(seed, static_cast<uint64_t>(i), lo, hi);
    switch (t.dtype()) {
      case DType::kF32:
        t.data_as<float>()[i] = v;
        break;
      case DType::kBF16:
        t.data_as<uint16_t>()[i] = f32_to_bf16(v);
        break;
      default:
        t.data_as<uint16_t>()[i] = f32_to_f16(v);
        break;
    }
  });
}

void CpuBackend::transpose01(const Tensor& x, const Tensor& out) {
  cpu::check_host("transpose01", "x", x);
  cpu::check_host("transpose01", "out", out);
  cpu::check_dtype("transpose01", "x", x, DType::kF32);
  cpu::check_dtype("transpose01", "out", out, DType::kF32);
  cpu::check_rank("transpose01", "x", x, 3);
  const int64_t A = x.dim(0), B = x.dim(1), C = x.dim(2);
  if (out.shape() != Shape{B, A, C}) {
    fail("transpose01: out {} must be [{}, {}, {}] for x {}", out.describe(), B, A, C,
         x.describe());
  }
  cpu::check_no_alias("transpose01", "out", out, "x", x);
  const float* src = x.data_as<const float>();
  float* dst = out.data_as<float>();
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(dst + (b * A + a) * C, src + (a * B + b) * C, static_cast<size_t>(C) * 4);
}

void CpuBackend::reserve_scratch(int64_t max_keys, int64_t max_width) {
  // Attention borrows one score row per thread; wide products one widened weight row per thread.
  const int64_t per_thread = std::max<int64_t>({max_keys, max_width, 1});
  scratch_.reserve(static_cast<size_t>(cpu::team_size()) * static_cast<size_t>(per_thread));
}

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<CpuBackend>();
}

namespace cpu {

void check_ids_below(const char* op, const char* name, const Tensor& ids, int64_t bound) {
  const int32_t* v = ids.data_as<const int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (v[i] < 0 || v[i] >= bound) {
      fail("{}: {}[{}] = {} is outside [0, {}) ({})", op, name, i, v[i], bound, ids.describe());
    }
  }
}

void check_host(const char* op, const char* name, const Tensor& t) {
  if (!t.device().is_cpu()) {
    fail("{}: {} {} is on {}, but the CPU backend needs host tensors", op, name, t.describe(),
         t.device().str());
  }
  if (t.data() == nullptr && t.numel() != 0) {
    fail("{}: {} {} has no memory behind it (empty view)", op, name, t.describe());
  }
}

bool worth_parallel(int64_t work) {
  // Below this, waking the OpenMP team costs more than the loop itself.
  constexpr int64_t kMinParallelWork = 1 << 15;
  return work >= kMinParallelWork;
}

}  // namespace cpu

void CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  cpu::check_host("copy", "src", src);
  cpu::check_host("copy", "dst", dst);
  if (src.dtype() != dst.dtype() || src.shape() != dst.shape()) {
    fail("copy: src {} and dst {} must have the same dtype and shape", src.describe(),
         dst.describe());
  }
  // memmove: an overlapping copy is well defined (if rarely meaningful).
  if (src.nbytes() != 0 && src.data() != dst.data())
    std::memmove(dst.data(), src.data(), src.nbytes());
}

void CpuBackend::gather_rows(const Tensor& src, const Tensor& idx, const Tensor& out) {
  constexpr const char* kOp = "gather_rows";
  cpu::check_host(kOp, "src", src);
  cpu::check_host(kOp, "idx", idx);
  cpu::check_host(kOp, "out", out);
  const ops::GatherRowsDims d = ops::check_gather_rows(kOp, src, idx, out);
  cpu::check_ids_below(kOp, "idx", idx, d.src_rows);
  const int32_t* ids = idx.data_as<const int32_t>();
  const size_t row_bytes = static_cast<size_t>(d.row_words) * 4;
  const char* from = static_cast<const char*>(src.data());
  char* to = static_cast<char*>(out.data());
  for (int64_t i = 0; i < d.rows; ++i)
    std::memcpy(to + static_cast<size_t>(i) * row_bytes,
                from + static_cast<size_t>(ids[i]) * row_bytes, row_bytes);
}

void CpuBackend::store_kv(const Tensor& k, const Tensor& v, const Tensor& positions,
                          const Tensor& cache_k, const Tensor& cache_v) {
  constexpr const char* kOp = "store_kv";
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"k", &k},
                                {"v", &v},
                                {"positions", &positions},
                                {"cache_k", &cache_k},
                                {"cache_v", &cache_v}}) {
    cpu::check_host(kOp, name, *t);
  }
  const ops::StoreKvDims d = ops::check_store_kv(kOp, k, v, positions, cache_k, cache_v);
  const int32_t* pos = positions.data_as<const int32_t>();
  for (int64_t i = 0; i < d.rows; ++i) {
    if (pos[i] < 0) fail("{}: position {} of row {} is negative", kOp, pos[i], i);
  }
  // Row by row through convert (f32 rows into an f32, bf16 or fp8 cache; an
  // fp8 row keeps its [KV, D] shape, so its per-head scales come along).
  for (int64_t i = 0; i < d.rows; ++i) {
    const int64_t slot = pos[i] % d.cache_rows;
    convert(k.slice_rows(i, i + 1), cache_k.slice_rows(slot, slot + 1));
    convert(v.slice_rows(i, i + 1), cache_v.slice_rows(slot, slot + 1));
  }
}

namespace {
// The scales of an fp8 view (one per row of its last dimension), or an Error
// naming the tensor when it carries none.
Tensor fp8_scales(const char* op, const char* name, const Tensor& t) {
  if (t.scale_data() == nullptr)
    fail("{}: {} {} is f8e4m3 without its per-row scales", op, name, t.describe());
  return t.scales();
}

// An fp8 view's rows (one a scale, each `width` codes wide), for convert.
struct Fp8Rows {
  Tensor scales;
  int64_t rows = 0;
  int64_t width = 0;
};
Fp8Rows fp8_rows(const char* op, const char* name, const Tensor& t) {
  Fp8Rows r{fp8_scales(op, name, t)};
  r.rows = r.scales.numel();
  r.width = r.rows == 0 ? 0 : t.numel() / r.rows;
  return r;
}
}  // namespace

void CpuBackend::convert(const Tensor& src, const Tensor& dst) {
  constexpr const char* kOp = "convert";
  cpu::check_host(kOp, "src", src);
  cpu::check_host(kOp, "dst", dst);
  if (src.shape() != dst.shape()) {
    fail("{}: src {} and dst {} must have the same shape", kOp, src.describe(), dst.describe());
  }
  if (src.dtype() == dst.dtype()) {
    copy(src, dst);
    if (src.dtype() == DType::kF8E4M3)
      copy(fp8_scales(kOp, "src", src), fp8_scales(kOp, "dst", dst));
    return;
  }
  const int64_t n = src.numel();
  if (src.dtype() == DType::kF32 && dst.dtype() == DType::kF8E4M3) {
    // One scale per row of the last dimension (a KV cache's (token, head) vectors).
    cpu::check_no_alias(kOp, "dst", dst, "src", src);
    const Fp8Rows d = fp8_rows(kOp, "dst", dst);
    const float* s = src.data_as<const float>();
    auto* o = dst.data_as<uint8_t>();
    float* sc = d.scales.data_as<float>();
    for (int64_t r = 0; r < d.rows; ++r)
      kv_e4m3_quantize_row(s + r * d.width, d.width, o + r * d.width, sc + r);
    return;
  }
  if (src.dtype() == DType::kF8E4M3 && dst.dtype() == DType::kF32) {
    cpu::check_no_alias(kOp, "dst", dst, "src", src);
    const Fp8Rows f = fp8_rows(kOp, "src", src);
    const float* sc = f.scales.data_as<const float>();
    for (int64_t r = 0; r < f.rows; ++r) {
      cpu::dequantize_to_f32(src.data_as<const uint8_t>() + r * f.width, DType::kF8E4M3, sc[r],
                             dst.data_as<float>() + r * f.width, f.width);
    }
    return;
  }
  if (src.dtype() == DType::kF32 && dst.dtype() == DType::kBF16) {
    cpu::check_no_alias(kOp, "dst", dst, "src", src);
    const float* s = src.data_as<const float>();
    auto* o = dst.data_as<uint16_t>();
    for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(s[i]);
  } else if (src.dtype() == DType::kBF16 && dst.dtype() == DType::kF32) {
    cpu::check_no_alias(kOp, "dst", dst, "src", src);
    const auto* s = src.data_as<const uint16_t>();
    float* o = dst.data_as<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = bf16_to_f32(s[i]);
  } else {
    fail("{}: no conversion from src {} to dst {} (f32 <-> bf16 and f32 <-> f8e4m3 only)", kOp,
         src.describe(), dst.describe());
  }
}

}  // namespace specula
