// Role pieces of the megakernels' GEMM tasks: the CUTLASS sm90 collective mainloops, the
// producer's TMA loads of one task, the consumers' mainloop call, and the epilogues (forward L1:
// SwiGLU into the act ring; backward first GEMM: the SwiGLU backward into the d_h ring and the
// router-weight gradient's partial sums; either pass's second GEMM: bf16 rows into the source
// ranks' slot_rows).
//
// Forward, one mainloop type for L1 and L2: both are "A row-major [rows, K] times B [N, K]
// K-contiguous per expert" (L1: x_ring x w_gate_up[e], K = H; L2: act_ring x w_down[e], K = I),
// each with its own Params (two TMA descriptors, made on the host by the collective's
// to_underlying_arguments). Backward, the data gradients read the same weights untransposed, so
// B is N-contiguous (MegaMainloopNN): the L2 dgrad d_ring [rows, H] x w_down[e] [H, I] and the
// L1 dgrad d_h_ring [rows, 2I] x w_gate_up[e] [2I, H].
// NOTE: the TiledMma is the grouped-GEMM engine's cooperative 128x256x64 one (same builder, same
// tile, same operand majors), and the mainloop reduces K in the same order, so an output tile's
// fp32 accumulators are bitwise those of grouped_gemm_l1_swiglu / grouped_gemm_nt on the same rows.
#pragma once

#include <cuda_bf16.h>

#include <cutlass/pipeline/sm90_pipeline.hpp>
#include <cstdint>
#include <type_traits>

#include "mok/common/bf16x8.cuh"
#include "mok/roles/epilogue_swiglu.cuh"
#include "mok/roles/grouped_gemm_config.cuh"
#include "mok/roles/megakernel_tasks.cuh"
#include "mok/roles/row_grad.cuh"
#include "mok/roles/swiglu.cuh"

namespace mok::gemm {

using MegaTileShape = Cooperative::TileShape;  // 128 x 256 x 64
static_assert(cute::size<0>(MegaTileShape{}) == layout::kBlockM &&
              cute::size<1>(MegaTileShape{}) == layout::kBlockN,
              "the plan's tile sizes (layout/mega.cuh) must be the mainloop's");

constexpr int kMegaSmemCarveout = 1024;  // bytes of shared memory left to the kernel's own use

// The CTAs of a megakernel's cluster, (1, C, 1) in CUTLASS's (M, N, K) order: the C CTAs run C
// n-tiles of one m-tile and share its A tile by TMA multicast (layout::kMaxClusterCtas).
template <int kCluster>
using MegaClusterShape = cute::Shape<cute::_1, cute::Int<kCluster>, cute::_1>;
static_assert(std::is_same_v<MegaClusterShape<1>, ClusterShape>, "1 CTA: the engine's cluster");
// The cluster as launched (launch/moe_megakernel.cu: clusterDim.x = C): CTA c of the cluster is
// at (c, 0, 0), and its rank is c, which is the slice of A it loads (load_task).
template <int kCluster>
using MegaLaunchCluster = cute::Shape<cute::Int<kCluster>, cute::_1, cute::_1>;

// The non-array TMA + wgmma collective (MainloopSm90TmaGmmaWarpSpecialized) for B [N, K] of
// layout LayoutB: ColumnMajor (K contiguous, the forward's) or RowMajor (N contiguous, the
// backward's: the same tile and schedule). In a cluster of C > 1 its A loads are multicast.
template <class LayoutB, int kCluster, class LayoutA = RowMajor>
using MegaMainloopFor = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlignment, Element,
    LayoutB, kAlignment, Accumulator, MegaTileShape, MegaClusterShape<kCluster>,
    cutlass::gemm::collective::StageCountAutoCarveout<kMegaSmemCarveout>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using MegaMainloop = MegaMainloopFor<ColumnMajor, 1>;
using MegaMainloopNN = MegaMainloopFor<RowMajor, 1>;
// The backward's down-weight gradient (one CTA per task): A = the d_out rows transposed (M = H,
// K = rows: M-major, ColumnMajor) and B = bf16(w * a) rows (N = I, K = rows: N-major, RowMajor),
// as grouped_gemm_tn's operands. Same tile, stages and pipeline as the data gradients' mainloop;
// its own shared-memory layouts (MN-major swizzle atoms) over the same bytes (wgrad_smem).
using MegaMainloopWgrad = MegaMainloopFor<RowMajor, 1, ColumnMajor>;
using MegaPipeline = typename MegaMainloop::MainloopPipeline;
using MegaPipelineState = typename MegaMainloop::PipelineState;
using MegaTiledMma = typename MegaMainloop::TiledMma;

// A pass's mainloop: the forward's (B K-contiguous) or the backward's (B N-contiguous), in
// clusters of kCluster CTAs.
template <bool kBackward, int kCluster = 1>
using MegaMainloopOf =
    MegaMainloopFor<std::conditional_t<kBackward, RowMajor, ColumnMajor>, kCluster>;

template <int kCluster>
constexpr bool one_pipeline_and_smem() {
  using F = MegaMainloopOf<false, kCluster>;
  using B = MegaMainloopOf<true, kCluster>;
  return std::is_same_v<typename F::MainloopPipeline, MegaPipeline> &&
         std::is_same_v<typename B::MainloopPipeline, MegaPipeline> &&
         sizeof(typename F::TensorStorage) == sizeof(typename MegaMainloop::TensorStorage) &&
         sizeof(typename B::TensorStorage) == sizeof(typename MegaMainloop::TensorStorage);
}
static_assert(one_pipeline_and_smem<1>() && one_pipeline_and_smem<layout::kMaxClusterCtas>(),
              "both passes' mainloops, in every cluster size: one pipeline type and the same "
              "shared memory");
static_assert(std::is_same_v<typename MegaMainloopWgrad::MainloopPipeline, MegaPipeline> &&
                  sizeof(typename MegaMainloopWgrad::TensorStorage) ==
                      sizeof(typename MegaMainloop::TensorStorage) &&
                  cute::cosize_v<typename MegaMainloopWgrad::SmemLayoutA> ==
                      cute::cosize_v<typename MegaMainloop::SmemLayoutA> &&
                  MegaMainloopWgrad::TmaTransactionBytes == MegaMainloop::TmaTransactionBytes,
              "the weight-gradient mainloop shares the data gradients' stages: one pipeline, the "
              "same shared memory, A's stages first and B's after at the same offsets, and the "
              "same bytes per stage");
static_assert(cute::size<2>(MegaTileShape{}) == layout::kWgradRowAlign,
              "the weight gradient's B rows are aligned to its k-tile (layout/mega.cuh)");

// The data gradients' stages seen as the weight-gradient mainloop's (the same bytes: A's stages
// at the start, B's after them, in both).
template <class TensorStorage>
CUTLASS_DEVICE typename MegaMainloopWgrad::TensorStorage& wgrad_smem(TensorStorage& smem) {
  static_assert(sizeof(TensorStorage) == sizeof(typename MegaMainloopWgrad::TensorStorage),
                "one stage layout in bytes");
  return *reinterpret_cast<typename MegaMainloopWgrad::TensorStorage*>(&smem);
}

// The two GEMMs' TMA descriptors (forward L1: x_ring, w_gate_up; L2: act_ring, w_down;
// backward first: d_ring, w_down; second: d_h_ring, w_gate_up).
template <class Mainloop>
struct MegaGemmParamsOf {
  typename Mainloop::Params l1;
  typename Mainloop::Params l2;
};
using MegaGemmParams = MegaGemmParamsOf<MegaMainloop>;
// The down weight's gradient added into float32 main_grad (MegaParams::wgrad kWgradAddF32) by TMA
// reduce-add (wgrad_reduce_epilogue): boxes of one consumer warp's rows of a tile (kWgradEpiRows
// of H: a wgmma fragment's warp holds 16 rows) by kWgradEpiCols columns of I, staged in shared
// memory, row-major, each warp's own.
constexpr int kWgradEpiRows = 16;
constexpr int kWgradEpiCols = 16;
constexpr int kWgradEpiBuffers = 2;  // per warp: one filling while the other drains
constexpr int kConsumerWarps = 8;
using WgradEpiSmemLayout =
    cute::Layout<cute::Shape<cute::Int<kWgradEpiRows>, cute::Int<kWgradEpiCols>>,
                 cute::Stride<cute::Int<kWgradEpiCols>, cute::_1>>;
// Its descriptor over main_grad [E_l, H, I] float32, as (H, I, E_l) coordinates.
inline auto make_wgrad_reduce_tma(float* acc, int num_experts, int hidden, int inter) {
  using namespace cute;
  Tensor g = make_tensor(make_gmem_ptr(acc),
                         make_layout(make_shape(hidden, inter, num_experts),
                                     make_stride(int64_t{inter}, _1{}, int64_t{hidden} * inter)));
  return make_tma_copy(SM90_TMA_REDUCE_ADD{}, g, WgradEpiSmemLayout{});
}
using MegaWgradReduceTma = decltype(make_wgrad_reduce_tma(nullptr, 1, 64, 16));

// The BF16 megakernels' own shared memory beside the stages (MegaComputeStorage::scratch; both
// passes have it, so that one size serves both): the wgrad epilogue's staging boxes.
struct MegaBf16Scratch {
  alignas(128) float wgrad_boxes[kConsumerWarps][kWgradEpiBuffers][kWgradEpiRows * kWgradEpiCols];
};

// The backward's: its two data gradients and the down weight's gradient (wgrad: A = x_ring, the
// d_out rows; B = MegaArgs::wgrad_b).
template <class Mainloop>
struct MegaBwdGemmParamsOf {
  typename Mainloop::Params l1;
  typename Mainloop::Params l2;
  typename MegaMainloopWgrad::Params wgrad;
  MegaWgradReduceTma wgrad_reduce;  // main_grad's (kWgradAddF32)
};

// One task's operands: A rows [row_begin, row_begin + 128) of the ring, n-tile `n_tile` of
// expert `expert`'s B [n_size, k_size]; k_tiles = ceil(k_size / 64); `round` for a timeout's
// record.
struct MegaLoad {
  int row_begin;
  int n_tile;
  int expert;
  int n_size;       // B rows per expert: 2I (L1) or H (L2)
  int k_size;       // H (L1) or I (L2)
  int k_tiles;
  int num_experts;  // E_l
  int round;
};

// One thread (a pipeline's producer): waits until slot `state` of `pipeline` (the mainloop's, or
// the ticket queue) is free, then acquires it (the mainloop's: arms the stage's transaction
// bytes). Bounded, unlike the pipeline's own producer_acquire: a slot that never frees (a
// consumer that stopped; in a cluster, CTAs out of step) records the timeout (phase
// kProducerSlot; index: the waiting CTA; seen: the pipeline slot; expected: the slot's use, the
// state's count over the stages) and traps instead of hanging unnamed.
// NOTE: the record names the CTA, not the task: nothing more stays live in the producer warp's
// 40 registers across the k-tile loop.
// `before_arm(stage)` runs once the slot is free, before the full barrier is armed (whose arrival
// releases what it stored to the consumers: the FP8 mainloop's weight scale of the stage).
struct NoArmHook {
  CUTLASS_DEVICE void operator()(int) const {}
};
// acquire_slot's bounded wait alone, without arming (rows in place: the stage is armed by the
// leader once every row's copies are tracked).
template <class Pipeline, class State>
CUTLASS_DEVICE void wait_slot(const roles::MegaParams& p, Pipeline& pipeline, const State& state,
                              int round) {
  const auto phase = roles::pass_phase(p, layout::MegaPhase::kProducerSlot);
  uint64_t start_ns = 0;
  while (pipeline.producer_try_acquire(state) != cutlass::BarrierStatus::WaitDone) {
    const uint64_t now = comm::global_timer_ns();
    if (start_ns == 0) {
      start_ns = now;
    } else if (static_cast<int64_t>(now - start_ns) > roles::timeout_of(p, phase)) {
      const int cta = static_cast<int>(blockIdx.x);
      const roles::MegaWaitSite site{phase, round, cta, 0};
      roles::report_mega_timeout(p, site, cta, -1, static_cast<int32_t>(state.index()),
                                 static_cast<int32_t>(state.count() / Pipeline::Stages));
    }
  }
}

// `row_arrivals`: arrivals added beside the arming one, for a mainloop pipeline whose full
// barriers also count the rows-in-place loaders' (kInPlaceRowArrivals) on a stage whose A comes
// by TMA (an L2 task's); 0 elsewhere.
template <class Pipeline, class State, class BeforeArm = NoArmHook>
CUTLASS_DEVICE void acquire_slot(const roles::MegaParams& p, Pipeline& pipeline,
                                 const State& state, int round, BeforeArm before_arm = {},
                                 uint32_t row_arrivals = 0) {
  wait_slot(p, pipeline, state, round);
  before_arm(static_cast<int>(state.index()));
  pipeline.producer_acquire(state, {cutlass::BarrierStatus::WaitDone});
  if (row_arrivals != 0) {
    ptx::mbarrier_arrive_count(cute::cast_smem_ptr_to_uint(pipeline.producer_get_barrier(state)),
                               row_arrivals);
  }
}

// Producer (one thread, the pipeline's leader): k_tiles stages from `state` on, stage k holding
// k-tile k of gA (BLK_M, BLK_K, k) and gB (BLK_N, BLK_K, k), the TMA coordinate tiles of one
// task (load_task, load_wgrad_task). In a cluster (1, C, 1): this CTA loads its slice of the
// shared A tile into every CTA of the cluster (each one's full barrier counts the bytes), and all
// of its own B tile. `row_arrivals`: as acquire_slot's.
template <class Mainloop, class TileA, class TileB>
CUTLASS_DEVICE void issue_task_stages(const roles::MegaParams& p,
                                      typename Mainloop::Params const& mp,
                                      MegaPipeline& pipeline, MegaPipelineState state,
                                      typename Mainloop::TensorStorage& smem, const TileA& gA,
                                      const TileB& gB, int k_tiles, int round,
                                      uint32_t row_arrivals) {
  using namespace cute;
  Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), typename Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename Mainloop::SmemLayoutB{});
  constexpr int kCluster = size<1>(typename Mainloop::DispatchPolicy::ClusterShape{});
  auto block_tma_a = mp.tma_load_a.get_slice(kCluster > 1 ? cute::block_rank_in_cluster() : 0);
  auto block_tma_b = mp.tma_load_b.get_slice(0);
  Tensor tAgA = block_tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
  Tensor tAsA = block_tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
  Tensor tBgB = block_tma_b.partition_S(gB);
  Tensor tBsB = block_tma_b.partition_D(sB);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < k_tiles; ++k) {
    acquire_slot(p, pipeline, state, round, NoArmHook{}, row_arrivals);  // arms the bytes
    auto* full = pipeline.producer_get_barrier(state);
    const int stage = state.index();
    if constexpr (kCluster > 1) {
      constexpr auto kEveryCta = static_cast<uint16_t>((1u << kCluster) - 1);
      copy(mp.tma_load_a.with(*full, kEveryCta), tAgA(_, _, _, k), tAsA(_, _, _, stage));
    } else {
      copy(mp.tma_load_a.with(*full, 0), tAgA(_, _, _, k), tAsA(_, _, _, stage));
    }
    copy(mp.tma_load_b.with(*full, 0), tBgB(_, _, _, k), tBsB(_, _, _, stage));
    ++state;
  }
}

// Producer (one thread: warp 0's lane 0, the pipeline's leader): issues the k-tiles of one task
// from `state` on (the caller advances its state by k_tiles, in every lane). A is the TMA
// coordinate tensor of the whole ring shifted by row_begin (domain_offset), so a tile may start
// at any row; rows past the ring are zero-filled by TMA, rows of the next m-tile are loaded,
// computed and discarded by the epilogue (an output row depends on its own A row only).
// NOTE: the coordinate tensors are (rows, K) and (N, K, E) whatever the operands' majors: the
// descriptors map them onto memory.
// `row_arrivals`: as acquire_slot's (the loaders' arrivals where the rows are read in place).
template <class Mainloop>
CUTLASS_DEVICE void load_task(const roles::MegaParams& p, typename Mainloop::Params const& mp,
                              MegaPipeline& pipeline, MegaPipelineState state,
                              typename Mainloop::TensorStorage& smem, const MegaLoad& load,
                              uint32_t row_arrivals = 0) {
  using namespace cute;
  // TMA coordinate tensors (their shapes only shape the tiling; the descriptors, made over the
  // whole ring and the whole weight, bound every access). A: the 128-row window at row_begin.
  Tensor mA = mp.tma_load_a.get_tma_tensor(make_shape(get<0>(MegaTileShape{}), load.k_size, 1));
  Tensor mB = mp.tma_load_b.get_tma_tensor(make_shape(load.n_size, load.k_size, load.num_experts));
  Tensor gA = local_tile(domain_offset(make_coord(load.row_begin, 0), mA(_, _, 0)),
                         select<0, 2>(MegaTileShape{}), make_coord(0, _));  // (BLK_M, BLK_K, k)
  Tensor gB = local_tile(mB(_, _, load.expert), select<1, 2>(MegaTileShape{}),
                         make_coord(load.n_tile, _));  // (BLK_N, BLK_K, k)
  issue_task_stages<Mainloop>(p, mp, pipeline, state, smem, gA, gB, load.k_tiles, load.round,
                              row_arrivals);
}

// One down-weight gradient task's operands (MegaParams::wgrad): expert rows from ring row
// k_begin on (A: the d_out rows of x_ring, transposed) and from B row b_begin on, tile m_tile of
// H by n_tile of I; k_tiles = ceil(the expert's rows / kWgradRowAlign).
struct MegaWgradLoad {
  int k_begin;
  int b_begin;
  int m_tile;
  int n_tile;
  int k_tiles;
  int round;
};

// Producer (one thread, as load_task): issues one down-weight gradient task's k-tiles. A last
// k-tile's rows past the expert are the next expert's d_out rows (or zero rows the comm CTAs
// pulled, or TMA's zeros past the ring) times B's zero rows: each such product is 0, and the tile
// sums the expert's rows only, as grouped_gemm_tn, whose k-tiles start at the same row.
CUTLASS_DEVICE void load_wgrad_task(const roles::MegaParams& p,
                                    typename MegaMainloopWgrad::Params const& mp,
                                    MegaPipeline& pipeline, MegaPipelineState state,
                                    typename MegaMainloopWgrad::TensorStorage& smem,
                                    const MegaWgradLoad& load) {
  using namespace cute;
  using Mainloop = MegaMainloopWgrad;
  // (M, K) coordinate tensors whatever the majors (load_task's NOTE): A (H, ring rows), B (I, its
  // rows); their K extents only shape the tiling, the descriptors bound every access.
  const int b_rows = p.ring_rows + layout::kWgradRowAlign * p.num_local_experts;
  Tensor mA = mp.tma_load_a.get_tma_tensor(make_shape(p.hidden, p.ring_rows, 1));
  Tensor mB = mp.tma_load_b.get_tma_tensor(make_shape(p.inter, b_rows, 1));
  Tensor gA = local_tile(domain_offset(make_coord(0, load.k_begin), mA(_, _, 0)),
                         select<0, 2>(MegaTileShape{}), make_coord(load.m_tile, _));
  Tensor gB = local_tile(domain_offset(make_coord(0, load.b_begin), mB(_, _, 0)),
                         select<1, 2>(MegaTileShape{}), make_coord(load.n_tile, _));
  issue_task_stages<Mainloop>(p, mp, pipeline, state, smem, gA, gB, load.k_tiles, load.round,
                              0);
}

// Rows in place (MoKConfig.fwd_rows="in_place", one rank): an L1 task reads its A rows straight
// from the token rows [T, H] instead of from the ring a comm CTA filled. The 128 threads of the
// producer warpgroup copy each k-tile's 128 rows x 128 bytes with cp.async, 16-byte chunks into
// the stage under its 128-byte swizzle (chunk c of row r at chunk c ^ (r % 8) of the row's 128
// bytes: CuTe's Swizzle<3, 4, 3> of the K-major SW128 atom, the stage 1024-byte aligned), and
// each thread's cp.async.mbarrier.arrive makes the stage's full barrier wait for its copies. B is
// the leader's TMA as in load_task, armed and issued as soon as the stage is free.
// NOTE: lane l of warp w copies chunk l % 8 of rows 32 w + 4 j + l / 8, j = 0..7: each copy
// instruction of a warp reads 4 whole 128-byte rows. A row per thread (the first cp.async build,
// ba4fee4, not run) read 32 rows' 16 bytes per instruction, half of each 32-byte sector, and the
// next chunk's instruction the same sectors again (cp.async.cg does not keep them in L1): twice
// A's L2 bytes, in a mainloop bound by the L2 (docs/perf_notes.md). The rows' tokens go through
// shared memory (MegaComputeStorage::row_tokens) so that each thread can reach 8 rows.
// NOTE: one 2D TMA box per row (built first, commit 10e9f45) issues 128 TMAs per k-tile, which
// a warp sends one lane at a time (a TMA's coordinates are uniform registers): the L1 k-tile
// then took 1300 ns against the pull's 680 on one H200 (megakernel_trace_h200_fefeac9_*.json).
constexpr int kRowLoaderThreads = 128;  // the producer warpgroup
static_assert(kRowLoaderThreads == layout::kBlockM, "the row loaders write one token each");
constexpr int kBlockK = cute::size<2>(MegaTileShape{});
constexpr int kRowChunks = kBlockK * static_cast<int>(sizeof(Element)) / 16;  // 16-byte chunks
constexpr int kRowsPerCopy = 32 / kRowChunks;  // whole rows one warp instruction copies
constexpr int kCopiesPerThread = layout::kBlockM * kRowChunks / kRowLoaderThreads;
using MegaSmemLayoutA = typename MegaMainloop::SmemLayoutA;
static_assert(std::is_same_v<typename MegaMainloop::SmemLayoutAtomA,
                             decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{})> &&
                  kRowChunks == 8 && cute::size<0>(MegaSmemLayoutA{}) == layout::kBlockM &&
                  cute::size<1>(MegaSmemLayoutA{}) == kBlockK,
              "rows in place: a stage of A is 128 K-major rows of one 128-byte swizzle atom's "
              "width (8 chunks of 16 bytes, chunk c of row r at c ^ (r % 8)), 128 bytes apart");
constexpr int kStageAElems = layout::kBlockM * kBlockK;
static_assert(cute::cosize_v<MegaSmemLayoutA> == kStageAElems * MegaMainloop::DispatchPolicy::Stages &&
                  kStageAElems * sizeof(Element) % 1024 == 0,
              "rows in place: the stages of A are consecutive, each 1024-byte aligned");
constexpr auto kALayout = cute::get_nonswizzle_portion(MegaSmemLayoutA{});
static_assert(kALayout(1, 0, 0) == kBlockK && kALayout(8, 0, 0) == 8 * kBlockK &&
                  kALayout(0, 1, 0) == 1 && kALayout(0, 0, 1) == kStageAElems &&
                  std::is_same_v<decltype(cute::get_swizzle_portion(MegaSmemLayoutA{})),
                                 cute::Swizzle<3, 4, 3>>,
              "rows in place: row r at r * 128 bytes, stages consecutive, SW128 on byte addresses");
constexpr uint32_t kStageBBytes = layout::kBlockN * kBlockK * sizeof(Element);
// The BF16 forward with its rows in place: each stage's full barrier counts the leader's arming
// arrival and one cp.async arrival (.noinc) of each row loader, made when that thread's copies
// of the stage have landed (load_task_rows); a stage of an L2 task, all TMA, gets the loaders'
// arrivals from the leader (load_task's row_arrivals).
constexpr uint32_t kInPlaceRowArrivals = kRowLoaderThreads;
static_assert(kStageAElems * sizeof(Element) + kStageBBytes == MegaMainloop::TmaTransactionBytes,
              "rows in place: the stage's TMA bytes are B's alone");

// One thread's share of a k-tile's 128 rows x 128 bytes, copied in place (both precisions: a
// bf16 k-tile and an e4m3 K block are 128 bytes a row). Lane l of warp w copies chunk l % 8 of
// rows first_row + 4 j, first_row = 32 w + l / 8, j = 0..7 (the NOTE above). In a stage, row r is
// at r * 128 bytes and its chunk c at c ^ (r % 8); for copy j that is chunk ^ (first_row % 8) ^
// 4 (j % 2): the even copies' offset plus 512 j, the odd copies' with bit 6 flipped (immediate
// offsets from two registers, not 8 live ones).
struct RowCopies {
  int chunk;      // the thread's 16-byte chunk of each row
  int first_row;  // the tile row of its first copy
  uint32_t even;  // shared address of copy 0 in stage 0; copy j (even) at + 512 j
  uint32_t odd;   // copy 1's, less 512

  // `smem_a`: the shared address of A's first stage; `row`: the thread's index in the warpgroup.
  CUTLASS_DEVICE RowCopies(uint32_t smem_a, int row) {
    static_assert(kRowsPerCopy == 4 && kRowChunks == 8, "the offsets below");
    const int lane = static_cast<int>(threadIdx.x % 32);
    chunk = lane % kRowChunks;
    first_row = row / 32 * 32 + lane / kRowChunks;
    even = smem_a + static_cast<uint32_t>(first_row * 128) +
           ((static_cast<uint32_t>(chunk) ^ static_cast<uint32_t>(first_row % 8)) << 4);
    odd = even ^ 64u;
  }

  // The thread's rows of one task (rows first_row + kRowsPerCopy * j, j < kCopiesPerThread):
  // each one's element offset in the token rows (token * p.hidden, 32 bits: the host checks
  // that every row's offset fits) and a bit per row that has a token (bit j; -1: zeros), read
  // once per task from `row_tokens` (shared).
  struct Rows {
    uint32_t offset[kCopiesPerThread];
    uint32_t live;
  };

  CUTLASS_DEVICE Rows rows_of(const roles::MegaParams& p, const int32_t* row_tokens) const {
    Rows r;
    r.live = 0u;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCopiesPerThread; ++j) {
      const int32_t t = row_tokens[first_row + kRowsPerCopy * j];
      r.offset[j] = t >= 0 ? static_cast<uint32_t>(t) * static_cast<uint32_t>(p.hidden) : 0u;
      r.live |= static_cast<uint32_t>(t >= 0) << j;
    }
    return r;
  }

  // The copies into the stage at byte offset `stage` of the token rows `rows` (T elements), the
  // task's rows `r`, from column `col` (this thread's chunk, in elements of T): zeros for a row
  // without a token or a column at or past `k_size`.
  // NOTE: each copy's source is an add and a shift from the row's offset, held across the task's
  // k-tiles (ptxas keeps five of the eight in registers and three, with the stage addresses, in
  // local memory: 6011da7's SASS). Before, every k-tile read each row's token from shared memory
  // again and multiplied it by p.hidden, and the 40 registers of the producer warpgroup left the
  // eight copies one dependent chain each (a shared load, a compare, the parameter reloaded, the
  // multiply): Nsight Compute's warp samples of qwen3-30b-a3b's forward had the loaders issuing
  // and the stage-free wait almost never taken, the consumers waiting for full stages (the L1
  // k-tile ~910 ns in place against ~670 pulled; now ~710: docs/perf_notes.md, session 32).
  template <class T>
  CUTLASS_DEVICE void issue(const T* rows, const Rows& r, int col, int k_size,
                            uint32_t stage) const {
    static_assert(16 % sizeof(T) == 0, "16-byte chunks of whole elements");
    const bool in_k = col < k_size;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCopiesPerThread; ++j) {
      const bool live = in_k && ((r.live >> j) & 1u) != 0u;
      const uint32_t dst = (j % 2 ? odd : even) + stage + static_cast<uint32_t>(512 * j);
      ptx::cp_async_16_zfill(dst, rows + (live ? r.offset[j] + static_cast<uint32_t>(col) : 0u),
                             live ? 16 : 0);
    }
  }
};

// Producer thread (one of the warpgroup's 128; lane 0 of each warp waits for the stages): one L1
// task's k-tiles from `state` on (the caller advances its state by k_tiles) with A's rows read in
// place. `row` (the thread's index in the warpgroup) and `token`: one row of the tile and its
// token row (-1: a row past the tile or a padding row, zeros as the ring's zero rows gave), put
// in `row_tokens` (shared) for every thread to read. Columns past H (a last k-tile in part) are
// zeros too. `sync`: the warpgroup's named barrier, after the tokens are written. Every k-tile
// the leader (thread 0) arms B's bytes with its arrival and loads B, and each thread's
// cp.async.mbarrier.arrive.noinc arrives once its copies have landed: the stage's full barrier
// counts 1 + kInPlaceRowArrivals, so it completes when all have, with no barrier between the
// warps per k-tile (which the arrivals counted at their issue, without .noinc, needed).
template <class Mainloop, class Sync>
CUTLASS_DEVICE void load_task_rows(const roles::MegaParams& p, typename Mainloop::Params const& mp,
                                   MegaPipeline& pipeline, MegaPipelineState state,
                                   typename Mainloop::TensorStorage& smem, const MegaLoad& load,
                                   int row, int32_t token, int32_t* row_tokens, Sync sync) {
  using namespace cute;
  static_assert(std::is_same_v<typename Mainloop::SmemLayoutA, MegaSmemLayoutA>,
                "rows in place: the forward's A stages");
  const bool waits = threadIdx.x % 32 == 0, leader = threadIdx.x == 0;
  Tensor mB = mp.tma_load_b.get_tma_tensor(make_shape(load.n_size, load.k_size, load.num_experts));
  Tensor gB = local_tile(mB(_, _, load.expert), select<1, 2>(MegaTileShape{}),
                         make_coord(load.n_tile, _));  // (BLK_N, BLK_K, k)
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename Mainloop::SmemLayoutB{});
  auto block_tma_b = mp.tma_load_b.get_slice(0);
  Tensor tBgB = block_tma_b.partition_S(gB);
  Tensor tBsB = block_tma_b.partition_D(sB);
  row_tokens[row] = token;
  sync();  // every row's token is in shared memory
  static_assert(kBlockK * sizeof(Element) == 128, "RowCopies: 128-byte rows");
  const RowCopies copies(cast_smem_ptr_to_uint(smem.smem_A.data()), row);
  const RowCopies::Rows task_rows = copies.rows_of(p, row_tokens);
  const Element* rows = reinterpret_cast<const Element*>(p.rows);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < load.k_tiles; ++k) {
    if (waits) wait_slot(p, pipeline, state, load.round);
    __syncwarp();  // the stage is free before any lane writes it
    uint64_t* full = pipeline.producer_get_barrier(state);
    if (leader) {
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, kStageBBytes);
      copy(mp.tma_load_b.with(*full, 0), tBgB(_, _, _, k), tBsB(_, _, _, state.index()));
    }
    const uint32_t stage = static_cast<uint32_t>(state.index() * kStageAElems * sizeof(Element));
    copies.issue(rows, task_rows, k * kBlockK + copies.chunk * 8, load.k_size, stage);
    cutlass::arch::cpasync_barrier_arrive_noinc(full);  // once these copies have landed
    ++state;
  }
}

using MegaAccumulators =
    decltype(cute::partition_fragment_C(MegaTiledMma{}, cute::take<0, 2>(MegaTileShape{})));
// NOTE: a wgmma's accumulator fragment does not depend on its operands' majors: the backward's
// tiles use the forward's fragment type, coordinates (thread_coords) and epilogue helpers.
static_assert(std::is_same_v<MegaAccumulators,
                             decltype(cute::partition_fragment_C(
                                 typename MegaMainloopNN::TiledMma{},
                                 cute::take<0, 2>(MegaTileShape{})))> &&
                  std::is_same_v<MegaAccumulators,
                                 decltype(cute::partition_fragment_C(
                                     typename MegaMainloopWgrad::TiledMma{},
                                     cute::take<0, 2>(MegaTileShape{})))>,
              "every mainloop's accumulators are one fragment type");

// Consumers (both warpgroups, 256 threads): the collective's mainloop over one task's k-tiles,
// then its tail (all wgmma done, every slot released); advances `state` past them.
template <class Mainloop, class Accumulators>
CUTLASS_DEVICE void mma_task(typename Mainloop::Params const& mp,
                             typename Mainloop::MainloopPipeline& pipeline,
                             typename Mainloop::PipelineState& state,
                             typename Mainloop::TensorStorage& smem, Accumulators& acc,
                             int k_tiles, int mma_thread_idx) {
  Mainloop mainloop;
  mainloop.mma(pipeline, state, acc, k_tiles, mma_thread_idx, smem, mp);
  mainloop.mma_tail(pipeline, state, k_tiles);
  state.advance(k_tiles);
}

// Rows of a tile per consumer warpgroup (warpgroup 1 computes rows [64, 128)).
constexpr int kConsumerRows = layout::kBlockM / 2;

// Whether this consumer thread's warpgroup has no row of a tile of `rows` rows: warpgroup 1 of
// a tile of at most 64 rows, as an expert's last m-tile often is (at EP 1 about half of
// deepseek-v3's experts spill a few rows into a third m-tile). Such a warpgroup runs idle_task
// instead of mma_task and no epilogue.
MOK_DEVICE bool consumer_rows_idle(int mma_thread_idx, int rows) {
  return mma_thread_idx / cutlass::NumThreadsPerWarpGroup == 1 && rows <= kConsumerRows;
}

// An idle warpgroup's side of one task (consumer_rows_idle): no wgmma; it waits for each
// k-tile's stage and releases it (the other warpgroup's release still gates the refill), so the
// other warpgroup has the SM's tensor cores to itself and the tile takes about half the time.
// The other warpgroup's wgmma sequence is unchanged: its rows are bitwise a full tile's.
// Advances `state` past the task's k-tiles, as mma_task does.
template <class Pipeline, class State>
CUTLASS_DEVICE void idle_task(Pipeline& pipeline, State& state, int k_tiles) {
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < k_tiles; ++k) {
    pipeline.consumer_wait(state, pipeline.consumer_try_wait(state));
    pipeline.consumer_release(state);
    ++state;
  }
}

// Tile-local (row, col) of each accumulator element of this consumer thread (of the BF16 tile, or
// of another mainloop's TiledMma and tile).
template <class TiledMma = MegaTiledMma, class TileShape = MegaTileShape>
CUTLASS_DEVICE auto thread_coords(int mma_thread_idx) {
  using namespace cute;
  Tensor coords = make_identity_tensor(take<0, 2>(TileShape{}));
  return TiledMma{}.get_thread_slice(mma_thread_idx).partition_C(coords);
}

// NOTE: wgmma accumulator fragment: mode 0 is (2 cols, 2 row halves, N/8 col blocks), one MMA
// along M and N for the 128x256 cooperative tile: element 2 * half + 4 * j (+ 1) is column
// 8 j + 2 q (+ 1) of the thread's row `half`, q = lane % 4; the element 8 columns right of i is
// i + 4 (epilogue_swiglu.cuh's kPartner). The 4 lanes of a quad share their rows.
constexpr int kFragPartner = 4;
constexpr int kFragBlockCols = 8;  // columns of one block j
constexpr int kFragBlocks = layout::kBlockN / kFragBlockCols;
using MegaAccLayout = typename MegaAccumulators::layout_type;
static_assert(cute::size<0, 0>(MegaAccLayout{}) == 2 && cute::size<0, 1>(MegaAccLayout{}) == 2 &&
              cute::size<0, 2>(MegaAccLayout{}) == kFragBlocks &&
              cute::size<1>(MegaAccLayout{}) == 1 && cute::size<2>(MegaAccLayout{}) == 1,
              "unexpected wgmma accumulator fragment");
static_assert(kFragBlockCols == kSwigluInterleave, "a gate (or up) block is one fragment block");

MOK_DEVICE uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A quad's 4 lanes hold column pairs 2q, 2q + 1 of 4 blocks: w[b] is this lane's pair of block
// b. Returns block q's 8 columns (its 4 pairs in column order) to lane q, so that each lane
// stores 16 contiguous bytes and a quad 64: full 32-byte sectors and a quarter of the store
// instructions of one 4-byte store per pair (which left the epilogue request-bound).
// NOTE: a 4 x 4 transpose over the quad in two exchange rounds (lane bit 1, then bit 0); every
// lane of the warp takes part (the callers guard only the stores).
MOK_DEVICE uint4 quad_gather(const uint32_t (&w)[4]) {
  constexpr uint32_t kFull = 0xffffffffu;
  const int q = static_cast<int>(threadIdx.x % 4);
  const bool hi = (q & 2) != 0, odd = (q & 1) != 0;
  // Round 1, with lane q ^ 2: keep blocks 2h, 2h + 1 (h = bit 1 of q), send the other two.
  const uint32_t keep0 = hi ? w[2] : w[0], keep1 = hi ? w[3] : w[1];
  const uint32_t got0 = __shfl_xor_sync(kFull, hi ? w[0] : w[2], 2);
  const uint32_t got1 = __shfl_xor_sync(kFull, hi ? w[1] : w[3], 2);
  // keep*: this lane's blocks 2h, 2h + 1; got*: lane q ^ 2's. Round 2, with lane q ^ 1: keep
  // block q (= 2h + odd) of both, send block q ^ 1 of both.
  const uint32_t from_q1 = __shfl_xor_sync(kFull, odd ? keep0 : keep1, 1);  // lane q ^ 1's
  const uint32_t from_q3 = __shfl_xor_sync(kFull, odd ? got0 : got1, 1);    // lane q ^ 3's
  const uint32_t from_q0 = odd ? keep1 : keep0;                             // this lane's
  const uint32_t from_q2 = odd ? got1 : got0;                               // lane q ^ 2's
  // Pair k of block q came from lane k = q ^ d.
  uint32_t out[4];
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 4; ++k) {
    const int d = k ^ q;
    out[k] = d == 0 ? from_q0 : d == 1 ? from_q1 : d == 2 ? from_q2 : from_q3;
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

MOK_DEVICE void store16(__nv_bfloat16* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Blocks [0, kBlocks) of one row half in groups of 4: word(b) is this lane's packed pair of
// block b; fn(g, v) gets group g's 16 bytes for this lane's block 4 g + q (quad_gather).
template <int kBlocks, class Word, class Fn>
MOK_DEVICE void for_each_group(Word word, Fn fn) {
  static_assert(kBlocks % 4 == 0, "whole groups of 4 blocks");
  CUTLASS_PRAGMA_UNROLL
  for (int g = 0; g < kBlocks / 4; ++g) {
    uint32_t w[4];
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < 4; ++b) w[b] = word(4 * g + b);
    fn(g, quad_gather(w));
  }
}

// Fragment blocks (of 8 columns) of an accumulator type: kFragBlocks for the BF16 tile.
template <class Accumulators>
constexpr int frag_blocks() {
  return cute::size<0, 2>(typename Accumulators::layout_type{});
}

// The raw columns of one row half: block j's pair is bf16 of elements 2 half + 4 j (+ 1).
template <class Accumulators, class Fn>
MOK_DEVICE void for_each_raw_group(const Accumulators& acc, int half, Fn fn) {
  for_each_group<frag_blocks<Accumulators>()>(
      [&](int j) {
        const int i = 2 * half + kFragPartner * j;
        return pack_bf16x2(acc(i), acc(i + 1));
      },
      fn);
}

// The packed bf16 act pair (silu(g) * u, SwigluMath) of act block a of row half `half`: gate
// fragment block 2 a and its up partner.
template <class Accumulators>
MOK_DEVICE uint32_t swiglu_pair(const Accumulators& acc, int half, int a) {
  const int gi = 2 * half + kFragPartner * 2 * a;  // gate block 2 a
  const int ui = gi + kFragPartner;                 // its up partner
  return pack_bf16x2(SwigluMath::act(acc(gi), acc(ui)), SwigluMath::act(acc(gi + 1), acc(ui + 1)));
}

// L1 epilogue (consumers): rows [0, rows) of the tile at ring row row_begin, n-tile n_tile of the
// interleaved 2I columns: act_ring = silu(g) * u (SwigluMath, as stage 1), h_ring = g, u if set.
// NOTE: gate blocks are the even fragment blocks (col % 16 < 8), their up partners the odd ones;
// act block a of the tile is gate block 2a's (act columns n_tile * kBlockN / 2 + 8 a + c).
CUTLASS_DEVICE void l1_epilogue(const roles::MegaParams& p, const MegaAccumulators& acc,
                                int mma_thread_idx, int row_begin, int rows, int n_tile) {
  auto coords = thread_coords(mma_thread_idx);
  const int q = static_cast<int>(threadIdx.x % 4);
  const int h_cols = 2 * p.inter;
  const int h_col0 = n_tile * layout::kBlockN;
  const int act_col0 = n_tile * (layout::kBlockN / 2);
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = cute::get<0>(coords(2 * half));
    const bool live = row < rows;
    const int64_t ring_row = row_begin + row;
    __nv_bfloat16* act = p.act_ring + ring_row * p.inter;
    for_each_group<kFragBlocks / 2>(
        [&](int a) { return swiglu_pair(acc, half, a); },
        [&](int g, uint4 v) {
          const int col = act_col0 + (4 * g + q) * kFragBlockCols;
          if (live && col < p.inter) store16(act + col, v);
        });
    if (p.h_ring != nullptr) {
      __nv_bfloat16* h = p.h_ring + ring_row * h_cols;
      for_each_raw_group(acc, half, [&](int g, uint4 v) {
        const int col = h_col0 + (4 * g + q) * kFragBlockCols;
        if (live && col < h_cols) store16(h + col, v);
      });
    }
  }
}

// Backward, the first GEMM's epilogue (consumers): acc = d_rows @ W_down for rows [0, rows) of the
// tile at ring row row_begin and act columns [n_tile * kBlockN, + kBlockN) below I. As stage 1's
// no-y backward, step for step: m = bf16(acc) (the L2 dgrad's output), the row's router-weight
// gradient partial <m, a> over these columns, da = bf16(m * w), and the SwiGLU backward of
// roles/swiglu.cuh from h = (g, u) into d_h (interleaved as h). Each lane handles 8 contiguous
// columns at a time (quad_gather), 16-byte loads and stores.
// NOTE: the partial sums: each 8-column group as row_grad's fixed tree (dot_bf16x8), the lane's
// groups in column order, then the quad's 4 lanes by a xor butterfly (bitwise the same in every
// lane); one lane stores (row, n_tile)'s partial, and launch/moe_mega.cu sums a row's partials in
// n_tile order. Not row_grad's order over the whole row: d_row_w agrees with stage 1 within
// rounding, d_h is stage 1's arithmetic.
// NOTE: the loads of a batch of kDswigluBatch groups (a, g, u: 3 x 16 bytes each) are all issued
// before the first is used, and before the batch's stores (which the compiler may not move them
// past): one latency per batch rather than per group. Group by group (b2984e7's parent) this
// epilogue took ~20 us per task (the trace: 26% of qwen3-30b-a3b's CTA time), against ~3.5 us
// for the forward's L1 epilogue; in batches of 4 (b2984e7) ~13 us; in batches of a whole row
// half (96 registers of loads while the other half's accumulators are live) ~12.5 us (15fe76a,
// docs/PERF.md's backward timeline tables). Back to 4: with an idle warpgroup's path
// (consumer_rows_idle) beside it, a batch of 8 spilled in the mainloop (ptxas: 160 bytes).
constexpr int kDswigluGroups = kFragBlocks / 4;  // 8-column groups per lane and row half
constexpr int kDswigluBatch = 4;                 // groups whose loads are in flight at once
static_assert(kDswigluGroups % kDswigluBatch == 0, "whole batches");

CUTLASS_DEVICE void dswiglu_epilogue(const roles::MegaParams& p, const MegaAccumulators& acc,
                                     int mma_thread_idx, int round, int row_begin, int rows,
                                     int n_tile) {
  auto coords = thread_coords(mma_thread_idx);
  const int q = static_cast<int>(threadIdx.x % 4);
  const int64_t h_cols = 2 * static_cast<int64_t>(p.inter);
  const int col0 = n_tile * layout::kBlockN;
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = cute::get<0>(coords(2 * half));
    const bool live = row < rows;
    const int64_t ring_row = row_begin + row;
    const float w = live ? p.w_rows[static_cast<int64_t>(round) * p.ring_rows + ring_row] : 0.0f;
    const __nv_bfloat16* a_row = p.act_ring + ring_row * p.inter;
    const __nv_bfloat16* h_row = p.h_ring + ring_row * h_cols;
    __nv_bfloat16* dh_row = p.dh_ring + ring_row * h_cols;
    uint4 m[kDswigluGroups];  // bf16(acc) of this lane's groups (every lane takes part)
    for_each_raw_group(acc, half, [&](int g, uint4 v) { m[g] = v; });
    float partial = 0.0f;
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kDswigluGroups; b += kDswigluBatch) {
      uint4 a[kDswigluBatch], gv[kDswigluBatch], uv[kDswigluBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kDswigluBatch; ++j) {
        const int col = col0 + (4 * (b + j) + q) * kFragBlockCols;
        a[j] = gv[j] = uv[j] = make_uint4(0, 0, 0, 0);
        if (live && col < p.inter) {
          const int gate = SwigluMath::gate_col_of(col);
          a[j] = *reinterpret_cast<const uint4*>(a_row + col);
          gv[j] = *reinterpret_cast<const uint4*>(h_row + gate);
          uv[j] = *reinterpret_cast<const uint4*>(h_row + gate + kSwigluInterleave);
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kDswigluBatch; ++j) {
        const int col = col0 + (4 * (b + j) + q) * kFragBlockCols;
        if (!live || col >= p.inter) continue;
        partial = __fadd_rn(partial, row_grad::dot_bf16x8(m[b + j], a[j]));
        float gs[8], us[8], da[8], dg[8], du[8];
        unpack_bf16x8(row_grad::scale_bf16x8(m[b + j], w), da);
        unpack_bf16x8(gv[j], gs);
        unpack_bf16x8(uv[j], us);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; ++k) roles::swiglu_grad(da[k], gs[k], us[k], dg[k], du[k]);
        const int gate = SwigluMath::gate_col_of(col);
        store16(dh_row + gate, pack_bf16x8(dg));
        store16(dh_row + gate + kSwigluInterleave, pack_bf16x8(du));
      }
    }
    partial = __fadd_rn(partial, __shfl_xor_sync(0xffffffffu, partial, 1));
    partial = __fadd_rn(partial, __shfl_xor_sync(0xffffffffu, partial, 2));
    if (live && q == 0) p.rw_partials[ring_row * p.rw_parts + n_tile] = partial;
  }
}

// Where one row of an L2 tile goes: y_rows (if kept) and the source rank's slot row (if any).
struct L2RowDst {
  __nv_bfloat16* y;     // y_rows[ring row] or null
  __nv_bfloat16* slot;  // peer slot_rows[slot] or null
};

MOK_DEVICE L2RowDst l2_row_dst(const roles::MegaParams& p, int round, int ring_row) {
  L2RowDst d{nullptr, nullptr};
  if (p.y_rows != nullptr) d.y = p.y_rows + static_cast<int64_t>(ring_row) * p.hidden;
  const int64_t dst = p.row_dst[static_cast<int64_t>(round) * p.ring_rows + ring_row];
  if (dst >= 0) {
    const uint32_t s = static_cast<uint32_t>(dst) / static_cast<uint32_t>(p.slots_per_rank);
    const uint32_t slot = static_cast<uint32_t>(dst) % static_cast<uint32_t>(p.slots_per_rank);
    d.slot = reinterpret_cast<__nv_bfloat16*>(p.peer_bases[s] + p.slot_rows_offset) +
             static_cast<int64_t>(slot) * p.hidden;  // peer memory
  }
  return d;
}

// This consumer thread's two rows of an L2 tile (rows [0, rows) at ring row row_begin).
struct L2RowDsts {
  L2RowDst half[2] = {{nullptr, nullptr}, {nullptr, nullptr}};
};

template <class TiledMma = MegaTiledMma, class TileShape = MegaTileShape>
CUTLASS_DEVICE L2RowDsts l2_row_dsts(const roles::MegaParams& p, int mma_thread_idx, int round,
                                     int row_begin, int rows) {
  auto coords = thread_coords<TiledMma, TileShape>(mma_thread_idx);
  L2RowDsts d;
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = cute::get<0>(coords(2 * half));
    if (row < rows) d.half[half] = l2_row_dst(p, round, row_begin + row);
  }
  return d;
}

// L2 epilogue (consumers): the tile's columns [col0, col0 + its width) below H of this thread's
// rows `dsts`: y = bf16(acc) (round to nearest even), into y_rows and the slot row.
template <class Accumulators>
CUTLASS_DEVICE void l2_epilogue(const roles::MegaParams& p, const Accumulators& acc,
                                const L2RowDsts& dsts, int col0) {
  const int q = static_cast<int>(threadIdx.x % 4);
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const L2RowDst& d = dsts.half[half];
    for_each_raw_group(acc, half, [&](int g, uint4 v) {
      const int col = col0 + (4 * g + q) * kFragBlockCols;
      if (col >= p.hidden) return;
      if (d.y != nullptr) store16(d.y + col, v);
      if (d.slot != nullptr) store16(d.slot + col, v);
    });
  }
}

// The down-weight gradient's epilogue (consumers), stored (MegaParams::wgrad kWgradStore): acc is
// rows [m0, m0 + kBlockM) of H by columns [n0, n0 + kBlockN) of I of expert `expert`'s gradient,
// stored as bf16 into wgrad_out (round to nearest even, 16 bytes a lane as l2_epilogue).
CUTLASS_DEVICE void wgrad_epilogue(const roles::MegaParams& p, const MegaAccumulators& acc,
                                   int mma_thread_idx, int expert, int m0, int n0) {
  auto coords = thread_coords(mma_thread_idx);
  const int q = static_cast<int>(threadIdx.x % 4);
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = m0 + cute::get<0>(coords(2 * half));
    const bool live = row < p.hidden;
    const int64_t first = (static_cast<int64_t>(expert) * p.hidden + row) * p.inter;
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.wgrad_out) + first;
    for_each_raw_group(acc, half, [&](int g, uint4 v) {
      const int col = n0 + (4 * g + q) * kFragBlockCols;
      if (live && col < p.inter) store16(out + col, v);
    });
  }
}

// The down-weight gradient's epilogue into float32 main_grad (kWgradAddF32): each consumer warp
// stages its 16 rows of the tile kWgradEpiCols columns at a time in shared memory and hands each
// box to one TMA reduce-add (the L2 adds it: each element its old value + the tile's sum,
// rounded once, as grouped_gemm_tn_accumulate's epilogue), then goes on: the read-modify-write
// of main_grad drains while the SM runs its next tasks. Only a box's shared memory is waited
// for, kWgradEpiBuffers boxes later; a warp syncs only with itself.
// NOTE: a consumer-side read-modify-write (1d1712d, f38445e: each thread's column pairs loaded,
// added and stored) held both warpgroups for the whole tile's HBM round trip, about 10 us of 128
// KB read and written per tile on one SM: the layer's forward + backward into main_grad took
// 7.83 ms against 6.41 with the grouped GEMM after the launch (qwen3-30b-a3b, 8192 tokens, one
// H100). Boxes of a warpgroup's 64 rows (999790f), two named barriers of 128 threads a box,
// were level with the grouped GEMM there (docs/perf_notes.md, session 39).
// NOTE: every box's reduce has read its box before the CTA ends: wgrad_reduce_drain.
CUTLASS_DEVICE void wgrad_reduce_epilogue(const roles::MegaParams& p,
                                          const MegaWgradReduceTma& tma, MegaBf16Scratch& scratch,
                                          const MegaAccumulators& acc, int mma_thread_idx,
                                          int expert, int m_tile, int n_tile) {
  using namespace cute;
  const int warp = mma_thread_idx / 32;  // rows [16 warp, 16 warp + 16) of the tile
  const int lane = mma_thread_idx % 32;
  const bool issuer = lane == 0;
  const int q = lane % 4;
  auto coords = thread_coords(mma_thread_idx);
  Tensor mC = tma.get_tma_tensor(make_shape(p.hidden, p.inter, p.num_local_experts));
  constexpr int kBoxes = layout::kBlockN / kWgradEpiCols;
  constexpr int kBlocksPerBox = kWgradEpiCols / kFragBlockCols;
  static_assert(kConsumerWarps * kWgradEpiRows == layout::kBlockM, "a box row block per warp");
  CUTLASS_PRAGMA_UNROLL
  for (int b = 0; b < kBoxes; ++b) {
    float* box = scratch.wgrad_boxes[warp][b % kWgradEpiBuffers];
    // the box's buffer is free: the reduce that read it last (kWgradEpiBuffers boxes ago, this
    // task's or the last one's) has read it
    if (issuer) tma_store_wait<kWgradEpiBuffers - 1>();
    __syncwarp();
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int row = get<0>(coords(2 * half)) - kWgradEpiRows * warp;  // of the warp's 16
      CUTLASS_PRAGMA_UNROLL
      for (int jj = 0; jj < kBlocksPerBox; ++jj) {
        const int i = 2 * half + kFragPartner * (kBlocksPerBox * b + jj);
        *reinterpret_cast<float2*>(box + row * kWgradEpiCols + jj * kFragBlockCols + 2 * q) =
            make_float2(acc(i), acc(i + 1));
      }
    }
    cutlass::arch::fence_view_async_shared();  // this thread's writes, to the TMA's proxy
    __syncwarp();
    if (issuer) {
      Tensor s_box = make_tensor(make_smem_ptr(box), WgradEpiSmemLayout{});
      Tensor g_box = local_tile(mC(_, _, expert), WgradEpiSmemLayout{}.shape(),
                                make_coord(m_tile * kConsumerWarps + warp, n_tile * kBoxes + b));
      auto cta_tma = tma.get_slice(Int<0>{});
      copy(tma, cta_tma.partition_S(s_box), cta_tma.partition_D(g_box));
      tma_store_arrive();
    }
  }
}

// Consumers, before the CTA ends: every reduce-add this thread issued has read its box.
CUTLASS_DEVICE void wgrad_reduce_drain(int mma_thread_idx) {
  if (mma_thread_idx % 32 == 0) cute::tma_store_wait<0>();
}

}  // namespace mok::gemm
