// Torch-free launcher of the routing conversion (scheduler/routing.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok::launch {

enum class ProbType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// routing_map [T, E] bool and probs [T, E] (of `type`), contiguous -> topk_experts [T, K] int64
// and weights [T, K] float32 (preallocated).
void routing_to_topk(const bool* routing_map, const void* probs, ProbType type,
                     int64_t num_tokens, int num_experts, int topk, int64_t* topk_experts,
                     float* weights, cudaStream_t stream);

}  // namespace mok::launch
