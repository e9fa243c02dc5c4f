#include "apis/routing.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "apis/tensor_checks.h"
#include "launch/routing.h"

namespace mok::apis {

std::tuple<at::Tensor, at::Tensor> routing_to_topk(const at::Tensor& probs,
                                                   const at::Tensor& routing_map, int64_t topk) {
  check(routing_map, "routing_map", at::kBool, 2);
  TORCH_CHECK(probs.dim() == 2 && probs.sizes() == routing_map.sizes() && probs.is_contiguous() &&
                  probs.device() == routing_map.device(),
              "mok::routing_to_topk: probs ", probs.sizes(), " must be a contiguous [T, E] like "
              "routing_map ", routing_map.sizes(), ", on its device");
  launch::ProbType type;
  switch (probs.scalar_type()) {
    case at::kFloat: type = launch::ProbType::kFloat32; break;
    case at::kBFloat16: type = launch::ProbType::kBFloat16; break;
    case at::kHalf: type = launch::ProbType::kFloat16; break;
    default: TORCH_CHECK(false, "mok::routing_to_topk: probs must be float32, bf16 or fp16, got ",
                         probs.scalar_type());
  }
  TORCH_CHECK(topk >= 1 && routing_map.size(1) < (int64_t{1} << 31),
              "mok::routing_to_topk: topk=", topk, " must be >= 1");
  c10::cuda::CUDAGuard guard(probs.device());
  const int64_t t = routing_map.size(0);
  auto experts = at::empty({t, topk}, opts(routing_map, at::kLong));
  auto weights = at::empty({t, topk}, opts(routing_map, at::kFloat));
  launch::routing_to_topk(routing_map.data_ptr<bool>(), probs.data_ptr(), type, t,
                          static_cast<int>(routing_map.size(1)), static_cast<int>(topk),
                          experts.data_ptr<int64_t>(), weights.data_ptr<float>(),
                          stream_of(routing_map));
  return {experts, weights};
}

}  // namespace mok::apis
