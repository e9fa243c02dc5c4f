// The megakernels' shapes, plan records, counters and error record: defined once, used by
// the plan kernels, the megakernels and the host (Python reads every size through
// mok::moe_mega_shape; it never recomputes one).
//
// Rows. The schedule's C rows are laid out "padded": local expert e's rows start at a multiple of
// kGroupAlign (zero rows between groups), P = C + kGroupAlign * E_l padded rows in all. They run
// in R = max(1, ceil(C / macrobatch_rows)) rounds; round r holds padded rows
// [r * ring_rows, (r + 1) * ring_rows) in the ring (ring_rows = P for one round, else
// ceil(P / R) rounded up to kGroupAlign). This is exactly stage 1's row layout and round windows,
// so one plan serves both paths.
//
// Tiles. A round's rows are cut into m-tiles: at most kBlockM rows of one expert, in row order;
// `MegaTile` names one (ring rows [row_begin, row_end)). An L1 task is (m-tile, n-tile of 2I), an
// L2 task (m-tile, n-tile of H); both tile widths are kBlockN. Every CTA takes a round's tasks in
// one fixed order (roles/megakernel_tasks.cuh), each the next ticket of the round's ticket word.
// In clusters of C CTAs (MoKConfig.megakernel_cluster), a ticket is C tasks of one m-tile, n-tiles
// C j .. C j + C - 1, one per CTA of the cluster, which share the m-tile's A tile (TMA multicast).
//
// Counters (int32, in the workspace's counters region; zero when the workspace is made, never
// reset): a pass increments `epoch`; round r of a pass works with generation
// gen = epoch * R + r, which grows from pass to pass, so a flag "is set" when >= gen.
//   word kEpoch                 passes so far (the plan kernel adds 1 before the megakernel)
//   words kGridBar, +1          the round barrier: arrivals, released generation
//   word kTicket                the round's next task (atomicAdd); the one word that is reset:
//                               zeroed by the epoch kernel before the pass, and by the round
//                               barrier's last arriver (every CTA has left the round) for the next
//   arrive[num_minibatches]     minibatch mb of the ring holds round r's rows: = gen
//   l1_done[max_tiles * l1_ntiles]  L1 task (tile, n) of round r is stored: = gen
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::layout {

constexpr int kGroupAlign = 8;   // rows: each expert's padded group starts at a multiple of this
constexpr int kBlockM = 128;     // rows of one GEMM tile (the minibatch granularity too)
constexpr int kBlockN = 256;     // columns of one GEMM tile
// m-tiles per block of a round's task order (roles/megakernel_tasks.cuh, MegaTaskOrder): at
// most kOrderBlockTiles, which sizes the task records; the forward picks 8 or 16 per pass
// (MoKConfig.megakernel_order_block), the backward kOrderBlockTiles.
constexpr int kOrderBlockTiles = 16;
constexpr int kOrderBlockSmall = 8;
constexpr int kMaxClusterCtas = 2;    // CTAs per cluster of the megakernels: 1 or 2
// The down-weight gradient's k-tile (rows of an expert per mainloop stage): each expert's B rows
// start at a multiple of it, so a last k-tile's rows past the expert are B's zeros.
constexpr int kWgradRowAlign = 64;
// Whether `ctas` is a cluster size the megakernels are built for (1 or kMaxClusterCtas): the one
// rule the op, the launcher and the occupancy query check.
MOK_HOST_DEVICE constexpr bool valid_cluster_ctas(int64_t ctas) {
  return ctas == 1 || ctas == kMaxClusterCtas;
}

// NOTE: a block of 8 pads a round's m-tiles to a multiple of 8, never past the multiple of
// kOrderBlockTiles that max_tasks allows for.
MOK_HOST_DEVICE constexpr bool valid_order_block(int64_t tiles) {
  return tiles == kOrderBlockSmall || tiles == kOrderBlockTiles;
}
static_assert(kOrderBlockTiles % kOrderBlockSmall == 0, "a block of 8 pads within 16's bound");

// Counter words before the flag arrays.
constexpr int kEpoch = 0;
constexpr int kGridBar = 1;      // kGridBar: arrivals; kGridBar + 1: released generation
constexpr int kTicket = 3;       // the round's task ticket
constexpr int kCounterHeader = 32;

struct MegaTile {
  int32_t expert;     // local expert
  int32_t row_begin;  // ring rows [row_begin, row_end), row_end - row_begin <= kBlockM
  int32_t row_end;
  int32_t reserved;
};

struct MegaShape {
  int64_t row_capacity;      // C
  int64_t num_local_experts; // E_l
  int64_t hidden;            // H
  int64_t inter;             // I
  int64_t minibatch_rows;    // MoKConfig.minibatch_size
  int64_t macrobatch_rows;   // MoKConfig.macrobatch_size

  MOK_HOST_DEVICE static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

  MOK_HOST_DEVICE int64_t padded_rows() const {
    return row_capacity + kGroupAlign * num_local_experts;
  }
  MOK_HOST_DEVICE int64_t num_rounds() const {
    const int64_t r = ceil_div(row_capacity, macrobatch_rows);
    return r > 1 ? r : 1;
  }
  MOK_HOST_DEVICE int64_t ring_rows() const {
    const int64_t rounds = num_rounds();
    if (rounds == 1) return padded_rows();
    return ceil_div(ceil_div(padded_rows(), rounds), kGroupAlign) * kGroupAlign;
  }
  MOK_HOST_DEVICE int64_t num_minibatches() const { return ceil_div(ring_rows(), minibatch_rows); }
  // The FP8 forward's M-major scale regions ([K / 128, fp8_scale_stride()] float32): row
  // stride rounded up to 4 floats (TMA strides are multiples of 16 bytes).
  MOK_HOST_DEVICE int64_t fp8_scale_stride() const { return ceil_div(ring_rows(), 4) * 4; }
  MOK_HOST_DEVICE int64_t max_tiles() const {
    return ceil_div(ring_rows(), kBlockM) + num_local_experts;
  }
  MOK_HOST_DEVICE int64_t l1_ntiles() const { return ceil_div(2 * inter, kBlockN); }
  // The backward's first GEMM (the L2 dgrad, N = I): its n-tiles, also the router-weight
  // gradient's partial sums per row. Its task and flag counts fit the forward's (I < 2I).
  MOK_HOST_DEVICE int64_t dgrad_ntiles() const { return ceil_div(inter, kBlockN); }
  MOK_HOST_DEVICE int64_t l2_ntiles() const { return ceil_div(hidden, kBlockN); }
  // The backward's down-weight gradient tasks (MegaParams::wgrad): per local expert, the tiles of
  // its [H, I] gradient, kBlockM rows of H by kBlockN columns of I, K the expert's rows.
  MOK_HOST_DEVICE int64_t wgrad_mtiles() const { return ceil_div(hidden, kBlockM); }
  MOK_HOST_DEVICE int64_t wgrad_ntiles() const { return ceil_div(inter, kBlockN); }
  MOK_HOST_DEVICE int64_t wgrad_tasks() const {
    return num_local_experts * wgrad_mtiles() * wgrad_ntiles();
  }
  // Rows of the down-weight gradient's B operand (bf16(w * a), the rows of each expert from a
  // multiple of kWgradRowAlign on, zeros up to the next: launch/moe_megakernel.h, wgrad_b): the
  // ring's rows, each expert's group padded by less than kWgradRowAlign.
  MOK_HOST_DEVICE int64_t wgrad_b_rows() const {
    return ring_rows() + kWgradRowAlign * num_local_experts;
  }
  // Task records of a round at most: every block of the task order padded to kOrderBlockTiles
  // m-tiles (roles/megakernel_tasks.cuh, MegaTaskOrder::num_tasks), and each GEMM's n-tiles to a
  // whole cluster of the largest size (a ticket's C tasks have records C ticket + rank); and the
  // backward's down-weight gradient tasks where it runs them (one CTA per ticket; interleaved,
  // in chunks whose last is padded).
  MOK_HOST_DEVICE int64_t max_tasks() const {
    const int64_t blocks = ceil_div(max_tiles(), kOrderBlockTiles);
    const auto whole = [](int64_t n) { return ceil_div(n, kMaxClusterCtas) * kMaxClusterCtas; };
    return blocks * kOrderBlockTiles * (whole(l1_ntiles()) + whole(l2_ntiles())) +
           wgrad_tasks() + blocks;  // + interleaved D's last chunk's padding (< one per block)
  }

  MOK_HOST_DEVICE int64_t arrive_word() const { return kCounterHeader; }
  MOK_HOST_DEVICE int64_t l1_done_word() const { return kCounterHeader + num_minibatches(); }
  MOK_HOST_DEVICE int64_t counter_words() const {
    return l1_done_word() + max_tiles() * l1_ntiles();
  }
};

// The block MoKConfig.megakernel_order_block='auto' picks for the forward (order_block 0): of 8
// and 16, the one whose L1 tasks read fewer distinct bytes from HBM, per m-tile, in a model of
// waves of num_ctas tasks over a block's n-tile-major L1 tasks: a block's A tiles come from HBM
// once per wave its n-tiles span (ceil(l1_ntiles * block / num_ctas)); an expert's B tiles once
// per block its m-tiles span, shared by min(block, its m-tiles) of them (B's tile is kBlockN /
// kBlockM times A's). `routed_rows` / num_local_experts: the rows an expert is expected to get.
// Ties keep 16. deepseek-v3 at 8192 tokens (2 m-tiles an expert, 16 n-tiles): 17 against 18, so 8;
// qwen3-30b-a3b ties; mixtral-8x7b (16 m-tiles an expert, 112 n-tiles): 35 against 28, so 16.
inline int auto_order_block(int64_t routed_rows, int64_t num_local_experts, int64_t l1_ntiles,
                            int64_t num_ctas) {
  const double per_expert =
      static_cast<double>(routed_rows) / static_cast<double>(num_local_experts * kBlockM);
  const double mtiles = per_expert > 1.0 ? per_expert : 1.0;
  const auto bytes = [&](int64_t block) {
    const double waves = static_cast<double>(MegaShape::ceil_div(l1_ntiles * block, num_ctas));
    const double shared = static_cast<double>(block) < mtiles ? static_cast<double>(block) : mtiles;
    return waves + static_cast<double>(kBlockN) / kBlockM * static_cast<double>(l1_ntiles) / shared;
  };
  return bytes(kOrderBlockSmall) < bytes(kOrderBlockTiles) ? kOrderBlockSmall : kOrderBlockTiles;
}

// What the backward's down-weight gradient tasks do with a tile (MegaParams::wgrad; the host's
// MegaArgs::wgrad_mode): nothing (no such tasks), store it as bf16 (a fresh .grad), or add it into
// a float32 buffer (main_grad): the old value plus the tile's float32 sum, rounded once, as
// grouped_gemm_tn_accumulate.
enum MegaWgradOut : int {
  kWgradNone = 0,
  kWgradStore = 1,
  kWgradAddF32 = 2,
};

// The megakernel's timeline (diagnostics, scripts/megakernel_trace.py): given trace buffers, it
// records global-timer nanoseconds (0: never reached) per CTA, [num_ctas, kTraceCtaWords] int64,
// and per task, [R, max_tasks, kTraceTaskWords] int64 indexed by (round, ticket). Off (null
// buffers) it records nothing. Mirrored by name in mok_megatron/ops/moe.py (MEGA_TRACE_*).
enum MegaTraceCta : int {
  kTraceStart = 0,      // the CTA's pipelines are set up
  kTracePullNs = 1,     // time its consumer warpgroups spent pulling rows, all rounds
  kTraceBarrierNs = 2,  // time it spent in round barriers
  kTraceEnd = 3,        // its consumers finished their last task
  kTraceStartCycles = 4,  // the SM's cycle counter (clock64) at kTraceStart
  kTraceEndCycles = 5,    // and at kTraceEnd: cycles over nanoseconds, the SM's clock meanwhile
  kTraceCtaWords = 6,
};
enum MegaTraceTask : int {
  kTraceTaskCta = 0,    // 1 + the CTA that ran the task
  kTraceTaskId = 1,     // wgrad << 41 | l2 << 40 | m-tile << 20 | n-tile (a down-weight gradient
                        // task: expert << 20 | its tile, n * wgrad_mtiles + m)
  kTraceTake = 2,       // the producer took the ticket
  kTraceReady = 3,      // the task's inputs were ready (its waits returned)
  kTraceGot = 4,        // the consumers got the ticket
  kTraceMmaEnd = 5,     // the mainloop's last wgmma retired
  kTraceEpiEnd = 6,     // the epilogue's stores are issued (and an L1 task's flag released)
  kTraceStored = 7,     // an L1 task: every consumer's stores issued and fenced (their barrier
                        // passed), before its flag's release (0 for other tasks)
  kTraceTaskWords = 8,
};

// Which wait of a megakernel timed out (MegaError::kPhase). The backward's waits are the
// forward's, kBackwardPhases further: its first GEMM (the L2 dgrad) waits for d_out rows, its
// second (the L1 dgrad) for its m-tile's first-GEMM tasks.
enum class MegaPhase : int {
  kNone = 0,
  kL1WaitRows = 1,    // an L1 task waited for its minibatches to land (counter: arrive)
  kL2WaitL1 = 2,      // an L2 task waited for its m-tile's L1 tasks (counter: l1_done)
  kRoundBarrier = 3,  // a CTA waited at the end-of-round barrier (counter: the grid barrier)
  kBwdWaitRows = 4,   // backward: an L2-dgrad task waited for its d_out rows (arrive)
  kBwdWaitL1 = 5,     // backward: an L1-dgrad task waited for its m-tile's L2 dgrads (l1_done)
  kBwdRoundBarrier = 6,
  // NOTE: the later phases follow the same rule: the backward's is the forward's +
  // kBackwardPhases. Their timeouts: phase_depth.
  kClusterTicket = 9,      // the second CTA of a cluster waited for the ticket the first took,
                           // or the first for the second to read an earlier one (a shared-memory
                           // mailbox: counter -1, seen: its slot, expected: the slot's use by
                           // that ticket; index: the ticket's number in the launch)
  kProducerSlot = 10,      // a CTA's producer waited for a free slot: a mainloop stage (its
                           // consumers', in a cluster also the other CTA's, release) or a place
                           // in its ticket queue (counter -1, seen: the slot, expected: its use;
                           // index: the waiting CTA)
  kBwdClusterTicket = 12,  // the same as the forward's, backward
  kBwdProducerSlot = 13,
};
constexpr int kBackwardPhases = 3;  // phase p of the forward is p + 3 of the backward

// A wait's depth in the chain of waits: it gives up after this many MegaParams::timeout_ns, so
// that in a stall the wait nearest the cause gives up first. An L1 task waits on a comm CTA
// (1); an L2 task on L1 tasks (2); a producer's free slot on its consumers, which wait only on
// loads already issued, in a cluster also the other CTA's, issued after that CTA's input waits
// (3); a cluster's mailbox on the other CTA's producer, stuck behind any of those (4); the round
// barrier on every CTA (5).
// NOTE: a consumer that stops while it holds an L1 task is named by the L2 task waiting for that
// task (2x), not by its own producer's slot wait (3x): the record names the m-tile, and the
// timeline (scripts/megakernel_trace.py) which CTA took its L1 task.
// `forward`: a forward phase (a backward wait's depth is its forward phase's).
MOK_HOST_DEVICE constexpr int phase_depth(MegaPhase forward) {
  switch (forward) {
    case MegaPhase::kL1WaitRows:
      return 1;
    case MegaPhase::kL2WaitL1:
      return 2;
    case MegaPhase::kProducerSlot:
      return 3;
    case MegaPhase::kClusterTicket:
      return 4;
    default:  // the round barrier
      return 5;
  }
}
static_assert(static_cast<int>(MegaPhase::kBwdProducerSlot) ==
                  static_cast<int>(MegaPhase::kProducerSlot) + kBackwardPhases &&
              static_cast<int>(MegaPhase::kBwdClusterTicket) ==
                  static_cast<int>(MegaPhase::kClusterTicket) + kBackwardPhases,
              "the backward's phases are the forward's + kBackwardPhases");

// The error record (int32 words, all zero until a wait times out); mirrored in
// mok_megatron/ops/moe.py (MEGA_ERROR_FIELDS). It lives in pinned host memory, so the host can
// still read it after the trap has left the CUDA context unusable.
enum MegaError : int {
  kMegaErrTimedOut = 0,  // 1 once a wait gave up
  kMegaErrRank = 1,
  kMegaErrPhase = 2,     // a MegaPhase
  kMegaErrRound = 3,
  kMegaErrIndex = 4,     // minibatch (kL1WaitRows) or m-tile (kL2WaitL1) waited for; the
                         // waiting CTA (kRoundBarrier, kProducerSlot); the ticket's number in
                         // the launch (kClusterTicket)
  kMegaErrCounter = 5,   // word index in the counters region; -1: a shared-memory barrier
  kMegaErrSeen = 6,      // its value, last read (-1 word: the barrier's slot)
  kMegaErrExpected = 7,  // the generation waited for (-1 word: the slot's use)
  kMegaErrTimeoutMs = 8, // how long that wait lasted: timeout_ns x phase_depth, so the wait
                         // nearest a stall's cause gives up first
  kMegaErrWords = 9,
};

}  // namespace mok::layout
