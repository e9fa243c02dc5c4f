// Role pieces of the forward megakernel that are not GEMM: its device parameters, the static
// persistent task order of a round, the bounded flag waits (with the error record) and the
// end-of-round grid barrier. Shapes, plan records and counter words: layout/mega.cuh.
//
// NOTE: no 64-bit integer division anywhere in the megakernel: ptxas lowers it to a subroutine
// call, and a call in the GEMM kernel makes it ignore setmaxnreg and serialise wgmma (see
// scheduler/flag_wait.cuh). The host derives every size once (int32) and checks that the plan's
// encoded rows (s * T_max + t, (s * T_max + t) * K + k) fit in int32.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/comm/barrier.cuh"
#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/layout/mega.cuh"

namespace mok::roles {

using layout::MegaPhase;
using layout::MegaTile;
using layout::MegaWgradOut;

// Everything the megakernels' roles read, derived on the host from launch::MegaArgs. "l1" and
// "l2" name a pass's first and second GEMM (the backward's are the L2 and the L1 dgrads).
struct MegaParams {
  // ---- the symmetric workspace
  const uint64_t* peer_bases;  // [W] base of each rank's copy
  uint64_t tokens_offset;      // lay.offset(Region::kTokens): peer rows are pulled from there
  const uint8_t* local_tokens; // or, at one rank, from the token rows themselves (MegaArgs)
  uint64_t slot_rows_offset;   // lay.offset(Region::kSlotRows): result rows are pushed there
  int32_t* counters;           // this rank's counters region (layout/mega.cuh)
  int32_t* error;              // [kMegaErrWords] or null
  int rank;
  int64_t timeout_ns;

  // ---- sizes (int32, from MegaShape and the layout)
  int hidden;                  // H
  int inter;                   // I
  int num_local_experts;       // E_l
  int max_tokens;              // T_max
  int slots_per_rank;          // T_max * K
  int ring_rows;
  int minibatch_rows;
  int num_rounds;              // rounds this launch runs: the pass's R, or 1 (a backward round)
  int round_stride;            // the pass's R: a round's generation stride (generation())
  int round_base;              // the plan round this launch's round 0 is (the plan pointers
                               // below start there; the error record names plan rounds)
  int max_tiles;
  int l1_n;                    // B rows of the first GEMM: 2I (forward), I (backward)
  int l2_k;                    // K of the second: I (forward), 2I (backward)
  int l1_ntiles;               // n-tiles of l1_n
  int l2_ntiles;               // n-tiles of H
  int l1_ktiles;               // k-tiles of H
  int l2_ktiles;               // k-tiles of l2_k
  int arrive_word;             // counter word of arrive[0]
  int l1_done_word;            // counter word of l1_done[0]
  int num_ctas;
  int num_comm_ctas;
  int order_block;             // m-tiles per block of the task order (layout::valid_order_block)
  int rows_in_place;           // 1: the forward's L1 tasks read their rows from the token rows
                               // (one rank, gemm::load_task_rows) and no CTA pulls
  const __nv_bfloat16* rows;   // rows in place: the token rows [T, H] (x, or this rank's tokens
                               // region where they were staged)
  int stall_minibatch;
  int stall_l2_cta;            // fault injection (tests): this CTA's consumers stop at their
                               // first second-GEMM task (-1: none)
  int phase_offset;            // 0 (forward) or layout::kBackwardPhases: the error record's phase

  // ---- operands and plan (see launch/moe_megakernel.h)
  __nv_bfloat16* x_ring;       // [ring_rows, H]: pulled rows (the backward's: d_out rows)
  __nv_bfloat16* act_ring;     // [ring_rows, I]: forward L1's output; the backward reads it
  __nv_bfloat16* h_ring;       // [ring_rows, 2I] or null: forward L1's pre-activation (written
                               // if set); the backward reads it
  __nv_bfloat16* y_rows;       // [ring_rows, H] or null (forward)
  __nv_bfloat16* dh_ring;      // [ring_rows, 2I]: the backward's first GEMM's output, or null
  const float* w_rows;         // [R * ring_rows] router weight of each row (backward)
  float* rw_partials;          // [ring_rows, rw_parts]: <m, a> per (row, n-tile) (backward)
  int rw_parts;                // = l1_ntiles
  const int64_t* row_src;      // [R * ring_rows]
  const int64_t* row_dst;      // [R * ring_rows]
  const int32_t* tile_count;   // [R]
  const MegaTile* tiles;       // [R, max_tiles]

  // ---- the FP8 forward's (roles/megakernel_fp8.cuh; null / 0 otherwise). Token rows are stage
  // 1's packed FP8 rows (fp8_blockwise::packed_row_bytes); the rings' scales are M-major: row r's
  // scale of K block kb at [kb * scale_stride + r] (one TMA box per k-tile and m-tile)
  uint8_t* x8_ring;            // [ring_rows, H] e4m3: pulled rows
  float* x_scales;             // [H / 128, scale_stride]
  uint8_t* act8_ring;          // [ring_rows, I] e4m3: act quantised in (1, 128) blocks (L2's A)
  float* act_scales;           // [I / 128, scale_stride]
  int scale_stride;            // ring_rows rounded up to 4 (16-byte TMA strides)
  int token_row_bytes;         // bytes from one token row to the next (in place: H e4m3
                               // bytes; staged packed FP8 rows: the tokens region's 2 H)
  const float* local_token_scales;  // one rank: x's (1, 128) scales [T, H / 128] beside its
                                    // quantised rows in place (local_tokens), or null

  // ---- the backward's down-weight gradient tasks (launch/moe_megakernel.h, MegaArgs::wgrad_*;
  // 0 / null: none). Expert e's gradient [H, I] = d_rows^T bf16(w * a) over its ring rows
  // [end of e - 1, wgrad_ends[e]), K in kWgradRowAlign-row k-tiles from its first row: A the
  // d_out rows of x_ring, B its rows of wgrad_b from wgrad_b_starts[e] (zeros past its rows).
  int wgrad;                   // a MegaWgradOut: each round's tasks include the wgrad tasks
                               // (one round), their tiles into wgrad_out so; 0 (kWgradNone)
  int wgrad_interleave;        // 1: among the data gradients' tasks, else after them
                               // (MegaTaskOrder, phase D)
  int wgrad_mtiles;            // tiles of H (kBlockM rows)
  int wgrad_ntiles;            // tiles of I (kBlockN columns)
  const int32_t* wgrad_ends;   // [E_l]: each expert's group end in the ring (window offsets)
  const int32_t* wgrad_b_starts;  // [E_l]: each expert's first row of B
  void* wgrad_out;             // [E_l, H, I]: bf16 or float32 as `wgrad` says

  // ---- diagnostics: the timeline (layout/mega.cuh, MegaTraceCta / MegaTraceTask), or null
  int64_t* trace_ctas;         // [num_ctas, kTraceCtaWords]
  int64_t* trace_tasks;        // [R, max_tasks, kTraceTaskWords]
  int max_tasks;

  // Round r of this pass works with gen = epoch * R + r, which no earlier round or pass reached.
  // A backward in rounds launches once per round, each launch a pass of its own (an epoch),
  // with the same stride R: its one round's gen = epoch * R is above every earlier launch's.
  // NOTE: an earlier kernel advanced the epoch and nothing writes it during the launch, so every
  // read gives the value it had at the start; it is re-read per round rather than kept live
  // (the producer warp's 40 registers have no room for it across the task loop).
  MOK_DEVICE int32_t generation(int round) const {
    return counters[layout::kEpoch] * round_stride + round;
  }
  MOK_DEVICE const MegaTile& tile(int round, int index) const {
    return tiles[round * max_tiles + index];
  }
};

// One task: L1 (m-tile, n-tile of 2I) or L2 (m-tile, n-tile of H). A task of a padding m-tile
// (tile >= the round's m-tiles, see MegaTaskOrder) is skipped by producer and consumers alike.
// The backward's down-weight gradient task (wgrad): tile is the expert, n its tile of the
// expert's [H, I] gradient, n * wgrad_mtiles + m (m-tile of H, n-tile of I).
struct MegaTask {
  bool l2;
  int tile;
  int n;
  bool wgrad = false;
};

// The task order of one round, the same for every CTA. The m-tiles are taken in blocks of
// `block` consecutive ones (MegaParams::order_block, 8 or 16; the last block padded with m-tiles
// past the round's, whose tasks are skipped); a block's L1 tasks (or L2 tasks) run
// n-tile-major: (n 0, m 0..block-1), (n 1, m 0..block-1), ... With nb blocks and lag L (in
// blocks):
//   A: the L1 tasks of blocks 0..L-1;
//   B: for j = 0..nb-L-1: the L1 tasks of block L+j, then the L2 tasks of block j;
//   C: the L2 tasks of blocks nb-L..nb-1.
// NOTE: why blocks, n-tile-major: about one wave of tasks runs at a time, and what a wave reads
// from HBM is its distinct A and B tiles. One m-tile's n-tiles in a wave (the order without
// blocks) read each weight tile for one m-tile only: the expert's whole weight is streamed again
// for every 128 rows (mixtral-8x7b: 224 MB per wave of L1 tasks, HBM-bound). A block's m-tiles
// share each weight tile of a wave, and its A tiles stay in L2 across its n-tiles. Which block
// reads less from HBM depends on the shape (MoKConfig.megakernel_order_block's 'auto',
// layout::auto_order_block): where one wave covers all of a block of 8's n-tiles
// (deepseek-v3 at 8192 tokens: 16 n-tiles, 2 m-tiles an expert) its A tiles are read from HBM
// once, where a block of 16 needs two waves and the 235 MB of weights the first streams evict
// them; with many m-tiles an expert (mixtral-8x7b) 16 shares each weight tile more.
// CTAs take tasks in this order, one ticket at a time (next_ticket): whichever CTA is free takes
// the next task, so tasks of unequal length (L1 and L2 differ in K) do not pile up behind one CTA
// as a static round-robin share does (scripts/megakernel_schedule_sim.py models both).
// NOTE: every task's inputs come from tasks earlier in this order (an L2 task of block j follows
// all L1 tasks of block j), and every ticket is taken by a resident CTA that runs its tickets in
// increasing order, so the earliest unfinished task can always run: no deadlock. Which CTA runs
// a task does not change its result (one CTA computes a whole tile, K in a fixed order).
// L = min(nb, max(1, ceil(G / (block n1)))) keeps about one wave of L1 tasks ahead of the L2
// tasks.
// In clusters of C CTAs the order is over clusters: n1, n2 count n-tiles in groups of C (a task's
// n is the group, the cluster's CTA of rank c runs n-tile C n + c) and G counts clusters.
// D (the backward with MegaParams::wgrad): the down-weight gradient tasks, expert by expert, each
// expert's tiles n-major (m, the tile of H, fastest): a wave of tasks then reads the expert's A
// (its d_out rows) whole, which L2 holds, and a few n-tiles of B. m-major streamed all of the
// expert's B again for every m-tile (mixtral-8x7b's B is 58 MB an expert). D reads only pulled
// rows and B, made before the launch, so it waits on no task. Where: after C, or with
// MegaParams::wgrad_interleave in chunks of wg_chunk, chunk j after step j of phase B (its last
// chunk padded with skipped tasks; all after C where B has no step), so that D's HBM-bound
// epilogues run beside the data gradients' mainloops on other SMs.
// NOTE: on one H100 the interleaved order was no faster than D last on qwen3-30b-a3b and
// mixtral-8x7b (0.98x / 1.01x and 0.95x / 1.04x of the grouped GEMM against 0.99x / 1.00x,
// docs/perf_notes.md session 39), and slower with the consumers' own read-modify-write of
// main_grad; its case is deepseek-v3, whose down-weight gradient into main_grad moves about 30 GB
// beside 12 ms of data-gradient work (MoKConfig.bwd_wgrad="down_interleaved" keeps it to time).
struct MegaTaskOrder {
  int block;  // m-tiles per block
  int num_mtiles;
  int n1;
  int n2;
  int num_blocks;
  int lag;
  int wg_per_expert;  // D: tiles per expert (0: no phase D)
  int wg_experts;
  int wg_tasks;
  int wg_chunk;       // interleaved: D's tasks after each step of phase B (0: all of D after C)

  MOK_DEVICE MegaTaskOrder(int block_, int num_mtiles_, int n1_, int n2_, int num_ctas,
                           int wg_mtiles = 0, int wg_ntiles = 0, int wg_experts_ = 0,
                           bool wg_interleave = false)
      : block(block_), num_mtiles(num_mtiles_), n1(n1_), n2(n2_), wg_experts(wg_experts_) {
    num_blocks = (num_mtiles + block - 1) / block;
    const int block_l1 = block * n1;
    lag = min(num_blocks, max(1, (num_ctas + block_l1 - 1) / block_l1));
    wg_per_expert = wg_mtiles * wg_ntiles;
    wg_tasks = wg_per_expert * wg_experts;
    const int steps = num_blocks - lag;
    wg_chunk = wg_interleave && wg_tasks > 0 && steps > 0 ? (wg_tasks + steps - 1) / steps : 0;
  }

  // Tickets of the round, padding tasks included.
  MOK_DEVICE int num_tasks() const {
    const int d = wg_chunk > 0 ? wg_chunk * (num_blocks - lag) : wg_tasks;
    return num_blocks * block * (n1 + n2) + d;
  }

  // Task i (n-tile-major) of block b's L1 or L2 tasks.
  MOK_DEVICE MegaTask in_block(bool l2, int b, int i) const {
    return {l2, b * block + i % block, i / block};
  }

  // Task d of phase D (d >= wg_tasks: a padding task).
  MOK_DEVICE MegaTask wgrad_task(int d) const {
    return {false, d / wg_per_expert, d % wg_per_expert, true};
  }

  MOK_DEVICE MegaTask decode(int t) const {
    const int l1_block = block * n1, l2_block = block * n2;
    const int phase_a = lag * l1_block;
    if (t < phase_a) return in_block(false, t / l1_block, t % l1_block);
    const int u = t - phase_a;
    const int step = l1_block + l2_block + wg_chunk;
    const int phase_b = (num_blocks - lag) * step;
    if (u < phase_b) {
      const int j = u / step, w = u % step;
      if (w < l1_block) return in_block(false, lag + j, w);
      if (w < l1_block + l2_block) return in_block(true, j, w - l1_block);
      return wgrad_task(j * wg_chunk + w - l1_block - l2_block);
    }
    const int v = u - phase_b, phase_c = lag * l2_block;
    if (v < phase_c) return in_block(true, num_blocks - lag + v / l2_block, v % l2_block);
    return wgrad_task(v - phase_c);  // D after C (wg_chunk 0)
  }

  MOK_DEVICE bool skipped(const MegaTask& task) const {
    return task.wgrad ? task.tile >= wg_experts : task.tile >= num_mtiles;
  }
};

// ---- the timeline (diagnostics; each a no-op without trace buffers)
MOK_DEVICE int64_t trace_now() { return static_cast<int64_t>(comm::global_timer_ns()); }
// The SM's cycle counter (one per SM: the start and end stamps' threads read the same one).
MOK_DEVICE int64_t trace_cycles() { return static_cast<int64_t>(clock64()); }

// One thread: word `word` of this CTA's record = value, or += value.
MOK_DEVICE void trace_cta_set(const MegaParams& p, int word, int64_t value) {
  if (p.trace_ctas != nullptr) p.trace_ctas[blockIdx.x * layout::kTraceCtaWords + word] = value;
}
MOK_DEVICE void trace_cta_add(const MegaParams& p, int word, int64_t value) {
  if (p.trace_ctas != nullptr) p.trace_ctas[blockIdx.x * layout::kTraceCtaWords + word] += value;
}

// One thread: word `word` of task record `slot` of round `round` = value (the time now when
// value < 0). A task's slot is its ticket, or in a cluster of C CTAs C ticket + the CTA's rank.
MOK_DEVICE void trace_task(const MegaParams& p, int round, int slot, int word,
                           int64_t value = -1) {
  if (p.trace_tasks == nullptr) return;
  const int64_t record = static_cast<int64_t>(round) * p.max_tasks + slot;
  p.trace_tasks[record * layout::kTraceTaskWords + word] = value < 0 ? trace_now() : value;
}

// One thread: the next task of the running round (>= num_tasks once the round is used up).
MOK_DEVICE int next_ticket(const MegaParams& p) {
  return atomicAdd(p.counters + layout::kTicket, 1);
}

// Where a wait stands, for the error record: word j of the waited range names index + step * j.
struct MegaWaitSite {
  MegaPhase phase;
  int round;
  int index;
  int index_step;
};

// How long a wait of `phase` lasts before it gives up: timeout_ns times its depth in the chain
// of waits (layout::phase_depth).
// NOTE: a stall then shows where it starts: the wait nearest the cause gives up first (and
// writes the record), though a wait further down the chain may have started earlier.
// NOTE: the depth is the forward phase's: every wait builds its phase as pass_phase(p, forward),
// so once inlined the subtraction gives back the constant and the switch folds away.
MOK_DEVICE int64_t timeout_of(const MegaParams& p, MegaPhase phase) {
  const auto forward = static_cast<MegaPhase>(static_cast<int>(phase) - p.phase_offset);
  return p.timeout_ns * layout::phase_depth(forward);
}

// This pass's phase for one of the forward's waits (the backward's are kBackwardPhases on).
MOK_DEVICE MegaPhase pass_phase(const MegaParams& p, MegaPhase forward) {
  return static_cast<MegaPhase>(static_cast<int>(forward) + p.phase_offset);
}

// Records the wait that gave up (first writer only, best effort across CTAs), then traps.
// NOTE: no printf (a function call, see the NOTE at the top); the host decodes the record.
MOK_DEVICE void report_mega_timeout(const MegaParams& p, const MegaWaitSite& site, int index,
                                    int word, int32_t seen, int32_t expected) {
  if (p.error != nullptr) {
    volatile int32_t* err = p.error;
    if (err[layout::kMegaErrTimedOut] == 0) {
      err[layout::kMegaErrRank] = p.rank;
      err[layout::kMegaErrPhase] = static_cast<int>(site.phase);
      err[layout::kMegaErrRound] = p.round_base + site.round;
      err[layout::kMegaErrIndex] = index;
      err[layout::kMegaErrCounter] = word;
      err[layout::kMegaErrSeen] = seen;
      err[layout::kMegaErrExpected] = expected;
      err[layout::kMegaErrTimeoutMs] = static_cast<int32_t>(timeout_of(p, site.phase) / 1000000);
      __threadfence_system();
      err[layout::kMegaErrTimedOut] = 1;
      __threadfence_system();
    }
  }
  __trap();
}

constexpr uint32_t kMegaMaxSleepNs = 512;

// Fault injection (tests, MegaParams::stall_l2_cta): never returns; a bounded wait elsewhere
// traps the launch.
MOK_DEVICE void stall_forever() {
  for (;;) __nanosleep(kMegaMaxSleepNs);
}

MOK_DEVICE uint32_t next_sleep_ns(uint32_t sleep_ns) {
  return sleep_ns == 0 ? 32 : min(2 * sleep_ns, kMegaMaxSleepNs);
}

// Warp-collective (all 32 lanes converged): waits until counters[first + j] >= gen for every j in
// [0, count); lanes poll 32 words at a time (relaxed loads, then one acquire fence per lane: the
// fence after observing a released value synchronises with that release). Then fences the async
// proxy, so this warp's later TMA loads see what the writers stored before their release.
MOK_DEVICE void wait_counters(const MegaParams& p, int first, int count, int32_t gen,
                              const MegaWaitSite& site) {
  constexpr uint32_t kFullMask = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t timeout_ns = timeout_of(p, site.phase);
  uint64_t start_ns = 0;
  uint32_t sleep_ns = 0;
  for (int base = 0; base < count; base += 32) {
    const int j = base + lane;
    for (;;) {
      const int32_t seen = j < count ? ptx::ld_relaxed_gpu(p.counters + first + j) : gen;
      const uint32_t waiting = __ballot_sync(kFullMask, seen < gen);
      if (waiting == 0) break;
      const uint64_t now = __shfl_sync(kFullMask, comm::global_timer_ns(), 0);  // warp-uniform
      if (start_ns == 0) {
        start_ns = now;
      } else if (static_cast<int64_t>(now - start_ns) > timeout_ns &&
                 lane == __ffs(static_cast<int>(waiting)) - 1) {
        report_mega_timeout(p, site, site.index + site.index_step * j, first + j, seen, gen);
      }
      sleep_ns = next_sleep_ns(sleep_ns);
      __nanosleep(sleep_ns);
    }
  }
  // NOTE: each lane acquires its own words; the warp barrier orders those acquires before every
  // lane's proxy fence, and the TMA loads are issued after it by lane 0.
  ptx::fence_acq_rel_gpu();
  __syncwarp();
  ptx::fence_proxy_async_global();
}

// One thread: spins until the round barrier released `gen` (acquire), or records and traps.
MOK_DEVICE void wait_released(const MegaParams& p, int32_t gen, int round) {
  const int word = layout::kGridBar + 1;
  const MegaPhase phase = pass_phase(p, MegaPhase::kRoundBarrier);
  const int64_t timeout_ns = timeout_of(p, phase);
  uint64_t start_ns = 0;
  uint32_t sleep_ns = 0;
  for (;;) {
    const int32_t seen = ptx::ld_acquire_gpu(p.counters + word);
    if (seen >= gen) return;
    const uint64_t now = comm::global_timer_ns();
    if (start_ns == 0) {
      start_ns = now;
    } else if (static_cast<int64_t>(now - start_ns) > timeout_ns) {
      // The record's index names the waiting CTA.
      const MegaWaitSite site{phase, round, static_cast<int>(blockIdx.x), 0};
      report_mega_timeout(p, site, site.index, word, seen, gen);
    }
    sleep_ns = next_sleep_ns(sleep_ns);
    __nanosleep(sleep_ns);
  }
}

// All threads of the CTA, after all their stores of round `round` (generation gen): returns once
// every CTA of the grid got here. The last arriver resets the arrival count and the task ticket
// (for the next round), then releases gen.
// NOTE: the resets are safe: every CTA took its last ticket of this round before arriving, and
// nobody arrives again or takes a ticket before seeing gen, which is released after them.
MOK_DEVICE void round_barrier(const MegaParams& p, int32_t gen, int round) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t began = p.trace_ctas != nullptr ? trace_now() : 0;
    int32_t* arrivals = p.counters + layout::kGridBar;
    __threadfence();  // release: the CTA's writes of this round (ordered by the barrier above)
    const int32_t old = atomicAdd(arrivals, 1);
    if (old == p.num_ctas - 1) {
      __threadfence();  // acquire: every arriver's writes, through the arrivals' RMW chain
      atomicExch(arrivals, 0);
      atomicExch(p.counters + layout::kTicket, 0);
      ptx::st_release_gpu(arrivals + 1, gen);
    } else {
      wait_released(p, gen, round);
    }
    __threadfence();
    if (p.trace_ctas != nullptr) trace_cta_add(p, layout::kTraceBarrierNs, trace_now() - began);
  }
  __syncthreads();
}

}  // namespace mok::roles
