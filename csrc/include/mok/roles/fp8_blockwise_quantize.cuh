// Blockwise FP8 quantisation of a [num_rows, num_cols] matrix (leading batch dims flattened into
// rows): blocks of (1, 128), (128, 1) or (128, 128). The format and its rules live in
// mok/common/fp8_blockwise.cuh.
//
// Work split: one CTA per 128 x 128 tile, 256 threads; thread t owns column t % 128 of the
// tile's rows t / 128 + 2 k (k < 64), held in registers (consecutive threads read and write
// consecutive columns). The block maxima are taken on the float32 bits of |x| (integer max:
// Inf and NaN above every finite value): a row block across the 4 warps of a row phase, a
// column block in-thread then across the 2 phases, a tile block across all 8 warps.
// Correct first: not tuned (one byte store per element). Torch-free.
#pragma once

#include <cstdint>

#include "mok/common/fp8_blockwise.cuh"
#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/roles/mxfp8_quantize.cuh"  // the input element types

namespace mok::fp8_blockwise {

constexpr int kTile = kBlock;
constexpr int kQuantizeThreads = 256;
constexpr int kPhases = kQuantizeThreads / kTile;  // rows a CTA pass covers
constexpr int kRowsPerThread = kTile / kPhases;
constexpr int kWarpsPerPhase = kTile / 32;

struct QuantizeParams {
  const void* input;  // [num_rows, num_cols], contiguous
  int64_t num_rows;
  int64_t num_cols;
  uint8_t* data;   // [num_rows, num_cols] e4m3
  float* scales;   // [num_rows / br, num_cols / bc]
  bool pow2;
  const int32_t* row_limit;  // (1, 128) row kernel only: rows >= *row_limit are skipped (or null)
};

// The largest of kCount words (the block maxima's partial results).
template <int kCount>
MOK_DEVICE uint32_t max_of(const uint32_t* words) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kCount; ++i) m = max(m, words[i]);
  return m;
}

// x scaled by its block's scale and clamped to e4m3's range (encode's value before rounding);
// `d`: Divider(s.factor), made once per block (div_rn's arithmetic).
MOK_DEVICE float scaled(float x, const BlockScale& s, bool pow2, const Divider& d) {
  const float q = pow2 ? x * s.factor : d(x);
  return fminf(fmaxf(q, -kDataMax), kDataMax);
}
MOK_DEVICE uint8_t encode(float x, const BlockScale& s, bool pow2) {
  if (s.nonfinite) return kDataNaN;
  return static_cast<uint8_t>(ptx::cvt_e4m3x2(scaled(x, s, pow2, Divider(s.factor)), 0.0f) & 0xFF);
}
// Two elements' e4m3 bytes, x0's the low one: encode's for each, one conversion for both.
MOK_DEVICE uint16_t encode_pair(float x0, float x1, const BlockScale& s, bool pow2,
                                const Divider& d) {
  if (s.nonfinite) return static_cast<uint16_t>(kDataNaN * 0x0101u);
  return ptx::cvt_e4m3x2(scaled(x0, s, pow2, d), scaled(x1, s, pow2, d));
}

template <typename Input, int kBlockRows, int kBlockCols>
__global__ void __launch_bounds__(kQuantizeThreads)
    fp8_blockwise_quantize_kernel(const QuantizeParams p) {
  static_assert((kBlockRows == 1 && kBlockCols == kTile) ||
                    (kBlockRows == kTile && kBlockCols == 1) ||
                    (kBlockRows == kTile && kBlockCols == kTile),
                "blocks are 1x128, 128x1 or 128x128");
  using Raw = typename Input::Raw;
  const Raw* in = static_cast<const Raw*>(p.input);
  const int c = static_cast<int>(threadIdx.x) % kTile;
  const int phase = static_cast<int>(threadIdx.x) / kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kTile + c;
  const bool col_ok = col < p.num_cols;

  float x[kRowsPerThread];
  uint32_t abs_bits[kRowsPerThread];
  #pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int64_t row = row0 + phase + kPhases * k;
    const bool ok = col_ok && row < p.num_rows;
    x[k] = ok ? Input::to_float(in[row * p.num_cols + col]) : 0.0f;
    abs_bits[k] = __float_as_uint(x[k]) & mxfp8::kFloatAbsMask;
  }

  __shared__ uint32_t partial[kTile][kWarpsPerPhase];  // per (row, warp) or per (phase, col)
  __shared__ BlockScale block[kTile];
  if constexpr (kBlockRows == 1) {  // one block per row: the 128 columns of 4 warps
    #pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const uint32_t m = __reduce_max_sync(0xffffffffu, abs_bits[k]);
      if (threadIdx.x % 32 == 0) partial[phase + kPhases * k][warp % kWarpsPerPhase] = m;
    }
    __syncthreads();
    if (threadIdx.x < kTile) {
      block[threadIdx.x] = block_scale(max_of<kWarpsPerPhase>(partial[threadIdx.x]), p.pow2);
    }
  } else {
    uint32_t m = 0;  // this thread's rows of its column
    #pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) m = max(m, abs_bits[k]);
    if constexpr (kBlockCols == 1) {  // one block per column: the 2 phases
      partial[c][phase] = m;
      __syncthreads();
      if (threadIdx.x < kTile) {
        block[threadIdx.x] = block_scale(max_of<kPhases>(partial[threadIdx.x]), p.pow2);
      }
    } else {  // one block: all 8 warps
      m = __reduce_max_sync(0xffffffffu, m);
      __shared__ uint32_t warp_max[kQuantizeThreads / 32];
      if (threadIdx.x % 32 == 0) warp_max[warp] = m;
      __syncthreads();
      if (threadIdx.x == 0) block[0] = block_scale(max_of<kQuantizeThreads / 32>(warp_max), p.pow2);
    }
  }
  __syncthreads();

  // Scales: row r of the tile (1x128), column c (128x1), or the tile (128x128).
  const int64_t scale_cols = p.num_cols / kBlockCols;
  if constexpr (kBlockRows == 1) {
    const int64_t row = row0 + threadIdx.x;
    if (threadIdx.x < kTile && row < p.num_rows) {
      p.scales[row * scale_cols + blockIdx.y] = block[threadIdx.x].scale;
    }
  } else if constexpr (kBlockCols == 1) {
    if (threadIdx.x < kTile && col_ok) p.scales[blockIdx.x * scale_cols + col] = block[c].scale;
  } else {
    if (threadIdx.x == 0) p.scales[blockIdx.x * scale_cols + blockIdx.y] = block[0].scale;
  }
  if (!col_ok) return;
  #pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int r = phase + kPhases * k;
    const int64_t row = row0 + r;
    if (row >= p.num_rows) break;
    const BlockScale& s = block[kBlockRows == 1 ? r : (kBlockCols == 1 ? c : 0)];
    p.data[row * p.num_cols + col] = encode(x[k], s, p.pow2);
  }
}

// The (1, 128) form, the activations' hot path: one warp per row block, each lane owning 4
// consecutive elements (one 8- or 16-byte load, one 4-byte store), the block maximum one warp
// reduction, no shared memory; a warp takes kRowBlocksPerWarp blocks at a time, all loads
// first (memory-level parallelism). Same rules, same bits as the tile kernel above. NOTE: the
// input base is 16-byte aligned and num_cols % 128 == 0 (the launcher checks).
constexpr int kRowBlockThreads = 256;
constexpr int kElemsPerLane = kBlock / 32;
constexpr int kRowBlocksPerWarp = 4;

// One (1, 128) block held by a warp, kElemsPerLane consecutive elements per lane: this lane's
// e4m3 bytes (little-endian in a word) and the block's scale (in every lane). Every lane of the
// warp takes part.
struct QuantizedLane {
  uint32_t bytes;
  float scale;
};
MOK_DEVICE QuantizedLane quantize_block_lane(const float (&x)[kElemsPerLane], bool pow2) {
  uint32_t m = 0;
  #pragma unroll
  for (int i = 0; i < kElemsPerLane; ++i) m = max(m, __float_as_uint(x[i]) & mxfp8::kFloatAbsMask);
  const BlockScale s = block_scale(__reduce_max_sync(0xffffffffu, m), pow2);
  const Divider d(s.factor);
  uint32_t bytes = 0;
  #pragma unroll
  for (int i = 0; i < kElemsPerLane; i += 2) {
    bytes |= uint32_t{encode_pair(x[i], x[i + 1], s, pow2, d)} << (8 * i);
  }
  return {bytes, s.scale};
}

template <typename Input>
__global__ void __launch_bounds__(kRowBlockThreads)
    fp8_blockwise_quantize_rows_kernel(const QuantizeParams p) {
  using Raw = typename Input::Raw;
  struct alignas(kElemsPerLane * sizeof(Raw)) Pack { Raw v[kElemsPerLane]; };
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t blocks_per_row = p.num_cols / kBlock;
  const int64_t num_rows = p.row_limit == nullptr ? p.num_rows
                                                  : min(p.num_rows, int64_t{*p.row_limit});
  const int64_t num_blocks = num_rows * blocks_per_row;  // rows are contiguous runs of blocks
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kRowBlockThreads + threadIdx.x) / 32;
  const int64_t step = static_cast<int64_t>(gridDim.x) * (kRowBlockThreads / 32) * kRowBlocksPerWarp;
  for (int64_t b0 = warp * kRowBlocksPerWarp; b0 < num_blocks; b0 += step) {
    Pack in[kRowBlocksPerWarp];
    #pragma unroll
    for (int j = 0; j < kRowBlocksPerWarp; ++j) {
      if (b0 + j < num_blocks) {
        const int64_t offset = (b0 + j) * kBlock + lane * kElemsPerLane;
        in[j] = *reinterpret_cast<const Pack*>(static_cast<const Raw*>(p.input) + offset);
      }
    }
    #pragma unroll
    for (int j = 0; j < kRowBlocksPerWarp; ++j) {
      if (b0 + j >= num_blocks) break;  // warp-uniform
      float x[kElemsPerLane];
      #pragma unroll
      for (int i = 0; i < kElemsPerLane; ++i) x[i] = Input::to_float(in[j].v[i]);
      const QuantizedLane q = quantize_block_lane(x, p.pow2);
      const int64_t offset = (b0 + j) * kBlock + lane * kElemsPerLane;
      *reinterpret_cast<uint32_t*>(p.data + offset) = q.bytes;
      if (lane == 0) p.scales[b0 + j] = q.scale;
    }
  }
}

}  // namespace mok::fp8_blockwise
