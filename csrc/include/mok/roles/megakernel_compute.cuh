// Role: every CTA of a megakernel runs GEMM tasks (the first num_comm_ctas after their pulls
// of each round, roles/megakernel_comm.cuh). Each is one TMA producer warp (warp 0) + two
// cooperative wgmma consumer warpgroups, as the grouped-GEMM engine. The producer takes the
// round's tasks one ticket at a time (roles/megakernel_tasks.cuh), waits each task's inputs
// (arrive flags for L1, l1_done flags for L2), loads it, and passes the ticket to the consumers
// through a small shared-memory queue; the consumers run the mainloop and the epilogue, and an L1
// task's consumers release its l1_done flag.
// NOTE: producer and consumers walk the same tickets, and each advances its pipeline state by the
// same k-tiles per task, across tasks and rounds (as a CUTLASS persistent kernel does).
// kBackward: the backward megakernel, the same roles over its two data-gradient GEMMs (the
// backward's mainloop, gemm::MegaMainloopNN); only the first GEMM's epilogue differs
// (gemm::dswiglu_epilogue instead of gemm::l1_epilogue).
// kCluster: CTAs per cluster (1 or 2). In a cluster of 2, a ticket is a cluster task: the two
// CTAs run n-tiles 2 n and 2 n + 1 of one m-tile and share its A tile (TMA multicast); the first
// takes the tickets, the second receives them (roles/megakernel_cluster.cuh).
// kFp8: the FP8 forward (one CTA per cluster): the same roles over blockwise-FP8 operands, each
// task's n-tile as two 128-wide FP8 tiles in one pass over K (roles/megakernel_fp8.cuh).
#pragma once

#include <cstdint>
#include <type_traits>

#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/roles/megakernel_cluster.cuh"
#include "mok/roles/megakernel_comm.cuh"
#include "mok/roles/megakernel_fp8.cuh"
#include "mok/roles/megakernel_gemm.cuh"
#include "mok/roles/megakernel_tasks.cuh"

namespace mok::roles {

using gemm::MegaAccumulators;
using gemm::MegaLaunchCluster;
using gemm::MegaGemmParamsOf;
using gemm::MegaMainloopOf;

// A megakernel's GEMM types: BF16 (either pass, clusters of 1 or 2) or the FP8 forward.
template <bool kBackward, int kCluster, bool kFp8>
struct MegaGemmKind {
  using Mainloop = MegaMainloopOf<kBackward, kCluster>;
  using Params = std::conditional_t<kBackward, gemm::MegaBwdGemmParamsOf<Mainloop>,
                                    MegaGemmParamsOf<Mainloop>>;
  using Scratch = gemm::MegaBf16Scratch;
};
template <>
struct MegaGemmKind<false, 1, true> {
  using Mainloop = gemm::MegaFp8Mainloop;
  using Params = gemm::MegaFp8GemmParams;
  using Scratch = gemm::MegaFp8Scratch;
};
template <bool kBackward, int kCluster, bool kFp8>
using MegaMainloopKind = typename MegaGemmKind<kBackward, kCluster, kFp8>::Mainloop;
template <bool kBackward, int kCluster, bool kFp8>
using MegaParamsKind = typename MegaGemmKind<kBackward, kCluster, kFp8>::Params;
template <bool kBackward, int kCluster, bool kFp8>
using MegaPipelineKind = typename MegaMainloopKind<kBackward, kCluster, kFp8>::MainloopPipeline;
template <bool kBackward, int kCluster, bool kFp8>
using MegaStateKind = typename MegaMainloopKind<kBackward, kCluster, kFp8>::PipelineState;

constexpr int kMegaProducerRegs = 40;   // setmaxnreg of the producer warpgroup
constexpr int kMegaConsumerRegs = 232;  // and of the consumer warpgroups (as CUTLASS's kernel)
constexpr int kMegaConsumerThreads = 256;
static_assert(kMegaConsumerThreads == 32 * kPullWarps, "the consumer warpgroups pull the rows");
constexpr int kMegaTicketDepth = 4;  // tickets the producer may be ahead of its consumers

// Named barriers (id 0 is __syncthreads).
enum class MegaBarrier : int {
  kConsumers = 1,  // the 256 consumer threads
  kPulled = 2,     // a comm CTA's consumers (arrive) and producer warp (sync): the round's rows
                   // are pulled, tasks may be taken
  // (3 and 4: the FP8 consumers' turns, roles/megakernel_fp8.cuh)
  kProducers = 5,  // the producer warpgroup's 128 threads (rows in place): warp 0 passed a
                   // ticket to the other warps, or a k-tile's rows are copied and tracked
};

MOK_DEVICE void producers_sync() {
  ptx::named_barrier_sync(static_cast<int>(MegaBarrier::kProducers), 128);
}

// Producer -> consumers: the tickets the producer took, in order.
using MegaTicketQueue = cutlass::PipelineAsync<kMegaTicketDepth>;
using MegaTicketState = typename MegaTicketQueue::PipelineState;

// One ticket as the producer passes it on: this CTA's task, decoded (cta_task), its trace record
// and its m-tile, which the producer reads from the plan anyway; or the end of the round. A
// padding task (MegaTaskOrder::skipped) is not passed on: the consumers would do nothing with it.
// The consumers then start a task without a dependent global load and without the task order:
// reading the tile themselves cost each task its latency, 1.5-2.5 us under the mainloop's load
// on the FP8 megakernel (megakernel_trace's gaps between tasks, docs/perf_notes.md), before any
// wgmma; and the FP8 consumers, with no register to spare beside their accumulators, kept the
// order's fields in local memory and reloaded them at every ticket.
struct MegaTicket {
  MegaTile tile;
  MegaTask task;
  int32_t slot;  // trace_slot
  bool end;      // past the round's last task: the consumers go on to the round barrier
};

template <bool kBackward, int kCluster = 1, bool kFp8 = false>
struct MegaComputeStorage {
  using Mainloop = MegaMainloopKind<kBackward, kCluster, kFp8>;
  // NOTE: 128-byte-swizzled TMA / wgmma tiles want 1024-byte alignment; the kernel aligns the
  // dynamic shared memory base to it. The ticket queue and the mailbox fit the mainloop's
  // carveout.
  alignas(1024) typename Mainloop::TensorStorage tensors;
  alignas(16) typename Mainloop::PipelineStorage pipeline;
  alignas(16) typename MegaTicketQueue::SharedStorage ticket_barriers;
  MegaTicket tickets[kMegaTicketDepth];
  MegaTicket row_tickets[2];  // rows in place: warp 0 -> the other producer warps, alternately
  int32_t row_tokens[layout::kBlockM];  // rows in place: each row's token of the L1 task loading
  MegaMailbox mailbox;  // clusters of 2 only
  // the producer warp's (FP8); the wgrad epilogue's boxes (BF16, both passes: one size)
  typename MegaGemmKind<kBackward, kCluster, kFp8>::Scratch scratch;
};

// One round as this CTA sees it.
struct MegaRound {
  int round;
  int32_t gen;
  MegaTaskOrder order;
};

// In clusters of kCluster CTAs the order is over clusters and groups of kCluster n-tiles.
// The backward's down-weight gradient tasks (phase D: MegaTaskOrder) where it runs them.
template <int kCluster>
MOK_DEVICE MegaRound make_round(const MegaParams& p, int round) {
  const bool wgrad = kCluster == 1 && p.wgrad != 0;
  const MegaTaskOrder order(p.order_block, p.tile_count[round],
                            (p.l1_ntiles + kCluster - 1) / kCluster,
                            (p.l2_ntiles + kCluster - 1) / kCluster, p.num_ctas / kCluster,
                            wgrad ? p.wgrad_mtiles : 0, p.wgrad_ntiles,
                            wgrad ? p.num_local_experts : 0, p.wgrad_interleave != 0);
  return {round, p.generation(round), order};
}

// A down-weight gradient task's rows as the ticket carries them: expert e's ring rows [end of
// e - 1, end of e) and, in `reserved`, its first row of B.
MOK_DEVICE MegaTile wgrad_tile(const MegaParams& p, int expert) {
  const int begin = expert > 0 ? p.wgrad_ends[expert - 1] : 0;
  return {expert, begin, p.wgrad_ends[expert], p.wgrad_b_starts[expert]};
}

// Its k-tiles: the expert's rows in kWgradRowAlign-row steps (0 for an expert without rows).
MOK_DEVICE int wgrad_ktiles(const MegaTile& tile) {
  return (tile.row_end - tile.row_begin + layout::kWgradRowAlign - 1) / layout::kWgradRowAlign;
}

// This CTA's task of a ticket's task: n-tile kCluster n + its rank in the cluster (in a cluster,
// it may lie past the GEMM's n-tiles: see consume_task), and the task's trace record slot.
template <int kCluster>
MOK_DEVICE MegaTask cta_task(const MegaTask& task) {
  return {task.l2, task.tile, task.n * kCluster + cluster_rank<kCluster>(), task.wgrad};
}
template <int kCluster>
MOK_DEVICE int trace_slot(int ticket) {
  return ticket * kCluster + cluster_rank<kCluster>();
}

// Producer warp (all 32 lanes): the 128-byte lines of `count` int64 entries from `first` into
// L1, a lane a line.
MOK_DEVICE void prefetch_row_lines(const int64_t* first, int count) {
  constexpr int kPerLine = 128 / static_cast<int>(sizeof(int64_t));
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int lines = count > 0 ? (count + 2 * kPerLine - 2) / kPerLine : 0;  // an unaligned start
  for (int i = lane; i < lines; i += 32) ptx::prefetch_global_l1(first + min(i * kPerLine, count - 1));
}

// Whether a megakernel can read its L1 rows in place (MegaParams::rows_in_place): the forward
// (BF16 or FP8) without clusters.
template <bool kBackward, int kCluster, bool kFp8>
constexpr bool kRowsInPlace = !kBackward && kCluster == 1;

// The arrivals each stage's full barrier counts beside the leader's arming one: the row loaders'
// where the BF16 forward reads its rows in place (gemm::load_task_rows), else none. (The FP8
// forward's copies in place arrive as its own loader says: gemm::load_task_rows_fp8.)
template <bool kBackward, int kCluster, bool kFp8>
MOK_DEVICE uint32_t row_arrivals(const MegaParams& p) {
  if constexpr (kRowsInPlace<kBackward, kCluster, kFp8> && !kFp8) {
    return p.rows_in_place ? gemm::kInPlaceRowArrivals : 0u;
  }
  return 0u;
}

// Producer thread (one of the warpgroup's 128), rows in place: one L1 task's loads, its `row`
// of the tile and that row's token (row_token) its own to publish (gemm::load_task_rows, or the
// FP8 forward's gemm::load_task_rows_fp8).
template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void load_task_rows_in_place(const MegaParams& p,
                                            const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                            MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                            MegaStateKind<kBackward, kCluster, kFp8>& state,
                                            MegaComputeStorage<kBackward, kCluster, kFp8>& storage,
                                            const gemm::MegaLoad& load, int row, int32_t token);

// Rows in place: the token row (one rank: src = t) of row `row` of m-tile `tile`, or -1 for a row
// past the tile or a padding row (gemm::load_task_rows zero-fills it).
MOK_DEVICE int32_t row_token(const MegaParams& p, int round, const MegaTile& tile, int row) {
  if (row >= tile.row_end - tile.row_begin) return -1;
  const int64_t src = p.row_src[static_cast<int64_t>(round) * p.ring_rows + tile.row_begin + row];
  return src < 0 ? -1 : static_cast<int32_t>(src);
}

// Producer warp (all 32 lanes), the backward's first GEMM: the lines of act and h that the task's
// epilogue (gemm::dswiglu_epilogue) reads, into L2, once the task's last k-tile is issued: its
// consumers are then at most the pipeline's stages from that epilogue, which otherwise waits on
// HBM for 192 KB per task (a, g and u of 128 rows x 256 columns), batch after batch: 21% of
// qwen3-30b-a3b's backward CTA time at 15fe76a, 13 us per task (docs/perf_notes.md). Rows in the
// order the epilogue takes them: each warp's rows 16 w + 0..7 (its first row half), then
// 16 w + 8..15.
MOK_DEVICE void prefetch_dswiglu_rows(const MegaParams& p, const MegaTile& tile, int n_tile) {
  const int rows = tile.row_end - tile.row_begin;
  const int col0 = n_tile * layout::kBlockN;
  const int cols = min(layout::kBlockN, p.inter - col0);
  if (cols <= 0) return;  // a cluster's tile past the last n-tile
  const int lane = static_cast<int>(threadIdx.x % 32);
  const auto lines = [](const __nv_bfloat16* first, int count) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(first) & ~uintptr_t{127};
    const uintptr_t end = reinterpret_cast<uintptr_t>(first + count);
    for (uintptr_t line = begin; line < end; line += 128) {
      ptx::prefetch_global_l2(reinterpret_cast<const void*>(line));
    }
  };
  CUTLASS_PRAGMA_NO_UNROLL
  for (int i = lane; i < layout::kBlockM; i += 32) {
    const int half = i / (layout::kBlockM / 2), j = i % (layout::kBlockM / 2);
    const int row = (j / 8) * 16 + half * 8 + j % 8;
    if (row >= rows) continue;
    const int64_t ring_row = tile.row_begin + row;
    lines(p.act_ring + ring_row * p.inter + col0, cols);
    lines(p.h_ring + ring_row * 2 * p.inter + 2 * col0, 2 * cols);
  }
}

// Producer warp (all 32 lanes): waits until ring rows [row_begin, row_end) of the round have
// landed: every minibatch covering them was released (the first GEMM's rows wait, its phase).
MOK_DEVICE void wait_rows_landed(const MegaParams& p, const MegaRound& rd, int row_begin,
                                 int row_end) {
  const int mb_first = row_begin / p.minibatch_rows;
  const int mb_last = (row_end - 1) / p.minibatch_rows;
  const int num_mb = row_end > row_begin ? mb_last - mb_first + 1 : 0;
  wait_counters(p, p.arrive_word + mb_first, num_mb, rd.gen,
                {pass_phase(p, MegaPhase::kL1WaitRows), rd.round, mb_first, 1});
}

// Producer warp (all 32 lanes): waits for one task's inputs, then lane 0 issues its loads.
// `task` is this CTA's (cta_task); `slot` its trace record.
template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void produce_task(const MegaParams& p,
                                 const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                 MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                 MegaStateKind<kBackward, kCluster, kFp8>& state,
                                 MegaComputeStorage<kBackward, kCluster, kFp8>& storage,
                                 const MegaRound& rd, int slot, const MegaTask& task,
                                 const MegaTile& tile) {
  using Mainloop = MegaMainloopKind<kBackward, kCluster, kFp8>;
  auto& smem = storage.tensors;
  const bool leader = threadIdx.x % 32 == 0;  // NOTE: thread 0 is the pipeline's is_leader
  if (leader) trace_task(p, rd.round, slot, layout::kTraceTake);
  if constexpr (kFp8) {  // the weight scales do not wait for the task's inputs
    gemm::stage_weight_scales(task.l2 ? gp.l2 : gp.l1, tile.expert, task.n, storage.scratch);
  }
  if constexpr (kBackward && kCluster == 1) {
    if (task.wgrad) {
      // Its A rows landed: the expert's, and a last k-tile's past them (to the ring's end, where
      // TMA zero-fills), every minibatch covering them pulled (comm_round pulls that far).
      const int k_tiles = wgrad_ktiles(tile);
      wait_rows_landed(p, rd, tile.row_begin,
                       min(tile.row_begin + k_tiles * layout::kWgradRowAlign, p.ring_rows));
      if (leader) trace_task(p, rd.round, slot, layout::kTraceReady);
      if (leader) {
        const gemm::MegaWgradLoad load{tile.row_begin,           tile.reserved,
                                       task.n % p.wgrad_mtiles, task.n / p.wgrad_mtiles,
                                       k_tiles,                  rd.round};
        gemm::load_wgrad_task(p, gp.wgrad, pipeline, state, gemm::wgrad_smem(smem), load);
      }
      state.advance(k_tiles);
      __syncwarp();
      return;
    }
  }
  if (!task.l2) {
    const gemm::MegaLoad load{tile.row_begin, task.n,   tile.expert,
                              p.l1_n,         p.hidden, p.l1_ktiles,
                              p.num_local_experts, rd.round};
    if constexpr (kRowsInPlace<kBackward, kCluster, kFp8>) {
      if (p.rows_in_place) {  // the token rows were written before the launch: nothing to wait
        if (leader) trace_task(p, rd.round, slot, layout::kTraceReady);
        // warp 0's share of the copies (the other warps': rows_in_place_loader)
        const int row = static_cast<int>(threadIdx.x % 128);
        load_task_rows_in_place<kBackward, kCluster, kFp8>(p, gp, pipeline, state, storage, load,
                                                           row, row_token(p, rd.round, tile, row));
        state.advance(p.l1_ktiles);
        __syncwarp();
        return;
      }
    }
    wait_rows_landed(p, rd, tile.row_begin, tile.row_end);
    if (leader) trace_task(p, rd.round, slot, layout::kTraceReady);
    if (leader) {
      if constexpr (kFp8) {
        gemm::load_task_fp8(p, gp.l1, pipeline, state, smem, load, storage.scratch);
      } else {
        gemm::load_task<Mainloop>(p, gp.l1, pipeline, state, smem, load);
      }
    }
    state.advance(p.l1_ktiles);
    if constexpr (kBackward) {
      __syncwarp();  // after the leader's last k-tile: see prefetch_dswiglu_rows
      prefetch_dswiglu_rows(p, tile, task.n);
    }
  } else {
    // The consumers read their rows' destinations (gemm::l2_row_dsts) as the task begins: the
    // plan's row_dst entries of the tile's rows, brought into this SM's L1 now. The FP8 consumers
    // keep the destinations in local memory across the mainloop, so the store there waits for
    // these loads before the first wgmma (the BF16 consumers keep them in registers).
    const int64_t* row_dst = p.row_dst + static_cast<int64_t>(rd.round) * p.ring_rows;
    prefetch_row_lines(row_dst + tile.row_begin, tile.row_end - tile.row_begin);
    // The m-tile's act rows are stored: all n1 L1 tasks of the m-tile released l1_done.
    wait_counters(p, p.l1_done_word + task.tile * p.l1_ntiles, p.l1_ntiles, rd.gen,
                  {pass_phase(p, MegaPhase::kL2WaitL1), rd.round, task.tile, 0});
    if (leader) trace_task(p, rd.round, slot, layout::kTraceReady);
    const gemm::MegaLoad load{tile.row_begin, task.n,   tile.expert,
                              p.hidden,       p.l2_k,   p.l2_ktiles,
                              p.num_local_experts, rd.round};
    if (leader) {
      if constexpr (kFp8) {
        gemm::load_task_fp8(p, gp.l2, pipeline, state, smem, load, storage.scratch);
      } else {
        gemm::load_task<Mainloop>(p, gp.l2, pipeline, state, smem, load,
                                  row_arrivals<kBackward, kCluster, kFp8>(p));
      }
    }
    state.advance(p.l2_ktiles);
  }
  __syncwarp();
}

// Consumers, after an L1 task's epilogue: release l1_done[tile * n1 + n] = gen once all 256
// threads' act / h stores are done. `slot`: the task's trace record (kTraceStored).
MOK_DEVICE void release_l1_done(const MegaParams& p, const MegaRound& rd, const MegaTask& task,
                                int mma_thread_idx, int slot) {
  // NOTE: L2 tasks read the act rows by TMA (the async proxy): each writer fences its own
  // generic stores against it; the reader fences again after its acquire.
  ptx::fence_proxy_async_global();
  // NOTE: the barrier orders every consumer's stores before thread 0's release, which is
  // cumulative: no further fence (a __threadfence here is an SC fence plus an L1 invalidation).
  ptx::named_barrier_sync(static_cast<int>(MegaBarrier::kConsumers), kMegaConsumerThreads);
  if (mma_thread_idx == 0) {
    trace_task(p, rd.round, slot, layout::kTraceStored);
    ptx::st_release_gpu(p.counters + p.l1_done_word + task.tile * p.l1_ntiles + task.n, rd.gen);
  }
}

// Consumers' thread 0: a task's first trace records, as its consumers get its ticket: the time,
// the CTA and the task's id (layout/mega.cuh, kTraceTaskId).
MOK_DEVICE void trace_task_got(const MegaParams& p, const MegaRound& rd, int slot,
                               const MegaTask& task) {
  trace_task(p, rd.round, slot, layout::kTraceGot);
  trace_task(p, rd.round, slot, layout::kTraceTaskCta, 1 + blockIdx.x);
  trace_task(p, rd.round, slot, layout::kTraceTaskId,
             (int64_t{task.wgrad} << 41) | (int64_t{task.l2} << 40) |
                 (int64_t{task.tile} << 20) | task.n);
}

// Consumers (both warpgroups): one down-weight gradient task (MegaParams::wgrad), its trace
// records as consume_task's. An expert without rows has no k-tile: its tile is zeros (stored), or
// nothing to add.
template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void consume_wgrad_task(const MegaParams& p,
                                       const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                       MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                       MegaStateKind<kBackward, kCluster, kFp8>& state,
                                       MegaComputeStorage<kBackward, kCluster, kFp8>& storage,
                                       const MegaRound& rd, int slot, const MegaTask& task,
                                       const MegaTile& tile, int mma_thread_idx) {
  const bool tracer = mma_thread_idx == 0;
  if (tracer) trace_task_got(p, rd, slot, task);
  const int k_tiles = wgrad_ktiles(tile);
  MegaAccumulators acc;
  if (k_tiles > 0) {
    gemm::mma_task<gemm::MegaMainloopWgrad>(gp.wgrad, pipeline, state,
                                            gemm::wgrad_smem(storage.tensors), acc, k_tiles,
                                            mma_thread_idx);
  } else {
    cute::clear(acc);
  }
  if (tracer) trace_task(p, rd.round, slot, layout::kTraceMmaEnd);
  const int m_tile = task.n % p.wgrad_mtiles, n_tile = task.n / p.wgrad_mtiles;
  if (p.wgrad == layout::kWgradStore) {
    gemm::wgrad_epilogue(p, acc, mma_thread_idx, tile.expert, m_tile * layout::kBlockM,
                         n_tile * layout::kBlockN);
  } else if (k_tiles > 0) {  // kWgradAddF32
    gemm::wgrad_reduce_epilogue(p, gp.wgrad_reduce, storage.scratch, acc, mma_thread_idx,
                                tile.expert, m_tile, n_tile);
  }
  if (tracer) trace_task(p, rd.round, slot, layout::kTraceEpiEnd);
}

// Consumers (both warpgroups): one task's mainloop and epilogue.
// NOTE: the epilogue's stores stay here, though both warpgroups (and the tensor cores) wait for
// them. Commit 05618ca made the stores nothing in the launch waits for (the second GEMM's rows, the
// forward L1's h) during the next task's mainloop, between its wgmma: bitwise the same, the
// epilogue shorter, but the mainloop's k-tiles slower and the consumers waiting longer for
// tickets; every shape's span was longer, forward and backward (docs/perf_notes.md).
// `task` is this CTA's (cta_task); `slot` its trace record. In a cluster, a task past the GEMM's
// n-tiles (its n-tile count odd) only keeps the cluster in step: both warpgroups take its stages
// (loaded: A for the other CTA, B zero-filled) as an idle warpgroup does, and store nothing.
template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void consume_task(const MegaParams& p,
                                 const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                 MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                 MegaStateKind<kBackward, kCluster, kFp8>& state,
                                 typename MegaMainloopKind<kBackward, kCluster, kFp8>::TensorStorage& smem,
                                 const MegaRound& rd, int slot, const MegaTask& task,
                                 const MegaTile& tile, int mma_thread_idx) {
  const int rows = tile.row_end - tile.row_begin;
  const bool tracer = mma_thread_idx == 0;
  if constexpr (kCluster > 1) {
    if (task.n >= (task.l2 ? p.l2_ntiles : p.l1_ntiles)) {
      gemm::idle_task(pipeline, state, task.l2 ? p.l2_ktiles : p.l1_ktiles);
      return;
    }
  }
  if (tracer) trace_task_got(p, rd, slot, task);
  const int k_tiles = task.l2 ? p.l2_ktiles : p.l1_ktiles;
  if (gemm::consumer_rows_idle(mma_thread_idx, rows)) {
    // This warpgroup has no row of the tile: nothing to compute or store; an L1 task's release
    // still waits for the other warpgroup's stores.
    if constexpr (kFp8) {
      gemm::idle_task_fp8(pipeline, state, k_tiles, mma_thread_idx);  // takes its turns
    } else {
      gemm::idle_task(pipeline, state, k_tiles);
    }
    if (!task.l2) release_l1_done(p, rd, task, mma_thread_idx, slot);
    return;
  }
  if constexpr (kFp8) {
    gemm::fp8_task(p, pipeline, state, smem, task.l2, rd.round, tile.row_begin, rows, task.n,
                   k_tiles, mma_thread_idx, [&] {
                     if (tracer) trace_task(p, rd.round, slot, layout::kTraceMmaEnd);
                   });
  } else {
    // An L2 task's row destinations, loaded before the mainloop hides their latency (the
    // epilogue would otherwise wait on two dependent global loads per row half).
    const gemm::L2RowDsts dsts = task.l2 ? gemm::l2_row_dsts(p, mma_thread_idx, rd.round,
                                                           tile.row_begin, rows)
                                         : gemm::L2RowDsts{};
    MegaAccumulators acc;
    // NOTE: the collective's mma() reads no Params field (the data comes through shared
    // memory), so one call serves both GEMMs; only the k-tile count differs.
    gemm::mma_task<MegaMainloopOf<kBackward, kCluster>>(gp.l1, pipeline, state, smem, acc,
                                                         k_tiles, mma_thread_idx);
    if (tracer) trace_task(p, rd.round, slot, layout::kTraceMmaEnd);
    if (!task.l2) {
      if constexpr (kBackward) {
        gemm::dswiglu_epilogue(p, acc, mma_thread_idx, rd.round, tile.row_begin, rows, task.n);
      } else {
        gemm::l1_epilogue(p, acc, mma_thread_idx, tile.row_begin, rows, task.n);
      }
    } else {
      gemm::l2_epilogue(p, acc, dsts, task.n * layout::kBlockN);
    }
  }
  if (!task.l2) release_l1_done(p, rd, task, mma_thread_idx, slot);
  if (tracer) trace_task(p, rd.round, slot, layout::kTraceEpiEnd);
}

// Whether this CTA pulls rows (its comm index) or not (-1): none with the rows in place.
MOK_DEVICE int comm_index(const MegaParams& p) {
  const int b = static_cast<int>(blockIdx.x);
  return b < p.num_comm_ctas && !p.rows_in_place ? b : -1;
}

template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void load_task_rows_in_place(const MegaParams& p,
                                            const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                            MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                            MegaStateKind<kBackward, kCluster, kFp8>& state,
                                            MegaComputeStorage<kBackward, kCluster, kFp8>& storage,
                                            const gemm::MegaLoad& load, int row, int32_t token) {
  if constexpr (kFp8) {
    gemm::load_task_rows_fp8(p, gp.l1, pipeline, state, storage.tensors, load, row, token,
                             storage.row_tokens, storage.scratch, producers_sync);
  } else {
    gemm::load_task_rows<MegaMainloopKind<kBackward, kCluster, kFp8>>(
        p, gp.l1, pipeline, state, storage.tensors, load, row, token, storage.row_tokens,
        producers_sync);
  }
}

// Rows in place, the producer warpgroup's warps 1-3 (all lanes), one round: every ticket warp 0
// passes on (MegaComputeStorage::row_tickets, a kProducers barrier each), up to the round's end;
// each L1 task's share of the copies made (gemm::load_task_rows), every task's k-tiles counted
// in `state` as warp 0 counts them. A slot is rewritten two tickets later, after the barrier that
// follows this warp's read of it.
template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void rows_in_place_loader(const MegaParams& p,
                                         const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                         MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                         MegaStateKind<kBackward, kCluster, kFp8>& state,
                                         MegaComputeStorage<kBackward, kCluster, kFp8>& storage,
                                         const MegaRound& rd, uint32_t& passed) {
  for (;;) {
    producers_sync();
    const MegaTicket entry = storage.row_tickets[passed % 2];
    ++passed;
    if (entry.end) break;
    if (entry.task.l2) {
      state.advance(p.l2_ktiles);
      continue;
    }
    const gemm::MegaLoad load{entry.tile.row_begin, entry.task.n,   entry.tile.expert,
                              p.l1_n,               p.hidden,       p.l1_ktiles,
                              p.num_local_experts,  rd.round};
    const int row = static_cast<int>(threadIdx.x % 128);
    load_task_rows_in_place<kBackward, kCluster, kFp8>(p, gp, pipeline, state, storage, load, row,
                                                       row_token(p, rd.round, entry.tile, row));
    state.advance(p.l1_ktiles);
  }
}

// The producer warpgroup: warp 0 takes and loads tasks of every round (a comm CTA's once its
// rows are pulled) and passes each ticket on, the round's first ticket past its tasks last;
// warps 1-3 load their share of each L1 task's rows where the rows are read in place
// (rows_in_place_loader), else only meet the round barriers. In a cluster the first CTA takes the
// tickets and posts them to the second (cluster_ticket).
template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void producer_role(const MegaParams& p,
                                  const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                  MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                  MegaTicketQueue& queue,
                                  MegaComputeStorage<kBackward, kCluster, kFp8>& storage) {
  using Pipeline = MegaPipelineKind<kBackward, kCluster, kFp8>;
  MegaStateKind<kBackward, kCluster, kFp8> state = cutlass::make_producer_start_state<Pipeline>();
  MegaTicketState queue_state = cutlass::make_producer_start_state<MegaTicketQueue>();
  const bool loader = threadIdx.x / 32 == 0;
  const bool leader = threadIdx.x % 32 == 0;
  const bool pulls = comm_index(p) >= 0;
  // Rows in place: the producer warpgroup's other warps load their share of each L1 task's rows.
  bool row_loaders = false;
  if constexpr (kRowsInPlace<kBackward, kCluster, kFp8>) row_loaders = p.rows_in_place != 0;
  uint32_t passed = 0;  // tickets passed to the row loaders (their slot: passed % 2)
  uint32_t seq = 0;  // tickets this CTA took or received, all rounds (the mailbox's position)
  for (int round = 0; round < p.num_rounds; ++round) {
    const MegaRound rd = make_round<kCluster>(p, round);
    if (!loader && row_loaders) {
      if constexpr (kRowsInPlace<kBackward, kCluster, kFp8>) {
        rows_in_place_loader(p, gp, pipeline, state, storage, rd, passed);
      }
    } else if (loader) {
      if (pulls) {
        ptx::named_barrier_sync(static_cast<int>(MegaBarrier::kPulled), 32 + kMegaConsumerThreads);
      }
      for (;;) {
        int t = 0;
        if (leader) t = cluster_ticket<kCluster>(p, storage.mailbox, seq, round);
        ++seq;
        t = __shfl_sync(0xffffffffu, t, 0);
        const bool last = t >= rd.order.num_tasks();
        const MegaTask task = last ? MegaTask{} : rd.order.decode(t);
        const bool runs = !last && !rd.order.skipped(task);
        if (!last && !runs) continue;
        const MegaTile tile = !runs       ? MegaTile{}
                              : task.wgrad ? wgrad_tile(p, task.tile)
                                           : p.tile(rd.round, task.tile);
        const MegaTicket entry{tile, cta_task<kCluster>(task), trace_slot<kCluster>(t), last};
        if (leader) {
          gemm::acquire_slot(p, queue, queue_state, round);
          storage.tickets[queue_state.index()] = entry;
          queue.producer_commit(queue_state);
        }
        ++queue_state;
        if (row_loaders) {
          if (leader) storage.row_tickets[passed % 2] = entry;
          ++passed;
          producers_sync();
        }
        if (last) break;
        produce_task<kBackward, kCluster, kFp8>(p, gp, pipeline, state, storage, rd, entry.slot,
                                                entry.task, tile);
      }
    }
    if (round + 1 < p.num_rounds) round_barrier(p, rd.gen, round);
  }
  // Every stage released before the producer leaves (bounded): consumers stuck on their last
  // stages then trap here, named, rather than leave the launch hanging (as CUTLASS's load_tail,
  // which waits without a bound).
  if (loader && leader) {
    for (uint32_t s = 0; s < Pipeline::Stages; ++s, ++state) {
      gemm::acquire_slot(p, pipeline, state, p.num_rounds - 1);
    }
  }
  // NOTE: no thread leaves with copies of its own in flight (as CUTLASS's producers' load_tail);
  // the CTA would outlive them anyway (warp 0 waits above for the consumers, which wait for them).
  if (row_loaders) ptx::cp_async_wait_all();
  __syncwarp();  // warp 0 converged again before the cluster's aligned barrier
}

// The consumer warpgroups, every round: a comm CTA's pulls first, then the producer's tickets up
// to the one past the round's tasks, then the round barrier.
template <bool kBackward, int kCluster, bool kFp8>
CUTLASS_DEVICE void consumer_role(const MegaParams& p,
                                  const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                                  MegaPipelineKind<kBackward, kCluster, kFp8>& pipeline,
                                  MegaTicketQueue& queue,
                                  MegaComputeStorage<kBackward, kCluster, kFp8>& storage) {
  MegaStateKind<kBackward, kCluster, kFp8> state;  // phase 0: waits for the producer's first fill
  // The tickets read so far (all rounds): the queue's state, one register (the FP8 consumers
  // have none to spare beside their accumulators, and spilled the state's phase otherwise).
  uint32_t tickets_read = 0;
  // As CUTLASS's cooperative kernel: consumer warpgroup 1 is the tile's second 64 rows.
  const int mma_thread_idx = static_cast<int>(threadIdx.x) % kMegaConsumerThreads;
  const int comm_idx = comm_index(p);
  if constexpr (kFp8) gemm::fp8_turns_begin(mma_thread_idx);
  for (int round = 0; round < p.num_rounds; ++round) {
    const MegaRound rd = make_round<kCluster>(p, round);
    if (comm_idx >= 0) {
      const auto sync = [] {
        ptx::named_barrier_sync(static_cast<int>(MegaBarrier::kConsumers), kMegaConsumerThreads);
      };
      const int64_t began = mma_thread_idx == 0 && p.trace_ctas != nullptr ? trace_now() : 0;
      comm_round<kFp8>(p, comm_idx, round, rd.gen, mma_thread_idx / 32, sync);
      if (mma_thread_idx == 0) trace_cta_add(p, layout::kTracePullNs, trace_now() - began);
      ptx::named_barrier_arrive(static_cast<int>(MegaBarrier::kPulled),
                                32 + kMegaConsumerThreads);
    }
    for (;;) {
      const MegaTicketState queue_state(tickets_read % kMegaTicketDepth,
                                        (tickets_read / kMegaTicketDepth) % 2, tickets_read);
      ++tickets_read;
      queue.consumer_wait(queue_state);
      const MegaTicket entry = storage.tickets[queue_state.index()];
      queue.consumer_release(queue_state);
      if (entry.end) break;
      if (entry.task.l2 && p.stall_l2_cta == static_cast<int>(blockIdx.x)) stall_forever();  // tests
      if constexpr (kBackward && kCluster == 1) {
        if (entry.task.wgrad) {
          consume_wgrad_task<kBackward, kCluster, kFp8>(p, gp, pipeline, state, storage, rd,
                                                        entry.slot, entry.task, entry.tile,
                                                        mma_thread_idx);
          continue;
        }
      }
      consume_task<kBackward, kCluster, kFp8>(p, gp, pipeline, state, storage.tensors, rd,
                                              entry.slot, entry.task, entry.tile, mma_thread_idx);
    }
    if (round + 1 < p.num_rounds) round_barrier(p, rd.gen, round);
  }
  if constexpr (kFp8) gemm::fp8_turns_end(mma_thread_idx);
  if constexpr (kBackward && kCluster == 1) gemm::wgrad_reduce_drain(mma_thread_idx);
  if (mma_thread_idx == 0) {
    trace_cta_set(p, layout::kTraceEnd, trace_now());
    trace_cta_set(p, layout::kTraceEndCycles, trace_cycles());
  }
}

// This thread's side of a pipeline: the consumer warpgroups consume; of the producer warpgroup,
// the producer warp produces (the ticket queue's), or every warp (the mainloop's: with the rows in
// place all four load rows; the pipeline's leader, thread 0, alone arms a stage).
template <class Category>
MOK_DEVICE Category pipeline_role(int warp_group, bool whole_warpgroup) {
  return warp_group != 0                             ? Category::Consumer
         : whole_warpgroup || threadIdx.x / 32 == 0 ? Category::Producer
                                                    : Category::NonParticipant;
}

// A CTA's whole launch: the pipelines, then the warpgroup roles with their register budgets
// (setmaxnreg, in one if/else as CUTLASS's kernel does).
template <bool kBackward, int kCluster, bool kFp8 = false>
CUTLASS_DEVICE void cta_role(const MegaParams& p,
                             const MegaParamsKind<kBackward, kCluster, kFp8>& gp,
                             MegaComputeStorage<kBackward, kCluster, kFp8>& storage) {
  using Mainloop = MegaMainloopKind<kBackward, kCluster, kFp8>;
  using Pipeline = MegaPipelineKind<kBackward, kCluster, kFp8>;
  const int warp_group = static_cast<int>(threadIdx.x) / 128;
  typename Pipeline::Params pipe;
  pipe.role = pipeline_role<typename Pipeline::ThreadCategory>(warp_group, true);
  pipe.is_leader = threadIdx.x % 128 == 0;
  pipe.num_consumers = kMegaConsumerThreads;
  pipe.num_producers = 1 + row_arrivals<kBackward, kCluster, kFp8>(p);
  // NOTE: both GEMMs move full 128x64 + 256x64 bf16 boxes per stage (TMA counts zero-filled
  // bytes too), so one transaction size serves L1 and L2; FP8: 128x128 e4m3 boxes of A and of
  // both halves' B, and A's 128 scales.
  if constexpr (kFp8) {
    pipe.transaction_bytes = gemm::kMegaFp8StageBytes;
  } else {
    pipe.transaction_bytes = gp.l1.tma_transaction_bytes;
  }
  // NOTE: in a cluster, every consumer release must also reach the other CTA's empty barrier
  // (its producer multicasts A into this CTA's stages). The pipeline picks the CTAs it signals
  // by their cluster coordinates (block_id_in_cluster), so it takes the launch's geometry,
  // (kCluster, 1, 1), not the collective's (1, kCluster, 1): with the latter the second CTA's
  // barriers would get half their arrivals (the same count, 2 CTAs x 2 warpgroups, either way).
  Pipeline pipeline(storage.pipeline, pipe, MegaLaunchCluster<kCluster>{});
  typename MegaTicketQueue::Params qp;
  qp.role = pipeline_role<typename MegaTicketQueue::ThreadCategory>(warp_group, false);
  qp.producer_arv_count = 1;                     // the producer warp's lane 0
  qp.consumer_arv_count = kMegaConsumerThreads;  // every consumer thread releases its read
  // NOTE: the queue is this CTA's own: its consumers release to this CTA's rank in the cluster
  // (the pipeline signals CTA dst_blockid of the cluster). 0 sent a cluster's second CTA's
  // releases to the first CTA's queue: the second's producer waited forever (an unbounded wait)
  // for its kMegaTicketDepth + 1-th slot, and its peer behind it.
  qp.dst_blockid = static_cast<uint32_t>(cluster_rank<kCluster>());
  MegaTicketQueue queue(storage.ticket_barriers, qp, cute::true_type{});
  if (threadIdx.x == 0) {
    if constexpr (kFp8) {
      gemm::prefetch_tma_descriptors(gp);
    } else {
      Mainloop::prefetch_tma_descriptors(gp.l1);
      Mainloop::prefetch_tma_descriptors(gp.l2);
    }
  }
  if constexpr (kCluster > 1) {
    if (threadIdx.x == 0) init_mailbox(storage.mailbox);
    cutlass::arch::fence_barrier_init();
    // Every barrier of the cluster is initialised before any CTA signals another's.
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();  // the pipelines' barriers are initialised before anyone uses them
  }
  // Launched chained (launch/chain.h), the CTA got here while the kernel before it may still
  // run: nothing above reads or writes global memory. No chain_release (ptx.cuh says why).
  ptx::chain_wait();
  if (threadIdx.x == 0) {
    trace_cta_set(p, layout::kTraceStartCycles, trace_cycles());
    trace_cta_set(p, layout::kTraceStart, trace_now());
  }
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kMegaProducerRegs>();
    producer_role<kBackward, kCluster, kFp8>(p, gp, pipeline, queue, storage);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMegaConsumerRegs>();
    consumer_role<kBackward, kCluster, kFp8>(p, gp, pipeline, queue, storage);
  }
  if constexpr (kCluster > 1) {
    // NOTE: no CTA leaves while the other may still signal its barriers (stage releases, the
    // mailbox) or multicast into its shared memory.
    cute::cluster_arrive();
    cute::cluster_wait();
  }
}

}  // namespace mok::roles
