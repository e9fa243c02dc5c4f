// Torch-free host launchers of the megakernels (sm_90a). The forward: one persistent launch that
// pulls routed rows from the source ranks' token buffers into the ring, runs L1 (+ SwiGLU) and
// L2 tiles as their rows land, and stores every result row straight into its source rank's
// slot_rows region. The backward's data gradients, the same way: d_out rows (staged in the
// token buffers) pulled into the ring, L2-dgrad tiles with the SwiGLU backward in their
// epilogue (d_h, the router-weight gradient's partials), L1-dgrad tiles whose rows go to the
// sources' slot_rows. Layout, plan records and counters: mok/layout/mega.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mok/layout/mega.cuh"
#include "mok/layout/workspace.cuh"

namespace mok::launch {

struct MegaArgs {
  bool backward = false;                  // which megakernel (the operands below say which)

  // ---- where ranks' workspaces are (the symmetric layout)
  layout::WorkspaceLayout lay;            // slot_rows must be set; counter_words >= shape's
  const uint64_t* peer_bases = nullptr;   // device [W]: base address of each rank's copy
  uint64_t my_base = 0;                   // this rank's copy (its counters live here)
  int rank = 0;
  int64_t timeout_ns = 0;                 // a device wait gives up after this long (the L1's
                                          // row waits; the others a multiple of it:
                                          // layout::phase_depth)
  const void* local_tokens = nullptr;     // one rank only (lay.num_ranks == 1): the token rows
                                          // [T, H] read in place, with no staging copy into the
                                          // tokens region; null: the ranks' tokens regions
  int32_t* error = nullptr;               // [kMegaErrWords] record (pinned host memory)

  // ---- shapes and knobs
  layout::MegaShape shape;                // sizes of the ring, tiles and counters
  int num_ctas = 0;                       // the grid: every CTA resident (checked)
  int num_comm_ctas = 0;                  // the first num_comm_ctas CTAs move rows
  bool rows_in_place = false;             // the forward's L1 tasks copy their rows from the
                                          // token rows (MoKConfig.fwd_rows="in_place"):
                                          // one rank, clusters of 1; no CTA pulls, and
                                          // x_ring (FP8: x8_ring) may be null
  const void* rows = nullptr;             // rows_in_place, bf16: the token rows
                                          // [token_rows, H] (local_tokens, or this rank's
                                          // tokens region); FP8 reads local_tokens and
                                          // local_token_scales
  int64_t token_rows = 0;
  int cluster_ctas = 1;                   // CTAs per cluster, 1 or 2 (MoKConfig.
                                          // megakernel_cluster); divides num_ctas and
                                          // num_comm_ctas
  int order_block = layout::kOrderBlockTiles;  // m-tiles per block of the task order, 8 or 16
                                          // (MoKConfig.megakernel_order_block; the backward's:
                                          // 16, whose phase D's padding is sized for it)

  // ---- operands (bf16, contiguous)
  const void* w_gate_up = nullptr;        // [E_l, 2I, H], gate/up rows interleaved in blocks of 8
  const void* w_down = nullptr;           // [E_l, H, I]
  void* x_ring = nullptr;                 // [ring_rows, H]: pulled rows (comm CTAs write); the
                                          // backward's: d_out rows
  void* act_ring = nullptr;               // [ring_rows, I]: L1 + SwiGLU output (the backward
                                          // reads the forward's)
  void* h_ring = nullptr;                 // [ring_rows, 2I] or null: L1's pre-activation (the
                                          // backward reads the forward's: required)
  void* y_rows = nullptr;                 // [ring_rows, H] or null: L2's output, also kept here
                                          // (forward only)
  // ---- the backward's own (null in the forward)
  void* dh_ring = nullptr;                // [ring_rows, 2I]: d_h, the L2 dgrad + SwiGLU backward
  const float* w_rows = nullptr;          // [R * ring_rows]: each row's router weight (0: padding)
  float* rw_partials = nullptr;           // [ring_rows, shape.dgrad_ntiles()]: <m, a> per n-tile
  // The down weight's gradient inside the launch (MoKConfig.bwd_wgrad="down"; one round, clusters
  // of 1; all null: none): each expert's [H, I] = d_rows^T B over its rows, tasks after the data
  // gradients' (roles/megakernel_tasks.cuh, phase D), each tile one CTA's, K in the rows' order
  // from the expert's first row in 64-row k-tiles, as grouped_gemm_tn.
  const void* wgrad_b = nullptr;          // [shape.wgrad_b_rows(), I] bf16: bf16(w * a) of each
                                          // expert's rows from row wgrad_b_starts[e] on, zeros
                                          // after them up to the next multiple of
                                          // layout::kWgradRowAlign
  const int32_t* wgrad_ends = nullptr;    // [E_l]: each expert's group end in the ring (its rows:
                                          // [end of e - 1, end of e), the plan's groups)
  const int32_t* wgrad_b_starts = nullptr;  // [E_l]: multiples of kWgradRowAlign
  void* wgrad_out = nullptr;              // [E_l, H, I]: bf16 (stored) or float32 (added
                                          // into: main_grad)
  int wgrad_mode = 0;                     // a layout::MegaWgradOut: what the tiles do with
                                          // wgrad_out (0: no such tasks)
  bool wgrad_interleave = false;          // those tasks among the data gradients' (in chunks),
                                          // not after them (MoKConfig.bwd_wgrad=
                                          // "down_interleaved")

  // ---- the FP8 forward's (fp8: MoKConfig.expert_precision="fp8_blockwise", roles/
  // megakernel_fp8.cuh): w_gate_up / w_down are then the weights' e4m3 (128, 128)-block copies,
  // local_tokens (one rank) the packed FP8 token rows (fp8_blockwise::packed_row_bytes), and the
  // tokens regions hold them at several ranks (at one rank local_tokens may be the quantised
  // rows and local_token_scales their scales); x_ring is not used
  bool fp8 = false;
  const float* local_token_scales = nullptr;  // one rank: local_tokens are x quantised in
                                              // (1, 128) blocks [T, H] e4m3 and these its
                                              // scales [T, H / 128]; null: packed FP8 rows
  const float* w_gate_up_scales = nullptr;  // [E_l, 2I / 128, H / 128]
  const float* w_down_scales = nullptr;     // [E_l, H / 128, I / 128]
  void* x8_ring = nullptr;                  // [ring_rows, H] e4m3: the pulled rows
  float* x_scales = nullptr;                // [H / 128, shape.fp8_scale_stride()]
  void* act8_ring = nullptr;                // [ring_rows, I] e4m3: act for L2
  float* act_scales = nullptr;              // [I / 128, shape.fp8_scale_stride()]

  // ---- the plan (device; the plan kernels write it before the launch)
  const int64_t* row_src = nullptr;       // [R * ring_rows]: s * T_max + t, -1 (zero row)
  const int64_t* row_dst = nullptr;       // [R * ring_rows]: (s * T_max + t) * K + k, -1 (none)
  const int32_t* tile_count = nullptr;    // [R]: m-tiles of each round
  const layout::MegaTile* tiles = nullptr;  // [R, max_tiles], in row order

  // ---- a backward in macrobatch rounds: one launch per round, this one plan round `round` of
  // shape.num_rounds() (its rows, m-tiles, router weights and trace records; a pass of its own
  // for the counters, an epoch bumped with stride R before it); -1: every round of the plan in
  // one launch (the forward, and a backward of one round)
  int round = -1;

  // ---- fault injection (tests only): the comm role never releases this minibatch of the launch's
  // first round (a backward in rounds: of every round's launch);
  // this CTA's consumers stop at their first second-GEMM task (its producer's stage wait times out)
  int stall_minibatch = -1;
  int stall_l2_cta = -1;

  // ---- diagnostics: the timeline (layout/mega.cuh), both null (off) or both set, zeroed
  int64_t* trace_ctas = nullptr;          // [num_ctas, kTraceCtaWords]
  int64_t* trace_tasks = nullptr;         // [R, shape.max_tasks(), kTraceTaskWords]
};

// Dynamic shared memory and threads of one megakernel CTA (the FP8 forward's, or the others').
int megakernel_threads();
size_t megakernel_smem_bytes(bool fp8 = false);

// CTAs of a pass's megakernel in clusters of `cluster` the device holds at once: SMs x CTAs per
// SM for 1, the clusters it holds x 2 for 2 (a cluster's CTAs sit on the SMs of one GPC, so this
// may be fewer); 0 where it cannot run.
int megakernel_resident_ctas(bool backward, int cluster, bool fp8 = false);

// Enqueue the megakernel args.backward names, in clusters of args.cluster_ctas (all have one
// shared-memory size and thread count). Checks the arguments and that every CTA can be resident
// (num_ctas <= megakernel_resident_ctas(args.backward, args.cluster_ctas)); throws mok::Error
// naming the rule otherwise. The backward runs one round per launch: the plan's only one, or
// with several rounds the one args.round names (its act and h rings the forward's kept ones or
// recomputed).
void moe_megakernel(const MegaArgs& args, cudaStream_t stream);

}  // namespace mok::launch
