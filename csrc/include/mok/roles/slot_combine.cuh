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
#include "mok/common/ptx.cuh"
#include "mok/layout/workspace.cuh"

namespace mok::roles {

using layout::Region;
using layout::WorkspaceLayout;

// Slots whose rows one thread loads at once (reduce_slot_rows): all their loads in flight before
// the first add.
constexpr int kSlotBatch = 8;

// Grid-stride over [T, H / 8]: out[t] = bf16(sum_k w[t, k] * slot_rows[t, k] + shared[t]) over
// the slots k with an expert id in [0, num_experts); weights null: unweighted (the backward's
// d_x, whose rows carry the router weight already). The host checks T <= T_max and
// T * H / 8 < 2^31, and grid_for caps the grid at 4096 blocks: i + stride stays below 2^32.
// NOTE: each thread loads a batch of kSlotBatch slots' ids, weights and 16-byte row pieces
// before it adds any, the row pieces unconditionally (slot_rows holds every (t, k) of t < T_max,
// so a skipped slot's piece, which nothing wrote, is read and not used), then adds the kept ones in slot order: the
// same sum, step for step, as one slot at a time. One slot at a time (a dependent load of the id,
// then of the row, per slot) kept about one load per thread in flight: 93 us of qwen3-30b-a3b's
// 8192-token forward, 315 of deepseek-v3's (profile_moe_h200_ep1_0d9dae0.json), against about
// 70 and 250 at the HBM ceiling.
__global__ void reduce_slot_rows(WorkspaceLayout lay, uint64_t my_base, const int64_t* topk,
                                 const float* weights, int64_t num_experts,
                                 const __nv_bfloat16* shared_out, __nv_bfloat16* out,
                                 int num_tokens) {
  ptx::chain_begin();  // launch/chain.h
  const __nv_bfloat16* slots = lay.at<const __nv_bfloat16>(my_base, Region::kSlotRows);
  const int hidden = static_cast<int>(lay.hidden), k_n = static_cast<int>(lay.topk);
  const uint32_t vecs = static_cast<uint32_t>(hidden / 8);
  const uint32_t n = static_cast<uint32_t>(num_tokens) * vecs;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t t = i / vecs, h = static_cast<int64_t>(i % vecs) * 8;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k0 = 0; k0 < k_n; k0 += kSlotBatch) {
      bool keep[kSlotBatch];
      float w[kSlotBatch];
      uint4 y[kSlotBatch];
#pragma unroll
      for (int j = 0; j < kSlotBatch; ++j) {
        const int64_t slot = t * k_n + k0 + j;
        keep[j] = false;
        w[j] = 1.0f;
        y[j] = make_uint4(0, 0, 0, 0);
        if (k0 + j < k_n) {
          const int64_t id = topk[slot];
          keep[j] = id >= 0 && id < num_experts;
          if (weights != nullptr) w[j] = weights[slot];
          y[j] = __ldg(reinterpret_cast<const uint4*>(slots + slot * hidden + h));
        }
      }
#pragma unroll
      for (int j = 0; j < kSlotBatch; ++j) {
        if (!keep[j]) continue;
        float v[8];
        unpack_bf16x8(y[j], v);
        if (weights != nullptr) {
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(v[q], w[j]));  // no FMA
        } else {
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], v[q]);
        }
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
  ptx::chain_begin();  // launch/chain.h
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
  ptx::chain_begin();  // launch/chain.h
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
