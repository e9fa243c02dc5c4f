// Host launcher for mok/roles/mxfp8_quantize.cuh: picks the instantiation and the grid.
#include "launch/mxfp8.h"

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/roles/mxfp8_quantize.cuh"

namespace mok::launch {
namespace {

using mxfp8::QuantizeParams;

bool is_aligned(const void* ptr, uintptr_t alignment) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
}

// 16-byte loads and kVec-byte stores need aligned pointers and whole vectors per row.
template <typename Input>
bool can_vectorize(const Mxfp8QuantizeArgs& args) {
  constexpr int kVec = mxfp8::QuantizeTile<Input>::kVec;
  return args.num_cols % kVec == 0 && is_aligned(args.input, 16) &&
         is_aligned(args.row_data, kVec) && is_aligned(args.col_data, kVec) &&
         is_aligned(args.col_scales, kVec);
}

template <typename Input, bool kRowwise, bool kColwise, bool kVectorized>
void launch_kernel(const QuantizeParams& params, cudaStream_t stream) {
  using Tile = mxfp8::QuantizeTile<Input>;
  const int64_t num_row_ctas =
      (params.num_rows + Tile::kTileRowsPerCta - 1) / Tile::kTileRowsPerCta;
  const int64_t num_col_ctas = (params.num_cols + Tile::kWarpCols - 1) / Tile::kWarpCols;
  MOK_HOST_CHECK(num_row_ctas <= INT32_MAX && num_col_ctas <= 65535,
                 "mxfp8_quantize: shape [%lld, %lld] exceeds the grid (at most %lld columns)",
                 static_cast<long long>(params.num_rows), static_cast<long long>(params.num_cols),
                 static_cast<long long>(65535LL * Tile::kWarpCols));
  const dim3 grid(static_cast<unsigned>(num_row_ctas), static_cast<unsigned>(num_col_ctas));
  mxfp8::mxfp8_quantize_kernel<Input, kRowwise, kColwise, kVectorized>
      <<<grid, mxfp8::kQuantizeThreads, 0, stream>>>(params);
  MOK_CUDA_CHECK(cudaGetLastError());
}

template <typename Input, bool kRowwise, bool kColwise>
void dispatch_vectorized(const Mxfp8QuantizeArgs& args, const QuantizeParams& params,
                         cudaStream_t stream) {
  if (can_vectorize<Input>(args)) {
    launch_kernel<Input, kRowwise, kColwise, true>(params, stream);
  } else {
    launch_kernel<Input, kRowwise, kColwise, false>(params, stream);
  }
}

template <typename Input>
void dispatch_directions(const Mxfp8QuantizeArgs& args, const QuantizeParams& params,
                         cudaStream_t stream) {
  const bool rowwise = args.row_data != nullptr;
  const bool colwise = args.col_data != nullptr;
  if (rowwise && colwise) {
    dispatch_vectorized<Input, true, true>(args, params, stream);
  } else if (rowwise) {
    dispatch_vectorized<Input, true, false>(args, params, stream);
  } else {
    dispatch_vectorized<Input, false, true>(args, params, stream);
  }
}

void check_args(const Mxfp8QuantizeArgs& args) {
  const bool rowwise = args.row_data != nullptr;
  const bool colwise = args.col_data != nullptr;
  MOK_HOST_CHECK(rowwise || colwise, "mxfp8_quantize: ask for rowwise and/or colwise output");
  MOK_HOST_CHECK(rowwise == (args.row_scales != nullptr),
                 "mxfp8_quantize: rowwise data and scales must be given together");
  MOK_HOST_CHECK(colwise == (args.col_scales != nullptr),
                 "mxfp8_quantize: colwise data and scales must be given together");
  MOK_HOST_CHECK(!rowwise || args.num_cols % mxfp8::kBlockSize == 0,
                 "mxfp8_quantize: rowwise needs num_cols=%lld to be a multiple of %d",
                 static_cast<long long>(args.num_cols), mxfp8::kBlockSize);
  MOK_HOST_CHECK(!colwise || args.num_rows % mxfp8::kBlockSize == 0,
                 "mxfp8_quantize: colwise needs num_rows=%lld to be a multiple of %d",
                 static_cast<long long>(args.num_rows), mxfp8::kBlockSize);
}

}  // namespace

void mxfp8_quantize(const Mxfp8QuantizeArgs& args, cudaStream_t stream) {
  check_args(args);
  if (args.num_rows == 0 || args.num_cols == 0) return;
  const QuantizeParams params{args.input,      args.num_rows,   args.num_cols, args.row_data,
                              args.row_scales, args.col_data,   args.col_scales};
  switch (args.input_type) {
    case Mxfp8InputType::kFloat32:
      return dispatch_directions<mxfp8::Float32Input>(args, params, stream);
    case Mxfp8InputType::kFloat16:
      return dispatch_directions<mxfp8::Float16Input>(args, params, stream);
    case Mxfp8InputType::kBFloat16:
      return dispatch_directions<mxfp8::BFloat16Input>(args, params, stream);
  }
  MOK_HOST_CHECK(false, "mxfp8_quantize: unknown input type %d", static_cast<int>(args.input_type));
}

}  // namespace mok::launch
