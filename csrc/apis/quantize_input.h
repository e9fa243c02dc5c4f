// The input element types the quantisation ops take (MXFP8 and blockwise FP8), from a tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "launch/mxfp8.h"

namespace mok::apis {

// `op` and `name` go into the error: e.g. "mok::mxfp8_quantize", "w".
inline launch::Mxfp8InputType quantize_input_type(const at::Tensor& x, const char* op,
                                                  const char* name) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return launch::Mxfp8InputType::kFloat32;
    case at::kHalf:
      return launch::Mxfp8InputType::kFloat16;
    case at::kBFloat16:
      return launch::Mxfp8InputType::kBFloat16;
    default:
      break;
  }
  TORCH_CHECK(false, op, ": ", name, ".dtype=", x.scalar_type(),
              " is not supported; use bfloat16, float16 or float32");
  return launch::Mxfp8InputType::kBFloat16;  // unreachable
}

}  // namespace mok::apis
