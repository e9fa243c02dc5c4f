// The device plan: the schedule's rows laid out padded (each local expert's group starts at a
// multiple of kGroupAlign), cut into macrobatch rounds and, per round, into m-tiles; with each
// padded row's source, destination slot and router weight. Integer-for-integer equal to stage
// 1's torch plan (mok_megatron/functional/cuda/plan.py: padded_plan, make_rounds); the
// megakernel reads row_src / row_dst / tile_count / tiles (layout/mega.cuh).
//   plan_experts     (one block; E_l and R are small) block scans: group starts and ends, first
//                    rounds, the tile table of every round
//   plan_fill        padded-row arrays to "padding" (-1 / 0)
//   plan_rows        per schedule row: its padded row, and that row's token, weight, src, dst
//   plan_token_rows  per received (token, slot): its padded row
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/layout/mega.cuh"
#include "mok/scheduler/plan_params.cuh"

namespace mok::scheduler {

constexpr int kPlanThreads = 512;

// One block of kPlanThreads: block-wide scans over the groups (in chunks of kPlanThreads, with a
// carry), then, round by round, each group's m-tiles written at its scanned offset.
__global__ void plan_experts(PlanParams p) {
  ptx::chain_begin();  // launch/chain.h
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int e_l = static_cast<int>(p.shape.num_local_experts);
  const int64_t ring = p.shape.ring_rows(), max_tiles = p.shape.max_tiles();
  int64_t carry = 0;
  for (int base = 0; base < e_l; base += kPlanThreads) {
    const int e = base + threadIdx.x;
    const int64_t rows = e < e_l ? p.expert_offsets[e + 1] - p.expert_offsets[e] : 0;
    const int64_t padded = (rows + layout::kGroupAlign - 1) / layout::kGroupAlign *
                           layout::kGroupAlign;
    int64_t start, total;
    Scan(scan_storage).ExclusiveSum(padded, start, total);
    start += carry;
    if (e < e_l) {
      p.pad_start[e] = start;
      p.expert_rows[e] = rows;
      p.first_round[e] = rows > 0 ? static_cast<int32_t>(start / ring) : -1;
      p.offs[e] = static_cast<int32_t>(start + padded);
    }
    carry += total;
    __syncthreads();  // scan_storage is reused
  }
  for (int r = 0; r < p.shape.num_rounds(); ++r) {
    const int64_t lo = r * ring, hi = lo + ring;
    int64_t first_tile = 0;
    for (int base = 0; base < e_l; base += kPlanThreads) {
      const int e = base + threadIdx.x;
      int64_t begin = 0, end = 0;
      if (e < e_l) {
        begin = max(p.pad_start[e], lo);
        end = min(static_cast<int64_t>(p.offs[e]), hi);
      }
      const int64_t count = end > begin ? (end - begin + layout::kBlockM - 1) / layout::kBlockM : 0;
      int64_t at, total;
      Scan(scan_storage).ExclusiveSum(count, at, total);
      layout::MegaTile* tiles = p.tiles + r * max_tiles + first_tile + at;
      for (int64_t b = begin, i = 0; b < end; b += layout::kBlockM, ++i) {
        tiles[i] = layout::MegaTile{e, static_cast<int32_t>(b - lo),
                                    static_cast<int32_t>(min(b + layout::kBlockM, end) - lo), 0};
      }
      first_tile += total;
      __syncthreads();
    }
    if (threadIdx.x == 0) p.tile_count[r] = static_cast<int32_t>(first_tile);
  }
}

// Grid-stride over [R * ring].
__global__ void plan_fill(PlanParams p) {
  ptx::chain_begin();  // launch/chain.h
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
  ptx::chain_begin();  // launch/chain.h
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
  ptx::chain_begin();  // launch/chain.h
  const int64_t n = static_cast<int64_t>(p.token_capacity) * p.topk;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t c = p.token_rows[i];
    p.token_rows_padded[i] = c >= 0 ? p.prow[c] : -1;
  }
}

}  // namespace mok::scheduler
