// Torch-facing op of the fused per-row backward step (registered as mok::moe_row_grad in
// python_api.cpp; fake in mok_megatron/ops/moe.py). Checks its tensors, builds the torch-free
// launch arguments and enqueues one kernel on the current stream; never syncs the host.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace mok::apis {

// d_rows, y: [P, H] bf16 (H a multiple of 8); w_rows: [P] f32; row_tok: [P] int64 (-1 = padding)
// -> (d_row_w [P] f32 = sum_h d_rows * y, exactly 0 for padding rows;
//     dy [P, H] bf16 = bf16(d_rows * w_rows[:, None])). Deterministic.
std::tuple<at::Tensor, at::Tensor> moe_row_grad(const at::Tensor& d_rows, const at::Tensor& y,
                                                const at::Tensor& w_rows,
                                                const at::Tensor& row_tok);

}  // namespace mok::apis
