// MXFP8 quantisation of a [num_rows, num_cols] matrix (leading batch dims flattened into rows):
// rowwise (32-element blocks along a row) and/or colwise (32-row blocks down a column) in one
// pass over the input. The format and its edge rules live in mok/common/mxfp8.cuh.
//
// Work split: each warp owns a tile of kTileRows = 32 rows x (32 lanes * kVec) columns; a lane
// holds its kVec columns of all 32 rows in registers (one 16-byte load per row, so a warp reads
// 512 contiguous bytes per row). Rowwise blocks then span kLanesPerRowBlock neighbouring lanes
// (one shuffle reduction); colwise blocks are a lane's own column, reduced in-thread.
// Torch-free.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/common/mxfp8.cuh"
#include "mok/common/ptx.cuh"

namespace mok::mxfp8 {

// Input element types: raw bits, an exact conversion to float32, and |x| maxima taken on packed
// raw words (sign-magnitude bits order like the values, with Inf and NaN above every finite).
struct Float32Input {
  using Raw = uint32_t;
  static MOK_DEVICE float to_float(Raw r) { return __uint_as_float(r); }
  static MOK_DEVICE uint32_t max_abs(uint32_t acc, uint32_t word) {
    return max(acc, word & kFloatAbsMask);
  }
  // float32 bits of the packed maximum's element j (j indexes the elements of one word).
  static MOK_DEVICE uint32_t amax_bits(uint32_t acc, int /*j*/) { return acc; }
};

template <typename Derived>
struct Packed16Input {
  using Raw = uint16_t;
  static MOK_DEVICE uint32_t max_abs(uint32_t acc, uint32_t word) {
    return __vmaxu2(acc, word & 0x7FFF7FFFu);
  }
  static MOK_DEVICE uint32_t amax_bits(uint32_t acc, int j) {
    return float_bits(Derived::to_float(static_cast<Raw>(acc >> (16 * j))));
  }
};

struct BFloat16Input : Packed16Input<BFloat16Input> {
  static MOK_DEVICE float to_float(Raw r) {
    return __uint_as_float(static_cast<uint32_t>(r) << 16);
  }
};
struct Float16Input : Packed16Input<Float16Input> {
  static MOK_DEVICE float to_float(Raw r) { return __half2float(__ushort_as_half(r)); }
};

struct QuantizeParams {
  const void* input;     // [num_rows, num_cols], contiguous
  int64_t num_rows;
  int64_t num_cols;
  uint8_t* row_data;     // [num_rows, num_cols] e4m3 bytes, when rowwise
  uint8_t* row_scales;   // [num_rows, num_cols / 32] E8M0, when rowwise
  uint8_t* col_data;     // [num_rows, num_cols] e4m3 bytes, when colwise
  uint8_t* col_scales;   // [num_rows / 32, num_cols] E8M0, when colwise
};

constexpr int kWarpSize = 32;
constexpr int kQuantizeWarps = 4;  // warps of a CTA take consecutive 32-row tiles
constexpr int kQuantizeThreads = kQuantizeWarps * kWarpSize;
constexpr int kTileRows = kBlockSize;

template <typename Input>
struct QuantizeTile {
  using Raw = typename Input::Raw;
  static constexpr int kVec = 16 / static_cast<int>(sizeof(Raw));  // elements per 16-byte load
  static constexpr int kWarpCols = kWarpSize * kVec;
  static constexpr int kLanesPerRowBlock = kBlockSize / kVec;
  static constexpr int kTileRowsPerCta = kQuantizeWarps * kTileRows;
  static_assert(kBlockSize % kVec == 0, "a rowwise block must be whole lanes");
};

// kVec consecutive outputs packed as e4m3 bytes, lowest column in the lowest byte.
template <int kVec>
struct PackedFp8 {
  uint32_t words[kVec / 4];
};

MOK_DEVICE float clamp_to_fp8_range(float x) { return fminf(fmaxf(x, -kDataMax), kDataMax); }

// NOTE: the single multiply by an exact power of two and the clamp are the whole arithmetic;
// the reference does the same in float32, which is what makes the two bitwise equal.
template <int kVec>
MOK_DEVICE PackedFp8<kVec> encode_fp8(const float (&x)[kVec], const float (&inv_scale)[kVec],
                                      const bool (&nonfinite)[kVec]) {
  PackedFp8<kVec> out;
#pragma unroll
  for (int w = 0; w < kVec / 4; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int j = 4 * w + 2 * p;
      const uint32_t pair =
          ptx::cvt_e4m3x2(clamp_to_fp8_range(x[j] * inv_scale[j]),
                          clamp_to_fp8_range(x[j + 1] * inv_scale[j + 1]));
      word |= pair << (16 * p);
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (nonfinite[4 * w + b]) {
        word = (word & ~(0xFFu << (8 * b))) | (static_cast<uint32_t>(kDataNaN) << (8 * b));
      }
    }
    out.words[w] = word;
  }
  return out;
}

// Writes kVec bytes at dst (columns col0 .. col0 + kVec - 1 of a row with num_cols columns).
template <int kVec, bool kVectorized>
MOK_DEVICE void store_bytes(uint8_t* dst, const uint32_t (&words)[kVec / 4], int64_t col0,
                            int64_t num_cols) {
  if constexpr (kVectorized) {
    if constexpr (kVec == 8) {
      ptx::st_global_v2(dst, make_uint2(words[0], words[1]));
    } else {
      static_assert(kVec == 4, "16-byte loads hold 4 or 8 elements");
      ptx::st_global_u32(dst, words[0]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (col0 + j < num_cols) dst[j] = static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4)));
    }
  }
}

// A lane's 16 bytes of one row, kept packed (4 registers) until an element is needed.
using PackedRow = uint32_t[4];

// Element j (compile-time after unrolling) of a packed row, as float32.
template <typename Input>
MOK_DEVICE float element(const PackedRow& row, int j) {
  using Raw = typename Input::Raw;
  if constexpr (sizeof(Raw) == 4) {
    return Input::to_float(row[j]);
  } else {
    return Input::to_float(static_cast<Raw>(row[j / 2] >> (16 * (j % 2))));
  }
}

// Loads the lane's kVec columns of the warp's 32 rows; out-of-range elements read as +0.
template <typename Input, bool kVectorized>
MOK_DEVICE void load_tile(const QuantizeParams& params, int64_t row0, int64_t col0,
                          PackedRow (&tile)[kTileRows]) {
  using Raw = typename Input::Raw;
  constexpr int kVec = QuantizeTile<Input>::kVec;
  constexpr int kRawBits = 8 * static_cast<int>(sizeof(Raw));
  const Raw* input = static_cast<const Raw*>(params.input);
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t row = row0 + r;
    const Raw* src = input + row * params.num_cols + col0;
    const bool row_in = row < params.num_rows && col0 < params.num_cols;
    if constexpr (kVectorized) {
      // NOTE: kVectorized implies num_cols % kVec == 0, so a lane's vector is all in or all out.
      const uint4 v = row_in ? ptx::ld_global_nc_v4(src) : make_uint4(0, 0, 0, 0);
      tile[r][0] = v.x;
      tile[r][1] = v.y;
      tile[r][2] = v.z;
      tile[r][3] = v.w;
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w) tile[r][w] = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const uint32_t raw = (row_in && col0 + j < params.num_cols) ? src[j] : Raw(0);
        tile[r][j * kRawBits / 32] |= raw << (j * kRawBits % 32);
      }
    }
  }
}

// Rowwise: the block of row r covering the lane's columns spans kLanesPerRowBlock lanes.
template <typename Input, bool kVectorized>
MOK_DEVICE void quantize_rows(const QuantizeParams& params, int64_t row0, int64_t col0, int lane,
                              const PackedRow (&tile)[kTileRows]) {
  using Tile = QuantizeTile<Input>;
  constexpr int kVec = Tile::kVec;
  const bool col_in = col0 < params.num_cols;
  const int64_t num_scale_cols = params.num_cols / kBlockSize;
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    uint32_t packed_max = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) packed_max = Input::max_abs(packed_max, tile[r][w]);
    // max of |x| as float32 bits: NaN and Inf order above every finite value
    uint32_t amax_bits = Input::amax_bits(packed_max, 0);
    if constexpr (kVec == 8) amax_bits = max(amax_bits, Input::amax_bits(packed_max, 1));
#pragma unroll
    for (int offset = 1; offset < Tile::kLanesPerRowBlock; offset *= 2) {
      amax_bits = max(amax_bits, __shfl_xor_sync(0xFFFFFFFFu, amax_bits, offset));
    }
    const int64_t row = row0 + r;
    if (row >= params.num_rows || !col_in) continue;  // after the shuffle: all lanes took part
    const BlockScale scale = block_scale(amax_bits);
    float x[kVec];
    float inv_scale[kVec];
    bool nonfinite[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      x[j] = element<Input>(tile[r], j);
      inv_scale[j] = scale.inv_scale;
      nonfinite[j] = scale.nonfinite;
    }
    const PackedFp8<kVec> packed = encode_fp8<kVec>(x, inv_scale, nonfinite);
    store_bytes<kVec, kVectorized>(params.row_data + row * params.num_cols + col0, packed.words,
                                   col0, params.num_cols);
    if (lane % Tile::kLanesPerRowBlock == 0) {
      params.row_scales[row * num_scale_cols + col0 / kBlockSize] = scale.biased_exponent;
    }
  }
}

// Colwise: the lane's kVec columns over the warp's 32 rows are kVec whole blocks.
template <typename Input, bool kVectorized>
MOK_DEVICE void quantize_cols(const QuantizeParams& params, int64_t row0, int64_t col0,
                              const PackedRow (&tile)[kTileRows]) {
  constexpr int kVec = QuantizeTile<Input>::kVec;
  if (col0 >= params.num_cols) return;
  constexpr int kPerWord = kVec / 4;  // elements per packed word
  uint32_t packed_max[4] = {0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
#pragma unroll
    for (int w = 0; w < 4; ++w) packed_max[w] = Input::max_abs(packed_max[w], tile[r][w]);
  }
  float inv_scale[kVec];
  bool nonfinite[kVec];
  uint32_t scale_words[kVec / 4];
#pragma unroll
  for (int w = 0; w < kVec / 4; ++w) scale_words[w] = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const BlockScale scale = block_scale(Input::amax_bits(packed_max[j / kPerWord], j % kPerWord));
    inv_scale[j] = scale.inv_scale;
    nonfinite[j] = scale.nonfinite;
    scale_words[j / 4] |= static_cast<uint32_t>(scale.biased_exponent) << (8 * (j % 4));
  }
  const int64_t scale_row = row0 / kBlockSize;
  store_bytes<kVec, kVectorized>(params.col_scales + scale_row * params.num_cols + col0,
                                 scale_words, col0, params.num_cols);
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    float x[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) x[j] = element<Input>(tile[r], j);
    const PackedFp8<kVec> packed = encode_fp8<kVec>(x, inv_scale, nonfinite);
    store_bytes<kVec, kVectorized>(params.col_data + (row0 + r) * params.num_cols + col0,
                                   packed.words, col0, params.num_cols);
  }
}

// Grid: x = ceil(num_rows / (kQuantizeWarps * 32)) row tiles, y = ceil(num_cols / kWarpCols).
// NOTE: kColwise requires num_rows % 32 == 0 and kRowwise num_cols % 32 == 0 (host-checked);
// kVectorized requires 16-byte aligned input, num_cols % kVec == 0 and kVec-aligned outputs.
template <typename Input, bool kRowwise, bool kColwise, bool kVectorized>
__global__ void __launch_bounds__(kQuantizeThreads)
    mxfp8_quantize_kernel(const QuantizeParams params) {
  using Tile = QuantizeTile<Input>;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + warp) * kTileRows;
  // NOTE: a whole warp leaves together, and nothing below synchronises across warps.
  if (row0 >= params.num_rows) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * Tile::kWarpCols + lane * Tile::kVec;

  PackedRow tile[kTileRows];
  load_tile<Input, kVectorized>(params, row0, col0, tile);
  if constexpr (kRowwise) quantize_rows<Input, kVectorized>(params, row0, col0, lane, tile);
  if constexpr (kColwise) quantize_cols<Input, kVectorized>(params, row0, col0, tile);
}

}  // namespace mok::mxfp8
