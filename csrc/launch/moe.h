// Torch-free host launchers of the stage-1 expert-parallel MoE pass: pointers, ints, a stream.
// Every launcher only enqueues work (no host synchronisation) and throws mok::Error on a broken
// precondition or a failed launch.
#pragma once

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>

#include "mok/layout/workspace.cuh"
#include "mok/scheduler/params.cuh"

namespace mok::launch {

// Where this rank's and its peers' workspace copies live, and how long a device wait may take.
struct MoeComm {
  layout::WorkspaceLayout lay;
  const uint64_t* peer_bases = nullptr;   // device [W]: base address of each rank's copy
  const uint64_t* signal_pads = nullptr;  // device [W]: each rank's signal pad (null when W == 1)
  uint64_t my_base = 0;                   // this rank's copy (host value)
  int rank = 0;
  int64_t timeout_ns = 0;
  int32_t* error_record = nullptr;        // the megakernel's pinned error record (or null)
  bool chained = false;                   // launch the pass's kernels chained (launch/chain.h)
};

// A cross-rank barrier (no-op for one rank); `phase` is a mok::comm::Phase, printed on timeout.
void moe_barrier(const MoeComm& comm, int phase, cudaStream_t stream);

// Stage topk [T, K] int64 / weights [T, K] f32 (T = num_tokens <= T_max), barrier, gather every
// rank's into global_topk [W, T_max, K] / global_weights [W, T_max, K], barrier.
void moe_gather_routing(const MoeComm& comm, const int64_t* topk, const float* weights,
                        int num_tokens, int64_t* global_topk, float* global_weights,
                        cudaStream_t stream);

// The schedule from global_topk (params.global_topk); scratch and outputs preallocated.
void moe_build_schedule(const scheduler::ScheduleParams& params, cudaStream_t stream);

// Stage x [T, width] bf16 (width <= H, a multiple of 8: H, or the packed FP8 token rows),
// barrier, then recv[j] = token recv_token_src[j] of its source (zeros when -1), recv:
// [num_recv, width] bf16.
void moe_dispatch(const MoeComm& comm, const void* x, int num_tokens, int64_t width,
                  const int64_t* recv_token_src, int num_recv, void* recv, cudaStream_t stream);

// The packed FP8 token rows (common/fp8_blockwise.cuh) of (1, 128)-quantised rows: data [R, H]
// e4m3 and scales [R, H / 128] float32 into packed [R, packed_row_bytes(H)] (copies, no kernel).
void moe_fp8_pack_rows(const void* data, const float* scales, int64_t num_rows, int64_t hidden,
                       void* packed, cudaStream_t stream);

// data [P, H] e4m3 / scales [P, H / 128] float32 = the packed FP8 row packed[row_tok[p]] split,
// an all-zero row's quantisation (data 0, scales 1) where row_tok[p] < 0 (local gather).
void moe_gather_rows_fp8(const void* packed, const int64_t* row_tok, void* data, float* scales,
                         int64_t num_rows, int64_t hidden, cudaStream_t stream);

struct MoeCombineArgs {
  const void* rows = nullptr;             // [P, H] bf16
  const void* rows2 = nullptr;            // [P, H] bf16 or null: added to rows (float32)
  const int64_t* token_rows = nullptr;    // [C_tok, K] indices into rows, -1 when not here
  const int64_t* recv_token_src = nullptr;// [C_tok]
  const float* slot_weights = nullptr;    // [W * T_max * K] or null (weight 1)
  int num_recv = 0;                       // C_tok
  const bool* send_to = nullptr;          // [T_max, W]
  const void* shared_out = nullptr;       // [T, H] bf16 or null
  void* out = nullptr;                    // [T, H] bf16
  int num_tokens = 0;                     // T
  // Macrobatch rounds (roles/combine.cuh): rows hold padded rows [row_begin, row_end); acc_in
  // holds earlier rounds' float32 sums (or null); a non-null acc_out makes this a round that
  // only accumulates locally (no push, no barrier, out untouched).
  int64_t row_begin = 0;
  int64_t row_end = INT64_MAX;
  const float* acc_in = nullptr;          // [C_tok, H]
  float* acc_out = nullptr;               // [C_tok, H]
};

// Expert-side slot sum + push, barrier, source-side sum over ranks (+ shared) into out; or, for
// a round that is not the last, the expert-side sum into acc_out only.
void moe_combine(const MoeComm& comm, const MoeCombineArgs& args, cudaStream_t stream);

// Per-slot values: push row_values[token_rows[j, k]] to the source, barrier, sum over ranks into
// out [T, K] f32.
void moe_combine_slots(const MoeComm& comm, const float* row_values, const int64_t* token_rows,
                       const int64_t* recv_token_src, int num_recv, const bool* send_to,
                       float* out, int num_tokens, cudaStream_t stream);

// out [P, H] = src[row_tok[p]] per row, zeros where row_tok[p] < 0 (local gather).
void moe_gather_rows(const void* src, const int64_t* row_tok, void* out, int64_t num_rows,
                     int64_t hidden, cudaStream_t stream);

// SwiGLU operands: g, u [P, I] bf16 with row strides g_ld, u_ld (elements).
struct MoeSwigluArgs {
  const void* g = nullptr;
  const void* u = nullptr;
  int64_t g_ld = 0;
  int64_t u_ld = 0;
  int64_t num_rows = 0;
  int64_t inter = 0;
  int64_t blk_stride = 8;  // 8: contiguous columns; 16: interleaved halves (roles/swiglu.cuh)
};

// out [P, I] (contiguous) = silu(g) * u; backward: dg, du (row strides dg_ld, du_ld, the same
// column layout as g and u) from da.
void moe_swiglu_forward(const MoeSwigluArgs& args, void* out, cudaStream_t stream);
void moe_swiglu_backward(const MoeSwigluArgs& args, const void* da, void* dg, int64_t dg_ld,
                         void* du, int64_t du_ld, cudaStream_t stream);

// Round `round`'s weight gradient `part` [G, group_elems] into `total` (roles/group_grads.cuh):
// zero groups with no rows at all, copy in a group's first round, add in later ones.
void moe_accumulate_groups(void* total, const void* part, const int* offs,
                           const int* first_round, int round, int64_t num_groups,
                           int64_t group_elems, cudaStream_t stream);

}  // namespace mok::launch
