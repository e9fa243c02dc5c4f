// Cross-rank barrier over symmetric-memory signal pads, with a timeout that names the rank, the
// phase and the flag it waited on, then traps (the launch fails; it never hangs).
//
// Protocol (the one torch's symmetric memory uses): rank r sets slot [r] of every peer's pad from
// 0 to 1 (waiting while the previous signal is unconsumed), then consumes each slot [p] of its own
// pad from 1 back to 0. A slot is therefore reusable by the next barrier at once, and a CUDA graph
// may replay the sequence any number of times.
#pragma once

#include <cstdint>
#include <cstdio>

#include "mok/common/macros.cuh"

namespace mok::comm {

// Which step of a pass waited: printed on a timeout.
enum class Phase : int {
  kScheduleStaged = 0,   // every rank's routing is in its buffer
  kScheduleGathered = 1, // every rank has read every rank's routing
  kDispatchStaged = 2,   // every rank's tokens (x or d_out) are in its buffer
  kCombinePushed = 3,    // every rank pushed its per-token partial sums
  kSlotsPushed = 4,      // every rank pushed its per-slot values
  kSlotRowsPushed = 5,   // every rank's megakernel stored its result rows (slot_rows)
  kTokensRead = 6,       // every rank is done reading the tokens region's previous contents
};

MOK_DEVICE const char* phase_name(int phase) {
  switch (phase) {
    case 0: return "schedule/routing staged";
    case 1: return "schedule/routing gathered";
    case 2: return "dispatch/tokens staged";
    case 3: return "combine/partials pushed";
    case 4: return "combine/slot values pushed";
    case 5: return "megakernel/slot rows stored";
    case 6: return "dispatch/previous tokens read";
    default: return "unknown";
  }
}

MOK_DEVICE uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *flag goes from `expect` to `desired` (system scope); trap after timeout_ns.
MOK_DEVICE void cas_with_timeout(uint32_t* flag, uint32_t expect, uint32_t desired, int rank,
                                 int peer, int phase, int64_t timeout_ns) {
  const uint64_t start = global_timer_ns();
  while (atomicCAS_system(flag, expect, desired) != expect) {
    if (static_cast<int64_t>(global_timer_ns() - start) > timeout_ns) {
      printf("mok: rank %d timed out after %lld ms in phase '%s' waiting for the signal flag "
             "of peer %d to go %u -> %u (is every rank running the same pass? raise "
             "MoKConfig.wait_timeout_ms if this is a slow start)\n",
             rank, static_cast<long long>(timeout_ns / 1000000), phase_name(phase), peer, expect,
             desired);
      __trap();
    }
  }
}

// One thread per peer (blockDim.x >= world); call from a single block.
MOK_DEVICE void barrier_block(const uint64_t* signal_pads, int rank, int world, int phase,
                              int64_t timeout_ns) {
  const int peer = threadIdx.x;
  if (peer < world) {
    __threadfence_system();  // release: this rank's earlier writes (any kernel) before the flag
    uint32_t* remote = reinterpret_cast<uint32_t*>(signal_pads[peer]) + rank;
    cas_with_timeout(remote, 0u, 1u, rank, peer, phase, timeout_ns);
    uint32_t* local = reinterpret_cast<uint32_t*>(signal_pads[rank]) + peer;
    cas_with_timeout(local, 1u, 0u, rank, peer, phase, timeout_ns);
    __threadfence_system();  // acquire: peers' writes before what follows
  }
  __syncthreads();
}

}  // namespace mok::comm
