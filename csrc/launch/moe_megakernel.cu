// Host launcher of the megakernels (launch/moe_megakernel.h): checks the arguments, derives the
// device parameters (int32 sizes, region offsets, the four TMA descriptors) and launches one
// persistent grid. The kernels: include/mok/kernels/moe_megakernels.cuh.
#include "launch/moe_megakernel.h"

#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "launch/chain.h"
#include "mok/common/macros.cuh"
#include "mok/kernels/moe_megakernels.cuh"

namespace mok::launch {
namespace {

using layout::Region;

bool fits_int32(int64_t v) { return v >= 0 && v <= std::numeric_limits<int32_t>::max(); }

int to_int32(int64_t v, const char* what) {
  MOK_HOST_CHECK(fits_int32(v), "megakernel: %s=%lld must fit in int32", what,
                 static_cast<long long>(v));
  return static_cast<int>(v);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// TMA descriptors of one GEMM: A = a [a_rows, k] (one "batch"); B the expert weights, as (N, K)
// per expert: b [num_experts, n, k] (the forward's mainloop, K contiguous) or b [num_experts, k,
// n] (the backward's, N contiguous).
// NOTE: A comes from a problem with L = 1 and B from one with L = num_experts; each call builds
// both descriptors, and only the right one of each is kept.
template <bool kBackward, class Mainloop>
typename Mainloop::Params gemm_params(const void* a, int a_rows, const void* b, int n, int k,
                                      int num_experts) {
  using Element = gemm::Element;
  const auto stride_a = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{a_rows} * k);
  typename Mainloop::StrideB stride_b;
  if constexpr (kBackward) {
    stride_b = cute::make_stride(cute::Int<1>{}, int64_t{n}, int64_t{n} * k);
  } else {
    stride_b = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{n} * k);
  }
  const typename Mainloop::Arguments args{static_cast<const Element*>(a), stride_a,
                                          static_cast<const Element*>(b), stride_b};
  typename Mainloop::Params params =
      Mainloop::to_underlying_arguments(cute::make_shape(a_rows, n, k, 1), args, nullptr);
  const typename Mainloop::Params batched = Mainloop::to_underlying_arguments(
      cute::make_shape(a_rows, n, k, num_experts), args, nullptr);
  params.tma_load_b = batched.tma_load_b;
  return params;
}

// TMA descriptors of the down weight's gradient (gemm::MegaMainloopWgrad): A (M = H, K = ring
// rows) over d_rows [ring, H], M-major; B (N = I, K = B rows) over wgrad_b [b_rows, I], N-major.
// NOTE: A and B have different K extents: each from a problem with its own K, as gemm_params
// takes B's from another problem.
typename gemm::MegaMainloopWgrad::Params wgrad_params(const void* d_rows, int ring,
                                                     const void* b, int b_rows, int h, int i) {
  using Mainloop = gemm::MegaMainloopWgrad;
  using Element = gemm::Element;
  const auto of = [&](int k) {
    const typename Mainloop::Arguments args{
        static_cast<const Element*>(d_rows),
        cute::make_stride(cute::Int<1>{}, int64_t{h}, int64_t{h} * ring),
        static_cast<const Element*>(b),
        cute::make_stride(cute::Int<1>{}, int64_t{i}, int64_t{i} * b_rows)};
    return Mainloop::to_underlying_arguments(cute::make_shape(h, i, k, 1), args, nullptr);
  };
  typename Mainloop::Params params = of(ring);
  params.tma_load_b = of(b_rows).tma_load_b;
  return params;
}

// The FP8 forward's operands (MegaArgs::fp8).
void check_fp8_args(const MegaArgs& a) {
  const layout::MegaShape& s = a.shape;
  constexpr int kBlock = gemm::kFp8ScaleBlock;
  MOK_HOST_CHECK(!a.backward && a.cluster_ctas == 1,
                 "FP8 megakernel: the forward only, without clusters (cluster_ctas=%d; use "
                 "MoKConfig.megakernel_cluster=1 with FP8 experts)",
                 a.cluster_ctas);
  MOK_HOST_CHECK(s.hidden % kBlock == 0 && s.inter % kBlock == 0 &&
                     s.hidden / kBlock <= gemm::kMegaFp8MaxKBlocks &&
                     s.inter / kBlock <= gemm::kMegaFp8MaxKBlocks,
                 "FP8 megakernel: hidden=%lld and inter=%lld must be multiples of %d (the FP8 "
                 "blocks) and at most %d",
                 static_cast<long long>(s.hidden), static_cast<long long>(s.inter), kBlock,
                 kBlock * gemm::kMegaFp8MaxKBlocks);
  // NOTE: with the rows in place no x8 ring exists (an empty tensor's data pointer is null); the
  // producers read x quantised in place (roles/megakernel_fp8.cuh).
  MOK_HOST_CHECK(a.w_gate_up_scales != nullptr && a.w_down_scales != nullptr &&
                     (a.x8_ring != nullptr || a.rows_in_place) && a.x_scales != nullptr &&
                     a.act8_ring != nullptr && a.act_scales != nullptr,
                 "FP8 megakernel: null weight scales, x8_ring, x_scales, act8_ring or act_scales");
  MOK_HOST_CHECK(a.local_token_scales == nullptr || a.local_tokens != nullptr,
                 "FP8 megakernel: local_token_scales go with the quantised rows in place "
                 "(local_tokens, one rank)");
  MOK_HOST_CHECK(aligned16(a.x8_ring) && aligned16(a.x_scales) && aligned16(a.act8_ring) &&
                     aligned16(a.act_scales),
                 "FP8 megakernel: the FP8 rings and their scales must be 16-byte aligned (TMA)");
}

void check_args(const MegaArgs& a) {
  const layout::MegaShape& s = a.shape;
  const layout::WorkspaceLayout& lay = a.lay;
  if (a.fp8) check_fp8_args(a);
  MOK_HOST_CHECK(a.fp8 || a.local_token_scales == nullptr,
                 "megakernel: local_token_scales are the FP8 forward's");
  MOK_HOST_CHECK(layout::valid_cluster_ctas(a.cluster_ctas),
                 "megakernel: cluster_ctas=%d must be 1 or %d", a.cluster_ctas,
                 layout::kMaxClusterCtas);
  MOK_HOST_CHECK(a.num_ctas % a.cluster_ctas == 0 && a.num_comm_ctas % a.cluster_ctas == 0,
                 "megakernel: num_ctas=%d and num_comm_ctas=%d must be multiples of the cluster's "
                 "%d CTAs (a cluster's CTAs take tasks together)",
                 a.num_ctas, a.num_comm_ctas, a.cluster_ctas);
  MOK_HOST_CHECK(a.num_comm_ctas >= 1, "megakernel: num_comm_ctas=%d must be >= 1",
                 a.num_comm_ctas);
  MOK_HOST_CHECK(layout::valid_order_block(a.order_block) &&
                     (!a.backward || a.order_block == layout::kOrderBlockTiles),
                 "megakernel: order_block=%d must be %d or %d (the backward's %d: "
                 "MoKConfig.megakernel_order_block sets the forward's)",
                 a.order_block, layout::kOrderBlockSmall, layout::kOrderBlockTiles,
                 layout::kOrderBlockTiles);
  MOK_HOST_CHECK(a.num_ctas - a.num_comm_ctas >= 1,
                 "megakernel: num_ctas=%d must exceed num_comm_ctas=%d (>= 1 CTA takes tasks from "
                 "the start)",
                 a.num_ctas, a.num_comm_ctas);
  MOK_HOST_CHECK(s.hidden > 0 && s.hidden % 8 == 0 && s.inter > 0 && s.inter % 8 == 0,
                 "megakernel: hidden=%lld and inter=%lld must be positive multiples of 8 "
                 "(16-byte rows)",
                 static_cast<long long>(s.hidden), static_cast<long long>(s.inter));
  MOK_HOST_CHECK(s.minibatch_rows > 0 && s.minibatch_rows % 8 == 0 && s.macrobatch_rows > 0,
                 "megakernel: minibatch_rows=%lld must be a positive multiple of 8 and "
                 "macrobatch_rows=%lld positive",
                 static_cast<long long>(s.minibatch_rows),
                 static_cast<long long>(s.macrobatch_rows));
  MOK_HOST_CHECK(s.row_capacity >= 0 && s.num_local_experts >= 1,
                 "megakernel: row_capacity=%lld must be >= 0 and num_local_experts=%lld >= 1",
                 static_cast<long long>(s.row_capacity),
                 static_cast<long long>(s.num_local_experts));
  MOK_HOST_CHECK(lay.hidden == s.hidden, "megakernel: layout hidden=%lld != shape hidden=%lld",
                 static_cast<long long>(lay.hidden), static_cast<long long>(s.hidden));
  MOK_HOST_CHECK(lay.slot_rows != 0, "megakernel: the workspace layout needs slot_rows set");
  MOK_HOST_CHECK(lay.counter_words >= s.counter_words(),
                 "megakernel: layout counter_words=%lld < the shape's %lld",
                 static_cast<long long>(lay.counter_words),
                 static_cast<long long>(s.counter_words()));
  MOK_HOST_CHECK(a.rank >= 0 && a.rank < lay.num_ranks, "megakernel: rank=%d not in [0, %lld)",
                 a.rank, static_cast<long long>(lay.num_ranks));
  MOK_HOST_CHECK(a.timeout_ns > 0, "megakernel: timeout_ns must be positive");
  // Plan encodings the device decodes with 32-bit division.
  MOK_HOST_CHECK(fits_int32(lay.num_ranks * lay.max_tokens * lay.topk),
                 "megakernel: num_ranks * max_tokens * topk = %lld must fit in int32",
                 static_cast<long long>(lay.num_ranks * lay.max_tokens * lay.topk));
  MOK_HOST_CHECK(fits_int32(s.num_rounds() * s.ring_rows()) && fits_int32(s.counter_words()),
                 "megakernel: the plan (%lld rounds of %lld rows) is too large for int32 indices",
                 static_cast<long long>(s.num_rounds()), static_cast<long long>(s.ring_rows()));
  MOK_HOST_CHECK(a.peer_bases != nullptr && a.my_base != 0 && a.error != nullptr,
                 "megakernel: null peer_bases, my_base or error");
  MOK_HOST_CHECK(a.local_tokens == nullptr || (lay.num_ranks == 1 && aligned16(a.local_tokens)),
                 "megakernel: local_tokens (token rows read in place) needs one rank, not %lld, "
                 "and 16-byte aligned rows",
                 static_cast<long long>(lay.num_ranks));
  if (a.rows_in_place) {
    MOK_HOST_CHECK(!a.backward && a.cluster_ctas == 1 && lay.num_ranks == 1,
                   "megakernel: rows in place (MoKConfig.fwd_rows='in_place') are the forward's "
                   "at one rank without clusters (backward=%d, cluster_ctas=%d, num_ranks=%lld); "
                   "use fwd_rows='pull'",
                   static_cast<int>(a.backward), a.cluster_ctas,
                   static_cast<long long>(lay.num_ranks));
    // NOTE: the loaders hold each row's offset (token * hidden elements) in 32 bits
    // (gemm::RowCopies::Rows).
    MOK_HOST_CHECK(a.token_rows * lay.hidden <= int64_t{UINT32_MAX},
                   "megakernel: rows in place address %lld token rows of hidden=%lld by 32-bit "
                   "offsets; use fwd_rows='pull'",
                   static_cast<long long>(a.token_rows), static_cast<long long>(lay.hidden));
    const void* rows = a.fp8 ? a.local_tokens : a.rows;  // FP8: x quantised in place
    MOK_HOST_CHECK(rows != nullptr && aligned16(rows) && a.token_rows >= 1 &&
                       fits_int32(a.token_rows) && a.token_rows <= lay.max_tokens,
                   "megakernel: rows in place need 16-byte aligned token rows, 1 to %lld of them "
                   "(got %lld)",
                   static_cast<long long>(lay.max_tokens), static_cast<long long>(a.token_rows));
    MOK_HOST_CHECK(!a.fp8 || a.local_token_scales != nullptr,
                   "FP8 megakernel: rows in place read the scales of x quantised in place "
                   "(local_token_scales)");
    MOK_HOST_CHECK(a.stall_minibatch < 0,
                   "megakernel: stall_minibatch (a test's fault) needs pulled rows, not rows in "
                   "place");
  }
  MOK_HOST_CHECK(a.w_gate_up != nullptr && a.w_down != nullptr &&
                     (a.fp8 || ((a.x_ring != nullptr || a.rows_in_place) && a.act_ring != nullptr)),
                 "megakernel: null w_gate_up, w_down, x_ring or act_ring (only the FP8 forward "
                 "reads neither: its L2 reads act's FP8 copy, and it stores the bf16 act where "
                 "act_ring is given)");
  if (a.backward) {
    MOK_HOST_CHECK(a.h_ring != nullptr && a.dh_ring != nullptr && a.w_rows != nullptr &&
                       a.rw_partials != nullptr && a.y_rows == nullptr,
                   "backward megakernel: h_ring, dh_ring, w_rows and rw_partials are required "
                   "and y_rows is the forward's only");
    MOK_HOST_CHECK(s.num_rounds() == 1 ? a.round <= 0 : a.round >= 0 && a.round < s.num_rounds(),
                   "backward megakernel: round=%d of %lld macrobatch rounds; a backward of several "
                   "rounds launches once per round, each naming its round",
                   a.round, static_cast<long long>(s.num_rounds()));
    const bool wgrad = a.wgrad_mode != layout::kWgradNone;
    MOK_HOST_CHECK(a.wgrad_mode >= layout::kWgradNone && a.wgrad_mode <= layout::kWgradAddF32 &&
                       wgrad == (a.wgrad_b != nullptr) && wgrad == (a.wgrad_ends != nullptr) &&
                       wgrad == (a.wgrad_b_starts != nullptr) &&
                       wgrad == (a.wgrad_out != nullptr),
                   "backward megakernel: the down weight's gradient (wgrad_mode=%d) takes "
                   "wgrad_b, wgrad_ends, wgrad_b_starts and wgrad_out, or mode 0 and none of them",
                   a.wgrad_mode);
    MOK_HOST_CHECK(!wgrad || (s.num_rounds() == 1 && a.cluster_ctas == 1),
                   "backward megakernel: the down weight's gradient in the launch "
                   "(MoKConfig.bwd_wgrad='down') runs in one macrobatch round without clusters "
                   "(rounds=%lld, cluster_ctas=%d); use bwd_wgrad='off'",
                   static_cast<long long>(s.num_rounds()), a.cluster_ctas);
    MOK_HOST_CHECK(wgrad || !a.wgrad_interleave,
                   "backward megakernel: wgrad_interleave orders the down weight's gradient "
                   "tasks; it needs them (wgrad_mode)");
    MOK_HOST_CHECK(!wgrad || (aligned16(a.wgrad_b) && aligned16(a.wgrad_out)),
                   "backward megakernel: wgrad_b and wgrad_out must be 16-byte aligned");
  } else {
    MOK_HOST_CHECK(a.round == -1, "forward megakernel: round=%d; the forward runs every round "
                   "in one launch (round=-1)", a.round);
    MOK_HOST_CHECK(a.wgrad_mode == layout::kWgradNone && a.wgrad_b == nullptr &&
                       a.wgrad_out == nullptr && !a.wgrad_interleave,
                   "forward megakernel: the down weight's gradient is the backward's");
    MOK_HOST_CHECK(a.dh_ring == nullptr && a.w_rows == nullptr && a.rw_partials == nullptr,
                   "forward megakernel: dh_ring, w_rows and rw_partials are the backward's only");
  }
  MOK_HOST_CHECK((a.trace_ctas == nullptr) == (a.trace_tasks == nullptr),
                 "megakernel: trace_ctas and trace_tasks are both given or both null");
  MOK_HOST_CHECK(fits_int32(s.num_rounds() * s.max_tasks()),
                 "megakernel: %lld rounds of %lld tasks are too many for int32 tickets",
                 static_cast<long long>(s.num_rounds()), static_cast<long long>(s.max_tasks()));
  MOK_HOST_CHECK(a.row_src != nullptr && a.row_dst != nullptr && a.tile_count != nullptr &&
                     a.tiles != nullptr,
                 "megakernel: null row_src, row_dst, tile_count or tiles");
  MOK_HOST_CHECK(aligned16(a.w_gate_up) && aligned16(a.w_down) && aligned16(a.x_ring) &&
                     aligned16(a.act_ring) && aligned16(a.h_ring) && aligned16(a.y_rows) &&
                     aligned16(a.dh_ring),
                 "megakernel: weights and rings must be 16-byte aligned (TMA, 16-byte rows)");
}

roles::MegaParams device_params(const MegaArgs& a) {
  const layout::MegaShape& s = a.shape;
  roles::MegaParams p{};
  p.peer_bases = a.peer_bases;
  p.tokens_offset = static_cast<uint64_t>(a.lay.offset(Region::kTokens));
  p.local_tokens = static_cast<const uint8_t*>(a.local_tokens);
  p.slot_rows_offset = static_cast<uint64_t>(a.lay.offset(Region::kSlotRows));
  p.counters = a.lay.at<int32_t>(a.my_base, Region::kCounters);
  p.error = a.error;
  p.rank = a.rank;
  p.timeout_ns = a.timeout_ns;
  p.hidden = to_int32(s.hidden, "hidden");
  p.inter = to_int32(s.inter, "inter");
  p.num_local_experts = to_int32(s.num_local_experts, "num_local_experts");
  p.max_tokens = to_int32(a.lay.max_tokens, "max_tokens");
  p.slots_per_rank = to_int32(a.lay.max_tokens * a.lay.topk, "max_tokens * topk");
  p.ring_rows = to_int32(s.ring_rows(), "ring_rows");
  p.minibatch_rows = to_int32(s.minibatch_rows, "minibatch_rows");
  // A backward round's launch: the plan from round `round` on, one round; else all of them.
  const int64_t base = a.round < 0 ? 0 : a.round, ring_base = base * s.ring_rows();
  p.num_rounds = a.round < 0 ? to_int32(s.num_rounds(), "num_rounds") : 1;
  p.round_stride = to_int32(s.num_rounds(), "num_rounds");
  p.round_base = static_cast<int>(base);
  p.max_tiles = to_int32(s.max_tiles(), "max_tiles");
  // The first GEMM's B rows and the second's K: forward (2I, I), backward (I, 2I).
  p.l1_n = a.backward ? p.inter : 2 * p.inter;
  p.l2_k = a.backward ? 2 * p.inter : p.inter;
  p.l1_ntiles = to_int32(a.backward ? s.dgrad_ntiles() : s.l1_ntiles(), "l1_ntiles");
  p.l2_ntiles = to_int32(s.l2_ntiles(), "l2_ntiles");
  // A task's k-tiles (mainloop stages); FP8: K / 128, each stage both halves' (megakernel_fp8.cuh).
  const int block_k = a.fp8 ? cute::size<2>(gemm::MegaFp8TileShape{})
                            : cute::size<2>(gemm::MegaTileShape{});
  p.l1_ktiles = to_int32(layout::MegaShape::ceil_div(s.hidden, block_k), "l1_ktiles");
  p.l2_ktiles = to_int32(layout::MegaShape::ceil_div(p.l2_k, block_k), "l2_ktiles");
  p.arrive_word = to_int32(s.arrive_word(), "arrive_word");
  p.l1_done_word = to_int32(s.l1_done_word(), "l1_done_word");
  p.num_ctas = a.num_ctas;
  p.num_comm_ctas = a.num_comm_ctas;
  p.order_block = a.order_block;
  p.rows_in_place = a.rows_in_place ? 1 : 0;
  p.rows = static_cast<const __nv_bfloat16*>(a.rows);
  p.stall_minibatch = a.stall_minibatch;
  p.stall_l2_cta = a.stall_l2_cta;
  p.phase_offset = a.backward ? layout::kBackwardPhases : 0;
  p.x_ring = static_cast<__nv_bfloat16*>(a.x_ring);
  p.act_ring = static_cast<__nv_bfloat16*>(a.act_ring);
  p.h_ring = static_cast<__nv_bfloat16*>(a.h_ring);
  p.y_rows = static_cast<__nv_bfloat16*>(a.y_rows);
  p.dh_ring = static_cast<__nv_bfloat16*>(a.dh_ring);
  p.w_rows = a.w_rows == nullptr ? nullptr : a.w_rows + ring_base;
  p.rw_partials = a.rw_partials;
  p.rw_parts = p.l1_ntiles;
  p.wgrad = a.wgrad_mode;
  p.wgrad_interleave = a.wgrad_interleave ? 1 : 0;
  p.wgrad_mtiles = to_int32(s.wgrad_mtiles(), "wgrad_mtiles");
  p.wgrad_ntiles = to_int32(s.wgrad_ntiles(), "wgrad_ntiles");
  p.wgrad_ends = a.wgrad_ends;
  p.wgrad_b_starts = a.wgrad_b_starts;
  p.wgrad_out = a.wgrad_out;
  if (p.wgrad) {  // the gradient's elements and B's rows are addressed in 64 bits, rows in 32
    (void)to_int32(s.wgrad_b_rows(), "wgrad_b_rows");
    (void)to_int32(s.wgrad_tasks(), "wgrad_tasks");
  }
  p.row_src = a.row_src + ring_base;
  p.row_dst = a.row_dst + ring_base;
  p.tile_count = a.tile_count + base;
  p.tiles = a.tiles + base * s.max_tiles();
  p.max_tasks = to_int32(s.max_tasks(), "max_tasks");
  p.trace_ctas = a.trace_ctas;
  p.trace_tasks = a.trace_tasks == nullptr
                      ? nullptr
                      : a.trace_tasks + base * s.max_tasks() * layout::kTraceTaskWords;
  if (a.fp8) {
    p.x8_ring = static_cast<uint8_t*>(a.x8_ring);
    p.x_scales = a.x_scales;
    p.act8_ring = static_cast<uint8_t*>(a.act8_ring);
    p.act_scales = a.act_scales;
    p.scale_stride = to_int32(s.fp8_scale_stride(), "fp8_scale_stride");
    p.local_token_scales = a.local_token_scales;
    // The quantised rows in place (one rank: H bytes, their scales apart), the packed rows in
    // place, or packed rows staged into the tokens region's rows of hidden bf16
    // (moe_stage_tokens' pitch).
    const int64_t in_place_row = a.local_token_scales != nullptr
                                     ? s.hidden
                                     : fp8_blockwise::packed_row_bytes(s.hidden);
    p.token_row_bytes =
        to_int32(a.local_tokens != nullptr ? in_place_row : s.hidden * 2, "token_row_bytes");
  }
  return p;
}

// One FP8 GEMM's operands: A = a [a_rows, k] e4m3 with M-major scales a_scales [k / 128,
// scale_stride]; B = b [num_experts, n, k] e4m3 with scales b_scales [num_experts, n / 128,
// k / 128]. As gemm_params, A's descriptor from a problem with L = 1, B's with L = num_experts.
// `scale_rows` (default a_rows): the rows of A's scale descriptor, at most scale_stride.
gemm::MegaFp8Gemm fp8_gemm_params(const void* a, const float* a_scales, int a_rows,
                                  int scale_stride, const void* b, const float* b_scales, int n,
                                  int k, int num_experts, int scale_rows = -1) {
  using Mainloop = gemm::MegaFp8Base;  // its TMA descriptors (MegaFp8Mainloop::Params)
  using Element = gemm::Fp8Element;
  constexpr int kBlock = gemm::kFp8ScaleBlock;
  const auto stride_a = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{a_rows} * k);
  const auto stride_b = cute::make_stride(int64_t{k}, cute::Int<1>{}, int64_t{n} * k);
  const auto args = [&](int l) {
    const auto shape = cute::make_shape(a_rows, n, k, l);
    return typename Mainloop::Arguments{static_cast<const Element*>(a), stride_a,
                                        static_cast<const Element*>(b), stride_b,
                                        a_scales, gemm::Fp8ScaleConfig::tile_atom_to_shape_SFA(shape),
                                        b_scales, gemm::Fp8ScaleConfig::tile_atom_to_shape_SFB(shape)};
  };
  gemm::MegaFp8Gemm g{};
  g.ml = Mainloop::to_underlying_arguments(cute::make_shape(a_rows, n, k, 1), args(1), nullptr);
  g.ml.tma_load_b = Mainloop::to_underlying_arguments(cute::make_shape(a_rows, n, k, num_experts),
                                                      args(num_experts), nullptr)
                        .tma_load_b;
  g.sfa = gemm::make_sfa_tma(a_scales, scale_rows < 0 ? a_rows : scale_rows, k / kBlock,
                             scale_stride);
  g.sfb = b_scales;
  g.n_blocks = n / kBlock;
  g.k_blocks = k / kBlock;
  return g;
}

kernels::MegaKernelParams<false, 1, true> fp8_kernel_params(const MegaArgs& a) {
  kernels::MegaKernelParams<false, 1, true> kp;
  kp.p = device_params(a);
  const int ring = kp.p.ring_rows, h = kp.p.hidden, i = kp.p.inter, e = kp.p.num_local_experts;
  const int stride = kp.p.scale_stride;
  if (a.rows_in_place) {  // no x8 ring: A's descriptor over x quantised in place (unread: the
                         // producers copy A and its scales, roles/megakernel_fp8.cuh)
    const int rows = to_int32(a.token_rows, "token_rows");
    // (the scales' descriptor over the ring's scale region, ring rows: its row stride)
    kp.gemm.l1 = fp8_gemm_params(a.local_tokens, a.x_scales, rows, stride, a.w_gate_up,
                                 a.w_gate_up_scales, 2 * i, h, e, ring);
  } else {
    kp.gemm.l1 = fp8_gemm_params(a.x8_ring, a.x_scales, ring, stride, a.w_gate_up,
                                 a.w_gate_up_scales, 2 * i, h, e);
  }
  kp.gemm.l2 = fp8_gemm_params(a.act8_ring, a.act_scales, ring, stride, a.w_down,
                               a.w_down_scales, h, i, e);
  return kp;
}

// Forward: L1 = x_ring x w_gate_up[e] (N = 2I, K = H), L2 = act_ring x w_down[e] (N = H,
// K = I). Backward: L2 dgrad = d_ring x w_down[e] (N = I, K = H), L1 dgrad = dh_ring x
// w_gate_up[e] (N = H, K = 2I).
template <bool kBackward, int kCluster>
kernels::MegaKernelParams<kBackward, kCluster> kernel_params(const MegaArgs& a) {
  using Mainloop = gemm::MegaMainloopOf<kBackward, kCluster>;
  kernels::MegaKernelParams<kBackward, kCluster> kp;
  kp.p = device_params(a);
  const int ring = kp.p.ring_rows, h = kp.p.hidden, i = kp.p.inter, e = kp.p.num_local_experts;
  if constexpr (kBackward) {
    kp.gemm.l1 = gemm_params<kBackward, Mainloop>(a.x_ring, ring, a.w_down, i, h, e);
    kp.gemm.l2 = gemm_params<kBackward, Mainloop>(a.dh_ring, ring, a.w_gate_up, h, 2 * i, e);
    if (a.wgrad_mode != layout::kWgradNone) {
      kp.gemm.wgrad = wgrad_params(a.x_ring, ring, a.wgrad_b,
                                   to_int32(a.shape.wgrad_b_rows(), "wgrad_b_rows"), h, i);
    }
    if (a.wgrad_mode == layout::kWgradAddF32) {
      kp.gemm.wgrad_reduce =
          gemm::make_wgrad_reduce_tma(static_cast<float*>(a.wgrad_out), e, h, i);
    }
  } else if (a.rows_in_place) {  // x_ring unused: A's ring descriptor over the token rows
    const int rows = to_int32(a.token_rows, "token_rows");
    kp.gemm.l1 = gemm_params<kBackward, Mainloop>(a.rows, rows, a.w_gate_up, 2 * i, h, e);
    kp.gemm.l2 = gemm_params<kBackward, Mainloop>(a.act_ring, ring, a.w_down, h, i, e);
  } else {
    kp.gemm.l1 = gemm_params<kBackward, Mainloop>(a.x_ring, ring, a.w_gate_up, 2 * i, h, e);
    kp.gemm.l2 = gemm_params<kBackward, Mainloop>(a.act_ring, ring, a.w_down, h, i, e);
  }
  return kp;
}

}  // namespace

int megakernel_threads() { return kernels::kMegaThreads; }

size_t megakernel_smem_bytes(bool fp8) {
  return fp8 ? kernels::kMegaFp8SmemBytes : kernels::kMegaSmemBytes;
}

namespace {

template <bool kBackward, int kCluster>
auto kernel_of() {
  if constexpr (kBackward) {
    return &kernels::moe_backward_megakernel<kCluster>;
  } else {
    return &kernels::moe_forward_megakernel<kCluster>;
  }
}

// The megakernel of a pass for clusters of `cluster` CTAs (1 or 2: check_args), or the FP8
// forward's.
const void* kernel_ptr(bool backward, int cluster, bool fp8) {
  const auto of = [](auto kernel) { return reinterpret_cast<const void*>(kernel); };
  if (fp8) return of(&kernels::moe_forward_megakernel_fp8);
  if (backward) return cluster == 1 ? of(kernel_of<true, 1>()) : of(kernel_of<true, 2>());
  return cluster == 1 ? of(kernel_of<false, 1>()) : of(kernel_of<false, 2>());
}

// A launch of `grid` megakernel CTAs in clusters of `cluster` (cudaLaunchKernelEx's form): the
// cluster occupancy query and the launch describe it alike.
// `chained`: with programmatic stream serialization (launch/chain.h); never for the occupancy
// query, whose answer is cached for every later launch, chained or not.
struct ClusterLaunch {
  cudaLaunchAttribute attrs[2]{};
  cudaLaunchConfig_t config{};

  ClusterLaunch(int grid, int cluster, cudaStream_t stream, bool chained) {
    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attrs[0].val.clusterDim.y = attrs[0].val.clusterDim.z = 1;
    attrs[1] = chained_attribute();
    config.gridDim = dim3(static_cast<unsigned>(grid));
    config.blockDim = dim3(static_cast<unsigned>(megakernel_threads()));
    config.dynamicSmemBytes = megakernel_smem_bytes(false);  // the BF16 megakernels' (clusters)
    config.stream = stream;
    config.attrs = attrs;
    config.numAttrs = chained ? 2 : 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // config points at attrs
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// CTAs of the megakernel (of a pass, for clusters of `cluster` CTAs) the device holds at once:
// SMs x CTAs per SM, or clusters x `cluster` (a cluster's CTAs sit on SMs of one GPC); 0 where
// it cannot run. Also sets the kernel's dynamic shared-memory attribute.
int query_resident_ctas(int device, bool backward, int cluster, bool fp8) {
  int major = 0, minor = 0, sms = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (major != 9 || minor != 0) return 0;  // the kernels are built for sm_90a only
  const int smem = static_cast<int>(megakernel_smem_bytes(fp8));
  const void* kernel = kernel_ptr(backward, cluster, fp8);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // not built for this device, or too much shared memory
    return 0;
  }
  if (cluster == 1) {
    int ctas = 0;
    MOK_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, megakernel_threads(), smem));
    return sms * ctas;
  }
  const ClusterLaunch one(cluster, cluster, nullptr, false);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &one.config) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return clusters * cluster;
}

// query_resident_ctas, asked once per device, pass and cluster size (the answer and the
// shared-memory attribute the query sets do not change): the launch asks on every pass, and the
// query costs host time the GPU waits out.
int resident_ctas(bool backward, int cluster, bool fp8) {
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  constexpr int kMaxDevices = 64;
  // [fp8][backward][cluster - 1][device]: 1 + the answer
  static std::atomic<int> known[2][2][layout::kMaxClusterCtas][kMaxDevices];
  if (device >= kMaxDevices) return query_resident_ctas(device, backward, cluster, fp8);
  std::atomic<int>& slot = known[fp8 ? 1 : 0][backward ? 1 : 0][cluster - 1][device];
  int k = slot.load(std::memory_order_acquire);
  if (k == 0) {
    k = 1 + query_resident_ctas(device, backward, cluster, fp8);
    slot.store(k, std::memory_order_release);
  }
  return k - 1;
}

template <bool kBackward, int kCluster>
void launch(const MegaArgs& args, cudaStream_t stream) {
  const auto params = kernel_params<kBackward, kCluster>(args);
  const auto kernel = kernel_of<kBackward, kCluster>();
  if constexpr (kCluster == 1) {
    launch::kernel(kernel, args.num_ctas, megakernel_threads(), megakernel_smem_bytes(), stream,
                   params);
  } else {
    const ClusterLaunch grid(args.num_ctas, kCluster, stream, chained());
    launch_ex(grid.config, kernel, params);
  }
}

}  // namespace

int megakernel_resident_ctas(bool backward, int cluster, bool fp8) {
  MOK_HOST_CHECK(layout::valid_cluster_ctas(cluster), "megakernel: cluster=%d must be 1 or %d",
                 cluster, layout::kMaxClusterCtas);
  MOK_HOST_CHECK(!fp8 || (!backward && cluster == 1),
                 "megakernel: the FP8 megakernel is a forward without clusters");
  return resident_ctas(backward, cluster, fp8);
}

void moe_megakernel(const MegaArgs& args, cudaStream_t stream) {
  check_args(args);
  // NOTE: sets the kernel's shared-memory attribute
  const int resident = resident_ctas(args.backward, args.cluster_ctas, args.fp8);
  MOK_HOST_CHECK(resident >= 1,
                 "megakernel: cannot run on this device (needs sm_90a, %zu bytes of shared "
                 "memory per CTA and clusters of %d)",
                 megakernel_smem_bytes(args.fp8), args.cluster_ctas);
  MOK_HOST_CHECK(args.num_ctas <= resident,
                 "megakernel: num_ctas=%d exceeds the %d CTAs (clusters of %d) this GPU holds at "
                 "once: every CTA must be resident, or a spin-wait could wait on an unscheduled "
                 "CTA",
                 args.num_ctas, resident, args.cluster_ctas);
  if (args.fp8) {
    const auto params = fp8_kernel_params(args);
    launch::kernel(kernels::moe_forward_megakernel_fp8, args.num_ctas, megakernel_threads(),
                   megakernel_smem_bytes(true), stream, params);
  } else if (args.backward) {
    args.cluster_ctas == 1 ? launch<true, 1>(args, stream) : launch<true, 2>(args, stream);
  } else {
    args.cluster_ctas == 1 ? launch<false, 1>(args, stream) : launch<false, 2>(args, stream);
  }
}

}  // namespace mok::launch
