// Host launcher of the routing conversion (launch/routing.h).
#include "launch/routing.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "mok/common/macros.cuh"
#include "mok/scheduler/routing.cuh"

namespace mok::launch {

void routing_to_topk(const bool* routing_map, const void* probs, ProbType type,
                     int64_t num_tokens, int num_experts, int topk, int64_t* topk_experts,
                     float* weights, cudaStream_t stream) {
  using scheduler::kRoutingWarps;
  if (num_tokens == 0) return;
  const int64_t blocks = (num_tokens + kRoutingWarps - 1) / kRoutingWarps;
  MOK_HOST_CHECK(blocks <= 0x7fffffff, "routing_to_topk: %lld tokens are too many",
                 static_cast<long long>(num_tokens));
  const dim3 grid(static_cast<unsigned>(blocks)), block(32 * kRoutingWarps);
  switch (type) {
    case ProbType::kFloat32:
      scheduler::routing_to_topk<<<grid, block, 0, stream>>>(
          routing_map, static_cast<const float*>(probs), num_tokens, num_experts, topk,
          topk_experts, weights);
      break;
    case ProbType::kBFloat16:
      scheduler::routing_to_topk<<<grid, block, 0, stream>>>(
          routing_map, static_cast<const __nv_bfloat16*>(probs), num_tokens, num_experts, topk,
          topk_experts, weights);
      break;
    case ProbType::kFloat16:
      scheduler::routing_to_topk<<<grid, block, 0, stream>>>(
          routing_map, static_cast<const __half*>(probs), num_tokens, num_experts, topk,
          topk_experts, weights);
      break;
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::launch
