// Torch-facing op of the routing conversion (registered as mok::routing_to_topk in
// python_api.cpp; wrapper, autograd and fake in mok_megatron/ops/moe.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace mok::apis {

// probs [T, E] float32 / bf16 / fp16, routing_map [T, E] bool -> (topk_experts [T, K] int64,
// weights [T, K] float32).
std::tuple<at::Tensor, at::Tensor> routing_to_topk(const at::Tensor& probs,
                                                   const at::Tensor& routing_map, int64_t topk);

}  // namespace mok::apis
