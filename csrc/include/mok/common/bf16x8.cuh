// Eight bf16 values in one 16-byte vector (uint4): unpack to float32 and pack back (round to
// nearest even). Shared by the element-wise roles that move rows 16 bytes at a time.
#pragma once

#include <cuda_bf16.h>

#include "mok/common/macros.cuh"

namespace mok {

MOK_DEVICE void unpack_bf16x8(uint4 v, float* out) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

MOK_DEVICE uint4 pack_bf16x8(const float* in) {
  uint4 v;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return v;
}

}  // namespace mok
