// Torch-facing blockwise FP8 ops: check tensors, build mok::launch::Fp8BlockwiseQuantizeArgs,
// launch on the current stream. Registered as mok::fp8_blockwise_quantize(_out) in python_api.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace mok::apis {

// x: [..., rows, cols], float32 / float16 / bfloat16, contiguous, CUDA; (block_rows, block_cols)
// one of (1, 128), (128, 1), (128, 128). Returns (data float8_e4m3fn with x's shape, scales
// float32 [..., rows / block_rows, cols / block_cols]).
std::tuple<at::Tensor, at::Tensor> fp8_blockwise_quantize(const at::Tensor& x, int64_t block_rows,
                                                          int64_t block_cols, bool pow2_scales);

// The same into caller-provided outputs (every byte is written).
void fp8_blockwise_quantize_out(const at::Tensor& x, int64_t block_rows, int64_t block_cols,
                                bool pow2_scales, const at::Tensor& data,
                                const at::Tensor& scales);

}  // namespace mok::apis
