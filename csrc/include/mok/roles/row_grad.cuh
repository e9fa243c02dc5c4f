// Per-row gradients at the start of the MoE backward, from one read of d_rows and y ([P, H] bf16):
//   d_row_w[p] = sum_h d_rows[p, h] * y[p, h]   (float32; exactly 0 for padding rows)
//   dy[p, h]   = bf16_rn(d_rows[p, h] * w_rows[p])   (every row, padding included)
//
// Work split: one block per row; thread t owns the 16-byte vectors v = t + i * blockDim.x,
// i = 0..kVecsPerThread-1, all loaded before any is used.
// NOTE: the sum order is a pure function of H (the launcher picks blockDim.x and kVecsPerThread
// from H alone): each vector's 8 products summed as a fixed pairwise tree, the vectors added to
// the thread's sum in i order, then a xor-butterfly over each warp's lanes and the same butterfly
// over the warps' sums. Every product is __fmul_rn and every add __fadd_rn, so the compiler cannot
// contract them into FMAs; no atomics. Torch-free.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::row_grad {

constexpr int kVec = 8;                                 // bf16 elements per 16-byte vector
constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 512;                        // blockDim.x never exceeds this
constexpr int kMaxWarps = kMaxThreads / kWarpSize;
constexpr int kMaxVecsPerThread = 8;
constexpr int kPreferredThreads = 256;                  // grow kVecsPerThread before threads
constexpr int64_t kMaxHidden = int64_t{kMaxThreads} * kMaxVecsPerThread * kVec;  // 32768

struct RowGradParams {
  const __nv_bfloat16* d_rows;  // [num_rows, hidden]
  const __nv_bfloat16* y;       // [num_rows, hidden]
  const float* w_rows;          // [num_rows]
  const int64_t* row_tok;       // [num_rows], -1 for padding rows
  float* d_row_w;               // [num_rows]
  __nv_bfloat16* dy;            // [num_rows, hidden]
  int64_t hidden;               // a multiple of kVec
};

// A row's 8 products, summed as ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)).
MOK_DEVICE float dot_bf16x8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
  float pair[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 fa = __bfloat1622float2(a2[j]), fb = __bfloat1622float2(b2[j]);
    pair[j] = __fadd_rn(__fmul_rn(fa.x, fb.x), __fmul_rn(fa.y, fb.y));
  }
  return __fadd_rn(__fadd_rn(pair[0], pair[1]), __fadd_rn(pair[2], pair[3]));
}

// bf16_rn(float(a) * w) for each of the 8 elements (the product rounded to float32 first).
MOK_DEVICE uint4 scale_bf16x8(const uint4& a, float w) {
  uint4 out;
  const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
  __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 fa = __bfloat1622float2(a2[j]);
    o2[j] = __floats2bfloat162_rn(__fmul_rn(fa.x, w), __fmul_rn(fa.y, w));
  }
  return out;
}

// Butterfly over the 32 lanes; a + b == b + a bitwise, so every lane ends with the same sum.
MOK_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// The block's sum, valid in thread 0. blockDim.x must be a multiple of 32 and <= kMaxThreads.
MOK_DEVICE float block_sum(float v) {
  __shared__ float warp_sums[kMaxWarps];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp != 0) return 0.0f;
  return warp_sum(lane < static_cast<int>(blockDim.x / kWarpSize) ? warp_sums[lane] : 0.0f);
}

// Grid: one block per row. blockDim.x: a multiple of 32 with
// blockDim.x * kVecsPerThread >= hidden / kVec (the launcher's pick, a function of hidden).
template <int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) row_grad_kernel(RowGradParams p) {
  static_assert(kVecsPerThread >= 1 && kVecsPerThread <= kMaxVecsPerThread);
  const int64_t row = blockIdx.x;
  const int num_vecs = static_cast<int>(p.hidden / kVec);
  const bool live = p.row_tok[row] >= 0;  // block-uniform
  const float w = p.w_rows[row];
  const uint4* d_vecs = reinterpret_cast<const uint4*>(p.d_rows + row * p.hidden);
  const uint4* y_vecs = reinterpret_cast<const uint4*>(p.y + row * p.hidden);
  uint4* dy_vecs = reinterpret_cast<uint4*>(p.dy + row * p.hidden);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 d[kVecsPerThread], y[kVecsPerThread];
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
    d[i] = v < num_vecs ? d_vecs[v] : zero;
    y[i] = live && v < num_vecs ? y_vecs[v] : zero;  // padding rows' y is never read
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
    if (v < num_vecs) {
      dy_vecs[v] = scale_bf16x8(d[i], w);
      sum = __fadd_rn(sum, dot_bf16x8(d[i], y[i]));
    }
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) p.d_row_w[row] = live ? sum : 0.0f;
}

}  // namespace mok::row_grad
