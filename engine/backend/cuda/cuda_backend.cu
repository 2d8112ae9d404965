// SPDX-License-Identifier: Apache-2.0
// CudaBackend construction, device memory, transfers, copies and shared checks.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "engine/backend/backends.h"
#include "engine/backend/cuda/cuda_backend.h"
#include "engine/backend/cuda/cuda_linear_mma.h"

namespace specula {
namespace cuda {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    fail("cuda: {} failed: {} ({})", what, cudaGetErrorString(status), cudaGetErrorName(status));
  }
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail("cublasLt: {} failed with status {}", what, static_cast<int>(status));
  }
}

CudaBackend::CudaBackend(int device_index) : device_index_(device_index) {
  int count = 0;
  cudaError_t st = cudaGetDeviceCount(&count);
  if (st != cudaSuccess || count == 0) {
    fail("cuda:{}: no CUDA device is usable ({})", device_index,
         st == cudaSuccess ? "no devices" : cudaGetErrorString(st));
  }
  if (device_index < 0 || device_index >= count) {
    fail("cuda:{}: no such device ({} CUDA device(s) present)", device_index, count);
  }
  check_cuda(cudaSetDevice(device_index), "cudaSetDevice");
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cublas(cublasLtCreate(&lt_), "cublasLtCreate");
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_index_);
  if (stream_) cudaStreamSynchronize(stream_);
  print_op_profile();
  for (Scratch* s : {&lt_workspace_, &x_bf16_, &w_bf16_, &attn_partials_, &moe_scratch_,
                     &attn_scores_, &attn_kv_f32_, &argmax_partials_, &x_split_, &x_split_out_}) {
    if (s->data) cudaFree(s->data);
  }
  for (StagingSlot& slot : staging_) {
    if (slot.host) cudaFreeHost(slot.host);
    if (slot.copied) cudaEventDestroy(slot.copied);
  }
  if (lt_) cublasLtDestroy(lt_);
  if (stream_) cudaStreamDestroy(stream_);
}

MemoryInfo CudaBackend::memory_info() const {
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  size_t free = 0, total = 0;
  check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return {.free_bytes = static_cast<int64_t>(free), .total_bytes = static_cast<int64_t>(total)};
}

void* CudaBackend::allocate(size_t bytes) {
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  void* p = nullptr;
  cudaError_t st = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (st != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of a failed allocation
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    fail("cuda:{}: out of device memory allocating {:.2f} GiB ({:.2f} GiB free of {:.2f})",
         device_index_, bytes / 1073741824.0, free_bytes / 1073741824.0, total / 1073741824.0);
  }
  ++allocations_;
  return p;
}

void CudaBackend::release(void* p) noexcept {
  if (p == nullptr) return;
  ++release_generation_;
  cudaFree(p);
}

void* CudaBackend::scratch(Scratch& s, size_t bytes) {
  std::lock_guard<std::mutex> lock(scratch_mutex_);
  if (bytes > s.size) {
    if (capturing_) {
      fail(
          "cuda: an op needs {} bytes of scratch while a step is being recorded (run the step "
          "once unrecorded first)",
          bytes);
    }
    ++scratch_generation_;
    // Grow with headroom; the old buffer may still be read by queued work.
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    if (s.data) cudaFree(s.data);
    s.data = nullptr;
    s.size = 0;
    const size_t want = bytes + bytes / 4;
    s.data = allocate(want);
    s.size = want;
  }
  return s.data;
}

void CudaBackend::reserve_scratch(int64_t max_keys, int64_t max_width) {
  reserved_keys_ = std::max(reserved_keys_, max_keys);
  scratch(lt_workspace_, size_t{32} << 20);
  // Every product of up to kInvariantRows rows with bf16 weights splits x.
  if (max_width > 0) {
    scratch(x_split_, mma_split_bytes(kInvariantRows, max_width));
    scratch(x_split_out_, mma_split_bytes(kInvariantRows, max_width));
  }
}

void CudaBackend::upload(const void* host, const Tensor& dst) {
  ++op_seq_;
  check_on(*this, "upload", "dst", dst);
  if (capturing_) fail("upload: not allowed while a step is being recorded");
  if (dst.nbytes() == 0) return;
  check_cuda(cudaMemcpyAsync(dst.data(), host, dst.nbytes(), cudaMemcpyHostToDevice, stream_),
             "upload (cudaMemcpyAsync)");
  check_cuda(cudaStreamSynchronize(stream_), "upload (synchronize)");
}

void CudaBackend::download(const Tensor& src, void* host) {
  check_on(*this, "download", "src", src);
  if (capturing_) fail("download: not allowed while a step is being recorded");
  if (src.nbytes() == 0) return;
  ++readbacks_;
  check_cuda(cudaMemcpyAsync(host, src.data(), src.nbytes(), cudaMemcpyDeviceToHost, stream_),
             "download (cudaMemcpyAsync)");
  check_cuda(cudaStreamSynchronize(stream_), "download (synchronize)");
}

void CudaBackend::upload_async(const void* host, const Tensor& dst) {
  ++op_seq_;
  check_on(*this, "upload_async", "dst", dst);
  if (capturing_) fail("upload_async: not allowed while a step is being recorded");
  const size_t bytes = dst.nbytes();
  if (bytes == 0) return;
  StagingSlot& slot = staging_[next_staging_];
  next_staging_ = (next_staging_ + 1) % kStagingSlots;
  // The copy that last read this slot must have run before it is overwritten
  // (normally long ago: the host is at most kStagingSlots uploads ahead).
  if (slot.copied != nullptr) check_cuda(cudaEventSynchronize(slot.copied), "upload_async (wait)");
  if (bytes > slot.size) {
    // Every slot grows at once (after the copies that read them have run):
    // growing them one by one, as each came round, allocated in steady state
    // until the ring had gone round once.
    const size_t want = std::max<size_t>(size_t{64} << 10, bytes + bytes / 2);
    for (StagingSlot& s : staging_) {
      if (s.size >= want) continue;
      if (s.copied != nullptr) check_cuda(cudaEventSynchronize(s.copied), "upload_async (wait)");
      if (s.host) check_cuda(cudaFreeHost(s.host), "cudaFreeHost");
      s.host = nullptr;
      s.size = 0;
      check_cuda(cudaHostAlloc(&s.host, want, cudaHostAllocDefault), "cudaHostAlloc");
      s.size = want;
      ++allocations_;  // growth is an allocation like any other (steady steps make none)
    }
  }
  if (slot.copied == nullptr) {
    check_cuda(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming), "cudaEventCreate");
  }
  std::memcpy(slot.host, host, bytes);
  check_cuda(cudaMemcpyAsync(dst.data(), slot.host, bytes, cudaMemcpyHostToDevice, stream_),
             "upload_async (cudaMemcpyAsync)");
  check_cuda(cudaEventRecord(slot.copied, stream_), "upload_async (cudaEventRecord)");
}

void CudaBackend::synchronize() {
  if (capturing_) fail("synchronize: not allowed while a step is being recorded");
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  OpTimer timer(*this, "copy");
  check_on(*this, "copy", "src", src);
  check_on(*this, "copy", "dst", dst);
  if (src.dtype() != dst.dtype() || src.numel() != dst.numel()) {
    fail("copy: src {} and dst {} must have the same dtype and element count", src.describe(),
         dst.describe());
  }
  if (src.nbytes() == 0 || src.data() == dst.data()) return;
  check_cuda(
      cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, stream_),
      "copy (cudaMemcpyAsync)");
}

namespace {

// A captured and instantiated CUDA graph, with the scratch generation it saw.
class CudaStepGraph final : public StepGraph {
 public:
  CudaStepGraph(const CudaBackend* owner, cudaGraphExec_t exec, uint64_t generation,
                uint64_t released)
      : owner_(owner), exec_(exec), generation_(generation), released_(released) {}
  ~CudaStepGraph() override {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  CudaStepGraph(const CudaStepGraph&) = delete;
  CudaStepGraph& operator=(const CudaStepGraph&) = delete;

  const CudaBackend* owner_;
  cudaGraphExec_t exec_;
  uint64_t generation_;  // the backend's scratch generation at recording
  uint64_t released_;    // and its release generation
};

}  // namespace

void CudaBackend::begin_capture() {
  ++op_seq_;
  if (capturing_) fail("cuda: begin_capture while a step is already being recorded");
  if (op_profile_) {
    fail(
        "cuda: steps cannot be recorded while the per-op profile is on (it synchronises every op)");
  }
  check_cuda(cudaSetDevice(device_index_), "cudaSetDevice");
  // Relaxed: other threads may keep using the CUDA API (allocation, other
  // streams) while this stream records.
  check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed),
             "cudaStreamBeginCapture");
  capturing_ = true;
}

std::unique_ptr<StepGraph> CudaBackend::end_capture() {
  if (!capturing_) fail("cuda: end_capture without begin_capture");
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  check_cuda(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t st = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check_cuda(st, "cudaGraphInstantiate");
  return std::make_unique<CudaStepGraph>(this, exec, scratch_generation_,
                                         release_generation_.load());
}

bool CudaBackend::replay(StepGraph& graph) {
  ++op_seq_;
  auto* g = dynamic_cast<CudaStepGraph*>(&graph);
  if (g == nullptr || g->owner_ != this) fail("cuda: replay of a graph recorded elsewhere");
  if (capturing_) fail("cuda: replay while a step is being recorded");
  // Recorded before a scratch buffer moved or any device memory was released:
  // it may point at freed memory (seen under compute-sanitizer, which does not
  // hand freed addresses straight back as cudaMalloc usually does).
  if (g->generation_ != scratch_generation_ || g->released_ != release_generation_.load()) {
    return false;
  }
  check_cuda(cudaGraphLaunch(g->exec_, stream_), "cudaGraphLaunch");
  return true;
}

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void CudaBackend::set_op_profile(bool on) {
  if (capturing_) fail("cuda: the per-op profile cannot change while a step is being recorded");
  op_profile_ = on;
}

OpTimer::OpTimer(CudaBackend& be, const char* op) : op_(op) {
  ++be.op_seq_;
  if (!be.op_profile_) return;
  be_ = &be;
  be.synchronize();
  start_ = now_seconds();
}

OpTimer::~OpTimer() {
  if (be_ == nullptr) return;
  cudaStreamSynchronize(be_->stream());
  const double t = now_seconds() - start_;
  std::lock_guard<std::mutex> lock(be_->profile_mutex_);
  CudaBackend::ProfileEntry& e = be_->profile_[op_];
  ++e.calls;
  e.seconds += t;
}

void CudaBackend::print_op_profile() {
  std::lock_guard<std::mutex> lock(profile_mutex_);
  if (profile_.empty()) return;
  double total = 0;
  for (auto& [name, e] : profile_) total += e.seconds;
  std::fprintf(stderr, "\n%s per-op profile (synchronous per op):\n%-14s %10s %12s %10s %7s\n",
               device().str().c_str(), "op", "calls", "total ms", "us/call", "share");
  for (auto& [name, e] : profile_) {
    std::fprintf(stderr, "%-14s %10lld %12.2f %10.2f %6.1f%%\n", name.c_str(),
                 static_cast<long long>(e.calls), e.seconds * 1e3, e.seconds * 1e6 / e.calls,
                 100 * e.seconds / total);
  }
}

void check_on(const CudaBackend& be, const char* op, const char* name, const Tensor& t) {
  if (t.device() != be.device()) {
    fail("{}: {} {} is on {}, but this backend runs on {}", op, name, t.describe(),
         t.device().str(), be.device().str());
  }
  if (t.data() == nullptr && t.numel() != 0) {
    fail("{}: {} {} has no memory behind it (empty view)", op, name, t.describe());
  }
}

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  return std::make_unique<cuda::CudaBackend>(device_index);
}

bool cuda_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

namespace {
// Atomics: kernels are planned from several threads (the server's workers).
std::atomic<bool> g_tiled_products{false};
std::atomic<bool> g_raw_kv_staging{false};
}  // namespace

void set_cuda_kernel_choices(const CudaKernelChoices& choices) {
  g_tiled_products.store(choices.tiled_products, std::memory_order_relaxed);
  g_raw_kv_staging.store(choices.raw_kv_staging, std::memory_order_relaxed);
}

CudaKernelChoices cuda_kernel_choices() {
  return {.tiled_products = g_tiled_products.load(std::memory_order_relaxed),
          .raw_kv_staging = g_raw_kv_staging.load(std::memory_order_relaxed)};
}

}  // namespace specula
