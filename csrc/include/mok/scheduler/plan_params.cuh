// The device plan's parameters (kernels: scheduler/plan.cuh), host- and device-safe.
#pragma once

#include <cstdint>

#include "mok/layout/mega.cuh"

namespace mok::scheduler {

struct PlanParams {
  layout::MegaShape shape;
  int num_ranks = 0;
  int max_tokens = 0;  // T_max
  int topk = 0;
  int token_capacity = 0;
  // schedule (inputs)
  const int64_t* expert_offsets = nullptr;  // [E_l + 1]
  const int64_t* row_expert = nullptr;      // [C]
  const int64_t* row_src_rank = nullptr;    // [C]
  const int64_t* row_src_token = nullptr;   // [C]
  const int64_t* row_src_slot = nullptr;    // [C]
  const int64_t* row_token_idx = nullptr;   // [C]
  const int64_t* token_rows = nullptr;      // [C_tok, K] schedule rows
  const float* global_weights = nullptr;    // [W, T_max, K]
  // plan (outputs)
  int64_t* pad_start = nullptr;             // [E_l] scratch: first padded row of each group
  int32_t* offs = nullptr;                  // [E_l] group ends (padded), int32 for the GEMMs
  int64_t* expert_rows = nullptr;           // [E_l]
  int32_t* first_round = nullptr;           // [E_l] round of the first row, -1 without rows
  int64_t* prow = nullptr;                  // [C] padded row of each schedule row (P: unused)
  int64_t* row_tok = nullptr;               // [R * ring] received token of each row, -1
  float* w_rows = nullptr;                  // [R * ring] router weight of each row, 0
  int64_t* row_src = nullptr;               // [R * ring] s * T_max + t, -1
  int64_t* row_dst = nullptr;               // [R * ring] (s * T_max + t) * K + k, -1
  int64_t* token_rows_padded = nullptr;     // [C_tok, K] padded row of each slot, -1
  int32_t* tile_count = nullptr;            // [R]
  layout::MegaTile* tiles = nullptr;        // [R, max_tiles]
};

}  // namespace mok::scheduler
