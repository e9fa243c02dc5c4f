// Role pieces of the megakernels in clusters of 2 CTAs (MoKConfig.megakernel_cluster): the two
// CTAs run the two n-tiles of one cluster task on one m-tile, which share its A tile (TMA
// multicast, roles/megakernel_gemm.cuh), so they must take the same tickets in the same order.
// The first CTA (rank 0) takes each ticket and posts it to the second's mailbox in shared memory
// (distributed shared memory: a remote store, then a release arrive on the second's barrier);
// the second waits for it (acquire) and frees the slot (a release arrive on the first's barrier).
// Every wait is bounded (MegaPhase::kClusterTicket).
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "mok/comm/barrier.cuh"
#include "mok/common/macros.cuh"
#include "mok/roles/megakernel_tasks.cuh"

namespace mok::roles {

constexpr int kMailboxSlots = 4;  // tickets the first CTA may post ahead of the second's reads

// A cluster's mailbox: every CTA has one; only the second's slots and the first's "empty"
// barriers are used.
struct MegaMailbox {
  alignas(8) uint64_t full[kMailboxSlots];   // the second CTA's: slot i holds a ticket
  uint64_t empty[kMailboxSlots];             // the first CTA's: the second read slot i
  int32_t tickets[kMailboxSlots];            // the second CTA's
};

MOK_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The address of this CTA's shared-memory word `addr` in CTA `cta` of the cluster.
MOK_DEVICE uint32_t cluster_addr(uint32_t addr, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(cta));
  return remote;
}

MOK_DEVICE void st_cluster(uint32_t remote, int32_t value) {
  asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(remote), "r"(value) : "memory");
}

// Arrive on a barrier of the cluster, releasing this thread's earlier writes at cluster scope.
MOK_DEVICE void arrive_release_cluster(uint32_t remote_barrier) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                   remote_barrier)
               : "memory");
}

// Whether this CTA's barrier completed the phase of parity `parity`, acquiring at cluster scope.
MOK_DEVICE bool try_wait_acquire_cluster(uint32_t barrier, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(barrier), "r"(parity)
      : "memory");
  return done != 0;
}

// One thread: initialises the mailbox's barriers (one arrival completes a phase); the caller
// fences and syncs the cluster before anyone signals them.
MOK_DEVICE void init_mailbox(MegaMailbox& box) {
  for (int i = 0; i < kMailboxSlots; ++i) {
    cutlass::arch::ClusterBarrier::init(&box.full[i], 1);
    cutlass::arch::ClusterBarrier::init(&box.empty[i], 1);
  }
}

// One thread: waits until `barrier` (of mailbox slot seq % kMailboxSlots) completed its phase
// `use` (parity use & 1), or records the timeout (index: the ticket's sequence number; seen: the
// slot; expected: the slot's use by that ticket, seq / kMailboxSlots) and traps.
MOK_DEVICE void wait_mailbox(const MegaParams& p, const uint64_t* barrier, uint32_t use,
                             int round, uint32_t seq) {
  const MegaPhase phase = pass_phase(p, MegaPhase::kClusterTicket);
  const int64_t timeout_ns = timeout_of(p, phase);
  const uint32_t addr = smem_addr(barrier);
  uint64_t start_ns = 0;
  while (!try_wait_acquire_cluster(addr, use & 1)) {
    const uint64_t now = comm::global_timer_ns();
    if (start_ns == 0) {
      start_ns = now;
    } else if (static_cast<int64_t>(now - start_ns) > timeout_ns) {
      const MegaWaitSite site{phase, round, static_cast<int>(seq), 0};
      report_mega_timeout(p, site, site.index, -1, static_cast<int32_t>(seq % kMailboxSlots),
                          static_cast<int32_t>(seq / kMailboxSlots));
    }
  }
}

// The first CTA (one thread): posts its ticket number `seq` (counted over the launch) to the
// second, once the second read the ticket kMailboxSlots before it.
MOK_DEVICE void post_ticket(const MegaParams& p, MegaMailbox& box, int ticket, uint32_t seq,
                            int round) {
  const uint32_t slot = seq % kMailboxSlots, use = seq / kMailboxSlots;
  if (use > 0) wait_mailbox(p, &box.empty[slot], use - 1, round, seq);
  constexpr uint32_t kSecond = 1;
  st_cluster(cluster_addr(smem_addr(&box.tickets[slot]), kSecond), ticket);
  arrive_release_cluster(cluster_addr(smem_addr(&box.full[slot]), kSecond));
}

// The second CTA (one thread): the first's ticket number `seq`; frees its slot.
MOK_DEVICE int receive_ticket(const MegaParams& p, MegaMailbox& box, uint32_t seq, int round) {
  const uint32_t slot = seq % kMailboxSlots, use = seq / kMailboxSlots;
  wait_mailbox(p, &box.full[slot], use, round, seq);
  const int ticket = *static_cast<volatile int32_t*>(&box.tickets[slot]);
  constexpr uint32_t kFirst = 0;
  arrive_release_cluster(cluster_addr(smem_addr(&box.empty[slot]), kFirst));
  return ticket;
}

// This CTA's rank in its cluster of kCluster CTAs.
template <int kCluster>
MOK_DEVICE int cluster_rank() {
  if constexpr (kCluster == 1) {
    return 0;
  } else {
    return static_cast<int>(cute::block_rank_in_cluster());
  }
}

// One thread (the producer warp's lane 0): the round's next ticket, taken by the cluster's first
// CTA and posted to the second, which receives it; `seq` counts this CTA's tickets over the
// launch.
template <int kCluster>
MOK_DEVICE int cluster_ticket(const MegaParams& p, MegaMailbox& box, uint32_t seq, int round) {
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
  if constexpr (kCluster == 1) {
    return next_ticket(p);
  } else {
    if (cluster_rank<kCluster>() != 0) return receive_ticket(p, box, seq, round);
    const int ticket = next_ticket(p);
    post_ticket(p, box, ticket, seq, round);
    return ticket;
  }
}

}  // namespace mok::roles
