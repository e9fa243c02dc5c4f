// Torch-free host launcher for blockwise FP8 quantisation: plain pointers, sizes and a stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "launch/mxfp8.h"  // Mxfp8InputType: the same three input types

namespace mok::launch {

struct Fp8BlockwiseQuantizeArgs {
  const void* input = nullptr;  // [num_rows, num_cols], contiguous; batch dims flattened into rows
  Mxfp8InputType input_type = Mxfp8InputType::kBFloat16;
  int64_t num_rows = 0;
  int64_t num_cols = 0;
  int block_rows = 1;  // (1, 128), (128, 1) or (128, 128)
  int block_cols = 128;
  bool pow2 = false;
  uint8_t* data = nullptr;  // [num_rows, num_cols] float8_e4m3fn
  float* scales = nullptr;  // [num_rows / block_rows, num_cols / block_cols]
  // (1, 128) blocks only: a device int32; rows >= *row_limit are neither read nor written
  // (the grouped GEMMs' rows past offs[-1]). Null: every row.
  const int32_t* row_limit = nullptr;
};

// Enqueues one kernel on `stream` (no host synchronisation). Throws mok::Error on a broken
// precondition or a failed launch.
void fp8_blockwise_quantize(const Fp8BlockwiseQuantizeArgs& args, cudaStream_t stream);

}  // namespace mok::launch
