// Torch-free host launchers around the forward megakernel: the device plan, staging this rank's
// tokens for its peers, the pass's epoch, zero rows for dropped slots, and the source-side slot
// sum. Like every launcher here they only enqueue work (no host synchronisation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "launch/moe.h"
#include "mok/scheduler/plan_params.cuh"

namespace mok::launch {

// The plan from a schedule (scheduler/plan.cuh); outputs preallocated.
void moe_build_plan(const scheduler::PlanParams& params, cudaStream_t stream);

// Barrier (every peer is done reading the tokens region's previous contents), copy x [T, width]
// bf16 (width <= H, a multiple of 8; the region's rows are H wide) into this rank's tokens
// region, then barrier: peers may pull it.
void moe_stage_tokens(const MoeComm& comm, const void* x, int num_tokens, int64_t width,
                      cudaStream_t stream);

// counters[kEpoch] += 1: the pass's generation base for the megakernel's flags (every counter
// back to zero and the epoch to 1 before a pass of `num_rounds` rounds whose generations would
// pass INT32_MAX); and counters[kTicket] = 0, the first round's task ticket.
void moe_bump_epoch(const MoeComm& comm, int num_rounds, cudaStream_t stream);

// Zero rows into the sources' slot_rows for slots routed here that the schedule dropped.
void moe_zero_dropped_slots(const MoeComm& comm, const int64_t* global_topk, const int* slot_row,
                            int64_t num_local_experts, cudaStream_t stream);

// Barrier (every rank's megakernel stored its rows), then out [T, H] bf16 = the slot-ordered sum
// of this rank's slot_rows weighted by weights [T, K] (null: unweighted) (+ shared_out [T, H],
// may be null).
void moe_reduce_slot_rows(const MoeComm& comm, const int64_t* topk, const float* weights,
                          int64_t num_experts, const void* shared_out, void* out, int num_tokens,
                          cudaStream_t stream);

// d_row_w [rows] float32 = each row's partials [rows, parts] summed in order (0 on padding rows,
// row_tok < 0): the backward megakernel's router-weight gradient per row.
void moe_sum_row_partials(const float* partials, int64_t parts, const int64_t* row_tok,
                          float* d_row_w, int64_t rows, cudaStream_t stream);

// The backward megakernel's down-weight gradient operand B (MegaArgs::wgrad_b): each expert's rows
// of bf16(w * a) (act_ring [ring, inter] times w_rows, rounded once as weighted_rows does) from row
// starts[e] on, zeros after them up to the next multiple of layout::kWgradRowAlign and after the
// last expert's; starts [E_l] int32 is written first, from the group ends `ends` [E_l] int32.
// b [b_rows, inter] with b_rows = MegaShape::wgrad_b_rows().
void moe_wgrad_b_rows(const void* act_ring, const float* w_rows, const int32_t* ends,
                      int num_local_experts, int64_t b_rows, int64_t inter, int32_t* starts,
                      void* b, cudaStream_t stream);

}  // namespace mok::launch
