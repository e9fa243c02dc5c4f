// Tensor checks and small helpers shared by the apis/ translation units (torch-facing only).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

namespace mok::apis {

inline cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// A contiguous CUDA tensor of `dtype` with `dim` dims; the error names the tensor and the rule.
inline void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "mok::moe: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "mok::moe: ", name, " has dtype ", t.scalar_type(),
              ", expected ", dtype);
  TORCH_CHECK(t.dim() == dim, "mok::moe: ", name, " has shape ", t.sizes(), ", expected ", dim,
              " dims");
  TORCH_CHECK(t.is_contiguous(), "mok::moe: ", name, " must be contiguous");
}

inline at::TensorOptions opts(const at::Tensor& like, at::ScalarType dtype) {
  return like.options().dtype(dtype);
}

}  // namespace mok::apis
