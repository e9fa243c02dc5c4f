// Role pieces of the megakernels' consumers: the mainloop of one GEMM task, and the stores of the
// task before it, made while that mainloop's wgmma run.
//
// Why: a task's epilogue stops both consumer warpgroups, and so the SM's tensor cores, while it
// stores its 128 x 256 tile (the traces: 15% of qwen3-30b-a3b's forward CTA time). The stores
// that nothing in the launch waits for (an L2 task's rows into their sources' slots and y, an L1
// task's pre-activation h) need not happen there: the epilogue packs them into registers
// (DeferredStores, 64 per thread) and the next task's mainloop issues them between its
// asynchronous wgmma, a few groups per k-tile. An L1 task's act rows, which its l1_done flag
// releases to the L2 tasks, are still stored in its epilogue.
//
// The mainloop is CUTLASS's sm90 TMA + wgmma collective's (MainloopSm90TmaGmmaWarpSpecialized::
// mma() and mma_tail(), K_PIPE_MMAS = 1) with that hook added: the same wgmma sequence on the
// same shared-memory stages, so an output tile's accumulators are bitwise the collective's.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/roles/megakernel_gemm.cuh"

namespace mok::gemm {

// This consumer thread's share of a finished tile's bf16 rows, stored during the next task's
// mainloop. Group g of row half h is the 16 bytes for columns col0 + 8 q + 32 g (q = lane % 4,
// quad_gather's order) of up to two rows (dst[h][0], dst[h][1]: y and the source's slot, or h).
// NOTE: every index into v is a compile-time constant (store_step's switch): a register array
// indexed at run time would live in local memory.
struct DeferredStores {
  static constexpr int kGroups = kFragBlocks / 4;  // 16-byte groups per row half and lane
  static constexpr int kGroupsPerStep = 2;
  static constexpr int kSteps = kGroups / kGroupsPerStep;  // mainloop k-tiles they are spread over
  static_assert(kGroups % kGroupsPerStep == 0, "whole steps");

  uint4 v[2][kGroups];
  __nv_bfloat16* dst[2][2] = {{nullptr, nullptr}, {nullptr, nullptr}};  // null: not stored
  int lane_cols = 0;  // columns left from this lane's first one to the output's last

  template <int kGroup>
  MOK_DEVICE void store_group() {
    if (32 * kGroup >= lane_cols) return;
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      CUTLASS_PRAGMA_UNROLL
      for (int t = 0; t < 2; ++t) {
        if (dst[half][t] != nullptr) store16(dst[half][t] + 32 * kGroup, v[half][kGroup]);
      }
    }
  }

  template <int kStep>
  MOK_DEVICE void store_step_of() {
    store_group<kStep * kGroupsPerStep>();
    store_group<kStep * kGroupsPerStep + 1>();
  }

  // Step `step` of kSteps: its groups of both row halves.
  MOK_DEVICE void store_step(int step) {
    static_assert(kSteps == 4, "one case per step");
    switch (step) {
      case 0: store_step_of<0>(); break;
      case 1: store_step_of<1>(); break;
      case 2: store_step_of<2>(); break;
      case 3: store_step_of<3>(); break;
      default: break;
    }
  }

  // The steps from `first` on, then nothing is pending.
  // NOTE: the data is set to constants once stored, so that its registers are free (not live)
  // through the epilogues that defer nothing (the backward's SwiGLU backward, an idle warpgroup,
  // a forward L1 without h): the compiler cannot tell that null destinations store nothing.
  MOK_DEVICE void finish(int first) {
    for (int step = first; step < kSteps; ++step) store_step(step);
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      dst[half][0] = dst[half][1] = nullptr;
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kGroups; ++g) v[half][g] = make_uint4(0, 0, 0, 0);
    }
  }
};

// The raw bf16 columns of both row halves of `acc` into `d` (every lane of the warp takes part:
// quad_gather), for the rows `rows` (each at this lane's first column, or null) and columns below
// `lane_cols` from there.
// NOTE: d must hold nothing pending (the mainloop before stored it).
CUTLASS_DEVICE void defer_raw(DeferredStores& d, const MegaAccumulators& acc,
                              __nv_bfloat16* const (&rows)[2][2], int lane_cols) {
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    for_each_raw_group(acc, half, [&](int g, uint4 v) { d.v[half][g] = v; });
    d.dst[half][0] = rows[half][0];
    d.dst[half][1] = rows[half][1];
  }
  d.lane_cols = lane_cols;
}

// The second GEMM's epilogue (forward L2, backward L1 dgrad), deferred: this thread's rows
// (dsts, l2_row_dsts) of n-tile n_tile below H, bf16(acc), into y_rows and the source's slot.
CUTLASS_DEVICE void defer_l2(DeferredStores& d, const roles::MegaParams& p,
                             const MegaAccumulators& acc, const L2RowDsts& dsts, int n_tile) {
  const int col = n_tile * layout::kBlockN + static_cast<int>(threadIdx.x % 4) * kFragBlockCols;
  __nv_bfloat16* rows[2][2];
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    rows[half][0] = dsts.half[half].y != nullptr ? dsts.half[half].y + col : nullptr;
    rows[half][1] = dsts.half[half].slot != nullptr ? dsts.half[half].slot + col : nullptr;
  }
  defer_raw(d, acc, rows, p.hidden - col);
}

// The forward L1 epilogue's pre-activation h = (g, u) (interleaved as the GEMM's columns),
// deferred: rows [0, rows) of the tile at ring row row_begin, n-tile n_tile. Only the backward
// reads h, after the launch.
CUTLASS_DEVICE void defer_h(DeferredStores& d, const roles::MegaParams& p,
                            const MegaAccumulators& acc, int mma_thread_idx, int row_begin,
                            int rows, int n_tile) {
  auto coords = thread_coords(mma_thread_idx);
  const int64_t h_cols = 2 * static_cast<int64_t>(p.inter);
  const int col = n_tile * layout::kBlockN + static_cast<int>(threadIdx.x % 4) * kFragBlockCols;
  __nv_bfloat16* dst[2][2];
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = cute::get<0>(coords(2 * half));
    dst[half][0] = row < rows ? p.h_ring + (row_begin + row) * h_cols + col : nullptr;
    dst[half][1] = nullptr;
  }
  defer_raw(d, acc, dst, static_cast<int>(h_cols) - col);
}

// Consumers (both warpgroups, 256 threads): the collective's mainloop over one task's k-tiles and
// its tail (every wgmma done, every stage released), issuing `deferred`'s stores after the
// wgmma of k-tiles 1, 2, ... (the rest, if the task has fewer k-tiles, after the tail); advances
// `state` past the k-tiles and leaves nothing pending.
template <class Mainloop>
CUTLASS_DEVICE void mma_task(MegaPipeline& pipeline, MegaPipelineState& state,
                             typename Mainloop::TensorStorage& smem, MegaAccumulators& acc,
                             int k_tiles, int mma_thread_idx, DeferredStores& deferred) {
  using namespace cute;
  using TiledMma = typename Mainloop::TiledMma;
  Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), typename Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename Mainloop::SmemLayoutB{});
  constexpr int kMmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  const Layout warp_groups = make_layout(Int<kMmaWarpGroups>{},
                                         Int<cutlass::NumThreadsPerWarpGroup>{});
  const int warp_group = __shfl_sync(0xffffffffu,
                                     mma_thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  TiledMma tiled_mma;
  auto thread_mma = tiled_mma.get_slice(warp_groups(warp_group));
  Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,M,K,PIPE)
  Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,N,K,PIPE)
  MegaPipelineState read = state, release = state;

  // k-tile 0: the accumulators start from zero (scale-out 0 on its first k-block).
  warpgroup_fence_operand(acc);
  pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
  warpgroup_arrive();
  tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
    cute::gemm(tiled_mma, tCrA(_, _, k_block, read.index()), tCrB(_, _, k_block, read.index()),
               acc);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  ++read;
  warpgroup_fence_operand(acc);

  // k-tiles 1..: one wgmma batch in flight past the one waited for; the stage of the waited one
  // goes back to the producer.
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 1; k < k_tiles; ++k) {
    pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    cute::gemm(tiled_mma, tCrA(_, _, _, read.index()), tCrB(_, _, _, read.index()), acc);
    warpgroup_commit_batch();
    // NOTE: between the commit and the wait, the stores overlap this k-tile's wgmma; they touch
    // no accumulator register.
    if (k <= DeferredStores::kSteps) deferred.store_step(k - 1);
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    pipeline.consumer_release(release);
    ++read;
    ++release;
  }
  warpgroup_fence_operand(acc);
  warpgroup_wait<0>();
  pipeline.consumer_release(release);  // the last k-tile's stage
  state.advance(k_tiles);
  deferred.finish(k_tiles - 1);
}

// An idle warpgroup's side of one task (consumer_rows_idle): no wgmma; it waits for each
// k-tile's stage and releases it (the other warpgroup's release still gates the refill), so the
// other warpgroup has the SM's tensor cores to itself and the tile takes about half the time.
// The other warpgroup's wgmma sequence is unchanged: its rows are bitwise a full tile's. Makes
// `deferred`'s stores as mma_task does; advances `state` past the task's k-tiles.
CUTLASS_DEVICE void idle_task(MegaPipeline& pipeline, MegaPipelineState& state, int k_tiles,
                              DeferredStores& deferred) {
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < k_tiles; ++k) {
    pipeline.consumer_wait(state, pipeline.consumer_try_wait(state));
    if (k < DeferredStores::kSteps) deferred.store_step(k);
    pipeline.consumer_release(state);
    ++state;
  }
  deferred.finish(k_tiles);
}

}  // namespace mok::gemm
