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
// Idle warpgroups. A group's last 128-row tile is partly empty (deepseek-v3's ~256 rows per
// expert: a fifth of the L1's tiles hold 64 rows or fewer). The auxiliary load writes 0 as the
// scale of a row past the group's end (`load_auxiliary`: cp.async with zero fill, where CUTLASS
// skips those rows and leaves the stage's old values), and no quantised row has a zero scale
// (an all-zero block's is 1), so a zero scale marks a row past the end. The rows past the end
// are the tile's last ones, so when the first row of a consumer warpgroup's slice is past the
// end, none of its rows is a row: that warpgroup waits for and releases each stage as usual
// but issues no MMA, and the other one has the tensor cores to itself. Its accumulators stay
// zero and the epilogues store no row past the group's end, so the outputs are bit for bit
// those of the full tile.
#pragma once

#include <cute/arch/copy_sm80.hpp>
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

  // The base's auxiliary (scale) load, with A's scales of rows past the group's end written
  // as 0 (cp.async zero fill) instead of left as the stage's old values: what `mma` reads to
  // find an idle warpgroup (the header's note). B's scales as the base loads them.
  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(
      Params const&, MainloopPipeline pipeline, PipelineState smem_pipe_write,
      cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& load_inputs,
      BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
      uint32_t, TensorStorage& shared_tensors) {
    using namespace cute;
    using TileShape = typename Base::TileShape;
    using ScaleT = ScaleElement;
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()),
                              typename Base::SmemLayoutSFA{});  // (BLK_M,BLK_K,P)
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()),
                              typename Base::SmemLayoutSFB{});  // (BLK_N,BLK_K,P)
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor mSFA_mkl = get<2>(load_inputs);
    Tensor mSFB_nkl = get<3>(load_inputs);
    Tensor iSFA_mkl = make_identity_tensor(shape(mSFA_mkl.layout()));  // (m,k,l)
    Tensor iSFB_nkl = make_identity_tensor(shape(mSFB_nkl.layout()));  // (n,k,l)
    Tensor gSFA_k = local_tile(mSFA_mkl, TileShape{}, make_coord(_, _, _),
                               Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor cSFA_k = local_tile(iSFA_mkl, TileShape{}, make_coord(_, _, _),
                               Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor gSFB_k = local_tile(mSFB_nkl, TileShape{}, make_coord(_, _, _),
                               Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    Tensor cSFB_k = local_tile(iSFB_nkl, TileShape{}, make_coord(_, _, _),
                               Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    TiledCopy scale_copy_b = make_tiled_copy(typename Base::CopyAtomSFB{}, Layout<Shape<_32>>{},
                                             Layout<Shape<_1>>{});
    // A's: the same thread-to-element map, each element its own zero-filling cp.async
    TiledCopy scale_copy_a = make_tiled_copy(typename Base::CopyAtomSFA{}, Layout<Shape<_32>>{},
                                             Layout<Shape<_1>>{});
    ThrCopy thr_a = scale_copy_a.get_slice(thread_idx);
    ThrCopy thr_b = scale_copy_b.get_slice(thread_idx);
    Tensor tSFAgSFA_k = thr_a.partition_S(gSFA_k);
    Tensor tSFAcSFA_k = thr_a.partition_S(cSFA_k);
    Tensor tSFAsSFA = thr_a.partition_D(sSFA);
    Tensor tSFBgSFB_k = thr_b.partition_S(gSFB_k);
    Tensor tSFBcSFB_k = thr_b.partition_S(cSFB_k);
    Tensor tSFBsSFB = thr_b.partition_D(sSFB);
    Tensor tSFBpSFB = make_tensor<bool>(shape(filter_zeros(tSFBsSFB(_, _, _, _0{}))));
    auto SFA_shape = shape(mSFA_mkl.layout());
    auto SFB_shape = shape(mSFB_nkl.layout());
    // NOTE: a zero-filled element reads no byte; its source address is the group's first
    // scale, which exists (a tile has a row)
    const ScaleT* safe_src = raw_pointer_cast(mSFA_mkl.data());
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      const int write_stage = smem_pipe_write.index();
      if (thread_idx < Base::ScaleMsPerTile) {
        Tensor src = filter_zeros(tSFAgSFA_k(_, _, _, *k_tile_iter));
        Tensor coord = filter_zeros(tSFAcSFA_k(_, _, _, *k_tile_iter));
        Tensor dst = filter_zeros(tSFAsSFA(_, _, _, write_stage));
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(dst); ++i) {
          const bool in = elem_less(coord(i), SFA_shape);
          SM80_CP_ASYNC_CACHEALWAYS_ZFILL<ScaleT>::copy(in ? src(i) : *safe_src, dst(i), in);
        }
      }
      const bool load_sfb = thread_idx < Base::ScaleNsPerTile;
      Tensor tSFBcSFB_compact = filter_zeros(tSFBcSFB_k(_, _, _, *k_tile_iter));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSFBpSFB); ++i) {
        tSFBpSFB(i) = load_sfb && elem_less(tSFBcSFB_compact(i), SFB_shape);
      }
      copy_if(scale_copy_b, tSFBpSFB, filter_zeros(tSFBgSFB_k(_, _, _, *k_tile_iter)),
              filter_zeros(tSFBsSFB(_, _, _, write_stage)));
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

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

    if (warp_group > 0) {  // an idle warpgroup (the header's note)? Row 0 always is a row.
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      constexpr int kSliceRows = size<0>(TileShape{}) / kWarpGroups;
      Tensor sSFA_stages = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()),
                                       typename Base::SmemLayoutSFA{});  // (BLK_M,BLK_K,P)
      if (sSFA_stages(warp_group * kSliceRows, 0, smem_pipe_read.index()) == ScaleElement(0)) {
        // NOTE: every stage is waited for before it is released (the empty barriers count
        // this warpgroup's arrivals phase by phase); the last is mma_tail's, as below
        ++smem_pipe_read;
        for (int k = 1; k < k_tile_count; ++k) {
          pipeline.consumer_wait(smem_pipe_read);
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
          ++smem_pipe_read;
        }
        return;
      }
    }

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
