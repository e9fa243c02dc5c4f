// Host launcher for mok/roles/fp8_blockwise_quantize.cuh: picks the instantiation and the grid.
#include "launch/fp8_blockwise.h"

#include <algorithm>
#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/roles/fp8_blockwise_quantize.cuh"

namespace mok::launch {
namespace {

using fp8_blockwise::kBlock;
using fp8_blockwise::kTile;
using fp8_blockwise::QuantizeParams;

template <typename Input, int kBlockRows, int kBlockCols>
void launch_kernel(const QuantizeParams& params, cudaStream_t stream) {
  const int64_t row_tiles = (params.num_rows + kTile - 1) / kTile;
  const int64_t col_tiles = (params.num_cols + kTile - 1) / kTile;
  MOK_HOST_CHECK(row_tiles <= INT32_MAX && col_tiles <= 65535,
                 "fp8_blockwise_quantize: shape [%lld, %lld] exceeds the grid (at most %lld "
                 "columns)",
                 static_cast<long long>(params.num_rows), static_cast<long long>(params.num_cols),
                 static_cast<long long>(65535LL * kTile));
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  fp8_blockwise::fp8_blockwise_quantize_kernel<Input, kBlockRows, kBlockCols>
      <<<grid, fp8_blockwise::kQuantizeThreads, 0, stream>>>(params);
  MOK_CUDA_CHECK(cudaGetLastError());
}

// The (1, 128) row-block kernel: a grid of a few CTAs per SM striding over the blocks.
template <typename Input>
void launch_rows_kernel(const QuantizeParams& params, cudaStream_t stream) {
  int device = 0, sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  constexpr int kBlocksPerCta = fp8_blockwise::kRowBlockThreads / 32 * fp8_blockwise::kRowBlocksPerWarp;
  const int64_t blocks = params.num_rows * (params.num_cols / kBlock);
  const int64_t ctas =
      std::max<int64_t>(1, std::min<int64_t>(8LL * sms, (blocks + kBlocksPerCta - 1) / kBlocksPerCta));
  fp8_blockwise::fp8_blockwise_quantize_rows_kernel<Input>
      <<<static_cast<unsigned>(ctas), fp8_blockwise::kRowBlockThreads, 0, stream>>>(params);
  MOK_CUDA_CHECK(cudaGetLastError());
}

template <typename Input>
void dispatch_block(const Fp8BlockwiseQuantizeArgs& args, const QuantizeParams& params,
                    cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(args.input) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(args.data) % 4 == 0;
  if (args.block_rows == 1 && aligned) return launch_rows_kernel<Input>(params, stream);
  MOK_HOST_CHECK(args.row_limit == nullptr, "fp8_blockwise_quantize: a row limit needs a "
                 "16-byte aligned input and a 4-byte aligned output");
  if (args.block_rows == 1) return launch_kernel<Input, 1, kBlock>(params, stream);
  if (args.block_cols == 1) return launch_kernel<Input, kBlock, 1>(params, stream);
  return launch_kernel<Input, kBlock, kBlock>(params, stream);
}

void check_args(const Fp8BlockwiseQuantizeArgs& args) {
  const bool known = (args.block_rows == 1 && args.block_cols == kBlock) ||
                     (args.block_rows == kBlock && args.block_cols == 1) ||
                     (args.block_rows == kBlock && args.block_cols == kBlock);
  MOK_HOST_CHECK(known, "fp8_blockwise_quantize: block (%d, %d) is not (1, 128), (128, 1) or "
                 "(128, 128)", args.block_rows, args.block_cols);
  MOK_HOST_CHECK(args.num_rows % args.block_rows == 0 && args.num_cols % args.block_cols == 0,
                 "fp8_blockwise_quantize: [%lld, %lld] is not a whole number of (%d, %d) blocks",
                 static_cast<long long>(args.num_rows), static_cast<long long>(args.num_cols),
                 args.block_rows, args.block_cols);
  // NOTE: an empty input's outputs are empty tensors, whose data pointers may be null
  const bool empty = args.num_rows == 0 || args.num_cols == 0;
  MOK_HOST_CHECK(empty || (args.data != nullptr && args.scales != nullptr),
                 "fp8_blockwise_quantize: data and scales must be given");
}

}  // namespace

void fp8_blockwise_quantize(const Fp8BlockwiseQuantizeArgs& args, cudaStream_t stream) {
  check_args(args);
  if (args.num_rows == 0 || args.num_cols == 0) return;
  MOK_HOST_CHECK(args.row_limit == nullptr || args.block_rows == 1,
                 "fp8_blockwise_quantize: a row limit is for (1, 128) blocks only");
  const QuantizeParams params{args.input, args.num_rows, args.num_cols, args.data,
                              args.scales, args.pow2,    args.row_limit};
  switch (args.input_type) {
    case Mxfp8InputType::kFloat32:
      return dispatch_block<mxfp8::Float32Input>(args, params, stream);
    case Mxfp8InputType::kFloat16:
      return dispatch_block<mxfp8::Float16Input>(args, params, stream);
    case Mxfp8InputType::kBFloat16:
      return dispatch_block<mxfp8::BFloat16Input>(args, params, stream);
  }
  MOK_HOST_CHECK(false, "fp8_blockwise_quantize: unknown input type %d",
                 static_cast<int>(args.input_type));
}

}  // namespace mok::launch
