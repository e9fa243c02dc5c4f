// Combine roles. Expert side: each received token's rows are summed over its slots in slot order
// k = 0..K-1 (float32, each product rounded before the add, as the reference does) and one row per
// (token, rank) is pushed into the source's buffer. Source side: a fixed-order sum over ranks
// d = 0..W-1 of the partials of the ranks the token visited, plus the shared expert, then bf16.
//
// Macrobatch rounds: when the routed rows run in rounds, `rows` holds only the window
// [row_begin, row_end) of the padded row layout. Each round adds its window's slots (slot order)
// to a local float32 accumulator, starting from the previous rounds' value; the last round pushes
// the accumulated row. The order is a pure function of the schedule and the macrobatch size.
#pragma once

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

#include "mok/common/bf16x8.cuh"
#include "mok/common/macros.cuh"
#include "mok/layout/workspace.cuh"

namespace mok::roles {

using layout::WorkspaceLayout;

struct CombineParams {
  WorkspaceLayout lay;
  const uint64_t* peer_bases;
  int rank;
  const __nv_bfloat16* rows;     // [P, H]: expert rows (padded GEMM layout)
  const int64_t* token_rows;     // [C_tok, K]: row of each slot in `rows`, -1 when not here
  const int64_t* recv_token_src; // [C_tok]: s * T_max + t, -1 when unused
  const float* slot_weights;     // [W * T_max * K] gathered router weights, or null (weight 1)
  int num_recv;                  // C_tok
  const __nv_bfloat16* rows2 = nullptr;  // [P, H] or null: a second term per row, added after
                                         // rows in float32 (d_x = dg W_gate + du W_up)
  int64_t row_begin = 0;         // `rows` holds padded rows [row_begin, row_end)
  int64_t row_end = INT64_MAX;
  const float* acc_in = nullptr; // [C_tok, H] earlier rounds' sums, or null (start from 0)
  float* acc_out = nullptr;      // [C_tok, H]: write the sum here (not the last round), or null
};

// One block per received token; each thread owns 8 consecutive hidden elements at a time.
// Writes the token's (accumulated) row to the source's combine block, or to acc_out.
__global__ void push_partials(CombineParams p) {
  const int j = blockIdx.x;
  if (j >= p.num_recv) return;
  const int64_t src = p.recv_token_src[j];
  if (src < 0) return;
  const int64_t hidden = p.lay.hidden, k_n = p.lay.topk, t_max = p.lay.max_tokens;
  const int64_t s = src / t_max, t = src % t_max;
  const int64_t* slots = p.token_rows + j * k_n;
  if (p.acc_out != nullptr && p.acc_out == p.acc_in) {  // a middle round: skip untouched tokens
    bool touched = false;
    for (int64_t k = 0; k < k_n; ++k) touched |= slots[k] >= p.row_begin && slots[k] < p.row_end;
    if (!touched) return;
  }
  float* dst = p.acc_out != nullptr
                   ? p.acc_out + static_cast<int64_t>(j) * hidden
                   : p.lay.at<float>(p.peer_bases[s], layout::Region::kCombine) +
                         (static_cast<int64_t>(p.rank) * t_max + t) * hidden;  // peer memory
  const float* start = p.acc_in != nullptr ? p.acc_in + static_cast<int64_t>(j) * hidden : nullptr;
  for (int64_t h = threadIdx.x * 8; h < hidden; h += blockDim.x * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (start != nullptr) {
      const float4 a = reinterpret_cast<const float4*>(start + h)[0];
      const float4 b = reinterpret_cast<const float4*>(start + h)[1];
      acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
      acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
    }
    for (int64_t k = 0; k < k_n; ++k) {
      const int64_t row = slots[k];
      if (row < p.row_begin || row >= p.row_end) continue;  // -1, or another round's row
      const float w = p.slot_weights ? p.slot_weights[src * k_n + k] : 1.0f;
      const int64_t at = (row - p.row_begin) * hidden + h;
      float y[8];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(p.rows + at), y);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(y[i], w));  // no FMA
      if (p.rows2 != nullptr) {
        unpack_bf16x8(*reinterpret_cast<const uint4*>(p.rows2 + at), y);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(y[i], w));
      }
    }
    reinterpret_cast<float4*>(dst + h)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    reinterpret_cast<float4*>(dst + h)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

// Grid-stride over [T, H / 8]: out[t] = bf16(sum_d partial[d][t] (if visited) + shared[t]).
__global__ void reduce_partials(WorkspaceLayout lay, uint64_t my_base, const bool* send_to,
                                const __nv_bfloat16* shared_out, __nv_bfloat16* out,
                                int num_tokens) {
  const float* partials = lay.at<const float>(my_base, layout::Region::kCombine);
  const int64_t hidden = lay.hidden, vecs = hidden / 8, n = num_tokens * vecs;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t t = i / vecs, h = (i % vecs) * 8;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < lay.num_ranks; ++d) {
      if (!send_to[t * lay.num_ranks + d]) continue;
      const float4* part =
          reinterpret_cast<const float4*>(partials + (d * lay.max_tokens + t) * hidden + h);
      const float4 a = part[0], b = part[1];
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], v[q]);
    }
    if (shared_out) {
      float sh[8];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(shared_out + t * hidden + h), sh);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], sh[q]);
    }
    *reinterpret_cast<uint4*>(out + t * hidden + h) = pack_bf16x8(acc);
  }
}

// Grid-stride over [C_tok, K]: push each slot's value (0 when the slot is not here) to its source.
__global__ void push_slots(WorkspaceLayout lay, const uint64_t* peer_bases, int rank,
                           const float* row_values, const int64_t* token_rows,
                           const int64_t* recv_token_src, int num_recv) {
  const int64_t k_n = lay.topk, n = static_cast<int64_t>(num_recv) * k_n;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t src = recv_token_src[i / k_n];
    if (src < 0) continue;
    const int64_t s = src / lay.max_tokens, t = src % lay.max_tokens, row = token_rows[i];
    float* dst = lay.at<float>(peer_bases[s], layout::Region::kSlotValues);
    dst[(static_cast<int64_t>(rank) * lay.max_tokens + t) * k_n + i % k_n] =
        row >= 0 ? row_values[row] : 0.0f;
  }
}

// Grid-stride over [T, K]: out[t][k] = sum_d values[d][t][k] over the ranks t visited.
__global__ void reduce_slots(WorkspaceLayout lay, uint64_t my_base, const bool* send_to,
                             float* out, int num_tokens) {
  const float* values = lay.at<const float>(my_base, layout::Region::kSlotValues);
  const int64_t k_n = lay.topk, n = static_cast<int64_t>(num_tokens) * k_n;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t t = i / k_n;
    float acc = 0.0f;
    for (int64_t d = 0; d < lay.num_ranks; ++d) {
      if (send_to[t * lay.num_ranks + d]) {
        acc = __fadd_rn(acc, values[(d * lay.max_tokens + t) * k_n + i % k_n]);
      }
    }
    out[i] = acc;
  }
}

}  // namespace mok::roles
