// SPDX-License-Identifier: Apache-2.0
// CpuBackend construction, argument checks shared by all CPU ops, and copy.
#include "engine/backend/cpu/cpu_backend.h"

#include <omp.h>

#include <algorithm>

#include <cstring>
#include <memory>

#include "engine/backend/backends.h"

namespace specula {

CpuBackend::CpuBackend() = default;

void CpuBackend::reserve_scratch(int64_t max_keys, int64_t max_width) {
  // Attention borrows one score row per thread; wide products one widened weight row per thread.
  const int64_t per_thread = std::max<int64_t>({max_keys, max_width, 1});
  scratch_.reserve(static_cast<size_t>(omp_get_max_threads()) * static_cast<size_t>(per_thread));
}

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<CpuBackend>();
}

namespace cpu {

void check_host(const char* op, const char* name, const Tensor& t) {
  if (!t.device().is_cpu()) {
    fail("{}: {} {} is on {}, but the CPU backend needs host tensors", op, name, t.describe(),
         t.device().str());
  }
  if (t.data() == nullptr && t.numel() != 0) {
    fail("{}: {} {} has no memory behind it (empty view)", op, name, t.describe());
  }
}

void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  if (t.dtype() != dtype)
    fail("{}: {} must be {}, got {}", op, name, dtype_name(dtype), t.describe());
}

void check_float(const char* op, const char* name, const Tensor& t) {
  const DType d = t.dtype();
  if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16) {
    fail("{}: {} must be f32, bf16 or f16, got {}", op, name, t.describe());
  }
}

void check_rank(const char* op, const char* name, const Tensor& t, int rank) {
  if (t.rank() != rank) fail("{}: {} must have rank {}, got {}", op, name, rank, t.describe());
}

void check_same_shape(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                      const Tensor& b) {
  if (a.shape() != b.shape()) {
    fail("{}: {} {} and {} {} must have the same shape", op, a_name, a.describe(), b_name,
         b.describe());
  }
}

namespace {

bool ranges_overlap(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data());
  const auto* b0 = static_cast<const char*>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

}  // namespace

void check_no_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                    const Tensor& in) {
  if (ranges_overlap(out, in)) {
    fail("{}: output {} {} overlaps input {} {}; this op needs a separate output buffer", op,
         out_name, out.describe(), in_name, in.describe());
  }
}

void check_exact_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                       const Tensor& in) {
  if (out.data() != in.data() && ranges_overlap(out, in)) {
    fail("{}: output {} {} partially overlaps input {} {}; it may only be the same buffer", op,
         out_name, out.describe(), in_name, in.describe());
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

}  // namespace specula
