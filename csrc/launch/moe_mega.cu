// Host launchers around the forward megakernel (see launch/moe_mega.h).
#include "launch/moe_mega.h"

#include "launch/chain.h"
#include "launch/grid.h"
#include "mok/common/ptx.cuh"
#include "mok/comm/barrier.cuh"
#include "mok/layout/mega.cuh"
#include "mok/roles/row_grad.cuh"
#include "mok/roles/slot_combine.cuh"
#include "mok/scheduler/plan.cuh"

namespace mok::launch {
namespace {

using detail::grid_for;
using detail::kThreads;

// The pass's epoch, and the first round's task ticket back to 0 (layout/mega.cuh).
// One block. Round r of a pass waits for gen = epoch * R + r (layout/mega.cuh). Before the
// pass whose last generation would pass INT32_MAX (signed compares would then read every old
// flag as set) every word goes back to zero and the epoch restarts at 1: the counters are this
// rank's alone and stream-ordered, so no kernel of an earlier pass still reads them.
__global__ void bump_epoch_kernel(int32_t* counters, int64_t words, int32_t num_rounds) {
  ptx::chain_begin();  // launch/chain.h
  const int64_t epoch = counters[layout::kEpoch] + int64_t{1};
  const bool wrap = (epoch + 1) * num_rounds > INT32_MAX;
  __syncthreads();  // every thread read the epoch before anyone writes
  if (wrap) {
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) counters[i] = 0;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    counters[layout::kEpoch] = wrap ? 1 : static_cast<int32_t>(epoch);
    counters[layout::kTicket] = 0;
  }
}

}  // namespace

void moe_build_plan(const scheduler::PlanParams& p, cudaStream_t stream) {
  using namespace scheduler;
  const int64_t padded_rows = p.shape.num_rounds() * p.shape.ring_rows();
  launch::kernel(plan_experts, 1, kPlanThreads, 0, stream, p);
  launch::kernel(plan_fill, grid_for(padded_rows), kThreads, 0, stream, p);
  launch::kernel(plan_rows, grid_for(p.shape.row_capacity), kThreads, 0, stream, p);
  if (p.token_capacity > 0) {
    launch::kernel(plan_token_rows, grid_for(int64_t{p.token_capacity} * p.topk), kThreads, 0,
                   stream, p);
  }
}

void moe_stage_tokens(const MoeComm& comm, const void* x, int num_tokens, int64_t width,
                      cudaStream_t stream) {
  const auto& lay = comm.lay;
  // NOTE: checked before the first barrier: a refused call enqueues nothing peers wait on
  MOK_HOST_CHECK(width > 0 && width <= lay.hidden && width % 8 == 0,
                 "staged token rows of %lld bf16 must be a multiple of 8, at most hidden=%lld",
                 static_cast<long long>(width), static_cast<long long>(lay.hidden));
  // NOTE: peers read this rank's tokens after kDispatchStaged, and where a pass ends with that
  // read (the backward's dispatch of x for the gate/up weight gradient) no later barrier orders
  // it before the next staging (the next layer's d_out): this one does, before the copy.
  moe_barrier(comm, static_cast<int>(comm::Phase::kTokensRead), stream);
  if (num_tokens > 0) {  // rows `width` wide into the region's rows of `hidden`
    MOK_CUDA_CHECK(cudaMemcpy2DAsync(lay.at<void>(comm.my_base, layout::Region::kTokens),
                                     static_cast<size_t>(lay.hidden) * 2, x,
                                     static_cast<size_t>(width) * 2,
                                     static_cast<size_t>(width) * 2,
                                     static_cast<size_t>(num_tokens), cudaMemcpyDeviceToDevice,
                                     stream));
  }
  moe_barrier(comm, static_cast<int>(comm::Phase::kDispatchStaged), stream);
}

void moe_bump_epoch(const MoeComm& comm, int num_rounds, cudaStream_t stream) {
  MOK_HOST_CHECK(comm.lay.counter_words > layout::kTicket, "the workspace has no counters region");
  MOK_HOST_CHECK(num_rounds >= 1 && num_rounds < INT32_MAX / 2, "num_rounds=%d out of range",
                 num_rounds);
  launch::kernel(bump_epoch_kernel, 1, 256, 0, stream,
                 comm.lay.at<int32_t>(comm.my_base, layout::Region::kCounters),
                 comm.lay.counter_words, num_rounds);
}

void moe_zero_dropped_slots(const MoeComm& comm, const int64_t* global_topk, const int* slot_row,
                            int64_t num_local_experts, cudaStream_t stream) {
  const auto& lay = comm.lay;
  const int64_t slots = lay.num_ranks * lay.max_tokens * lay.topk;
  if (slots == 0) return;
  launch::kernel(roles::zero_dropped_slots, grid_for(slots), kThreads, 0, stream, lay,
                 comm.peer_bases, global_topk, slot_row, comm.rank, num_local_experts);
}

void moe_reduce_slot_rows(const MoeComm& comm, const int64_t* topk, const float* weights,
                          int64_t num_experts, const void* shared_out, void* out, int num_tokens,
                          cudaStream_t stream) {
  const auto& lay = comm.lay;
  MOK_HOST_CHECK(lay.slot_rows == 1, "the workspace has no slot_rows region");
  // NOTE: checked before the barrier, as every refusal here (nothing enqueued that peers wait on).
  // The kernel reads every slot row of its tokens, kept or not: they must lie in slot_rows.
  MOK_HOST_CHECK(num_tokens >= 0 && num_tokens <= lay.max_tokens,
                 "moe_reduce_slot_rows: %d tokens, the workspace's slot_rows hold %lld",
                 num_tokens, static_cast<long long>(lay.max_tokens));
  MOK_HOST_CHECK(int64_t{num_tokens} * (lay.hidden / 8) <= INT32_MAX,
                 "moe_reduce_slot_rows: %d tokens of hidden=%lld are more than its 32-bit "
                 "indices reach; split the call", num_tokens, static_cast<long long>(lay.hidden));
  moe_barrier(comm, static_cast<int>(comm::Phase::kSlotRowsPushed), stream);
  if (num_tokens == 0) return;
  launch::kernel(roles::reduce_slot_rows, grid_for(num_tokens * lay.hidden / 8), kThreads, 0,
                 stream, lay, comm.my_base, topk, weights, num_experts,
                 static_cast<const __nv_bfloat16*>(shared_out), static_cast<__nv_bfloat16*>(out),
                 num_tokens);
}

namespace {

// One thread: each expert's first B row, its group's rows rounded up to kWgradRowAlign after the
// previous expert's (E_l is small: a few hundred at most).
__global__ void wgrad_b_starts(const int32_t* ends, int num_local_experts, int32_t* starts) {
  ptx::chain_begin();  // launch/chain.h
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  constexpr int32_t kAlign = layout::kWgradRowAlign;
  int32_t row = 0, begin = 0;
  for (int e = 0; e < num_local_experts; ++e) {
    starts[e] = row;
    row += (ends[e] - begin + kAlign - 1) / kAlign * kAlign;
    begin = ends[e];
  }
}

// Grid-stride over B's 16-byte vectors: row `row` belongs to the last expert e whose start is at
// or before it (experts without rows share the next one's start and own none); it is ring row
// begin_e + row - starts[e] while that lies in e's group, else zeros.
__global__ void wgrad_b_fill(const __nv_bfloat16* act, const float* w_rows, const int32_t* ends,
                             const int32_t* starts, int num_local_experts, int64_t b_rows,
                             int64_t inter, __nv_bfloat16* b) {
  ptx::chain_begin();  // launch/chain.h
  const int64_t vecs = inter / 8, n = b_rows * vecs;
  const uint4* act_vecs = reinterpret_cast<const uint4*>(act);
  uint4* b_vecs = reinterpret_cast<uint4*>(b);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs, v = i % vecs;
    int lo = 0, hi = num_local_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (starts[mid] <= row) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t begin = lo > 0 ? ends[lo - 1] : 0;
    const int64_t ring_row = begin + (row - starts[lo]);
    uint4 out = make_uint4(0, 0, 0, 0);
    if (ring_row < ends[lo]) {
      out = row_grad::scale_bf16x8(act_vecs[ring_row * vecs + v], w_rows[ring_row]);
    }
    b_vecs[i] = out;
  }
}

}  // namespace

void moe_wgrad_b_rows(const void* act_ring, const float* w_rows, const int32_t* ends,
                      int num_local_experts, int64_t b_rows, int64_t inter, int32_t* starts,
                      void* b, cudaStream_t stream) {
  MOK_HOST_CHECK(num_local_experts >= 1 && inter % 8 == 0 && b_rows >= 0,
                 "moe_wgrad_b_rows: num_local_experts=%d >= 1 and inter=%lld a multiple of 8",
                 num_local_experts, static_cast<long long>(inter));
  launch::kernel(wgrad_b_starts, 1, 1, 0, stream, ends, num_local_experts, starts);
  if (b_rows == 0) return;
  launch::kernel(wgrad_b_fill, grid_for(b_rows * inter / 8), kThreads, 0, stream,
                 static_cast<const __nv_bfloat16*>(act_ring), w_rows, ends, starts,
                 num_local_experts, b_rows, inter, static_cast<__nv_bfloat16*>(b));
}

void moe_sum_row_partials(const float* partials, int64_t parts, const int64_t* row_tok,
                          float* d_row_w, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return;
  launch::kernel(roles::sum_row_partials, grid_for(rows), kThreads, 0, stream, partials, parts,
                 row_tok, d_row_w, rows);
}

}  // namespace mok::launch
