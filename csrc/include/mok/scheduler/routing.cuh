// Kernel: Megatron's router output, a [T, E] routing map and probabilities, to MoK's [T, K]
// slots (mok_megatron/megatron/token_dispatcher.py routing_to_topk, which it replaces on CUDA):
// each token's chosen experts in ascending id, the first K of them, with their probability as
// float32; empty slots -1 / 0. One warp per token, 32 experts per step; no atomics, so the slots
// are a function of the inputs only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::scheduler {

constexpr int kRoutingWarps = 8;  // tokens per block of routing_to_topk

// Exact widening to float32 (the build disables the implicit bf16 / fp16 conversions).
MOK_DEVICE float prob_to_float(float v) { return v; }
MOK_DEVICE float prob_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
MOK_DEVICE float prob_to_float(__half v) { return __half2float(v); }

template <class Prob>
__global__ void routing_to_topk(const bool* routing_map, const Prob* probs, int64_t num_tokens,
                                int num_experts, int topk, int64_t* topk_experts,
                                float* weights) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRoutingWarps + threadIdx.x / 32;
  if (t >= num_tokens) return;  // warp-uniform
  const bool* row = routing_map + t * num_experts;
  int64_t* experts_out = topk_experts + t * topk;
  float* weights_out = weights + t * topk;
  int found = 0;
  for (int base = 0; base < num_experts && found < topk; base += 32) {
    const int e = base + lane;
    const bool chosen = e < num_experts && row[e];
    const uint32_t mask = __ballot_sync(0xffffffffu, chosen);
    // This lane's slot: the chosen experts before it, in this step and the earlier ones.
    const int slot = found + __popc(mask & ((1u << lane) - 1u));
    if (chosen && slot < topk) {
      experts_out[slot] = e;
      weights_out[slot] = prob_to_float(probs[t * num_experts + e]);
    }
    found += __popc(mask);
  }
  for (int slot = found + lane; slot < topk; slot += 32) {
    experts_out[slot] = -1;
    weights_out[slot] = 0.0f;
  }
}

}  // namespace mok::scheduler
