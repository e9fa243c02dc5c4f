// Role: the grouped-GEMM engine's configuration on sm_90a. The kernel itself is CUTLASS 3's
// persistent, warp-specialised ptr-array grouped GEMM (one TMA producer warp, two cooperative
// wgmma consumer warpgroups, a multi-stage shared-memory pipeline, a group-aware persistent tile
// scheduler); this header fixes its tile, cluster and operand types once, so every mok grouped
// GEMM (and a later megakernel that reuses the mainloop) agrees on them.
//
// NOTE: groups (experts) come from device-side row offsets turned into problem/pointer/stride
// arrays by scheduler/grouped_problems.cuh: the host never reads a row count. No split-K: each
// output tile is reduced by one CTA over K in order, so results are bitwise reproducible.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace mok::gemm {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M,N,K)
using ProblemSize = ProblemShape::UnderlyingProblemShape;
using Element = cutlass::bfloat16_t;
using Accumulator = float;

constexpr int kAlignment = 8;  // elements per 16 bytes: TMA needs 16-byte aligned rows

// Operand layouts, CUTLASS naming: A is (M,K), B is (N,K) as stored in memory.
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
// NOTE: 1x1x1 clusters, no TMA multicast between CTAs, unless a schedule says otherwise.
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

// Three schedules. Cooperative: both consumer warpgroups share one 128x256 tile (the default, and
// the only one the SwiGLU epilogues use). Pingpong: each consumer warpgroup owns a 128x128 tile
// and its epilogue overlaps the other's mainloop (helps short K). CooperativeCluster2: the
// cooperative tile, two CTAs sharing B (the weight-gradient ops only).
struct Cooperative {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = gemm::ClusterShape;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = gemm::ClusterShape;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
// The cooperative tile in clusters of two CTAs along M (the weight gradients' schedule choice):
// the pair computes two m-tiles of one n-tile, and each CTA loads half of the shared B tile and
// multicasts it to both (TMA multicast inside the cluster, not NVLink multicast), so a k-tile
// reads 16 + 16 KB from L2 per CTA instead of 16 + 32. Each tile's arithmetic is the
// cooperative's: bitwise the same results. CUTLASS's group scheduler rounds each group's m-tiles
// up to the pair, so an odd count gives the last pair a tile past M that computes on the TMA's
// zero fill and stores nothing (the weight gradients' M, 2I or H, is a multiple of 256 for every
// benchmark shape).
struct CooperativeCluster2 {
  using TileShape = Cooperative::TileShape;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using KernelSchedule = Cooperative::KernelSchedule;
  using EpilogueSchedule = Cooperative::EpilogueSchedule;
};
using TileShape = Cooperative::TileShape;  // the SwiGLU epilogues' tile

// The plain epilogue: D = ElementD(accumulator) (bf16 unless asked), stored by TMA, no source
// operand; on the schedule's tile and cluster. TMA alignment: 16 bytes of ElementD.
template <class LayoutD, class Schedule = Cooperative, class ElementD = Element>
using PlainEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Schedule::TileShape,
    typename Schedule::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, Accumulator,
    Accumulator, void, LayoutD*, 16 / sizeof(ElementD), ElementD, LayoutD*, 16 / sizeof(ElementD),
    typename Schedule::EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, Accumulator>>::CollectiveOp;

// The weight-gradient accumulators: fp32 (Megatron's main_grad) by default; bf16 where a
// weight's .grad is summed over macrobatch rounds in place (functional/cuda/stage1.py).
using AccumElement = float;

// The accumulating epilogue: D = beta * C + alpha * accumulator with alpha = beta = 1 and C = D,
// one buffer of `ElementAcc`, so a weight gradient adds into it with no separate pass. NOTE:
// CUTLASS evaluates fma(beta, C, alpha * acc) in fp32: with alpha = beta = 1 that is C + acc
// rounded once to ElementAcc (for fp32, the same bits as adding the fp32 GEMM result in a separate
// pass). In place is safe: every element of D reads only its own element of C, and output tiles
// never overlap. TMA alignment: 16 bytes of ElementAcc.
template <class LayoutD, class Schedule = Cooperative, class ElementAcc = AccumElement>
using AccumulateEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Schedule::TileShape,
    typename Schedule::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, Accumulator,
    Accumulator, ElementAcc, LayoutD*, 16 / sizeof(ElementAcc), ElementAcc, LayoutD*,
    16 / sizeof(ElementAcc), typename Schedule::EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementAcc, Accumulator, ElementAcc,
                                                 Accumulator>>::CollectiveOp;

// TMA reduce-add as the grouped epilogue's store: cp.reduce.async.bulk.tensor .add sends each
// epilogue subtile from shared memory to be added into global memory by the L2, so an fp32
// accumulator is read, added to and written there, and the consumer warpgroups go on to their
// next tile without waiting for it. CuTe has the op (SM90_TMA_REDUCE_ADD) but not the
// descriptor-swapping `with()` the ptr-array epilogue calls once per group; these two ops add it,
// as SM90_TMA_STORE / SM90_TMA_STORE_PTR do for the plain store (traits below, in cute).
struct TmaReduceAddGrouped : cute::SM90_TMA_REDUCE_ADD {};
struct TmaReduceAddGroupedPtr : cute::SM90_TMA_REDUCE_ADD {};

template <class Epilogue>
struct WithReduceAddStore;
template <class Policy, class Tile, class EpiTile, class C, class StrideC, class D, class StrideD,
          class Fusion, class G2S, class SmemAtomC, class S2R, class S2G, class SmemAtomD,
          class R2S, class CopyAtomC, class R2R>
struct WithReduceAddStore<cutlass::epilogue::collective::CollectiveEpilogue<
    Policy, Tile, EpiTile, C, StrideC, D, StrideD, Fusion, G2S, SmemAtomC, S2R, S2G, SmemAtomD,
    R2S, CopyAtomC, R2R>> {
  static_assert(std::is_same_v<S2G, cute::SM90_TMA_STORE> && std::is_void_v<C>,
                "the reduce-add store replaces a plain TMA store of a sourceless epilogue");
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      Policy, Tile, EpiTile, C, StrideC, D, StrideD, Fusion, G2S, SmemAtomC, S2R,
      TmaReduceAddGrouped, SmemAtomD, R2S, CopyAtomC, R2R>;
};

// The fp32 accumulating epilogue (Megatron's main_grad): D += accumulator, the fp32 plain
// epilogue whose subtiles leave by TMA reduce-add. NOTE: the L2 adds in fp32 and rounds once, so
// what lands is old + accumulator rounded once to fp32, the same bits as AccumulateEpilogue's
// fma(1, C, 1 * acc) and as a separate fp32 add pass; output tiles never overlap, so each
// element gets exactly one add per launch (deterministic). bf16 accumulators keep
// AccumulateEpilogue: a bf16 reduce would round the accumulator to bf16 before adding.
template <class LayoutD, class Schedule = Cooperative>
using ReduceAddEpilogue =
    typename WithReduceAddStore<PlainEpilogue<LayoutD, Schedule, AccumElement>>::type;

// The mainloop + kernel for one (LayoutA, LayoutB, epilogue, schedule) choice. `Shape` picks the
// tile scheduler: ProblemShape gets CUTLASS's group scheduler, scheduler/flag_wait.cuh's
// FlagWaitProblemShape the one with the per-tile flag wait.
template <class LayoutA, class LayoutB, class CollectiveEpilogue, class Schedule = Cooperative,
          class Shape = ProblemShape>
struct GroupedGemm {
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element,
      LayoutB*, kAlignment, Accumulator, typename Schedule::TileShape,
      typename Schedule::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape, Mainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
};

// What both reduce-add traits below issue: the shared-memory tile `src` added into global memory
// at `dst`'s TMA coordinates, through descriptor `desc`.
template <class TS, class SLayout, class TD, class DLayout>
CUTE_HOST_DEVICE void tma_reduce_add(cute::TmaDescriptor const* desc,
                                     cute::Tensor<TS, SLayout> const& src,
                                     cute::Tensor<TD, DLayout>& dst) {
  static_assert(cute::is_smem<TS>::value, "TMA reduce-add reads shared memory");
  cute::detail::explode_tuple(
      cute::detail::CallCOPY<cute::SM90_TMA_REDUCE_ADD>{},
      cute::make_tuple(static_cast<void const*>(desc), cute::raw_pointer_cast(src.data())),
      cute::seq<0, 1>{}, dst.data().coord_, cute::tuple_seq<decltype(dst.data().coord_)>{});
}

}  // namespace mok::gemm

namespace cute {
// Copy_Traits of mok::gemm::TmaReduceAddGrouped: SM90_TMA_REDUCE_ADD's, plus `with(desc)` giving
// the same op on another descriptor (the ptr-array epilogue's per-group tensormap).
template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<mok::gemm::TmaReduceAddGrouped, NumBitsPerTMA, AuxParams_> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor tma_desc_;
  using AuxParams = AuxParams_;
  AuxParams aux_params_;

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }

  template <class GShape>
  CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
    static_assert(is_congruent<decltype(g_shape), decltype(aux_params_.g_stride_)>::value);
    return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
  }

  CUTE_HOST_DEVICE constexpr Copy_Traits<mok::gemm::TmaReduceAddGroupedPtr, NumBitsPerTMA> with(
      TmaDescriptor const* new_tma_desc) const {
    return {new_tma_desc};
  }

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits,
                                                     Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    mok::gemm::tma_reduce_add(&traits.tma_desc_, src, dst);
  }
};

template <class NumBitsPerTMA>
struct Copy_Traits<mok::gemm::TmaReduceAddGroupedPtr, NumBitsPerTMA> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor const* tma_desc_;

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits,
                                                     Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    mok::gemm::tma_reduce_add(traits.tma_desc_, src, dst);
  }
};
}  // namespace cute
