// SwiGLU between the two expert GEMMs, float32 math, bf16 in and out: a = silu(g) * u, with the
// gate and up outputs g, u [P, I] given as two strided row sets, or as the two interleaved halves
// of one [P, 2I] tensor (8 gate columns, then the matching 8 up columns: the layout of the fused
// gate/up weight, ops.interleave_gate_up). Backward:
// dg = da * u * s * (1 + g * (1 - s)), du = da * g * s, with s = sigmoid(g) (the reference's
// formula, term for term).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/common/bf16x8.cuh"
#include "mok/common/macros.cuh"

namespace mok::roles {

MOK_DEVICE float sigmoid_f32(float g) { return 1.0f / (1.0f + __expf(-g)); }

// sigmoid with a fast reciprocal (1/inf = 0 keeps the limits): no subroutine call, where IEEE
// division has one for its slow path, and the backward megakernel's epilogue may not call (a
// call makes ptxas ignore setmaxnreg and serialise wgmma).
MOK_DEVICE float sigmoid_nocall(float g) { return __fdividef(1.0f, 1.0f + __expf(-g)); }

// The backward of one element: (dg, du) from da and (g, u), as the header says.
// NOTE: also the backward megakernel's epilogue (roles/megakernel_gemm.cuh): one expression, so
// both give bitwise the same d_h.
MOK_DEVICE void swiglu_grad(float da, float g, float u, float& dg, float& du) {
  const float s = sigmoid_nocall(g);
  dg = __fmul_rn(__fmul_rn(__fmul_rn(da, u), s), __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
  du = __fmul_rn(__fmul_rn(da, g), s);
}

// g, u: [P, I] bf16 with row strides (elements) g_ld, u_ld, so they may be two halves of one
// [P, 2I] buffer or two separate tensors; dg, du likewise. Column c of g, u, dg and du sits at
// (c / 8) * blk_stride + c % 8: blk_stride 8 is contiguous columns, 16 the interleaved halves
// (g = h, u = h + 8). a and da are [P, I] contiguous. kVec elements per thread step (8 = 16-byte
// accesses when I and every stride are multiples of 8; else 1).
struct SwigluParams {
  const __nv_bfloat16* g;
  const __nv_bfloat16* u;
  int64_t g_ld, u_ld;
  int64_t num_rows, inter;
  int64_t blk_stride;
};

MOK_DEVICE int64_t swiglu_col(const SwigluParams& p, int64_t c) {
  return (c >> 3) * p.blk_stride + (c & 7);
}

template <int kVec>
MOK_DEVICE void load_vec(const __nv_bfloat16* p, float* out) {
  if constexpr (kVec == 8) {
    unpack_bf16x8(*reinterpret_cast<const uint4*>(p), out);
  } else {
    out[0] = __bfloat162float(*p);
  }
}

template <int kVec>
MOK_DEVICE void store_vec(__nv_bfloat16* p, const float* in) {
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(p) = pack_bf16x8(in);
  } else {
    *p = __float2bfloat16_rn(in[0]);
  }
}

// Grid-stride over [P, I / kVec]: a = silu(g) * u ([P, I] contiguous).
template <int kVec>
__global__ void swiglu_forward(SwigluParams p, __nv_bfloat16* a) {
  const int64_t per_row = p.inter / kVec, n = p.num_rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * kVec, cs = swiglu_col(p, c);
    float g[kVec], u[kVec], out[kVec];
    load_vec<kVec>(p.g + r * p.g_ld + cs, g);
    load_vec<kVec>(p.u + r * p.u_ld + cs, u);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = __fmul_rn(__fmul_rn(g[k], sigmoid_f32(g[k])), u[k]);
    store_vec<kVec>(a + r * p.inter + c, out);
  }
}

// Grid-stride over [P, I / kVec]: dg, du (row strides dg_ld, du_ld) from da [P, I] contiguous.
template <int kVec>
__global__ void swiglu_backward(SwigluParams p, const __nv_bfloat16* da, __nv_bfloat16* dg,
                                int64_t dg_ld, __nv_bfloat16* du, int64_t du_ld) {
  const int64_t per_row = p.inter / kVec, n = p.num_rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * kVec, cs = swiglu_col(p, c);
    float g[kVec], u[kVec], d[kVec], out_g[kVec], out_u[kVec];
    load_vec<kVec>(p.g + r * p.g_ld + cs, g);
    load_vec<kVec>(p.u + r * p.u_ld + cs, u);
    load_vec<kVec>(da + r * p.inter + c, d);
#pragma unroll
    for (int k = 0; k < kVec; ++k) swiglu_grad(d[k], g[k], u[k], out_g[k], out_u[k]);
    store_vec<kVec>(dg + r * dg_ld + cs, out_g);
    store_vec<kVec>(du + r * du_ld + cs, out_u);
  }
}

}  // namespace mok::roles
