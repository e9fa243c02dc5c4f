// The blockwise FP8 format, defined once for host and device code (mirrors
// mok_megatron/ops/fp8_blockwise.py, whose docstring states the rules).
//
// Blocks of (kBlockRows, kBlockCols) in {(1, 128), (128, 1), (128, 128)} share one float32
// scale s, x ~= e4m3 data * s. For a block with amax = max|x|: non-finite -> s = NaN, data NaN;
// all zero -> s = 1; else s = max(amax / 448, 2^-126) and data = e4m3(clamp(x / s)), or with
// power-of-two scales s = 2^e (the smallest e with amax <= 448 * 2^e, clamped to [-126, 120])
// and data = e4m3(clamp(x * 2^-e)).
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/common/mxfp8.cuh"

namespace mok::fp8_blockwise {

constexpr int kBlock = 128;
constexpr int kMinExponent = -126;
constexpr int kMaxExponent = 120;  // enough for any finite float32 amax
constexpr float kDataMax = mxfp8::kDataMax;
constexpr uint8_t kDataNaN = mxfp8::kDataNaN;
constexpr float kMinScale = 1.1754943508222875e-38f;  // 2^-126: s stays a normal float32

// x / s rounded to nearest even (IEEE division), for finite x and a normal s > 0 with x / s
// below 2^120, the quantiser's two divisions (amax / 448, and x / s of an element of the block
// whose scale s is), without the subroutine call of the compiler's division: its slow path is a
// CALL, and a call anywhere in a kernel that issues wgmma makes ptxas serialise them (the FP8
// megakernel quantises act in its GEMM epilogue). s is scaled by a power of two into [1, 2) and
// x with it (exact), then the compiler's own fast-path sequence (a reciprocal, refined once; the
// quotient, corrected once) gives the correctly rounded quotient, as it does wherever the
// division's range check (FCHK) lets it. The one case outside that check: x * 2^-e below the
// normal range, where |x / s| < 2^-125: any rounding of it quantises to the same e4m3 (+-0) and
// clamps to the same scale. +-0 keeps its sign.
#if defined(__CUDACC__)
// div_rn's divisor part, once for the many x of one s (a block's elements).
struct Divider {
  float f;   // 2^-e for s = 1.m * 2^e
  float ss;  // s * f, in [1, 2)
  float r;   // 1 / ss, refined once
  MOK_DEVICE explicit Divider(float s) {
    const int e = static_cast<int>((__float_as_uint(s) >> 23) & 0xffu) - 127;
    f = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
    ss = __fmul_rn(s, f);
    const float r0 = __fdividef(1.0f, ss);  // the approximate reciprocal (MUFU.RCP)
    r = __fmaf_rn(__fmaf_rn(-ss, r0, 1.0f), r0, r0);
  }
  MOK_DEVICE float operator()(float x) const {
    const float xs = __fmul_rn(x, f);
    const float q = __fmul_rn(xs, r);
    const float d = __fmaf_rn(__fmaf_rn(-ss, q, xs), r, q);
    return xs == 0.0f ? xs : d;
  }
};
#endif

MOK_HOST_DEVICE float div_rn(float x, float s) {
#if defined(__CUDA_ARCH__)
  return Divider(s)(x);
#else
  return x / s;
#endif
}

struct BlockScale {
  float scale;   // the stored s (NaN for a non-finite block, 1 for an all-zero one)
  float factor;  // 2^-e to multiply by (pow2), or the divisor s (otherwise)
  bool nonfinite;
};

// The scale of a block whose |x| maximum has float32 bits amax_bits (sign bit clear).
MOK_HOST_DEVICE BlockScale block_scale(uint32_t amax_bits, bool pow2) {
  if (amax_bits >= mxfp8::kFloatInfBits) {
    return BlockScale{mxfp8::float_from_bits(0x7FC00000u), 1.0f, true};
  }
  const bool zero = amax_bits == 0;
  if (pow2) {
    int e = mxfp8::scale_exponent(amax_bits);  // its own clamp is [-127, 127]
    e = e < kMinExponent ? kMinExponent : (e > kMaxExponent ? kMaxExponent : e);
    return BlockScale{zero ? 1.0f : mxfp8::exp2_int(e), mxfp8::exp2_int(-e), false};
  }
  const float amax = mxfp8::float_from_bits(amax_bits);
  float s = div_rn(amax, kDataMax);
  s = s < kMinScale ? kMinScale : s;
  return BlockScale{zero ? 1.0f : s, s, false};
}

// Stage 1's FP8 token rows (the dispatch of (1, 128)-quantised tokens, half the bf16 bytes): a
// row holds the token's `hidden` e4m3 bytes, then its hidden / 128 float32 scales, then zeros up
// to whole 16-byte vectors. The dispatch and the row gather move it as bf16
// (packed_row_bytes / 2 elements per row).
MOK_HOST_DEVICE constexpr int64_t packed_scales_offset(int64_t hidden) { return hidden; }
MOK_HOST_DEVICE constexpr int64_t packed_row_bytes(int64_t hidden) {
  return (hidden + hidden / kBlock * static_cast<int64_t>(sizeof(float)) + 15) / 16 * 16;
}

}  // namespace mok::fp8_blockwise
