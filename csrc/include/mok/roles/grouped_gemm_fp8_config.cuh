// Role: the blockwise-FP8 grouped GEMM's configuration on sm_90a (issue 15), the Hopper FP8
// recipe of Megatron's `--fp8-recipe blockwise` and DeepGEMM: E4M3 operands, A (activations)
// with one float32 scale per row and 128-element K block, B (weights) with one per 128 x 128
// block; the wgmma accumulators are promoted into float32 main accumulators once per 128-K
// block, each partial sum multiplied by its two scales (CUTLASS 4.2's sm90 blockwise-scaled
// ptr-array mainloop). The data format is mok/common/fp8_blockwise.cuh's.
//
// Scale layouts (both K-major, the quantiser's natural output; see ops/fp8_blockwise.py):
//   A scales: [rows, K / 128] row-major; group g's start at row_begin_g * (K / 128).
//   B scales: [G, N / 128, K / 128] row-major; group g's at g * (N / 128) * (K / 128).
// NOTE: FP8 wgmma reads both operands K-major from shared memory, so A is [rows, K] and B is
// [G, N, K] (the NT form: forward L1 and L2). The tile's K is one scale block (128).
//
// Deterministic as the BF16 engine: no split-K, each output tile reduced by one CTA over K in
// order (grouped_gemm_config.cuh).
#pragma once

#include <cutlass/detail/blockwise_scale_layout.hpp>

#include "mok/roles/fp8_mainloop.cuh"
#include "mok/roles/grouped_gemm_config.cuh"

namespace mok::gemm {

using Fp8Element = cutlass::float_e4m3_t;
using ScaleElement = float;
constexpr int kFp8Alignment = 16;  // e4m3 elements per 16 bytes
constexpr int kFp8ScaleBlock = 128;

// (1 x 128) activation blocks, (128 x 128) weight blocks, both scale tensors K-major.
using Fp8ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kFp8ScaleBlock, kFp8ScaleBlock,
                                              cute::GMMA::Major::K, cute::GMMA::Major::K>;
using Fp8LayoutSFA = decltype(Fp8ScaleConfig::deduce_layoutSFA());
using Fp8LayoutSFB = decltype(Fp8ScaleConfig::deduce_layoutSFB());

// Two schedules. NOTE: the tiles are half the BF16 engine's: the mainloop keeps two float32
// accumulators (the wgmma partial sum of the current 128-K block and the promoted total), so a
// consumer warpgroup holds at most a 64 x 128 tile (2 x 64 registers per thread); 64 x 256
// spills (measured: 4x slower than BF16). And the tile's N is one weight-scale block: CUTLASS
// 4.2's mainloop does not partition several N scales per tile with a 256-wide one.
// Cooperative: a 128 x 128 tile over both consumer warpgroups, in clusters of 2 CTAs along N
// that share (TMA-multicast) their A tile, halving A's L2 reads (measured on one H200 against
// no cluster and clusters of 4, docs/results/bench_fp8_gemm_h200_{78467a1,b913f2d}.json: both
// slower on deepseek-v3's and qwen3-30b-a3b's L1; docs/FP8.md). Pingpong: 64 x 128 per
// warpgroup, one's epilogue overlapping the other's mainloop; no cluster.
struct Fp8Cooperative {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Fp8Pingpong {
  using TileShape = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using ClusterShape = gemm::ClusterShape;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// The mainloop + kernel for one (epilogue, schedule) choice; A row-major, B "column-major"
// ([N, K] with K contiguous), as grouped_gemm_config.cuh's NT op. The builder's collective gives
// the producer, the shared memory and the pipeline; its consumer loop is fp8_mainloop.cuh's.
template <class CollectiveEpilogue, class Schedule = Fp8Cooperative>
struct GroupedGemmFp8 {
  using BuilderMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8Element,
      cute::tuple<RowMajor*, Fp8LayoutSFA*>, kFp8Alignment, Fp8Element,
      cute::tuple<ColumnMajor*, Fp8LayoutSFB*>, kFp8Alignment, Accumulator,
      typename Schedule::TileShape, typename Schedule::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::KernelSchedule>::CollectiveOp;
  using Mainloop = OverlappedPromotionMma<BuilderMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

}  // namespace mok::gemm
