// Role pieces of the megakernel's GEMM tasks: the CUTLASS sm90 collective mainloop both GEMMs use,
// the producer's TMA loads of one task, the consumers' mainloop call, and the two epilogues (L1:
// SwiGLU into the act ring; L2: bf16 rows into the source ranks' slot_rows).
//
// One mainloop type serves L1 and L2: both are "A row-major [rows, K] times B [N, K] K-contiguous
// per expert" (L1: x_ring x w_gate_up[e], K = H; L2: act_ring x w_down[e], K = I), each with its
// own Params (two TMA descriptors, made on the host by the collective's to_underlying_arguments).
// NOTE: the TiledMma is the grouped-GEMM engine's cooperative 128x256x64 one (same builder, same
// tile, same operand majors), and the mainloop reduces K in the same order, so an output tile's
// fp32 accumulators are bitwise those of grouped_gemm_l1_swiglu / grouped_gemm_nt on the same rows.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/roles/epilogue_swiglu.cuh"
#include "mok/roles/grouped_gemm_config.cuh"
#include "mok/roles/megakernel_tasks.cuh"

namespace mok::gemm {

using MegaTileShape = Cooperative::TileShape;  // 128 x 256 x 64
static_assert(cute::size<0>(MegaTileShape{}) == layout::kBlockM &&
              cute::size<1>(MegaTileShape{}) == layout::kBlockN,
              "the plan's tile sizes (layout/mega.cuh) must be the mainloop's");

constexpr int kMegaSmemCarveout = 1024;  // bytes of shared memory left to the kernel's own use

// The non-array TMA + wgmma collective (MainloopSm90TmaGmmaWarpSpecialized).
using MegaMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, RowMajor, kAlignment, Element,
    ColumnMajor, kAlignment, Accumulator, MegaTileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<kMegaSmemCarveout>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using MegaPipeline = typename MegaMainloop::MainloopPipeline;
using MegaPipelineState = typename MegaMainloop::PipelineState;
using MegaTiledMma = typename MegaMainloop::TiledMma;

// The two GEMMs' TMA descriptors (L1: x_ring, w_gate_up; L2: act_ring, w_down).
struct MegaGemmParams {
  typename MegaMainloop::Params l1;
  typename MegaMainloop::Params l2;
};

// One task's operands: A rows [row_begin, row_begin + 128) of the ring, n-tile `n_tile` of
// expert `expert`'s B [n_size, k_size]; k_tiles = ceil(k_size / 64).
struct MegaLoad {
  int row_begin;
  int n_tile;
  int expert;
  int n_size;       // B rows per expert: 2I (L1) or H (L2)
  int k_size;       // H (L1) or I (L2)
  int k_tiles;
  int num_experts;  // E_l
};

// Producer (one thread: warp 0's lane 0, the pipeline's leader): issues the k-tiles of one task
// from `state` on (the caller advances its state by k_tiles, in every lane). A is the TMA
// coordinate tensor of the whole ring shifted by row_begin (domain_offset), so a tile may start
// at any row; rows past the ring are zero-filled by TMA, rows of the next m-tile are loaded,
// computed and discarded by the epilogue (an output row depends on its own A row only).
CUTLASS_DEVICE void load_task(typename MegaMainloop::Params const& mp, MegaPipeline& pipeline,
                              MegaPipelineState state,
                              typename MegaMainloop::TensorStorage& smem, const MegaLoad& load) {
  using namespace cute;
  // TMA coordinate tensors (their shapes only shape the tiling; the descriptors, made over the
  // whole ring and the whole weight, bound every access). A: the 128-row window at row_begin.
  Tensor mA = mp.tma_load_a.get_tma_tensor(make_shape(get<0>(MegaTileShape{}), load.k_size, 1));
  Tensor mB = mp.tma_load_b.get_tma_tensor(make_shape(load.n_size, load.k_size, load.num_experts));
  Tensor gA = local_tile(domain_offset(make_coord(load.row_begin, 0), mA(_, _, 0)),
                         select<0, 2>(MegaTileShape{}), make_coord(0, _));  // (BLK_M, BLK_K, k)
  Tensor gB = local_tile(mB(_, _, load.expert), select<1, 2>(MegaTileShape{}),
                         make_coord(load.n_tile, _));  // (BLK_N, BLK_K, k)
  Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), typename MegaMainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename MegaMainloop::SmemLayoutB{});
  auto block_tma_a = mp.tma_load_a.get_slice(0);
  auto block_tma_b = mp.tma_load_b.get_slice(0);
  Tensor tAgA = block_tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
  Tensor tAsA = block_tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
  Tensor tBgB = block_tma_b.partition_S(gB);
  Tensor tBsB = block_tma_b.partition_D(sB);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < load.k_tiles; ++k) {
    pipeline.producer_acquire(state);  // waits for the slot, arms the full barrier's bytes
    auto* full = pipeline.producer_get_barrier(state);
    const int stage = state.index();
    copy(mp.tma_load_a.with(*full, 0), tAgA(_, _, _, k), tAsA(_, _, _, stage));
    copy(mp.tma_load_b.with(*full, 0), tBgB(_, _, _, k), tBsB(_, _, _, stage));
    ++state;
  }
}

using MegaAccumulators =
    decltype(cute::partition_fragment_C(MegaTiledMma{}, cute::take<0, 2>(MegaTileShape{})));

// Consumers (both warpgroups, 256 threads): the collective's mainloop over one task's k-tiles,
// then its tail (all wgmma done, every slot released); advances `state` past them.
CUTLASS_DEVICE void mma_task(typename MegaMainloop::Params const& mp, MegaPipeline& pipeline,
                             MegaPipelineState& state, typename MegaMainloop::TensorStorage& smem,
                             MegaAccumulators& acc, int k_tiles, int mma_thread_idx) {
  MegaMainloop mainloop;
  mainloop.mma(pipeline, state, acc, k_tiles, mma_thread_idx, smem, mp);
  mainloop.mma_tail(pipeline, state, k_tiles);
  state.advance(k_tiles);
}

// Tile-local (row, col) of each accumulator element of this consumer thread.
CUTLASS_DEVICE auto thread_coords(int mma_thread_idx) {
  using namespace cute;
  Tensor coords = make_identity_tensor(take<0, 2>(MegaTileShape{}));
  return MegaTiledMma{}.get_thread_slice(mma_thread_idx).partition_C(coords);
}

// NOTE: wgmma accumulator fragment: mode 0 is (2 cols, 2 row halves, N/8 col blocks), one MMA
// along M and N for the 128x256 cooperative tile: element i is column pair i, i + 1 of row half
// (i / 2) % 2, and the element 8 columns right of i is i + 4 (epilogue_swiglu.cuh's kPartner).
constexpr int kFragPartner = 4;
using MegaAccLayout = typename MegaAccumulators::layout_type;
static_assert(cute::size<0, 0>(MegaAccLayout{}) == 2 && cute::size<0, 1>(MegaAccLayout{}) == 2 &&
              cute::size<0, 2>(MegaAccLayout{}) % 2 == 0 && cute::size<1>(MegaAccLayout{}) == 1 &&
              cute::size<2>(MegaAccLayout{}) == 1,
              "unexpected wgmma accumulator fragment");

MOK_DEVICE void store_bf16x2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// L1 epilogue (consumers): rows [0, rows) of the tile at ring row row_begin, n-tile n_tile of the
// interleaved 2I columns: act_ring = silu(g) * u (SwigluMath, as stage 1), h_ring = g, u if set.
CUTLASS_DEVICE void l1_epilogue(const roles::MegaParams& p, const MegaAccumulators& acc,
                                int mma_thread_idx, int row_begin, int rows, int n_tile) {
  auto coords = thread_coords(mma_thread_idx);
  const int h_cols = 2 * p.inter;
  const int col0 = n_tile * layout::kBlockN;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    if ((i / kFragPartner) % 2 != 0) continue;  // up columns: taken with their gate partner
    const int row = cute::get<0>(coords(i));
    const int col = col0 + cute::get<1>(coords(i));  // a gate column (col % 16 < 8)
    if (row >= rows || col >= h_cols) continue;
    const float g0 = acc(i), g1 = acc(i + 1);
    const float u0 = acc(i + kFragPartner), u1 = acc(i + kFragPartner + 1);
    const int64_t ring_row = row_begin + row;
    store_bf16x2(p.act_ring + ring_row * p.inter + SwigluMath::act_col_of(col),
                 SwigluMath::act(g0, u0), SwigluMath::act(g1, u1));
    if (p.h_ring != nullptr) {
      __nv_bfloat16* h = p.h_ring + ring_row * h_cols + col;
      store_bf16x2(h, g0, g1);
      store_bf16x2(h + kSwigluInterleave, u0, u1);
    }
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

// L2 epilogue (consumers): rows [0, rows) of the tile at ring row row_begin, columns of n-tile
// n_tile below H: y = bf16(acc) (round to nearest even), into y_rows and the slot row.
CUTLASS_DEVICE void l2_epilogue(const roles::MegaParams& p, const MegaAccumulators& acc,
                                int mma_thread_idx, int round, int row_begin, int rows,
                                int n_tile) {
  auto coords = thread_coords(mma_thread_idx);
  L2RowDst dst[2];
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = cute::get<0>(coords(2 * half));
    dst[half] = row < rows ? l2_row_dst(p, round, row_begin + row) : L2RowDst{nullptr, nullptr};
  }
  const int col0 = n_tile * layout::kBlockN;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    const L2RowDst& d = dst[(i / 2) % 2];
    const int col = col0 + cute::get<1>(coords(i));
    if (col >= p.hidden) continue;
    const __nv_bfloat162 y = __floats2bfloat162_rn(acc(i), acc(i + 1));
    if (d.y != nullptr) *reinterpret_cast<__nv_bfloat162*>(d.y + col) = y;
    if (d.slot != nullptr) *reinterpret_cast<__nv_bfloat162*>(d.slot + col) = y;
  }
}

}  // namespace mok::gemm
