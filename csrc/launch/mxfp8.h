// Torch-free host launcher for MXFP8 quantisation: plain pointers, sizes and a stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok::launch {

enum class Mxfp8InputType : int { kFloat32, kFloat16, kBFloat16 };

struct Mxfp8QuantizeArgs {
  const void* input = nullptr;  // [num_rows, num_cols], contiguous; batch dims flattened into rows
  Mxfp8InputType input_type = Mxfp8InputType::kBFloat16;
  int64_t num_rows = 0;
  int64_t num_cols = 0;
  // Rowwise outputs (both null to skip): data [num_rows, num_cols], scales [num_rows, num_cols/32].
  uint8_t* row_data = nullptr;
  uint8_t* row_scales = nullptr;
  // Colwise outputs (both null to skip): data [num_rows, num_cols], scales [num_rows/32, num_cols].
  uint8_t* col_data = nullptr;
  uint8_t* col_scales = nullptr;
};

// Enqueues one kernel on `stream` (no host synchronisation). Throws mok::Error on a broken
// precondition or a failed launch.
void mxfp8_quantize(const Mxfp8QuantizeArgs& args, cudaStream_t stream);

}  // namespace mok::launch
