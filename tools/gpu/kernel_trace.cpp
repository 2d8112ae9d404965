// SPDX-License-Identifier: Apache-2.0
// kernel_trace: a CUPTI injection library that records every kernel the
// process runs (including the nodes of replayed CUDA graphs) as one CSV line:
//   start_ns,end_ns,grid_blocks,block_threads,demangled name
// (commas in names become ';'). The GPU machine has ncu but no nsys; this is
// how we see where a decode step's time goes with graphs and programmatic
// dependent launches on, which ncu's serialised replays cannot show.
//
// Build and use (tools/gpu/kernel_trace.sh does both):
//   g++ -O2 -shared -fPIC -DKERNEL_RECORD=CUpti_ActivityKernel10 -I<cupti include>
//       tools/gpu/kernel_trace.cpp -o libkernel_trace.so -L<cupti lib> -lcupti
//   TRACE_OUT=trace.csv CUDA_INJECTION64_PATH=$PWD/libkernel_trace.so specula bench ...
// KERNEL_RECORD names the newest CUpti_ActivityKernelN of the installed CUPTI.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

FILE* g_out = nullptr;
constexpr size_t kBufferBytes = size_t{32} << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = kBufferBytes;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const KERNEL_RECORD*>(record);
    int status = 0;
    char* demangled = abi::__cxa_demangle(k->name, nullptr, nullptr, &status);
    std::string name = status == 0 && demangled != nullptr ? demangled : k->name;
    std::free(demangled);
    for (char& c : name) {
      if (c == ',') c = ';';
    }
    std::fprintf(g_out, "%llu,%llu,%u,%u,%s\n", static_cast<unsigned long long>(k->start),
                 static_cast<unsigned long long>(k->end), k->gridX * k->gridY * k->gridZ,
                 k->blockX * k->blockY * k->blockZ, name.c_str());
  }
  std::free(buffer);
}

void flush_at_exit() {
  cuptiActivityFlushAll(1);
  if (g_out != nullptr) std::fclose(g_out);
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection() {
  const char* path = std::getenv("TRACE_OUT");
  g_out = std::fopen(path != nullptr ? path : "kernel_trace.csv", "w");
  if (g_out == nullptr) return 0;
  cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  std::atexit(flush_at_exit);
  return 1;
}
