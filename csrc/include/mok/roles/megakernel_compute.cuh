// Role: the megakernel's compute CTAs (all but the first num_comm_ctas). Each is one TMA producer
// warp (warp 0) + two cooperative wgmma consumer warpgroups, as the grouped-GEMM engine, running
// this CTA's share of every round's static task order (roles/megakernel_tasks.cuh): compute CTA
// c of G runs tasks c, c + G, c + 2G, ... The producer waits each task's inputs (arrive flags
// for L1, l1_done flags for L2), then loads it; the consumers run the mainloop and the epilogue,
// and an L1 task's consumers release its l1_done flag.
// NOTE: producer and consumers walk the same task list, and each advances its pipeline state by
// the same k-tiles per task, across tasks and rounds (as a CUTLASS persistent kernel does).
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/roles/megakernel_gemm.cuh"
#include "mok/roles/megakernel_tasks.cuh"

namespace mok::roles {

using gemm::MegaAccumulators;
using gemm::MegaGemmParams;
using gemm::MegaMainloop;
using gemm::MegaPipeline;
using gemm::MegaPipelineState;

constexpr int kMegaProducerRegs = 40;   // setmaxnreg of the producer warpgroup
constexpr int kMegaConsumerRegs = 232;  // and of the consumer warpgroups (as CUTLASS's kernel)
constexpr int kMegaConsumerThreads = 256;

// Named barriers (id 0 is __syncthreads).
enum class MegaBarrier : int { kConsumers = 1 };

struct MegaComputeStorage {
  // NOTE: 128-byte-swizzled TMA / wgmma tiles want 1024-byte alignment; the kernel aligns the
  // dynamic shared memory base to it.
  alignas(1024) typename MegaMainloop::TensorStorage tensors;
  alignas(16) typename MegaMainloop::PipelineStorage pipeline;
};

// One round as this CTA sees it.
struct MegaRound {
  int round;
  int32_t gen;
  MegaTaskOrder order;
  int first_task;  // this CTA's compute index
  int task_step;   // the number of compute CTAs
};

MOK_DEVICE MegaRound make_round(const MegaParams& p, int round) {
  const int num_compute = p.num_ctas - p.num_comm_ctas;
  const MegaTaskOrder order(p.tile_count[round], p.l1_ntiles, p.l2_ntiles, num_compute);
  return {round, p.generation(round), order,
          static_cast<int>(blockIdx.x) - p.num_comm_ctas, num_compute};
}

// Producer warp (all 32 lanes): waits for one task's inputs, then lane 0 issues its loads.
CUTLASS_DEVICE void produce_task(const MegaParams& p, const MegaGemmParams& gp,
                                 MegaPipeline& pipeline, MegaPipelineState& state,
                                 typename MegaMainloop::TensorStorage& smem, const MegaRound& rd,
                                 const MegaTask& task) {
  const MegaTile tile = p.tile(rd.round, task.tile);
  const bool leader = threadIdx.x % 32 == 0;  // NOTE: thread 0 is the pipeline's is_leader
  if (!task.l2) {
    // The rows [row_begin, row_end) landed: every minibatch covering them was released.
    const int mb_first = tile.row_begin / p.minibatch_rows;
    const int mb_last = (tile.row_end - 1) / p.minibatch_rows;
    const int num_mb = tile.row_end > tile.row_begin ? mb_last - mb_first + 1 : 0;
    wait_counters(p, p.arrive_word + mb_first, num_mb, rd.gen,
                  {MegaPhase::kL1WaitRows, rd.round, mb_first, 1});
    const gemm::MegaLoad load{tile.row_begin, task.n,   tile.expert,        2 * p.inter,
                              p.hidden,       p.l1_ktiles, p.num_local_experts};
    if (leader) gemm::load_task(gp.l1, pipeline, state, smem, load);
    state.advance(p.l1_ktiles);
  } else {
    // The m-tile's act rows are stored: all n1 L1 tasks of the m-tile released l1_done.
    wait_counters(p, p.l1_done_word + task.tile * p.l1_ntiles, p.l1_ntiles, rd.gen,
                  {MegaPhase::kL2WaitL1, rd.round, task.tile, 0});
    const gemm::MegaLoad load{tile.row_begin, task.n,   tile.expert,        p.hidden,
                              p.inter,        p.l2_ktiles, p.num_local_experts};
    if (leader) gemm::load_task(gp.l2, pipeline, state, smem, load);
    state.advance(p.l2_ktiles);
  }
  __syncwarp();
}

// Consumers, after an L1 task's epilogue: release l1_done[tile * n1 + n] = gen once all 256
// threads' act / h stores are done.
MOK_DEVICE void release_l1_done(const MegaParams& p, const MegaRound& rd, const MegaTask& task,
                                int mma_thread_idx) {
  // NOTE: L2 tasks read the act rows by TMA (the async proxy): each writer fences its own
  // generic stores against it; the reader fences again after its acquire.
  ptx::fence_proxy_async_global();
  ptx::named_barrier_sync(static_cast<int>(MegaBarrier::kConsumers), kMegaConsumerThreads);
  if (mma_thread_idx == 0) {
    __threadfence();
    ptx::st_release_gpu(p.counters + p.l1_done_word + task.tile * p.l1_ntiles + task.n, rd.gen);
  }
}

// Consumers (both warpgroups): one task's mainloop and epilogue.
CUTLASS_DEVICE void consume_task(const MegaParams& p, const MegaGemmParams& gp,
                                 MegaPipeline& pipeline, MegaPipelineState& state,
                                 typename MegaMainloop::TensorStorage& smem, const MegaRound& rd,
                                 const MegaTask& task, int mma_thread_idx) {
  const MegaTile tile = p.tile(rd.round, task.tile);
  const int rows = tile.row_end - tile.row_begin;
  MegaAccumulators acc;
  // NOTE: the collective's mma() reads no Params field (the data comes through shared memory),
  // so one call serves both GEMMs; only the k-tile count differs.
  gemm::mma_task(gp.l1, pipeline, state, smem, acc, task.l2 ? p.l2_ktiles : p.l1_ktiles,
                 mma_thread_idx);
  if (!task.l2) {
    gemm::l1_epilogue(p, acc, mma_thread_idx, tile.row_begin, rows, task.n);
    release_l1_done(p, rd, task, mma_thread_idx);
  } else {
    gemm::l2_epilogue(p, acc, mma_thread_idx, rd.round, tile.row_begin, rows, task.n);
  }
}

// The producer warpgroup: warp 0 loads every task of every round; warps 1-3 only meet the round
// barriers.
CUTLASS_DEVICE void producer_role(const MegaParams& p, const MegaGemmParams& gp,
                                  MegaPipeline& pipeline, MegaComputeStorage& storage) {
  MegaPipelineState state = cutlass::make_producer_start_state<MegaPipeline>();
  const bool loader = threadIdx.x / 32 == 0;
  for (int round = 0; round < p.num_rounds; ++round) {
    const MegaRound rd = make_round(p, round);
    if (loader) {
      for (int t = rd.first_task; t < rd.order.num_tasks(); t += rd.task_step) {
        produce_task(p, gp, pipeline, state, storage.tensors, rd, rd.order.decode(t));
      }
    }
    if (round + 1 < p.num_rounds) round_barrier(p, rd.gen, round);
  }
}

// The consumer warpgroups: every task of every round, then the round barrier.
CUTLASS_DEVICE void consumer_role(const MegaParams& p, const MegaGemmParams& gp,
                                  MegaPipeline& pipeline, MegaComputeStorage& storage) {
  MegaPipelineState state;  // phase 0: waits for the producer's first fill
  // As CUTLASS's cooperative kernel: consumer warpgroup 1 is the tile's second 64 rows.
  const int mma_thread_idx = static_cast<int>(threadIdx.x) % kMegaConsumerThreads;
  for (int round = 0; round < p.num_rounds; ++round) {
    const MegaRound rd = make_round(p, round);
    for (int t = rd.first_task; t < rd.order.num_tasks(); t += rd.task_step) {
      consume_task(p, gp, pipeline, state, storage.tensors, rd, rd.order.decode(t),
                   mma_thread_idx);
    }
    if (round + 1 < p.num_rounds) round_barrier(p, rd.gen, round);
  }
}

// A compute CTA's whole launch: the pipeline, then the warpgroup roles with their register
// budgets (setmaxnreg, in one if/else as CUTLASS's kernel does).
CUTLASS_DEVICE void compute_role(const MegaParams& p, const MegaGemmParams& gp,
                                 MegaComputeStorage& storage) {
  const int warp_group = static_cast<int>(threadIdx.x) / 128;
  typename MegaPipeline::Params pipe;
  using Role = typename MegaPipeline::ThreadCategory;
  pipe.role = warp_group != 0 ? Role::Consumer
              : threadIdx.x / 32 == 0 ? Role::Producer
                                      : Role::NonParticipant;
  pipe.is_leader = threadIdx.x % 128 == 0;
  pipe.num_consumers = kMegaConsumerThreads;
  pipe.num_producers = 1;
  // NOTE: both GEMMs move full 128x64 + 256x64 bf16 boxes per stage (TMA counts zero-filled
  // bytes too), so one transaction size serves L1 and L2.
  pipe.transaction_bytes = gp.l1.tma_transaction_bytes;
  MegaPipeline pipeline(storage.pipeline, pipe, gemm::ClusterShape{});
  if (threadIdx.x == 0) {
    MegaMainloop::prefetch_tma_descriptors(gp.l1);
    MegaMainloop::prefetch_tma_descriptors(gp.l2);
  }
  __syncthreads();  // the pipeline's barriers are initialised before anyone uses them
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kMegaProducerRegs>();
    producer_role(p, gp, pipeline, storage);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMegaConsumerRegs>();
    consumer_role(p, gp, pipeline, storage);
  }
}

}  // namespace mok::roles
