// Parameters of the schedule kernels (scheduler/schedule.cuh), shared with the host launcher.
// Torch-free and cub-free so host code may include it.
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::scheduler {

constexpr int kChunk = 256;         // slots per block in count_chunks / place_rows
constexpr int kTokenThreads = 1024; // threads of the one-block kernel (scan_chunks)
constexpr int kTokenChunk = 1024;   // tokens per block in count_tokens / place_tokens
constexpr int kErrRowOverflow = 1;  // mirrors MOK_ERR_ROW_OVERFLOW in schedule.py
constexpr int kErrExpertId = 2;     // mirrors MOK_ERR_EXPERT_ID

struct ScheduleParams {
  // Inputs.
  const int64_t* global_topk;  // [W, T, K]
  int rank, num_ranks, max_tokens, topk, num_experts, num_local_experts;
  int row_capacity, token_capacity;
  // Scratch.
  int* chunk_expert_rows;  // [B, E_l]: rows of each local expert in each chunk, then their base
  int* chunk_rank_slots;   // [B, W]: slots of each chunk routed to each rank
  int* chunk_bad;          // [B]: 1 when the chunk holds an id outside [-1, E)
  int* slot_row;           // [W * T * K]: row of each slot, -1 when not here or over capacity
  int* token_pos;          // [W * T]: uncapped received-token index, -1 when not received
  int* chunk_tokens;       // [B_t]: received tokens in each chunk of kTokenChunk tokens
  // Outputs (int64 unless noted).
  int64_t* row_expert;      // [C]
  int64_t* row_src_rank;    // [C]
  int64_t* row_src_token;   // [C]
  int64_t* row_src_slot;    // [C]
  int64_t* row_token_idx;   // [C]
  int64_t* expert_offsets;  // [E_l + 1]
  int64_t* num_rows;        // [1]
  int64_t* recv_token_src;  // [C_tok]
  int64_t* recv_token_pos;  // [W * T]
  int64_t* num_recv_tokens; // [1]
  int64_t* token_rows;      // [C_tok, K]
  bool* send_to;            // [T, W]
  int32_t* error_flags;     // [1]

  MOK_HOST_DEVICE int num_slots() const { return num_ranks * max_tokens * topk; }
  MOK_HOST_DEVICE int num_chunks() const {
    const int n = (num_slots() + kChunk - 1) / kChunk;
    return n > 0 ? n : 1;
  }
  MOK_HOST_DEVICE int num_tokens() const { return num_ranks * max_tokens; }
  MOK_HOST_DEVICE int num_token_chunks() const {
    const int n = (num_tokens() + kTokenChunk - 1) / kTokenChunk;
    return n > 0 ? n : 1;
  }
  // Local expert of a slot's id, or -1.
  MOK_HOST_DEVICE int local_expert(int64_t id) const {
    const int64_t e = id - static_cast<int64_t>(rank) * num_local_experts;
    return (id >= 0 && id < num_experts && e >= 0 && e < num_local_experts) ? static_cast<int>(e)
                                                                           : -1;
  }
};

}  // namespace mok::scheduler
