// Torch-free host launcher of the fused per-row backward step (mok/roles/row_grad.cuh): pointers,
// sizes and a stream. Enqueues one kernel (no host synchronisation); throws mok::Error on a broken
// precondition or a failed launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok::launch {

struct MoeRowGradArgs {
  const void* d_rows = nullptr;     // [num_rows, hidden] bf16, 16-byte aligned
  const void* y = nullptr;          // [num_rows, hidden] bf16, 16-byte aligned
  const float* w_rows = nullptr;    // [num_rows] router weight of each row
  const int64_t* row_tok = nullptr; // [num_rows], -1 for padding rows
  float* d_row_w = nullptr;         // [num_rows] out: sum_h d_rows * y, 0 for padding rows
  void* dy = nullptr;               // [num_rows, hidden] bf16 out: bf16(d_rows * w_rows)
  int64_t num_rows = 0;
  int64_t hidden = 0;               // a multiple of 8, at most 32768
};

void moe_row_grad(const MoeRowGradArgs& args, cudaStream_t stream);

}  // namespace mok::launch
