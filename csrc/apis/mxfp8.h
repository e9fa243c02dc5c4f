// Torch-facing MXFP8 ops: check tensors, build mok::launch::Mxfp8QuantizeArgs, launch on the
// current stream. Registered as mok::mxfp8_quantize / mok::mxfp8_quantize_out in python_api.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace mok::apis {

// w: [..., rows, cols], float32 / float16 / bfloat16, contiguous, CUDA.
// Returns (row_data, row_scales, col_data, col_scales): data float8_e4m3fn with w's shape;
// row_scales uint8 [..., rows, cols/32]; col_scales uint8 [..., rows/32, cols]. An output that
// was not asked for is an empty [0] tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mxfp8_quantize(const at::Tensor& w,
                                                                          bool rowwise,
                                                                          bool colwise);

// The same into caller-provided outputs (every byte of a requested output is written); outputs
// not asked for are ignored and may be empty.
void mxfp8_quantize_out(const at::Tensor& w, bool rowwise, bool colwise,
                        const at::Tensor& row_data, const at::Tensor& row_scales,
                        const at::Tensor& col_data, const at::Tensor& col_scales);

}  // namespace mok::apis
