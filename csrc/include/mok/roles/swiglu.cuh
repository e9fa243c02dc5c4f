// SwiGLU between the two expert GEMMs, float32 math, bf16 in and out. The gate/up GEMM writes
// gu = [g | u] ([P, 2I]); a = silu(g) * u. Backward: dg = da * u * s * (1 + g * (1 - s)),
// du = da * g * s, with s = sigmoid(g) (the reference's formula, term for term).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::roles {

MOK_DEVICE float sigmoid_f32(float g) { return 1.0f / (1.0f + __expf(-g)); }

// Grid-stride over [P, I].
__global__ void swiglu_forward(const __nv_bfloat16* gu, __nv_bfloat16* a, int64_t num_rows,
                               int64_t inter) {
  const int64_t n = num_rows * inter;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float g = __bfloat162float(gu[r * 2 * inter + c]);
    const float u = __bfloat162float(gu[r * 2 * inter + inter + c]);
    a[i] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(g, sigmoid_f32(g)), u));
  }
}

// Grid-stride over [P, I]: dgu = [dg | du].
__global__ void swiglu_backward(const __nv_bfloat16* da, const __nv_bfloat16* gu,
                                __nv_bfloat16* dgu, int64_t num_rows, int64_t inter) {
  const int64_t n = num_rows * inter;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float g = __bfloat162float(gu[r * 2 * inter + c]);
    const float u = __bfloat162float(gu[r * 2 * inter + inter + c]);
    const float d = __bfloat162float(da[i]);
    const float s = sigmoid_f32(g);
    const float dg = __fmul_rn(__fmul_rn(__fmul_rn(d, u), s), __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
    dgu[r * 2 * inter + c] = __float2bfloat16_rn(dg);
    dgu[r * 2 * inter + inter + c] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(d, g), s));
  }
}

}  // namespace mok::roles
