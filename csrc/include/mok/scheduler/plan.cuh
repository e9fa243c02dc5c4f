// The device plan: the schedule's rows laid out padded (each local expert's group starts at a
// multiple of kGroupAlign), cut into macrobatch rounds and, per round, into m-tiles; with each
// padded row's source, destination slot and router weight. Integer-for-integer equal to stage
// 1's torch plan (mok_megatron/functional/cuda/plan.py: padded_plan, make_rounds); the
// megakernel reads row_src / row_dst / tile_count / tiles (layout/mega.cuh).
//   plan_experts     (one block; E_l and R are small) group starts and ends, first rounds, the
//                    tile table of every round
//   plan_fill        padded-row arrays to "padding" (-1 / 0)
//   plan_rows        per schedule row: its padded row, and that row's token, weight, src, dst
//   plan_token_rows  per received (token, slot): its padded row
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/layout/mega.cuh"
#include "mok/scheduler/plan_params.cuh"

namespace mok::scheduler {


// One block. Thread 0 scans the groups (E_l is at most a few hundred); then one thread per round
// writes that round's tiles.
__global__ void plan_experts(PlanParams p) {
  const int e_l = static_cast<int>(p.shape.num_local_experts);
  const int64_t ring = p.shape.ring_rows();
  const int rounds = static_cast<int>(p.shape.num_rounds());
  if (threadIdx.x == 0) {
    int64_t start = 0;
    for (int e = 0; e < e_l; ++e) {
      const int64_t rows = p.expert_offsets[e + 1] - p.expert_offsets[e];
      const int64_t padded = (rows + layout::kGroupAlign - 1) / layout::kGroupAlign *
                             layout::kGroupAlign;
      p.pad_start[e] = start;
      p.expert_rows[e] = rows;
      p.first_round[e] = rows > 0 ? static_cast<int32_t>(start / ring) : -1;
      start += padded;
      p.offs[e] = static_cast<int32_t>(start);
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < rounds; r += blockDim.x) {
    const int64_t lo = r * ring, hi = lo + ring;
    int count = 0;
    for (int e = 0; e < e_l; ++e) {
      const int64_t begin = max(p.pad_start[e], lo);
      const int64_t end = min(static_cast<int64_t>(p.offs[e]), hi);
      for (int64_t b = begin; b < end; b += layout::kBlockM, ++count) {
        layout::MegaTile tile;
        tile.expert = e;
        tile.row_begin = static_cast<int32_t>(b - lo);
        tile.row_end = static_cast<int32_t>(min(b + layout::kBlockM, end) - lo);
        tile.reserved = 0;
        p.tiles[static_cast<int64_t>(r) * p.shape.max_tiles() + count] = tile;
      }
    }
    p.tile_count[r] = count;
  }
}

// Grid-stride over [R * ring].
__global__ void plan_fill(PlanParams p) {
  const int64_t n = p.shape.num_rounds() * p.shape.ring_rows();
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p.row_tok[i] = -1;
    p.w_rows[i] = 0.0f;
    p.row_src[i] = -1;
    p.row_dst[i] = -1;
  }
}

// Grid-stride over the C schedule rows (after plan_experts and plan_fill).
__global__ void plan_rows(PlanParams p) {
  const int64_t cap = p.shape.row_capacity, e_l = p.shape.num_local_experts;
  for (int64_t c = blockIdx.x * blockDim.x + threadIdx.x; c < cap; c += gridDim.x * blockDim.x) {
    const int64_t e = p.row_expert[c];
    if (e >= e_l) {  // unused row
      p.prow[c] = p.shape.padded_rows();
      continue;
    }
    const int64_t row = c - p.expert_offsets[e] + p.pad_start[e];
    const int64_t src = p.row_src_rank[c] * p.max_tokens + p.row_src_token[c];
    const int64_t slot = src * p.topk + p.row_src_slot[c];
    p.prow[c] = row;
    p.row_tok[row] = p.row_token_idx[c];
    p.w_rows[row] = p.global_weights[slot];
    p.row_src[row] = src;
    p.row_dst[row] = slot;
  }
}

// Grid-stride over [C_tok * K] (after plan_rows).
__global__ void plan_token_rows(PlanParams p) {
  const int64_t n = static_cast<int64_t>(p.token_capacity) * p.topk;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t c = p.token_rows[i];
    p.token_rows_padded[i] = c >= 0 ? p.prow[c] : -1;
  }
}

}  // namespace mok::scheduler
