// Role: the consumer side of the blockwise-FP8 mainloop with the promotion overlapped.
//
// CUTLASS 4.2's sm90 blockwise collective runs each 128-K block as: issue its wgmmas into a
// temporary accumulator, wait for them (warpgroup_wait<0>), then promote the temporary into the
// float32 total, times the block's scales. The tensor cores idle while a warpgroup waits and
// promotes. This mainloop keeps two temporaries and issues block k+1's wgmmas before it
// promotes block k (warpgroup_wait<1>), so the promotion's FFMAs run under the next block's
// MMAs. Same producer, same shared memory, same pipeline; only `mma` differs, and it computes
// the same expression in the same order (total += partial(k) * (sa(k) * sb(k)), k ascending)
// as the CUTLASS mainloop (by construction; the tests compare with a float64 oracle, not with
// it).
//
// NOTE: for one weight-scale block per tile along N and per-row scales along M (our
// Fp8ScaleConfig): ScaleNsPerTile == 1 and ScaleGranularityK == the tile's K. Three float32
// fragments per thread (total + two temporaries): 192 registers for a 64 x 128 warpgroup tile,
// inside the consumers' 232.
//
// NOTE: a consumer warpgroup whose 64-row slice lies past its group's end (a group's last,
// partly empty tile; the scales of rows past the end zero-filled to find it) skipping its MMAs
// was built and measured at 3765b52: bit for bit the same outputs, but slower in an A/B on one
// H200 (deepseek-v3's L1 4.79 / 4.77 ms without, 5.62 / 5.56 with:
// docs/results/bench_fp8_gemm_ab{1,2}_h200_{4f3b74d,3765b52}.json), so it is not here.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace mok::gemm {

template <class Base>
struct OverlappedPromotionMma : Base {
  using Base::Base;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using ScaleElement = typename Base::ElementBlockScale;

  static_assert(Base::ScaleNsPerTile == 1, "one weight-scale block per tile along N");
  static_assert(Base::ScaleMsPerTile == cute::size<0>(typename Base::TileShape{}),
                "per-row activation scales");
  static_assert(Base::ScalePromotionInterval ==
                    cute::size<2>(typename Base::TileShape{}) /
                        cute::size<2>(typename Base::TiledMma::AtomShape_MNK{}),
                "one promotion per k-tile");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    // The scales broadcast over the output tile: A's along N, B's along M.
    using LayoutSFA = typename Base::SmemLayoutSFA;
    using LayoutSFB = typename Base::SmemLayoutSFB;
    using TileShape = typename Base::TileShape;
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(LayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(LayoutSFA{}), shape<2>(LayoutSFA{}))),
                    make_stride(stride<0>(LayoutSFA{}), _0{},
                                make_stride(stride<1>(LayoutSFA{}), stride<2>(LayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(LayoutSFB{}),
                               make_shape(shape<1>(LayoutSFB{}), shape<2>(LayoutSFB{}))),
                    make_stride(_0{}, stride<0>(LayoutSFB{}),
                                make_stride(stride<1>(LayoutSFB{}), stride<2>(LayoutSFB{})))));

    typename Base::TiledMma tiled_mma;
    constexpr int kWarpGroups = size(typename Base::TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout warp_group_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto thread_mma = tiled_mma.get_slice(warp_group_layout(warp_group));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,M,K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,N,K,PIPE)

    // Two temporaries and their scales (sa * sb per accumulator element, broadcast).
    Tensor partial0 = make_fragment_like(accum);
    Tensor partial1 = make_fragment_like(accum);
    Tensor scale0 = make_tensor_like<ScaleElement>(tCsSFA(_, _, _, _0{}));
    Tensor scale1 = make_tensor_like<ScaleElement>(tCsSFA(_, _, _, _0{}));
    Tensor scale_b = make_tensor_like<ScaleElement>(tCsSFB(_, _, _, _0{}));
    clear(accum);
    if (k_tile_count <= 0) return;
    // NOTE: every register the loop carries is defined before the first wgmma is in flight;
    // otherwise ptxas materialises them after it and waits for that wgmma first.
    clear(partial0);
    clear(partial1);
    warpgroup_fence_operand(accum);
    warpgroup_fence_operand(partial0);
    warpgroup_fence_operand(partial1);

    PipelineState smem_pipe_release = smem_pipe_read;
    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);

    // Block k's wgmmas into `partial`, its scales into `scale` (not waited for).
    auto issue = [&](auto& partial, auto& scale) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      const int stage = smem_pipe_read.index();
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), scale);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), scale_b);
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(partial);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), partial);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      // NOTE: no operand fence here: touching `partial` before its wait makes ptxas wait.
      const ScaleElement sb = scale_b(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(scale)); ++i) {
        filter_zeros(scale)(i) = filter_zeros(scale)(i) * sb;
      }
      ++smem_pipe_read;
      barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    };
    // total += partial * scale, once its wgmmas are done (kOutstanding batches may still run).
    auto promote = [&](auto& partial, auto& scale, auto outstanding) {
      warpgroup_wait<decltype(outstanding)::value>();
      warpgroup_fence_operand(partial);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += partial(i) * scale(i);
    };
    auto retire = [&](auto& partial, auto& scale) {  // promote, then free its stage
      promote(partial, scale, Int<1>{});
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
    };

    // NOTE: the last stage is released by mma_tail, as in the CUTLASS mainloop.
    issue(partial0, scale0);
    int k = 1;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k + 1 < k_tile_count; k += 2) {
      issue(partial1, scale1);
      retire(partial0, scale0);
      issue(partial0, scale0);
      retire(partial1, scale1);
    }
    if (k < k_tile_count) {
      issue(partial1, scale1);
      retire(partial0, scale0);
      promote(partial1, scale1, Int<0>{});
    } else {
      promote(partial0, scale0, Int<0>{});
    }
  }
};

}  // namespace mok::gemm
