// Torch-facing ops of the stage-1 expert-parallel MoE pass (registered as mok::moe_* in
// python_api.cpp; fakes in mok_megatron/ops/moe.py). Each checks its tensors, builds the
// torch-free launch arguments and enqueues work on the current stream; none syncs the host.
//
// `comm` (int[]) names the symmetric workspace; its fields are defined once in apis/comm.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace mok::apis {

// [total_bytes, guard_bytes, offset of each layout::Region in order, then each region's guard
// offset in order].
std::vector<int64_t> moe_workspace_layout(int64_t num_ranks, int64_t max_tokens, int64_t topk,
                                          int64_t hidden, int64_t slot_rows,
                                          int64_t counter_words);

// The megakernel's sizes (layout::MegaShape): [padded_rows, num_rounds, ring_rows,
// num_minibatches, max_tiles, l1_ntiles, l2_ntiles, counter_words].
std::vector<int64_t> moe_mega_shape(int64_t row_capacity, int64_t num_local_experts,
                                    int64_t hidden, int64_t inter, int64_t minibatch_rows,
                                    int64_t macrobatch_rows);

// The m-tiles per block of the forward megakernel's task order that order_block 0 ('auto')
// picks (layout::auto_order_block): `routed_rows` this rank's experts are expected to get,
// E_l of them, l1_ntiles n-tiles of 2I, a grid of num_ctas. Host arithmetic only.
int64_t moe_mega_order_block(int64_t routed_rows, int64_t num_local_experts, int64_t l1_ntiles,
                             int64_t num_ctas);

// topk: [T, K] int64; weights: [T, K] f32 -> (global_topk [W, T_max, K] int64,
// global_weights [W, T_max, K] f32). Collective.
std::tuple<at::Tensor, at::Tensor> moe_gather_routing(const at::Tensor& topk,
                                                      const at::Tensor& weights,
                                                      at::IntArrayRef comm);

// The schedule fields of MoKSchedule from global_topk, in INTEGER_FIELDS order minus
// global_topk: row_expert, row_src_rank, row_src_token, row_src_slot, row_token_idx,
// expert_offsets, num_rows, recv_token_src, recv_token_pos, num_recv_tokens, token_rows, send_to,
// error_flags.
std::vector<at::Tensor> moe_build_schedule(const at::Tensor& global_topk, int64_t rank,
                                           int64_t num_experts, int64_t row_capacity,
                                           int64_t token_capacity);

// moe_build_schedule's tensors and `slot_row` [W * T_max * K] int32: each slot's schedule row,
// -1 when not here or dropped (the plan and the dropped-slot zeroing read it).
struct ScheduleTensors {
  std::vector<at::Tensor> fields;
  at::Tensor slot_row;
};
ScheduleTensors make_schedule(const at::Tensor& global_topk, int64_t rank, int64_t num_experts,
                              int64_t row_capacity, int64_t token_capacity);

// x: [T, H] bf16 -> recv [C_tok, H] bf16 (each received token pulled once). Collective.
at::Tensor moe_dispatch(const at::Tensor& x, const at::Tensor& recv_token_src,
                        at::IntArrayRef comm);

// rows: [P, H] bf16 (padded rows [row_begin, row_begin + P) of the layout); token_rows: [C_tok, K]
// int64 into the layout -> out [T, H] bf16. Collective on the last round. Macrobatch rounds pass
// acc [C_tok, H] f32: a round that is not `last` only accumulates into it (returns [0, H]).
// rows2 (optional, like rows) is added to each row in float32 before the slot sum goes on.
at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& token_rows,
                       const at::Tensor& recv_token_src,
                       const std::optional<at::Tensor>& slot_weights, const at::Tensor& send_to,
                       const std::optional<at::Tensor>& shared_out, int64_t num_tokens,
                       at::IntArrayRef comm, const std::optional<at::Tensor>& acc,
                       int64_t row_begin, bool first, bool last,
                       const std::optional<at::Tensor>& rows2);

// row_values: [P] f32 -> out [T, K] f32 (each slot's value from the rank that holds it).
at::Tensor moe_combine_slots(const at::Tensor& row_values, const at::Tensor& token_rows,
                             const at::Tensor& recv_token_src, const at::Tensor& send_to,
                             int64_t num_tokens, at::IntArrayRef comm);

// src [C, H], row_tok [P] int64 -> [P, H] bf16: src rows in row_tok order, zeros where -1.
at::Tensor moe_gather_rows(const at::Tensor& src, const at::Tensor& row_tok);

// The packed FP8 token row's width in bf16 (packed_row_bytes(hidden) / 2; host only).
int64_t moe_fp8_packed_row_width(int64_t hidden);

// data [R, H] float8_e4m3fn, scales [R, H / 128] float32 ((1, 128) blocks) -> the packed FP8
// rows [R, packed_row_bytes(H) / 2] bf16 (common/fp8_blockwise.cuh), what moe_dispatch moves.
at::Tensor moe_fp8_pack_rows(const at::Tensor& data, const at::Tensor& scales);

// packed [C, packed_row_bytes(H) / 2] bf16, row_tok [P] int64 -> (data [P, H] float8_e4m3fn,
// scales [P, H / 128] float32): packed[row_tok[p]] split; where row_tok[p] < 0, an all-zero
// row's quantisation (data 0, scales 1).
std::tuple<at::Tensor, at::Tensor> moe_gather_rows_fp8(const at::Tensor& packed,
                                                       const at::Tensor& row_tok, int64_t hidden);

// g, u: [P, I] bf16 (rows may be strided) -> a [P, I]; backward: (da [P, I], g, u) -> (dg, du).
at::Tensor moe_swiglu(const at::Tensor& g, const at::Tensor& u);
// The same on one [P, 2I] tensor whose gate and up columns alternate in blocks of 8.
at::Tensor moe_swiglu_interleaved(const at::Tensor& h);
at::Tensor moe_swiglu_interleaved_backward(const at::Tensor& da, const at::Tensor& h);
std::tuple<at::Tensor, at::Tensor> moe_swiglu_backward(const at::Tensor& da, const at::Tensor& g,
                                                       const at::Tensor& u);

// total, part: [G, M, N] bf16 (part may be total); offs, first_round: [G] int32. In place on
// total: empty groups zeroed (round 0), a group's first round copied, later rounds added.
void moe_accumulate_groups(const at::Tensor& total, const at::Tensor& part, const at::Tensor& offs,
                           const at::Tensor& first_round, int64_t round);

}  // namespace mok::apis
