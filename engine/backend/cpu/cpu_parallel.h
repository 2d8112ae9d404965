// SPDX-License-Identifier: Apache-2.0
// The CPU backend's thread team: a small pool of workers that claim chunks of a
// loop, in place of OpenMP parallel regions. Not part of any public API (the
// thread count is set through set_cpu_threads in engine/backend/backends.h).
//
// Why not OpenMP: an OpenMP region ends at a barrier that waits for every team
// thread, so when another process takes a core, each of the hundreds of regions
// per decode step can wait a scheduler time slice for a descheduled thread
// (issue #34: ~400 tok/s fell to 5-11 tok/s). libgomp's wait policy is fixed at
// library load (OMP_WAIT_POLICY); passive waiting avoids the collapse but costs
// a futex wake per region on idle cores (3x slower decode on the dev VM).
// Here the caller runs chunks itself and waits only for chunks that were
// claimed: a worker the scheduler has not run yet claims nothing, and the caller
// does its share. Idle workers spin briefly (the next region usually follows
// within microseconds), then sleep on a futex (std::atomic::wait).
#pragma once

#include <cstdint>
#include <utility>

namespace specula::cpu {

// Threads a parallel_for may use, the caller included: slots lie in
// [0, team_size()). Read it before leasing per-slot scratch.
int team_size();

// One chunk of a loop: indices [begin, end) run by the thread holding `slot`.
using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end, int slot);

// Runs fn over [0, n) in chunks, on the caller and the pool's workers when
// `parallel` (else on the caller alone, slot 0); returns when every chunk has
// run. Which thread runs which chunk varies from call to call, so each index's
// result must not depend on it (the kernels compute every output element from
// its own inputs in a fixed order). Slots are unique among the threads running
// one call. A call made while another call holds the team (another thread, or
// from inside a chunk) runs on its caller alone.
void parallel_run(int64_t n, bool parallel, ChunkFn fn, void* ctx);

// parallel_run with a callable body(int64_t begin, int64_t end, int slot).
template <class Body>
void parallel_for(int64_t n, bool parallel, Body&& body) {
  using B = std::remove_reference_t<Body>;
  parallel_run(
      n, parallel,
      [](void* ctx, int64_t begin, int64_t end, int slot) {
        (*static_cast<B*>(ctx))(begin, end, slot);
      },
      const_cast<void*>(static_cast<const void*>(&body)));
}

// parallel_for calling body(i, slot) for each index.
template <class Body>
void parallel_for_each(int64_t n, bool parallel, Body&& body) {
  parallel_for(n, parallel, [&](int64_t begin, int64_t end, int slot) {
    for (int64_t i = begin; i < end; ++i) body(i, slot);
  });
}

}  // namespace specula::cpu
