// Role pieces of the FP8 forward megakernel (issue 15; docs/FP8.md's design): the same tasks,
// waits and ring as the BF16 forward (roles/megakernel_compute.cuh), with blockwise-FP8 operands.
//
// Operands. A: the ring's e4m3 rows (L1: the pulled tokens, stage 1's (1, 128)-quantised packed
// rows; L2: act, quantised in the L1 epilogue) with one float32 scale per row and 128 columns,
// kept M-major ([K / 128, scale_stride]: a tile's 128 row scales are one TMA box per k-tile).
// B: the weights' (128, 128)-block FP8 copy [E_l, N, K] and its scales [E_l, N / 128, K / 128]
// (functional.fp8_weights', K-major).
//
// Tiles. The plan's tasks are 128 x 256 (layout::kBlockN); the FP8 wgmma tile is 128 x 128
// (its two-level accumulation holds 64 x 128 per consumer warpgroup and block of K:
// roles/fp8_mainloop.cuh). A task runs both 128-wide halves of its n-tile in one pass over K: each
// stage holds one 128-K block of the A tile and of both halves' B tiles, and each consumer
// warpgroup keeps both halves' float32 totals (64 x 256) and one partial (the block's wgmma sum of
// one half), promoted into its half's total before the other half's wgmmas reuse it. The A tile
// is read from L2 once per task (the ncu record ncu_megakernel_h200_3bf75fe_fp8.json had the L2
// at 81% of its peak, docs/FP8.md), where running the halves one after the other read it twice:
// 4 tile loads per 128-K block of a task become 3. The price: a warpgroup waits for its partial
// before it promotes (no second partial to overlap with: three 64-register fragments fill the
// consumers' budget), and its tensor-core share goes to the other warpgroup meanwhile; a timing
// experiment without the promotion ran the k-tiles 12-14% faster (docs/FP8.md).
// NOTE: hiding the promotion with 64-wide quarters through two 32-register partials (58060f8)
// was bitwise right and slower (shared-memory re-reads of A, spills in the k-loop): reverted.
// Then the two halves' epilogues, in order. The plan, the counters and the
// task order stay the BF16 forward's. An L1 task's 256 h columns are 128 act columns: exactly one
// (1, 128) act block, so the act quantisation needs no other task: with both halves' totals in
// registers, each lane quantises the act columns it stored under the row's maximum over the
// quad's lanes.
//
// Arithmetic: stage 1's FP8 forward, bit for bit (the tests compare them): the engine's FP8
// TiledMma and promotion order (OverlappedPromotionMma), SwigluMath, and the quantiser's block
// scale and encoding (common/fp8_blockwise.cuh, roles/fp8_blockwise_quantize.cuh) applied to the
// bf16 act values stage 1's quantiser reads.
//
// Producer. One thread issues each k-tile's TMA loads (A, both halves' B, A's 128 scales); with
// the rows in place at one rank (MoKConfig.fwd_rows) the producer warpgroup copies A's rows and
// scales from x quantised in place instead (load_task_rows_fp8) and no ring is pulled. B's
// one scale per half and k-tile is not a TMA box (4 bytes): the producer warp stages the task's
// K / 128 weight scales of both halves in shared memory first (one coalesced load), and the
// loading thread stores each k-tile's two into the stage's scale slots before it arms the stage's
// full barrier, whose arrival releases those stores to the consumers.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "mok/common/fp8_blockwise.cuh"
#include "mok/common/ptx.cuh"
#include "mok/roles/fp8_blockwise_quantize.cuh"
#include "mok/roles/grouped_gemm_fp8_config.cuh"
#include "mok/roles/megakernel_gemm.cuh"

namespace mok::gemm {

using MegaFp8TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
constexpr int kMegaFp8BlockN = cute::size<1>(MegaFp8TileShape{});
constexpr int kMegaFp8Halves = layout::kBlockN / kMegaFp8BlockN;  // halves of a task's n-tile
static_assert(kMegaFp8Halves == 2 && kMegaFp8BlockN == kFp8ScaleBlock &&
                  cute::size<2>(MegaFp8TileShape{}) == kFp8ScaleBlock &&
                  cute::size<0>(MegaFp8TileShape{}) == layout::kBlockM,
              "an FP8 task: two 128-wide halves of the plan's n-tile, one scale block each along "
              "N and K; the plan's m-tile");
// K / 128 of either GEMM at most (the weight scales a task stages in shared memory): K <= 16384.
constexpr int kMegaFp8MaxKBlocks = 128;
constexpr int kMegaFp8SfaBytes = layout::kBlockM * static_cast<int>(sizeof(float));

// The producer warp's staging of one task's weight scales (both halves).
struct MegaFp8Scratch {
  float sfb[kMegaFp8Halves * kMegaFp8MaxKBlocks];
};
constexpr int kMegaFp8Carveout = kMegaSmemCarveout + static_cast<int>(sizeof(MegaFp8Scratch));

// The engine's FP8 collective, non-array, one CTA, 128 x 128 x 128: its TMA descriptors (Params,
// made on the host by to_underlying_arguments), TiledMma and shared-memory atoms. Its stages,
// pipeline and loops are not used: the megakernel's stage (MegaFp8Mainloop) holds both halves.
// NOTE: built with the engine's K-major scale layouts, so CUTLASS makes no scale TMA (A's is
// ours, over the ring's M-major region; B's is staged).
using MegaFp8Base = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8Element,
    cute::tuple<RowMajor, Fp8LayoutSFA>, kFp8Alignment, Fp8Element,
    cute::tuple<ColumnMajor, Fp8LayoutSFB>, kFp8Alignment, Accumulator, MegaFp8TileShape,
    ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<kMegaFp8Carveout>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
static_assert(!MegaFp8Base::IsTmaLoadSFA && !MegaFp8Base::IsTmaLoadSFB,
              "the collective makes no scale TMA: the megakernel loads the scales itself");

// Stages of the task mainloop: 16 KB of A, 2 x 16 KB of B and 129 scales each (194 KB in all).
constexpr int kMegaFp8Stages = 4;

// The FP8 task mainloop's types: a stage is one 128-K block of a task's A tile (SmemLayoutA's
// stage s) and of both halves' B tiles (SmemLayoutB's 2 s and 2 s + 1), A's 128 row scales
// (smem_SFA[128 s + r]) and the halves' weight scales (smem_SFB[2 s + h]).
// NOTE: each stage of a layout is the collective's (the same atom tiled the same way: only the
// stage count differs), so the collective's TMA descriptors fill them and its TiledMma reads them.
struct MegaFp8Mainloop {
  using Base = MegaFp8Base;
  using TiledMma = typename Base::TiledMma;
  using Params = typename Base::Params;
  using MainloopPipeline = cutlass::PipelineTmaAsync<kMegaFp8Stages>;
  using PipelineState = cutlass::PipelineState<kMegaFp8Stages>;
  using PipelineStorage = typename MainloopPipeline::SharedStorage;
  using SmemLayoutA = decltype(cute::tile_to_shape(
      typename Base::SmemLayoutAtomA{},
      cute::make_shape(cute::Int<layout::kBlockM>{}, cute::Int<kFp8ScaleBlock>{},
                       cute::Int<kMegaFp8Stages>{}),
      cute::Step<cute::_1, cute::_2, cute::_3>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      typename Base::SmemLayoutAtomB{},
      cute::make_shape(cute::Int<kMegaFp8BlockN>{}, cute::Int<kFp8ScaleBlock>{},
                       cute::Int<kMegaFp8Halves * kMegaFp8Stages>{}),
      cute::Step<cute::_1, cute::_2, cute::_3>{}));
  struct TensorStorage : cute::aligned_struct<128> {
    cute::array_aligned<Fp8Element, cute::cosize_v<SmemLayoutA>> smem_A;
    cute::array_aligned<Fp8Element, cute::cosize_v<SmemLayoutB>> smem_B;
    CUTE_ALIGNAS(128) cute::array<float, layout::kBlockM * kMegaFp8Stages> smem_SFA;
    CUTE_ALIGNAS(16) cute::array<float, kMegaFp8Halves * kMegaFp8Stages> smem_SFB;
  };
  static CUTLASS_DEVICE void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
  }
};
using MegaFp8Pipeline = MegaFp8Mainloop::MainloopPipeline;
using MegaFp8PipelineState = MegaFp8Mainloop::PipelineState;
using MegaFp8TiledMma = MegaFp8Mainloop::TiledMma;
static_assert(cute::cosize_v<MegaFp8Mainloop::SmemLayoutA> ==
                      layout::kBlockM * kFp8ScaleBlock * kMegaFp8Stages &&
                  cute::cosize_v<MegaFp8Mainloop::SmemLayoutB> ==
                      kMegaFp8Halves * kMegaFp8BlockN * kFp8ScaleBlock * kMegaFp8Stages &&
                  std::is_same_v<decltype(cute::tile_to_shape(
                                     typename MegaFp8Base::SmemLayoutAtomA{},
                                     cute::make_shape(cute::Int<layout::kBlockM>{},
                                                      cute::Int<kFp8ScaleBlock>{},
                                                      cute::Int<MegaFp8Base::DispatchPolicy::Stages>{}),
                                     cute::Step<cute::_1, cute::_2, cute::_3>{})),
                                 typename MegaFp8Base::SmemLayoutA>,
              "a stage: one e4m3 byte per element, tiled as the collective's stages (whose TMA "
              "descriptors fill it)");
// The bytes TMA delivers into one stage: A, both halves' B (zero-filled rows count) and A's
// scales; the stage's full barrier is armed with them.
constexpr int kMegaFp8StageBytes =
    (layout::kBlockM + kMegaFp8Halves * kMegaFp8BlockN) * kFp8ScaleBlock + kMegaFp8SfaBytes;

using MegaFp8Accumulators =
    decltype(cute::partition_fragment_C(MegaFp8TiledMma{}, cute::take<0, 2>(MegaFp8TileShape{})));
constexpr int kMegaFp8FragBlocks = frag_blocks<MegaFp8Accumulators>();
static_assert(kMegaFp8FragBlocks * kFragBlockCols == kMegaFp8BlockN &&
                  cute::size<0, 0>(typename MegaFp8Accumulators::layout_type{}) == 2 &&
                  cute::size<0, 1>(typename MegaFp8Accumulators::layout_type{}) == 2 &&
                  cute::size<1>(typename MegaFp8Accumulators::layout_type{}) == 1 &&
                  cute::size<2>(typename MegaFp8Accumulators::layout_type{}) == 1,
              "the FP8 tile's wgmma fragment: the BF16 one's layout, half its column blocks");

// A's scales: one TMA box of the tile's 128 row scales of one K block, over the ring's M-major
// region (rows, K / 128) with row stride 1 and K-block stride `stride` floats.
using MegaFp8SfaSmemStage = cute::Layout<cute::Shape<cute::_128, cute::_1>>;
inline auto make_sfa_tma(const float* scales, int rows, int k_blocks, int stride) {
  using namespace cute;
  Tensor g = make_tensor(make_gmem_ptr(scales),
                         make_layout(make_shape(rows, k_blocks), make_stride(_1{}, stride)));
  return make_tma_copy(SM90_TMA_LOAD{}, g, MegaFp8SfaSmemStage{});
}
using MegaFp8SfaTma = decltype(make_sfa_tma(nullptr, 1, 1, 4));

// One FP8 GEMM's operands (forward L1: the x ring, w_gate_up; L2: the act ring, w_down).
struct MegaFp8Gemm {
  typename MegaFp8Mainloop::Params ml;  // A: the ring's e4m3 rows; B: the weights' FP8 [E, N, K]
  MegaFp8SfaTma sfa;                    // A's scales (the ring's M-major region)
  const float* sfb;                     // B's [E_l, N / 128, K / 128]
  int n_blocks;                         // N / 128
  int k_blocks;                         // K / 128: a task's k-tiles
};
struct MegaFp8GemmParams {
  MegaFp8Gemm l1;
  MegaFp8Gemm l2;
};

CUTLASS_DEVICE void prefetch_tma_descriptors(const MegaFp8GemmParams& gp) {
  MegaFp8Mainloop::prefetch_tma_descriptors(gp.l1.ml);
  MegaFp8Mainloop::prefetch_tma_descriptors(gp.l2.ml);
  cute::prefetch_tma_descriptor(gp.l1.sfa.get_tma_descriptor());
  cute::prefetch_tma_descriptor(gp.l2.sfa.get_tma_descriptor());
}

// The producer warp (all 32 lanes): task (expert, n_tile)'s weight scales of both halves into
// `stage` (half h's K block k at h * k_blocks + k; 0 for a half past N, whose B rows TMA
// zero-fills).
MOK_DEVICE void stage_weight_scales(const MegaFp8Gemm& g, int expert, int n_tile,
                                    MegaFp8Scratch& stage) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int j = lane; j < kMegaFp8Halves * g.k_blocks; j += 32) {
    const int half = j >= g.k_blocks ? 1 : 0;
    const int k = j - half * g.k_blocks;
    const int nb = n_tile * kMegaFp8Halves + half;
    stage.sfb[j] = nb < g.n_blocks
                       ? g.sfb[(static_cast<int64_t>(expert) * g.n_blocks + nb) * g.k_blocks + k]
                       : 0.0f;
  }
  __syncwarp();
}

// Producer (one thread): the task's K / 128 k-tiles from `state` on, each one stage: A's 128 x 128
// block, both halves' B blocks, A's scales (the caller advances its state by load.k_tiles). As
// load_task: A is the 128-row window at row_begin (rows past the ring zero-filled), its scales the
// same window of the scale region; a half past N (L2 with H % 256 == 128) is zero-filled B.
CUTLASS_DEVICE void load_task_fp8(const roles::MegaParams& p, const MegaFp8Gemm& g,
                                  MegaFp8Pipeline& pipeline, MegaFp8PipelineState state,
                                  typename MegaFp8Mainloop::TensorStorage& smem,
                                  const MegaLoad& load, const MegaFp8Scratch& scratch) {
  using namespace cute;
  using Tile = MegaFp8TileShape;
  Tensor mA = g.ml.tma_load_a.get_tma_tensor(make_shape(get<0>(Tile{}), load.k_size, 1));
  Tensor mB = g.ml.tma_load_b.get_tma_tensor(make_shape(load.n_size, load.k_size, load.num_experts));
  Tensor mS = g.sfa.get_tma_tensor(make_shape(get<0>(Tile{}), g.k_blocks));
  const auto window = make_coord(load.row_begin, 0);
  Tensor gA = local_tile(domain_offset(window, mA(_, _, 0)), select<0, 2>(Tile{}),
                         make_coord(0, _));  // (BLK_M, BLK_K, k)
  Tensor gS = local_tile(domain_offset(window, mS), MegaFp8SfaSmemStage{}.shape(),
                         make_coord(0, _));  // (BLK_M, 1, k)
  const int nb = load.n_tile * kMegaFp8Halves;
  Tensor gB0 = local_tile(mB(_, _, load.expert), select<1, 2>(Tile{}), make_coord(nb, _));
  Tensor gB1 = local_tile(mB(_, _, load.expert), select<1, 2>(Tile{}), make_coord(nb + 1, _));
  Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()),
                          typename MegaFp8Mainloop::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()),
                          typename MegaFp8Mainloop::SmemLayoutB{});  // (BLK_N, BLK_K, 2 PIPE)
  Tensor sS = make_tensor(make_smem_ptr(smem.smem_SFA.data()),
                          make_layout(make_shape(get<0>(Tile{}), _1{}, Int<kMegaFp8Stages>{}),
                                      make_stride(_1{}, get<0>(Tile{}), get<0>(Tile{}))));  // (BLK_M, 1, PIPE)
  auto tma_a = g.ml.tma_load_a.get_slice(0);
  auto tma_b = g.ml.tma_load_b.get_slice(0);
  auto tma_s = g.sfa.get_slice(0);
  Tensor tAgA = tma_a.partition_S(gA);
  Tensor tAsA = tma_a.partition_D(sA);
  Tensor tSgS = tma_s.partition_S(gS);
  Tensor tSsS = tma_s.partition_D(sS);
  Tensor tBgB0 = tma_b.partition_S(gB0);
  Tensor tBgB1 = tma_b.partition_S(gB1);
  Tensor tBsB = tma_b.partition_D(sB);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < g.k_blocks; ++k) {
    const float sb0 = scratch.sfb[k], sb1 = scratch.sfb[g.k_blocks + k];
    acquire_slot(p, pipeline, state, load.round, [&](int stage) {
      smem.smem_SFB[kMegaFp8Halves * stage] = sb0;
      smem.smem_SFB[kMegaFp8Halves * stage + 1] = sb1;
    });
    auto* full = pipeline.producer_get_barrier(state);
    const int stage = state.index();
    copy(g.ml.tma_load_a.with(*full, 0), tAgA(_, _, _, k), tAsA(_, _, _, stage));
    copy(g.ml.tma_load_b.with(*full, 0), tBgB0(_, _, _, k), tBsB(_, _, _, kMegaFp8Halves * stage));
    copy(g.ml.tma_load_b.with(*full, 0), tBgB1(_, _, _, k),
         tBsB(_, _, _, kMegaFp8Halves * stage + 1));
    copy(g.sfa.with(*full, 0), tSgS(_, _, _, k), tSsS(_, _, _, stage));
    ++state;
  }
}

// Rows in place (MoKConfig.fwd_rows="in_place", one rank): an L1 task reads its A rows and their
// scales straight from x quantised in place (MegaParams::local_tokens, local_token_scales) instead
// of from the ring and scale region a comm CTA filled; gemm::load_task_rows' copies (a K block of
// e4m3 is 128 bytes a row, as a bf16 k-tile: the same chunks, swizzle and warp mapping) plus each
// row's scale of the block, 4 bytes by its own thread into smem_SFA. A padding row or one past the
// tile gets zeros and scale 0 (the pull gave zeros and scale 1): its partials are +-0 and its
// totals +0 either way (weight scales are finite), so every row's outputs, a padding row's stored
// act included, are the same bits; rows past the tile are not stored.
constexpr uint32_t kMegaFp8StageBBytes = kMegaFp8Halves * kMegaFp8BlockN * kFp8ScaleBlock;
constexpr int kMegaFp8StageABytes = layout::kBlockM * kFp8ScaleBlock;
constexpr auto kFp8ALayout = cute::get_nonswizzle_portion(MegaFp8Mainloop::SmemLayoutA{});
static_assert(sizeof(Fp8Element) == 1 && kFp8ScaleBlock == 128 && kRowChunks * 16 == 128 &&
                  kFp8ALayout(1, 0, 0) == 128 && kFp8ALayout(8, 0, 0) == 8 * 128 &&
                  kFp8ALayout(0, 1, 0) == 1 && kFp8ALayout(0, 0, 1) == kMegaFp8StageABytes &&
                  std::is_same_v<decltype(cute::get_swizzle_portion(MegaFp8Mainloop::SmemLayoutA{})),
                                 cute::Swizzle<3, 4, 3>>,
              "FP8 rows in place: A's rows 128 bytes apart, stages consecutive, SW128 (as bf16's)");
static_assert(kMegaFp8StageABytes + kMegaFp8StageBBytes + kMegaFp8SfaBytes == kMegaFp8StageBytes,
              "FP8 rows in place: the stage's TMA bytes are B's alone");

// Producer thread (one of the warpgroup's 128): as gemm::load_task_rows, over one L1 task's K
// blocks; the leader also stores each block's two weight scales (from `scratch`) before its
// arrival, as load_task_fp8's does before arming.
template <class Sync>
CUTLASS_DEVICE void load_task_rows_fp8(const roles::MegaParams& p, const MegaFp8Gemm& g,
                                       MegaFp8Pipeline& pipeline, MegaFp8PipelineState state,
                                       typename MegaFp8Mainloop::TensorStorage& smem,
                                       const MegaLoad& load, int row, int32_t token,
                                       int32_t* row_tokens, const MegaFp8Scratch& scratch,
                                       Sync sync) {
  using namespace cute;
  using Tile = MegaFp8TileShape;
  const bool waits = threadIdx.x % 32 == 0, leader = threadIdx.x == 0;
  Tensor mB = g.ml.tma_load_b.get_tma_tensor(make_shape(load.n_size, load.k_size, load.num_experts));
  const int nb = load.n_tile * kMegaFp8Halves;
  Tensor gB0 = local_tile(mB(_, _, load.expert), select<1, 2>(Tile{}), make_coord(nb, _));
  Tensor gB1 = local_tile(mB(_, _, load.expert), select<1, 2>(Tile{}), make_coord(nb + 1, _));
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()),
                          typename MegaFp8Mainloop::SmemLayoutB{});  // (BLK_N, BLK_K, 2 PIPE)
  auto tma_b = g.ml.tma_load_b.get_slice(0);
  Tensor tBgB0 = tma_b.partition_S(gB0);
  Tensor tBgB1 = tma_b.partition_S(gB1);
  Tensor tBsB = tma_b.partition_D(sB);
  row_tokens[row] = token;
  sync();  // every row's token is in shared memory
  const RowCopies copies(cast_smem_ptr_to_uint(smem.smem_A.data()), row);  // as bf16's rows
  const RowCopies::Rows task_rows = copies.rows_of(p, row_tokens);
  const uint8_t* rows = p.local_tokens;
  const int blocks = p.hidden / kFp8ScaleBlock;
  const float* scale = token >= 0 ? p.local_token_scales + static_cast<int64_t>(token) * blocks
                                  : p.local_token_scales;  // this thread's row's, or a dummy
  const uint32_t sfa = cast_smem_ptr_to_uint(smem.smem_SFA.data()) +
                       static_cast<uint32_t>(row * sizeof(float));
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < g.k_blocks; ++k) {
    if (waits) wait_slot(p, pipeline, state, load.round);
    __syncwarp();  // the stage is free before any lane writes it
    uint64_t* full = pipeline.producer_get_barrier(state);
    const int stage = state.index();
    if (leader) {
      smem.smem_SFB[kMegaFp8Halves * stage] = scratch.sfb[k];
      smem.smem_SFB[kMegaFp8Halves * stage + 1] = scratch.sfb[g.k_blocks + k];
      cutlass::arch::ClusterTransactionBarrier::expect_transaction(full, kMegaFp8StageBBytes);
      copy(g.ml.tma_load_b.with(*full, 0), tBgB0(_, _, _, k), tBsB(_, _, _, kMegaFp8Halves * stage));
      copy(g.ml.tma_load_b.with(*full, 0), tBgB1(_, _, _, k),
           tBsB(_, _, _, kMegaFp8Halves * stage + 1));
    }
    const uint32_t a_stage = static_cast<uint32_t>(stage * kMegaFp8StageABytes);
    copies.issue(rows, task_rows, k * kFp8ScaleBlock + copies.chunk * 16, load.k_size,
                 a_stage);  // columns in bytes = e4m3 elements
    ptx::cp_async_4_zfill(sfa + static_cast<uint32_t>(stage * kMegaFp8SfaBytes), scale + k,
                          token >= 0 ? 4 : 0);
    cutlass::arch::cpasync_barrier_arrive(full);  // the stage also waits for these copies
    sync();
    if (leader) cutlass::arch::ClusterBarrier::arrive(full);
    ++state;
  }
}

// The consumer warpgroups' wgmma issue order: warpgroup 0's batch (one half of one k-tile), then
// warpgroup 1's, then warpgroup 0's next, and so on for the whole launch. Each warpgroup waits
// for its batch before it promotes it (mma_task_fp8), and both wait on the same stage: left to
// themselves they issue together, their batches finish together and both promote while the
// tensor cores idle. In turn, warpgroup 0's batch finishes first and its promotion runs under
// warpgroup 1's batch, and so on. Two named barriers pass the turn: kFp8TurnOf1 (warpgroup 0
// issued: 1 may) and kFp8TurnOf0 (1 issued: 0 may). A warpgroup with no rows in a task
// (consumer_rows_idle) still takes its turns (idle_task_fp8). No arithmetic changes: each
// warpgroup's wgmmas and promotions are the same, only their timing.
// NOTE: ids 1 and 2 are roles::MegaBarrier's.
constexpr int kFp8TurnOf1 = 3;
constexpr int kFp8TurnOf0 = 4;
constexpr int kFp8TurnThreads = 2 * cutlass::NumThreadsPerWarpGroup;

// Before warpgroup `wg`'s batch: its turn.
MOK_DEVICE void fp8_wait_turn(int wg) {
  ptx::named_barrier_sync(wg == 0 ? kFp8TurnOf0 : kFp8TurnOf1, kFp8TurnThreads);
}
// After its batch is issued: the other's turn.
MOK_DEVICE void fp8_pass_turn(int wg) {
  ptx::named_barrier_arrive(wg == 0 ? kFp8TurnOf1 : kFp8TurnOf0, kFp8TurnThreads);
}
// Once per launch, before the consumers' first task: warpgroup 0 has the first turn. And after
// their last: warpgroup 0 takes the turn warpgroup 1 passed last, so no arrival is left over.
MOK_DEVICE void fp8_turns_begin(int mma_thread_idx) {
  if (mma_thread_idx / cutlass::NumThreadsPerWarpGroup == 1) fp8_pass_turn(1);
}
MOK_DEVICE void fp8_turns_end(int mma_thread_idx) {
  if (mma_thread_idx / cutlass::NumThreadsPerWarpGroup == 0) fp8_wait_turn(0);
}

// A warpgroup with no rows in an FP8 task (consumer_rows_idle): as idle_task, and it takes its
// turns (both halves of each k-tile) without issuing.
template <class Pipeline, class State>
CUTLASS_DEVICE void idle_task_fp8(Pipeline& pipeline, State& state, int k_tiles,
                                  int mma_thread_idx) {
  const int wg = mma_thread_idx / cutlass::NumThreadsPerWarpGroup;
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < k_tiles; ++k) {
    pipeline.consumer_wait(state, pipeline.consumer_try_wait(state));
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < kMegaFp8Halves; ++half) {
      fp8_wait_turn(wg);
      fp8_pass_turn(wg);
    }
    pipeline.consumer_release(state);
    ++state;
  }
}

// Consumers (both warpgroups): one task's K / 128 k-tiles from `state` on (advanced past them),
// both halves of each: total_h += partial_h(k) * (sa(k) * sb_h(k)), k ascending, the engine's
// FP8 promotion (roles/fp8_mainloop.cuh) of half h's 128 x 128 tile, term for term, so each
// half's totals are bitwise the engine's tile's. Each stage is released once both halves have
// read it.
CUTLASS_DEVICE void mma_task_fp8(MegaFp8Pipeline& pipeline, MegaFp8PipelineState& state,
                                 typename MegaFp8Mainloop::TensorStorage& smem,
                                 MegaFp8Accumulators& total0, MegaFp8Accumulators& total1,
                                 int k_tiles, int thread_idx) {
  using namespace cute;
  using Mainloop = MegaFp8Mainloop;
  Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), typename Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename Mainloop::SmemLayoutB{});
  // A's row scales, broadcast along the tile's N: (BLK_M, BLK_N, PIPE).
  Tensor sSFA = make_tensor(
      make_smem_ptr(smem.smem_SFA.data()),
      make_layout(make_shape(Int<layout::kBlockM>{}, Int<kMegaFp8BlockN>{}, Int<kMegaFp8Stages>{}),
                  make_stride(_1{}, _0{}, Int<layout::kBlockM>{})));
  typename Mainloop::TiledMma tiled_mma;
  constexpr int kWarpGroups = size(typename Mainloop::TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  const Layout warp_group_layout =
      make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
  const int warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  auto thread_mma = tiled_mma.get_slice(warp_group_layout(warp_group));
  Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);     // (MMA, M, N, PIPE)
  Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, M, K, PIPE)
  Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, N, K, 2 PIPE)
  Tensor partial = make_fragment_like(total0);
  Tensor scale = make_tensor_like<float>(tCsSFA(_, _, _, _0{}));
  clear(total0);
  clear(total1);
  clear(partial);
  warpgroup_fence_operand(total0);
  warpgroup_fence_operand(total1);
  warpgroup_fence_operand(partial);
  // Half b % 2 of stage b / 2 into `total`: its wgmmas into the partial, the scales while they
  // run, then the promotion.
  auto half = [&](MegaFp8Accumulators& total, int stage, int b) {
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(partial);
    fp8_wait_turn(warp_group);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
      cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, b), partial);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    fp8_pass_turn(warp_group);
    copy(tCsSFA(_, _, _, stage), scale);
    const float sb = smem.smem_SFB[b];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(filter_zeros(scale)); ++i) {
      filter_zeros(scale)(i) = filter_zeros(scale)(i) * sb;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(partial);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(total); ++i) total(i) += partial(i) * scale(i);
  };
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < k_tiles; ++k) {
    pipeline.consumer_wait(state, pipeline.consumer_try_wait(state));
    const int stage = state.index();
    half(total0, stage, kMegaFp8Halves * stage);
    half(total1, stage, kMegaFp8Halves * stage + 1);
    pipeline.consumer_release(state);
    ++state;
  }
  warpgroup_fence_operand(total0);
  warpgroup_fence_operand(total1);
}

// The largest |x| of a packed bf16 pair, as float32 bits (the quantiser's integer maximum).
MOK_DEVICE uint32_t abs_bits_max(uint32_t pair) {
  return max((pair << 16) & mxfp8::kFloatAbsMask, pair & 0xffff0000u & mxfp8::kFloatAbsMask);
}

// 8 bf16 values (16 bytes) -> their 8 e4m3 bytes under block scale s (the quantiser's encode).
MOK_DEVICE uint2 encode8(uint4 v, const fp8_blockwise::BlockScale& s,
                         const fp8_blockwise::Divider& d) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};  // a bf16 pair each, the first in the low half
  uint32_t out[2] = {0, 0};
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 4; ++i) {
    const uint16_t pair = fp8_blockwise::encode_pair(__uint_as_float(w[i] << 16),
                                                     __uint_as_float(w[i] & 0xffff0000u), s,
                                                     false, d);
    out[i / 2] |= uint32_t{pair} << (16 * (i % 2));
  }
  return make_uint2(out[0], out[1]);
}

// FP8 L1 epilogue (consumers): the L1 task (m-tile at ring row row_begin, rows [0, rows); n-tile
// n_tile of the 2I interleaved columns) from both halves' totals: act = silu(g) * u into the
// bf16 act ring if set (act columns n_tile * 128 + [0, 128), half h's at + 64 h; a backward reads
// it, the L2 does not), h into h_ring if set,
// as l1_epilogue; then the act block n_tile (those 128 columns) quantised into act8_ring /
// act_scales, each lane encoding the columns it stored (its bf16 act, still in registers) under
// the row's block scale (the quad's maximum over both halves).
// NOTE: 2I % 256 == 0 (the host checks), so every column of an L1 task is below 2I.
CUTLASS_DEVICE void l1_epilogue_fp8(const roles::MegaParams& p, const MegaFp8Accumulators& total0,
                                    const MegaFp8Accumulators& total1, int mma_thread_idx,
                                    int row_begin, int rows, int n_tile) {
  auto coords = thread_coords<MegaFp8TiledMma, MegaFp8TileShape>(mma_thread_idx);
  const int q = static_cast<int>(threadIdx.x % 4);
  const int h_cols = 2 * p.inter;
  const int h_col0 = n_tile * layout::kBlockN;
  const int act_col0 = n_tile * (layout::kBlockN / 2);  // the act block's first column
  constexpr int kActBlocks = kMegaFp8FragBlocks / 2;    // act fragment blocks of one row half
  constexpr int kGroups = kActBlocks / 4;               // this lane's 16-byte stores per row
  constexpr int kHalfActCols = kMegaFp8BlockN / 2;
  CUTLASS_PRAGMA_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const int row = cute::get<0>(coords(2 * rh));
    const bool live = row < rows;
    const int64_t ring_row = row_begin + row;
    const bool keep_act = live && p.act_ring != nullptr;
    __nv_bfloat16* act = keep_act ? p.act_ring + ring_row * p.inter : nullptr;
    uint4 mine[kMegaFp8Halves][kGroups];  // this lane's stored act columns, 8 per group
    uint32_t m = 0;  // |act| maximum (float32 bits) over this lane's columns of both halves
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < kMegaFp8Halves; ++half) {
      const MegaFp8Accumulators& total = half == 0 ? total0 : total1;
      uint32_t words[kActBlocks];
      CUTLASS_PRAGMA_UNROLL
      for (int a = 0; a < kActBlocks; ++a) {
        words[a] = swiglu_pair(total, rh, a);
        m = max(m, abs_bits_max(words[a]));
      }
      const int col0 = act_col0 + half * kHalfActCols;
      for_each_group<kActBlocks>([&](int a) { return words[a]; },
                                 [&](int g, uint4 v) {
                                   mine[half][g] = v;
                                   if (keep_act) {
                                     store16(act + col0 + (4 * g + q) * kFragBlockCols, v);
                                   }
                                 });
      if (p.h_ring != nullptr) {
        __nv_bfloat16* h = p.h_ring + ring_row * h_cols + h_col0 + half * kMegaFp8BlockN;
        for_each_raw_group(total, rh, [&](int g, uint4 v) {
          if (live) store16(h + (4 * g + q) * kFragBlockCols, v);
        });
      }
    }
    // The row's maximum over the block's 128 act columns: the quad's 4 lanes.
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const fp8_blockwise::BlockScale s = fp8_blockwise::block_scale(m, false);
    if (!live) continue;
    const fp8_blockwise::Divider d(s.factor);
    uint8_t* act8 = p.act8_ring + ring_row * p.inter;
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < kMegaFp8Halves; ++half) {
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        const int col = act_col0 + half * kHalfActCols + (4 * g + q) * kFragBlockCols;
        *reinterpret_cast<uint2*>(act8 + col) = encode8(mine[half][g], s, d);
      }
    }
    if (q == 0) p.act_scales[static_cast<int64_t>(n_tile) * p.scale_stride + ring_row] = s.scale;
  }
}

// Consumers (both warpgroups): one FP8 task: the mainloop over both halves, then each half's
// epilogue in order; `mma_done()` after the mainloop (the timeline's mark).
template <class MmaDone>
CUTLASS_DEVICE void fp8_task(const roles::MegaParams& p, MegaFp8Pipeline& pipeline,
                             MegaFp8PipelineState& state,
                             typename MegaFp8Mainloop::TensorStorage& smem, bool l2, int round,
                             int row_begin, int rows, int n_tile, int k_tiles,
                             int mma_thread_idx, MmaDone mma_done) {
  // An L2 task's row destinations, loaded before the mainloop (as the BF16 task's).
  const L2RowDsts dsts =
      l2 ? l2_row_dsts<MegaFp8TiledMma, MegaFp8TileShape>(p, mma_thread_idx, round, row_begin,
                                                          rows)
         : L2RowDsts{};
  MegaFp8Accumulators total0, total1;
  mma_task_fp8(pipeline, state, smem, total0, total1, k_tiles, mma_thread_idx);
  mma_done();
  if (!l2) {
    l1_epilogue_fp8(p, total0, total1, mma_thread_idx, row_begin, rows, n_tile);
  } else {
    const int col0 = n_tile * kMegaFp8Halves * kMegaFp8BlockN;
    l2_epilogue(p, total0, dsts, col0);
    l2_epilogue(p, total1, dsts, col0 + kMegaFp8BlockN);
  }
}

}  // namespace mok::gemm
