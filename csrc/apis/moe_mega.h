// Torch-facing ops of the megakernel forward (registered as mok::moe_mega_* in python_api.cpp;
// fakes in mok_megatron/ops/moe.py). The names of the tensors they return are defined once, here,
// and read by Python through moe_mega_plan_fields / moe_mega_forward_fields.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

// The schedule (MoKSchedule's integer fields, plus the gathered router weights and each slot's
// schedule row) and the device plan (scheduler/plan.cuh), in this order.
#define MOK_MEGA_PLAN_FIELDS(X)                                                              \
  X(global_topk) X(global_weights) X(row_expert) X(row_src_rank) X(row_src_token)            \
  X(row_src_slot) X(row_token_idx) X(expert_offsets) X(num_rows) X(recv_token_src)           \
  X(recv_token_pos) X(num_recv_tokens) X(token_rows) X(send_to) X(error_flags) X(slot_row)   \
  X(pad_start) X(offs) X(expert_rows) X(first_round) X(prow) X(row_tok) X(w_rows) X(row_src) \
  X(row_dst) X(token_rows_padded) X(tile_count) X(tiles)

// The forward's outputs: out [T, H]; the ring's rows x, act ([ring, H], [ring, I]); kept for a
// backward when asked: h [ring, 2I] and y [ring, H] (one round) or x_recv [C_tok, H] (rounds);
// each is [0] when not kept; with `trace`, the megakernel's timeline (layout/mega.cuh:
// trace_ctas [num_ctas, kTraceCtaWords], trace_tasks [R, max_tasks, kTraceTaskWords] int64),
// else [0] each.
#define MOK_MEGA_FORWARD_FIELDS(X) \
  X(out) X(x_ring) X(act_ring) X(h_ring) X(y_rows) X(x_recv) X(trace_ctas) X(trace_tasks)

// The backward megakernel's outputs: d_x [T, H] (+ the shared expert's); the rows the weight
// gradients read: d_rows [ring, H] (d_out pulled to the rows) and d_h [ring, 2I] (interleaved as
// h); d_row_w [ring] float32, each row's router-weight gradient (0 on padding); the timeline as
// the forward's.
#define MOK_MEGA_BACKWARD_FIELDS(X) \
  X(d_x) X(d_rows) X(d_h) X(d_row_w) X(trace_ctas) X(trace_tasks)

namespace mok::apis {

std::vector<std::string> moe_mega_plan_fields();
std::vector<std::string> moe_mega_forward_fields();
std::vector<std::string> moe_mega_backward_fields();

// topk [T, K] int64, router_weights [T, K] f32 -> MOK_MEGA_PLAN_FIELDS. Collective.
std::vector<at::Tensor> moe_mega_plan(const at::Tensor& topk, const at::Tensor& router_weights,
                                      at::IntArrayRef comm, int64_t num_experts,
                                      int64_t row_capacity, int64_t token_capacity, int64_t inter,
                                      int64_t minibatch, int64_t macrobatch);

// One forward pass: the plan (unless `plan`, else empty, holds moe_mega_plan's tensors), staging
// (at one rank none: the megakernel reads x in place), the megakernel, the slot sum. x [T, H] bf16; w_gate_up [E_l, 2I, H] (interleaved); w_down
// [E_l, H, I]; shared_out [T, H] or none -> MOK_MEGA_FORWARD_FIELDS then MOK_MEGA_PLAN_FIELDS.
// `save`: keep what a backward needs; `keep_y`: that includes the L2 output rows y (only a
// backward whose L2 dgrad fuses the SwiGLU backward reads them). `cluster`: CTAs per cluster of
// the megakernel (1 or 2; the grid is num_sms rounded down to whole clusters). `stall_l2_cta`
// (tests only, -1: none): that CTA's consumers stop at their first second-GEMM task, so that its
// producer's wait for a free pipeline stage times out. FP8 experts (the FP8 megakernel, issue
// 15): w_gate_up / w_down are the weights' (128, 128)-block e4m3 copies and w_gate_up_scales
// [E_l, 2I / 128, H / 128] / w_down_scales [E_l, H / 128, I / 128] their float32 scales (both
// given or neither); x is quantised in (1, 128) blocks here, the forward runs stage 1's FP8
// arithmetic (x_ring is then [0, H]: the ring holds FP8 rows). `rows_in_place`
// (MoKConfig.fwd_rows, one rank, bf16, cluster 1): the L1 tiles read their rows from the token
// rows themselves and no CTA pulls; x_ring is then [0, H]. `keep_rings` (bf16, `save` with
// several macrobatch rounds): act_ring and h_ring are kept as well, holding the last round that
// has rows (the backward in rounds takes it first, without recomputing it). `order_block`: the
// m-tiles per block of the megakernel's task order, 8 or 16, or 0 for the shape's
// (MoKConfig.megakernel_order_block='auto': layout::auto_order_block). Collective.
std::vector<at::Tensor> moe_mega_forward(
    const at::Tensor& x, const at::Tensor& topk, const at::Tensor& router_weights,
    const at::Tensor& w_gate_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& shared_out, at::TensorList plan,
    at::IntArrayRef comm, int64_t num_experts, int64_t row_capacity, int64_t token_capacity,
    int64_t minibatch, int64_t macrobatch, int64_t num_comm_sms, int64_t num_sms, bool save,
    bool keep_y, int64_t stall_minibatch, bool trace, int64_t cluster, int64_t stall_l2_cta,
    const std::optional<at::Tensor>& w_gate_up_scales,
    const std::optional<at::Tensor>& w_down_scales, bool rows_in_place, bool keep_rings,
    int64_t order_block);

// The data gradients of one forward pass, from one call per macrobatch round: staging d_out (at
// one rank none: read in place), the backward megakernel, the unweighted slot sum (+ shared_dx
// [T, H] or none), the per-row router-weight gradients. plan: the forward's (moe_mega_plan's
// tensors); act_ring / h_ring: the round's activations (the forward's kept rings, or recomputed).
// `round`: -1 for a plan of one round; with R > 1 rounds, one call per round, R - 1 first and 0
// last: the first call stages d_out, every call pulls its round's d_out rows and stores their
// d_x rows into the sources' slots, and round 0's sums the slots (d_x is [0, H] in the others).
// `wgrad_down` (one round, cluster 1; MoKConfig.bwd_wgrad="down"): the down weight's gradient
// [E_l, H, I] computed inside the launch, after the data gradients' tasks: stored into it (bf16),
// or with `wgrad_accumulate` added into it (float32: main_grad); with `wgrad_interleave` its tasks
// run among the data gradients' (MoKConfig.bwd_wgrad="down_interleaved"); d_rows is still
// returned (the caller's to drop).
// -> MOK_MEGA_BACKWARD_FIELDS. Collective.
std::vector<at::Tensor> moe_mega_backward(
    const at::Tensor& d_out, const at::Tensor& topk, at::TensorList plan,
    const at::Tensor& act_ring, const at::Tensor& h_ring, const at::Tensor& w_gate_up,
    const at::Tensor& w_down, const std::optional<at::Tensor>& shared_dx, at::IntArrayRef comm,
    int64_t num_experts, int64_t row_capacity, int64_t minibatch, int64_t macrobatch,
    int64_t num_comm_sms, int64_t num_sms, int64_t stall_minibatch, bool trace, int64_t cluster,
    int64_t round, const std::optional<at::Tensor>& wgrad_down, bool wgrad_accumulate,
    bool wgrad_interleave);

}  // namespace mok::apis
