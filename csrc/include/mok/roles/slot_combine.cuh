// The megakernel path's combine: every (token, slot) result row lands in its source rank's
// slot_rows region (the L2 epilogue stores it there); the source then sums a token's slots in slot
// order k = 0..K-1, each weighted by its router weight in float32 (product rounded before the
// add, as stage 1), plus the shared expert, then rounds to bf16 once. At EP 1 this is stage 1's
// arithmetic, step for step (its rank-ordered sum adds one partial to 0); at EP > 1 stage 1 sums
// each rank's slots first, so the two agree within rounding only.
//
// A slot whose row the schedule could not hold (capacity overflow: recorded, raised later) gets a
// zero row from the expert side, so it adds nothing, as in stage 1.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/common/bf16x8.cuh"
#include "mok/common/macros.cuh"
#include "mok/layout/workspace.cuh"

namespace mok::roles {

using layout::Region;
using layout::WorkspaceLayout;

// Grid-stride over [T, H / 8]: out[t] = bf16(sum_k w[t, k] * slot_rows[t, k] + shared[t]) over
// the slots k with an expert id in [0, num_experts); weights null: unweighted (the backward's
// d_x, whose rows carry the router weight already).
__global__ void reduce_slot_rows(WorkspaceLayout lay, uint64_t my_base, const int64_t* topk,
                                 const float* weights, int64_t num_experts,
                                 const __nv_bfloat16* shared_out, __nv_bfloat16* out,
                                 int num_tokens) {
  const __nv_bfloat16* slots = lay.at<const __nv_bfloat16>(my_base, Region::kSlotRows);
  const int64_t hidden = lay.hidden, k_n = lay.topk, vecs = hidden / 8;
  const int64_t n = num_tokens * vecs;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t t = i / vecs, h = (i % vecs) * 8;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = 0; k < k_n; ++k) {
      const int64_t id = topk[t * k_n + k];
      if (id < 0 || id >= num_experts) continue;
      float y[8];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(slots + (t * k_n + k) * hidden + h), y);
      if (weights != nullptr) {
        const float w = weights[t * k_n + k];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(y[q], w));  // no FMA
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], y[q]);
      }
    }
    if (shared_out != nullptr) {
      float sh[8];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(shared_out + t * hidden + h), sh);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], sh[q]);
    }
    *reinterpret_cast<uint4*>(out + t * hidden + h) = pack_bf16x8(acc);
  }
}

// A thread per slot of [W, T_max, K] (grid-stride by warps of 32 consecutive slots): a slot
// routed to this rank whose row the schedule dropped (slot_row < 0) gets zeros in its source's
// slot_rows, each dropped slot's row by the whole warp. Without an overflow no slot is dropped
// and the pass reads the two int arrays once, coalesced.
// NOTE: a warp per slot (every lane reading the slot's two entries) took 11 us of qwen3-30b-a3b's
// 8192-token forward in its profile (profile_host_h200_ep1_9d6aef5.json): 65536 slots.
__global__ void zero_dropped_slots(WorkspaceLayout lay, const uint64_t* peer_bases,
                                   const int64_t* global_topk, const int* slot_row, int rank,
                                   int64_t num_local_experts) {
  const int64_t hidden = lay.hidden, vecs = hidden / 8;
  const int64_t per_rank = lay.max_tokens * lay.topk, n = lay.num_ranks * per_rank;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t first = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32 * 32;
  for (int64_t base = first; base < n; base += warps * 32) {  // warp-uniform
    const int64_t i = base + lane;
    bool dropped = false;
    if (i < n) {
      const int64_t local = global_topk[i] - rank * num_local_experts;
      dropped = local >= 0 && local < num_local_experts && slot_row[i] < 0;
    }
    for (uint32_t mask = __ballot_sync(0xffffffffu, dropped); mask != 0; mask &= mask - 1) {
      const int64_t slot = base + __ffs(mask) - 1;
      uint4* dst = lay.at<uint4>(peer_bases[slot / per_rank], Region::kSlotRows) +
                   (slot % per_rank) * vecs;  // peer memory
      for (int64_t v = lane; v < vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    }
  }
}

// Grid-stride over rows: d_row_w[r] = the sum of row r's parts partials[r, 0..parts) in order
// (the backward megakernel's router-weight gradient), 0 for a padding row (row_tok < 0), whose
// partials no tile may have written.
__global__ void sum_row_partials(const float* partials, int64_t parts, const int64_t* row_tok,
                                 float* d_row_w, int64_t rows) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    if (row_tok[r] >= 0) {
      for (int64_t j = 0; j < parts; ++j) sum = __fadd_rn(sum, partials[r * parts + j]);
    }
    d_row_w[r] = sum;
  }
}

}  // namespace mok::roles
