// Host launchers of the stage-1 MoE pass (see launch/moe.h). The kernels live in include/mok/.
#include "launch/chain.h"
#include "launch/grid.h"
#include "launch/moe.h"
#include "launch/moe_mega.h"

#include <algorithm>
#include <initializer_list>

#include "mok/comm/barrier.cuh"
#include "mok/roles/combine.cuh"
#include "mok/roles/dispatch.cuh"
#include "mok/roles/group_grads.cuh"
#include "mok/roles/swiglu.cuh"
#include "mok/scheduler/schedule.cuh"

namespace mok::launch {
namespace {

using detail::grid_for;
using detail::kThreads;

void check_launch() { MOK_CUDA_CHECK(cudaGetLastError()); }

__global__ void barrier_kernel(const uint64_t* signal_pads, int rank, int world, int phase,
                               int64_t timeout_ns) {
  comm::barrier_block(signal_pads, rank, world, phase, timeout_ns);
}

int row_threads(int64_t hidden) {
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, hidden / 8)));
}

}  // namespace

void moe_barrier(const MoeComm& comm, int phase, cudaStream_t stream) {
  if (comm.lay.num_ranks <= 1) return;
  MOK_HOST_CHECK(comm.signal_pads != nullptr, "a %lld-rank barrier needs signal pads",
                 static_cast<long long>(comm.lay.num_ranks));
  MOK_HOST_CHECK(comm.lay.num_ranks <= 32, "at most 32 ranks, got %lld",
                 static_cast<long long>(comm.lay.num_ranks));
  barrier_kernel<<<1, 32, 0, stream>>>(comm.signal_pads, comm.rank,
                                       static_cast<int>(comm.lay.num_ranks), phase,
                                       comm.timeout_ns);
  check_launch();
}

void moe_gather_routing(const MoeComm& comm, const int64_t* topk, const float* weights,
                        int num_tokens, int64_t* global_topk, float* global_weights,
                        cudaStream_t stream) {
  const auto& lay = comm.lay;
  launch::kernel(roles::stage_routing, grid_for(lay.max_tokens * lay.topk), kThreads, 0, stream,
                 lay, comm.my_base, topk, weights, num_tokens);
  moe_barrier(comm, static_cast<int>(comm::Phase::kScheduleStaged), stream);
  launch::kernel(roles::gather_routing, grid_for(lay.num_ranks * lay.max_tokens * lay.topk),
                 kThreads, 0, stream, lay, comm.peer_bases, global_topk, global_weights);
  moe_barrier(comm, static_cast<int>(comm::Phase::kScheduleGathered), stream);
}

void moe_build_schedule(const scheduler::ScheduleParams& p, cudaStream_t stream) {
  using namespace scheduler;
  const size_t count_smem = sizeof(int) * (p.num_local_experts + p.num_ranks + 1);
  MOK_HOST_CHECK(count_smem <= 48 * 1024, "too many local experts (%d) for the schedule kernel",
                 p.num_local_experts);
  launch::kernel(init_rows, grid_for(p.row_capacity), kThreads, 0, stream, p);
  launch::kernel(count_chunks, p.num_chunks(), kChunk, count_smem, stream, p);
  launch::kernel(scan_chunks, 1, kTokenThreads, 0, stream, p);
  launch::kernel(place_rows, p.num_chunks(), kChunk, 0, stream, p);
  launch::kernel(count_tokens, p.num_token_chunks(), kTokenChunk, 0, stream, p);
  launch::kernel(place_tokens, p.num_token_chunks(), kTokenChunk, 0, stream, p);
  launch::kernel(place_token_rows, grid_for(std::max<int64_t>(p.row_capacity, p.max_tokens)),
                 kThreads, 0, stream, p);
}

void moe_dispatch(const MoeComm& comm, const void* x, int num_tokens, int64_t width,
                  const int64_t* recv_token_src, int num_recv, void* recv, cudaStream_t stream) {
  const auto& lay = comm.lay;
  MOK_HOST_CHECK(lay.hidden % 8 == 0, "hidden=%lld must be a multiple of 8",
                 static_cast<long long>(lay.hidden));
  moe_stage_tokens(comm, x, num_tokens, width, stream);
  if (num_recv > 0) {
    launch::kernel(roles::pull_tokens, num_recv, row_threads(width), 0, stream, lay,
                   comm.peer_bases, recv_token_src, static_cast<__nv_bfloat16*>(recv), num_recv,
                   width);
  }
}

void moe_fp8_pack_rows(const void* data, const float* scales, int64_t num_rows, int64_t hidden,
                       void* packed, cudaStream_t stream) {
  MOK_HOST_CHECK(hidden % fp8_blockwise::kBlock == 0, "hidden=%lld must be a multiple of 128",
                 static_cast<long long>(hidden));
  if (num_rows == 0) return;
  const size_t pitch = static_cast<size_t>(fp8_blockwise::packed_row_bytes(hidden));
  const size_t scale_bytes = static_cast<size_t>(hidden / fp8_blockwise::kBlock) * sizeof(float);
  const size_t tail = pitch - static_cast<size_t>(hidden) - scale_bytes;
  auto* dst = static_cast<char*>(packed);
  const auto rows = static_cast<size_t>(num_rows);
  MOK_CUDA_CHECK(cudaMemcpy2DAsync(dst, pitch, data, static_cast<size_t>(hidden),
                                   static_cast<size_t>(hidden), rows, cudaMemcpyDeviceToDevice,
                                   stream));
  MOK_CUDA_CHECK(cudaMemcpy2DAsync(dst + fp8_blockwise::packed_scales_offset(hidden), pitch,
                                   scales, scale_bytes, scale_bytes, rows,
                                   cudaMemcpyDeviceToDevice, stream));
  if (tail > 0) {  // the padding to whole vectors: zeros, so a row's bytes are all defined
    MOK_CUDA_CHECK(cudaMemset2DAsync(dst + pitch - tail, pitch, 0, tail, rows, stream));
  }
}

void moe_gather_rows_fp8(const void* packed, const int64_t* row_tok, void* data, float* scales,
                         int64_t num_rows, int64_t hidden, cudaStream_t stream) {
  MOK_HOST_CHECK(hidden % fp8_blockwise::kBlock == 0, "hidden=%lld must be a multiple of 128",
                 static_cast<long long>(hidden));
  if (num_rows == 0) return;
  MOK_HOST_CHECK(num_rows < (int64_t{1} << 31), "too many rows (%lld)",
                 static_cast<long long>(num_rows));
  launch::kernel(roles::gather_rows_fp8, static_cast<unsigned>(num_rows), row_threads(hidden / 2),
                 0, stream, static_cast<const uint8_t*>(packed), row_tok,
                 static_cast<uint8_t*>(data), scales, hidden);
}

void moe_combine(const MoeComm& comm, const MoeCombineArgs& a, cudaStream_t stream) {
  const auto& lay = comm.lay;
  MOK_HOST_CHECK(lay.hidden % 8 == 0, "hidden=%lld must be a multiple of 8",
                 static_cast<long long>(lay.hidden));
  if (a.num_recv > 0) {
    roles::CombineParams p{lay, comm.peer_bases, comm.rank,
                           static_cast<const __nv_bfloat16*>(a.rows), a.token_rows,
                           a.recv_token_src, a.slot_weights, a.num_recv};
    p.rows2 = static_cast<const __nv_bfloat16*>(a.rows2);
    p.row_begin = a.row_begin;
    p.row_end = a.row_end;
    p.acc_in = a.acc_in;
    p.acc_out = a.acc_out;
    roles::push_partials<<<a.num_recv, row_threads(lay.hidden), 0, stream>>>(p);
    check_launch();
  }
  if (a.acc_out != nullptr) return;  // not the last round: nothing pushed yet
  moe_barrier(comm, static_cast<int>(comm::Phase::kCombinePushed), stream);
  if (a.num_tokens > 0) {
    roles::reduce_partials<<<grid_for(a.num_tokens * lay.hidden / 8), kThreads, 0, stream>>>(
        lay, comm.my_base, a.send_to, static_cast<const __nv_bfloat16*>(a.shared_out),
        static_cast<__nv_bfloat16*>(a.out), a.num_tokens);
    check_launch();
  }
}

void moe_combine_slots(const MoeComm& comm, const float* row_values, const int64_t* token_rows,
                       const int64_t* recv_token_src, int num_recv, const bool* send_to,
                       float* out, int num_tokens, cudaStream_t stream) {
  const auto& lay = comm.lay;
  if (num_recv > 0) {
    roles::push_slots<<<grid_for(num_recv * lay.topk), kThreads, 0, stream>>>(
        lay, comm.peer_bases, comm.rank, row_values, token_rows, recv_token_src, num_recv);
    check_launch();
  }
  moe_barrier(comm, static_cast<int>(comm::Phase::kSlotsPushed), stream);
  if (num_tokens > 0) {
    roles::reduce_slots<<<grid_for(num_tokens * lay.topk), kThreads, 0, stream>>>(
        lay, comm.my_base, send_to, out, num_tokens);
    check_launch();
  }
}

void moe_gather_rows(const void* src, const int64_t* row_tok, void* out, int64_t num_rows,
                     int64_t hidden, cudaStream_t stream) {
  MOK_HOST_CHECK(hidden % 8 == 0, "hidden=%lld must be a multiple of 8",
                 static_cast<long long>(hidden));
  if (num_rows == 0) return;
  MOK_HOST_CHECK(num_rows < (int64_t{1} << 31), "too many rows (%lld)",
                 static_cast<long long>(num_rows));
  launch::kernel(roles::gather_rows, static_cast<unsigned>(num_rows), row_threads(hidden), 0,
                 stream, static_cast<const __nv_bfloat16*>(src), row_tok,
                 static_cast<__nv_bfloat16*>(out), hidden);
}

namespace {
// 16-byte accesses need I, every row / block stride and every base pointer 16-byte aligned.
bool vec8(const MoeSwigluArgs& a, std::initializer_list<int64_t> strides,
          std::initializer_list<const void*> more_ptrs = {}) {
  if (a.inter % 8 || a.blk_stride % 8) return false;
  for (const void* ptr : {a.g, a.u}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return false;
  }
  for (const void* ptr : more_ptrs) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return false;
  }
  for (int64_t s : strides) {
    if (s % 8) return false;
  }
  return true;
}

roles::SwigluParams swiglu_params(const MoeSwigluArgs& a) {
  return roles::SwigluParams{static_cast<const __nv_bfloat16*>(a.g),
                             static_cast<const __nv_bfloat16*>(a.u), a.g_ld, a.u_ld, a.num_rows,
                             a.inter, a.blk_stride};
}
}  // namespace

void moe_swiglu_forward(const MoeSwigluArgs& a, void* out, cudaStream_t stream) {
  if (a.num_rows * a.inter == 0) return;
  const auto p = swiglu_params(a);
  auto* dst = static_cast<__nv_bfloat16*>(out);
  if (vec8(a, {a.g_ld, a.u_ld}, {out})) {
    roles::swiglu_forward<8><<<grid_for(a.num_rows * a.inter / 8), kThreads, 0, stream>>>(p, dst);
  } else {
    roles::swiglu_forward<1><<<grid_for(a.num_rows * a.inter), kThreads, 0, stream>>>(p, dst);
  }
  check_launch();
}

void moe_swiglu_backward(const MoeSwigluArgs& a, const void* da, void* dg, int64_t dg_ld,
                         void* du, int64_t du_ld, cudaStream_t stream) {
  if (a.num_rows * a.inter == 0) return;
  const auto p = swiglu_params(a);
  const auto* d = static_cast<const __nv_bfloat16*>(da);
  auto* g = static_cast<__nv_bfloat16*>(dg);
  auto* u = static_cast<__nv_bfloat16*>(du);
  if (vec8(a, {a.g_ld, a.u_ld, dg_ld, du_ld}, {da, dg, du})) {
    roles::swiglu_backward<8><<<grid_for(a.num_rows * a.inter / 8), kThreads, 0, stream>>>(
        p, d, g, dg_ld, u, du_ld);
  } else {
    roles::swiglu_backward<1><<<grid_for(a.num_rows * a.inter), kThreads, 0, stream>>>(
        p, d, g, dg_ld, u, du_ld);
  }
  check_launch();
}

void moe_accumulate_groups(void* total, const void* part, const int* offs,
                           const int* first_round, int round, int64_t num_groups,
                           int64_t group_elems, cudaStream_t stream) {
  MOK_HOST_CHECK(group_elems % 8 == 0, "group size %lld must be a multiple of 8",
                 static_cast<long long>(group_elems));
  if (num_groups == 0 || group_elems == 0) return;
  MOK_HOST_CHECK(num_groups <= 65535, "at most 65535 groups, got %lld",
                 static_cast<long long>(num_groups));
  roles::GroupGradParams p{static_cast<__nv_bfloat16*>(total),
                           static_cast<const __nv_bfloat16*>(part), offs, first_round, round,
                           group_elems};
  const int64_t per_group = std::min<int64_t>(64, (group_elems / 8 + kThreads - 1) / kThreads);
  const dim3 grid(static_cast<unsigned>(per_group), static_cast<unsigned>(num_groups));
  roles::accumulate_groups<<<grid, kThreads, 0, stream>>>(p);
  check_launch();
}

}  // namespace mok::launch
