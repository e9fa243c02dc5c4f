// Role pieces of the FP8 forward megakernel (issue 15; docs/FP8.md's design): the same tasks,
// waits and ring as the BF16 forward (roles/megakernel_compute.cuh), with blockwise-FP8 operands.
//
// Operands. A: the ring's e4m3 rows (L1: the pulled tokens, stage 1's (1, 128)-quantised packed
// rows; L2: act, quantised in the L1 epilogue) with one float32 scale per row and 128 columns,
// kept M-major ([K / 128, scale_stride]: a tile's 128 row scales are one TMA box per k-tile).
// B: the weights' (128, 128)-block FP8 copy [E_l, N, K] and its scales [E_l, N / 128, K / 128]
// (functional.fp8_weights', K-major).
//
// Tiles. The plan's tasks are 128 x 256 (layout::kBlockN); the FP8 mainloop's tile is 128 x 128
// (its two-level accumulation holds 64 x 128 per consumer warpgroup: roles/fp8_mainloop.cuh). So
// an FP8 task runs its n-tile as two halves, one after the other, each the engine's FP8 tile: a
// mainloop of K / 128 k-tiles, then that half's epilogue. The plan, the counters and the task
// order stay the BF16 forward's. An L1 task's 256 h columns are 128 act columns: exactly one
// (1, 128) act block, so the act quantisation needs no other task: the first half's row maxima
// wait in two registers, the second half's complete them, and each lane quantises the act
// columns it stored (the first half's read back from the bf16 act ring it just wrote).
//
// Arithmetic: stage 1's FP8 forward, bit for bit (the tests compare them): the engine's FP8
// TiledMma and promotion order (OverlappedPromotionMma), SwigluMath, and the quantiser's block
// scale and encoding (common/fp8_blockwise.cuh, roles/fp8_blockwise_quantize.cuh) applied to the
// bf16 act values stage 1's quantiser reads.
//
// Producer. One thread issues each k-tile's TMA loads (A, B, A's 128 scales). B's one scale per
// k-tile is not a TMA box (4 bytes): the producer warp stages the task's K / 128 weight scales of
// both halves in shared memory first (one coalesced load), and the loading thread stores each
// k-tile's into the stage's scale slot before it arms the stage's full barrier, whose arrival
// releases that store to the consumers.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/common/fp8_blockwise.cuh"
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

// The engine's FP8 collective (its shared memory, pipeline and TiledMma), non-array, one CTA;
// its consumer loop is fp8_mainloop.cuh's, its producer ours (load_task_fp8).
// NOTE: built with the engine's K-major scale layouts, so CUTLASS makes no scale TMA (A's is
// ours, over the ring's M-major region; B's is staged): the shared-memory layout of the scales
// is the same for either major (checked below).
using MegaFp8Base = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8Element,
    cute::tuple<RowMajor, Fp8LayoutSFA>, kFp8Alignment, Fp8Element,
    cute::tuple<ColumnMajor, Fp8LayoutSFB>, kFp8Alignment, Accumulator, MegaFp8TileShape,
    ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<kMegaFp8Carveout>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using MegaFp8Mainloop = OverlappedPromotionMma<MegaFp8Base>;
using MegaFp8Pipeline = typename MegaFp8Mainloop::MainloopPipeline;
using MegaFp8PipelineState = typename MegaFp8Mainloop::PipelineState;
using MegaFp8TiledMma = typename MegaFp8Mainloop::TiledMma;
constexpr int kMegaFp8Stages = MegaFp8Mainloop::DispatchPolicy::Stages;
static_assert(cute::cosize_v<typename MegaFp8Mainloop::SmemLayoutSFA> ==
                      layout::kBlockM * kMegaFp8Stages &&
                  cute::cosize_v<typename MegaFp8Mainloop::SmemLayoutSFB> == kMegaFp8Stages,
              "a stage's scales: 128 row scales (row r at r), then one weight scale");
static_assert(!MegaFp8Base::IsTmaLoadSFA && !MegaFp8Base::IsTmaLoadSFB,
              "the collective makes no scale TMA: the megakernel loads the scales itself");

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
  int k_blocks;                         // K / 128: one half's k-tiles
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

// Producer (one thread): the task's two halves, K / 128 k-tiles each, from `state` on (the
// caller advances its state by load.k_tiles = 2 K / 128). As load_task: A is the 128-row window
// at row_begin (rows past the ring zero-filled), its scales the same window of the scale region.
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
  Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()),
                          typename MegaFp8Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()),
                          typename MegaFp8Mainloop::SmemLayoutB{});
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
  Tensor tBsB = tma_b.partition_D(sB);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int half = 0; half < kMegaFp8Halves; ++half) {
    Tensor gB = local_tile(mB(_, _, load.expert), select<1, 2>(Tile{}),
                           make_coord(load.n_tile * kMegaFp8Halves + half, _));  // (BLK_N, BLK_K, k)
    Tensor tBgB = tma_b.partition_S(gB);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k = 0; k < g.k_blocks; ++k) {
      const float sb = scratch.sfb[half * g.k_blocks + k];
      acquire_slot(p, pipeline, state, load.round,
                   [&](int stage) { smem.smem_SFB[stage] = sb; });
      auto* full = pipeline.producer_get_barrier(state);
      const int stage = state.index();
      copy(g.ml.tma_load_a.with(*full, 0), tAgA(_, _, _, k), tAsA(_, _, _, stage));
      copy(g.ml.tma_load_b.with(*full, 0), tBgB(_, _, _, k), tBsB(_, _, _, stage));
      copy(g.sfa.with(*full, 0), tSgS(_, _, _, k), tSsS(_, _, _, stage));
      ++state;
    }
  }
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

// FP8 L1 epilogue (consumers), half `half` of the L1 task (m-tile at ring row row_begin, rows
// [0, rows); n-tile n_tile of the 2I interleaved columns): act = silu(g) * u into the bf16 act
// ring (act columns n_tile * 128 + half * 64 + [0, 64)), h into h_ring if set, as l1_epilogue;
// then the act block n_tile (128 columns, both halves) quantised into act8_ring / act_scales.
// amax[rh]: the first half's row maxima (|act| float32 bits over the quad's 64 columns) of this
// thread's two rows, kept for the second.
// NOTE: 2I % 256 == 0 (the host checks), so every column of an L1 task is below 2I.
CUTLASS_DEVICE void l1_epilogue_fp8(const roles::MegaParams& p, const MegaFp8Accumulators& acc,
                                    int mma_thread_idx, int row_begin, int rows, int n_tile,
                                    int half, uint32_t (&amax)[2]) {
  auto coords = thread_coords<MegaFp8TiledMma, MegaFp8TileShape>(mma_thread_idx);
  const int q = static_cast<int>(threadIdx.x % 4);
  const int h_cols = 2 * p.inter;
  const int h_col0 = n_tile * layout::kBlockN + half * kMegaFp8BlockN;
  const int block_col0 = n_tile * (layout::kBlockN / 2);  // the act block's first column
  const int act_col0 = block_col0 + half * (kMegaFp8BlockN / 2);
  constexpr int kActBlocks = kMegaFp8FragBlocks / 2;  // act fragment blocks of one row half
  constexpr int kGroups = kActBlocks / 4;              // this lane's 16-byte stores per row
  CUTLASS_PRAGMA_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const int row = cute::get<0>(coords(2 * rh));
    const bool live = row < rows;
    const int64_t ring_row = row_begin + row;
    __nv_bfloat16* act = p.act_ring + ring_row * p.inter;
    // The second half's epilogue quantises the first half's columns too: this lane's, as it
    // stored them, read back first (their latency under the act math below).
    uint4 first[kGroups];
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      first[g] = make_uint4(0, 0, 0, 0);
      if (half == 1 && live) {
        first[g] = *reinterpret_cast<const uint4*>(act + block_col0 + (4 * g + q) * kFragBlockCols);
      }
    }
    uint32_t words[kActBlocks];
    uint32_t m = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int a = 0; a < kActBlocks; ++a) {
      words[a] = swiglu_pair(acc, rh, a);
      m = max(m, abs_bits_max(words[a]));
    }
    // The row's maximum over this half's 64 act columns: the quad's 4 lanes.
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
    uint4 mine[kGroups];  // this lane's stored columns, 8 per group
    for_each_group<kActBlocks>([&](int a) { return words[a]; },
                               [&](int g, uint4 v) {
                                 mine[g] = v;
                                 if (live) store16(act + act_col0 + (4 * g + q) * kFragBlockCols, v);
                               });
    if (p.h_ring != nullptr) {
      __nv_bfloat16* h = p.h_ring + ring_row * h_cols;
      for_each_raw_group(acc, rh, [&](int g, uint4 v) {
        if (live) store16(h + h_col0 + (4 * g + q) * kFragBlockCols, v);
      });
    }
    if (half == 0) {
      amax[rh] = m;
      continue;
    }
    const fp8_blockwise::BlockScale s = fp8_blockwise::block_scale(max(amax[rh], m), false);
    if (!live) continue;
    const fp8_blockwise::Divider d(s.factor);
    uint8_t* act8 = p.act8_ring + ring_row * p.inter;
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      const int col = (4 * g + q) * kFragBlockCols;
      *reinterpret_cast<uint2*>(act8 + block_col0 + col) = encode8(first[g], s, d);
      *reinterpret_cast<uint2*>(act8 + act_col0 + col) = encode8(mine[g], s, d);
    }
    if (q == 0) p.act_scales[static_cast<int64_t>(n_tile) * p.scale_stride + ring_row] = s.scale;
  }
}

// Consumers (both warpgroups): one FP8 task, its two halves (mainloop, then that half's
// epilogue); `mma_done()` after the last half's mainloop (the timeline's mark).
template <class MmaDone>
CUTLASS_DEVICE void fp8_task(const roles::MegaParams& p, const MegaFp8GemmParams& gp,
                             MegaFp8Pipeline& pipeline, MegaFp8PipelineState& state,
                             typename MegaFp8Mainloop::TensorStorage& smem, bool l2, int round,
                             int row_begin, int rows, int n_tile, int k_tiles,
                             int mma_thread_idx, MmaDone mma_done) {
  // An L2 task's row destinations, loaded before the mainloop (as the BF16 task's).
  const L2RowDsts dsts =
      l2 ? l2_row_dsts<MegaFp8TiledMma, MegaFp8TileShape>(p, mma_thread_idx, round, row_begin,
                                                          rows)
         : L2RowDsts{};
  uint32_t amax[2] = {0, 0};
  const int half_tiles = k_tiles / kMegaFp8Halves;
  CUTLASS_PRAGMA_NO_UNROLL
  for (int half = 0; half < kMegaFp8Halves; ++half) {
    MegaFp8Accumulators acc;
    // NOTE: the collective's mma() reads no Params field: one call serves both GEMMs.
    mma_task<MegaFp8Mainloop>(gp.l1.ml, pipeline, state, smem, acc, half_tiles, mma_thread_idx);
    if (half + 1 == kMegaFp8Halves) mma_done();
    if (!l2) {
      l1_epilogue_fp8(p, acc, mma_thread_idx, row_begin, rows, n_tile, half, amax);
    } else {
      l2_epilogue(p, acc, dsts, (n_tile * kMegaFp8Halves + half) * kMegaFp8BlockN);
    }
  }
}

}  // namespace mok::gemm
