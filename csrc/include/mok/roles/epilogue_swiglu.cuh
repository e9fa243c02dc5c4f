// Role: SwiGLU epilogues for the grouped GEMM, applied to the wgmma accumulators in registers.
//
// Weight layout they rely on ("gate/up interleaved in blocks of 8"): the L1 weight w_gu
// [E, 2I, H] holds, for every block b of 8 intermediate columns, gate rows 8b..8b+7 at
// 16b..16b+7 and up rows 8b..8b+7 at 16b+8..16b+15. With the wgmma accumulator layout a thread
// then holds gate column j and up column j in registers kPartner apart (checked at compile time
// below and by tests/gpu), so SwiGLU needs no shared memory and no cross-thread exchange.
//
//   kForward : acc = h tile [rows, 2I] (interleaved); writes act = silu(g) * u  [rows, I] and,
//              if asked, h itself (bf16) for the backward.
//   kBackward: acc = d_act tile [rows, I] (from d_y @ W_down); reads h [rows, 2I] and writes
//              d_h [rows, 2I] (interleaved: d_g = d_act*u*silu'(g), d_u = d_act*silu(g)) and,
//              if asked, the recomputed act [rows, I] (the L2 weight gradient's operand).
//
// Used with CUTLASS's Sm90TmaWarpSpecializedAdapter, like its DefaultEpilogueArray: per-thread
// stores straight from registers, bounded by the group's rows.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>

#include "mok/roles/grouped_gemm_config.cuh"

namespace mok::gemm {

enum class SwigluMode : int { kForward = 0, kBackward = 1 };

constexpr int kSwigluInterleave = 8;  // gate/up block width in w_gu rows (and h columns)

// The forward arithmetic and column maps, shared by this epilogue and the megakernel's L1
// epilogue (roles/megakernel_gemm.cuh), so both give bitwise the same act.
struct SwigluMath {
  // Fast reciprocal: 1/inf = 0 keeps silu(-inf) = 0; bf16 outputs hide the ulp-level error.
  static __device__ __forceinline__ float sigmoid(float x) {
    return __fdividef(1.0f, 1.0f + __expf(-x));
  }
  // act = silu(g) * u, evaluated as (g * sigmoid(g)) * u.
  // NOTE: every forward path calls this one expression: products only, nothing to contract.
  static __device__ __forceinline__ float act(float g, float u) { return g * sigmoid(g) * u; }
  // h column `col` (a gate column, even) -> act column.
  static __device__ __forceinline__ int act_col_of(int col) {
    return (col / (2 * kSwigluInterleave)) * kSwigluInterleave + col % kSwigluInterleave;
  }
  // act column `col` -> its gate column in h (the up column is kSwigluInterleave further).
  static __device__ __forceinline__ int gate_col_of(int col) {
    return (col / kSwigluInterleave) * (2 * kSwigluInterleave) + col % kSwigluInterleave;
  }
};

template <SwigluMode kMode>
class SwigluEpilogueArray {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  // Types the kernel and the device adapter read; C is never loaded.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 1, Accumulator,
                                                                        Accumulator>;
  using ElementOutput = Element;
  using ElementAccumulator = Accumulator;
  using ElementCompute = Accumulator;
  using ElementScalar = Accumulator;
  using ElementC = Element;
  using ElementD = Element;
  using StrideC = cutlass::detail::TagToStrideC_t<RowMajor>*;
  using StrideD = StrideC;
  using InternalStrideC = cute::remove_pointer_t<StrideC>;
  using InternalStrideD = InternalStrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  struct Arguments {
    // kForward: out = act [rows, I], aux = h [rows, 2I] (written if write_aux).
    // kBackward: out = d_h [rows, 2I], aux = h [rows, 2I] (read), aux2 = act (written if
    // write_aux2).
    Element** ptr_out = nullptr;
    Element** ptr_aux = nullptr;
    Element** ptr_aux2 = nullptr;
    bool write_aux = false;
    bool write_aux2 = false;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE explicit SwigluEpilogueArray(Params const& params) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int num_rows = get<0>(problem_shape_mnkl);
    const int num_cols = get<1>(problem_shape_mnkl);  // accumulator columns: 2I fwd, I bwd
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;

    // Coordinates (row, col) in the group's output of every accumulator element of this thread.
    Tensor coords = make_identity_tensor(make_shape(num_rows, num_cols));
    Tensor tile_coords =
        local_tile(coords, take<0, 2>(blk_shape_mnk), make_coord(m_coord, n_coord));
    Tensor thr_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(tile_coords);

    // NOTE: wgmma accumulator fragment: mode 0 is (2 cols, 2 row halves, N/8 col blocks), so the
    // element 8 columns right of index i is i + 4 and the next column is i + 1.
    constexpr int kPartner = 4;
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2,
                  "unexpected wgmma accumulator fragment");
    static_assert(size<0, 2>(FrgLayout{}) % 2 == 0, "need an even number of 8-column blocks");

    Element* out = params_.ptr_out[l_coord];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); i += 2) {
      // Within mode 0: i = c + 2*r + 4*n8; gate/act pairs sit at even n8 (kForward) and every
      // n8 (kBackward).
      const int n8 = (i % size<0>(FrgLayout{})) / kPartner;
      if constexpr (kMode == SwigluMode::kForward) {
        if (n8 % 2 != 0) continue;
      }
      const auto coord = thr_coords(i);
      const int row = get<0>(coord);
      const int col = get<1>(coord);
      if (row >= num_rows || col >= num_cols) continue;
      if constexpr (kMode == SwigluMode::kForward) {
        forward_pair(accumulators, i, i + kPartner, row, col, num_cols, out, l_coord);
      } else {
        backward_pair(accumulators, i, row, col, num_cols, out, l_coord);
      }
    }
  }

 private:
  static __device__ __forceinline__ void store2(Element* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  }
  static __device__ __forceinline__ float2 load2(const Element* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  }

  template <class Acc>
  CUTLASS_DEVICE void forward_pair(Acc const& acc, int gi, int ui, int row, int col, int h_cols,
                                   Element* act, int group) {
    const float g0 = acc(gi), g1 = acc(gi + 1), u0 = acc(ui), u1 = acc(ui + 1);
    const float a0 = SwigluMath::act(g0, u0);
    const float a1 = SwigluMath::act(g1, u1);
    const int64_t act_cols = h_cols / 2;
    store2(act + row * act_cols + SwigluMath::act_col_of(col), a0, a1);
    if (params_.write_aux) {
      Element* h = params_.ptr_aux[group] + static_cast<int64_t>(row) * h_cols;
      store2(h + col, g0, g1);
      store2(h + col + kSwigluInterleave, u0, u1);
    }
  }

  template <class Acc>
  CUTLASS_DEVICE void backward_pair(Acc const& acc, int i, int row, int col, int act_cols,
                                    Element* d_h, int group) {
    const int64_t h_cols = 2 * static_cast<int64_t>(act_cols);
    const int gate_col = SwigluMath::gate_col_of(col);
    const Element* h = params_.ptr_aux[group] + row * h_cols;
    const float2 g = load2(h + gate_col);
    const float2 u = load2(h + gate_col + kSwigluInterleave);
    float dg[2], du[2], a[2];
    const float gs[2] = {g.x, g.y}, us[2] = {u.x, u.y};
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 2; ++c) {
      const float s = SwigluMath::sigmoid(gs[c]);
      const float silu = gs[c] * s;
      const float d_act = acc(i + c);
      dg[c] = d_act * us[c] * (s * (1.0f + gs[c] * (1.0f - s)));
      du[c] = d_act * silu;
      a[c] = silu * us[c];
    }
    Element* out = d_h + row * h_cols;
    store2(out + gate_col, dg[0], dg[1]);
    store2(out + gate_col + kSwigluInterleave, du[0], du[1]);
    if (params_.write_aux2) {
      store2(params_.ptr_aux2[group] + row * static_cast<int64_t>(act_cols) + col, a[0], a[1]);
    }
  }

  Params params_;
};

template <SwigluMode kMode>
using SwigluEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
    SwigluEpilogueArray<kMode>>;

}  // namespace mok::gemm
