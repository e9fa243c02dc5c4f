// Dispatch roles: stage this rank's routing into its symmetric buffer, gather every rank's routing
// (the routing all-gather), and pull each received token once from its source rank's buffer.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/common/fp8_blockwise.cuh"
#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/layout/workspace.cuh"

namespace mok::roles {

using layout::Region;
using layout::WorkspaceLayout;

// Grid-stride over [T_max, K]: rows >= num_tokens are padded (-1 ids, 0 weights).
__global__ void stage_routing(WorkspaceLayout lay, uint64_t my_base, const int64_t* topk,
                              const float* weights, int num_tokens) {
  ptx::chain_begin();  // launch/chain.h
  int64_t* dst_topk = lay.at<int64_t>(my_base, Region::kRoutingTopk);
  float* dst_weights = lay.at<float>(my_base, Region::kRoutingWeights);
  const int64_t n = lay.max_tokens * lay.topk, live = static_cast<int64_t>(num_tokens) * lay.topk;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    dst_topk[i] = i < live ? topk[i] : -1;
    dst_weights[i] = i < live ? weights[i] : 0.0f;
  }
}

// Grid-stride over [W, T_max, K]: global_topk[s] / global_weights[s] from rank s's buffer.
__global__ void gather_routing(WorkspaceLayout lay, const uint64_t* peer_bases,
                               int64_t* global_topk, float* global_weights) {
  ptx::chain_begin();  // launch/chain.h
  const int64_t per_rank = lay.max_tokens * lay.topk, n = lay.num_ranks * per_rank;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint64_t base = peer_bases[i / per_rank];
    global_topk[i] = lay.at<const int64_t>(base, Region::kRoutingTopk)[i % per_rank];
    global_weights[i] = lay.at<const float>(base, Region::kRoutingWeights)[i % per_rank];
  }
}

// One block per received token j: recv[j] = the first `width` columns of tokens[t] of source
// rank s (zeros when unused); recv rows are `width` wide, the tokens region's `hidden`.
// NOTE: width <= hidden, both multiples of 8, so every row is whole 16-byte vectors.
__global__ void pull_tokens(WorkspaceLayout lay, const uint64_t* peer_bases,
                            const int64_t* recv_token_src, __nv_bfloat16* recv, int num_recv,
                            int64_t width) {
  ptx::chain_begin();  // launch/chain.h
  const int j = blockIdx.x;
  if (j >= num_recv) return;
  const int64_t src = recv_token_src[j];
  const int64_t vecs = width / 8, stride = lay.hidden / 8;
  uint4* dst = reinterpret_cast<uint4*>(recv + static_cast<int64_t>(j) * width);
  if (src < 0) {
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int64_t s = src / lay.max_tokens, t = src % lay.max_tokens;
  const uint4* row =
      lay.at<const uint4>(peer_bases[s], Region::kTokens) + t * stride;  // peer memory
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = row[v];
}

// One block per padded row p: out[p] = src[row_tok[p]], or zeros where row_tok[p] < 0 (padding).
// Local (no peer memory): the received tokens in the expert GEMMs' row order.
__global__ void gather_rows(const __nv_bfloat16* src, const int64_t* row_tok, __nv_bfloat16* out,
                            int64_t hidden) {
  ptx::chain_begin();  // launch/chain.h
  const int64_t p = blockIdx.x, tok = row_tok[p], vecs = hidden / 8;
  uint4* dst = reinterpret_cast<uint4*>(out + p * hidden);
  if (tok < 0) {
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4* row = reinterpret_cast<const uint4*>(src + tok * hidden);
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = row[v];
}

// One block per padded row p: the packed FP8 token row src[row_tok[p]] (common/fp8_blockwise.cuh)
// split into data[p] (`hidden` e4m3 bytes) and scales[p] (hidden / 128 float32), both
// contiguous (the FP8 GEMM's operand); where row_tok[p] < 0 (padding), an all-zero row's
// quantisation: data 0, scales 1.
__global__ void gather_rows_fp8(const uint8_t* src, const int64_t* row_tok, uint8_t* data,
                                float* scales, int64_t hidden) {
  ptx::chain_begin();  // launch/chain.h
  const int64_t p = blockIdx.x, tok = row_tok[p], vecs = hidden / 16;
  const int64_t num_scales = hidden / fp8_blockwise::kBlock;
  uint4* dst = reinterpret_cast<uint4*>(data + p * hidden);
  float* dst_scales = scales + p * num_scales;
  if (tok < 0) {
    // NOTE: 1 with or without power-of-two scales (block_scale's all-zero rule)
    const float zero_scale = fp8_blockwise::block_scale(0u, false).scale;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
    for (int64_t i = threadIdx.x; i < num_scales; i += blockDim.x) dst_scales[i] = zero_scale;
    return;
  }
  const uint8_t* row = src + tok * fp8_blockwise::packed_row_bytes(hidden);
  const uint4* row_data = reinterpret_cast<const uint4*>(row);
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = row_data[v];
  const float* row_scales =
      reinterpret_cast<const float*>(row + fp8_blockwise::packed_scales_offset(hidden));
  for (int64_t i = threadIdx.x; i < num_scales; i += blockDim.x) dst_scales[i] = row_scales[i];
}

}  // namespace mok::roles
