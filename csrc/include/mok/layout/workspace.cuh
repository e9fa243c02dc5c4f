// The symmetric-memory workspace of the expert-parallel MoE pass: one byte layout, used by the
// host (sizes, offsets handed to Python through mok::moe_workspace_layout) and by the kernels
// (peer addresses). Every rank allocates the same layout; peers read and write each other's copy
// through the peer base-address table.
//
// Regions (each 256-byte aligned and followed by a kGuardBytes guard), W ranks, T = max local
// tokens, K = top-k, H = hidden:
//   routing_topk     [T, K]    int64    this rank's topk_experts, -1 padded     (peers read)
//   routing_weights  [T, K]    float32  this rank's router weights, 0 padded    (peers read)
//   tokens           [T, H]    bf16     this rank's x (forward) / d_out (backward) (peers read)
//   combine          [W, T, H] float32  block d: rank d's partial sum per token  (peers write)
//   slot_values      [W, T, K] float32  block d: rank d's per-slot values        (peers write)
//   slot_rows        [T, K, H] bf16     the megakernel's result row of each (token, slot)
//                                       (peers write; 0 bytes unless `slot_rows` is set)
//   counters         [counter_words] int32  the megakernel's epoch, grid barrier and flags
//                                       (this rank only; layout/mega.cuh; never reset: epochs)
// Guards: every region is followed by kGuardBytes that no kernel writes. A test fills them with
// a pattern and checks it unchanged after a pass, so a write past a region's end shows.
// NOTE: regions read by peers are rewritten only after a barrier that every reader passed.
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::layout {

enum class Region : int {
  kRoutingTopk = 0,
  kRoutingWeights = 1,
  kTokens = 2,
  kCombine = 3,
  kSlotValues = 4,
  kSlotRows = 5,
  kCounters = 6,
  kNumRegions = 7,
};

struct WorkspaceLayout {
  int64_t num_ranks;
  int64_t max_tokens;
  int64_t topk;
  int64_t hidden;
  int64_t slot_rows = 0;      // 1: the slot_rows region exists (the megakernel path)
  int64_t counter_words = 0;  // int32 words of the counters region (MegaShape::counter_words)

  static constexpr int64_t kAlign = 256;
  static constexpr int64_t kGuardBytes = 256;

  MOK_HOST_DEVICE static int64_t align(int64_t bytes) {
    return (bytes + kAlign - 1) / kAlign * kAlign;
  }

  MOK_HOST_DEVICE int64_t region_bytes(Region region) const {
    switch (region) {
      case Region::kRoutingTopk: return max_tokens * topk * 8;
      case Region::kRoutingWeights: return max_tokens * topk * 4;
      case Region::kTokens: return max_tokens * hidden * 2;
      case Region::kCombine: return num_ranks * max_tokens * hidden * 4;
      case Region::kSlotValues: return num_ranks * max_tokens * topk * 4;
      case Region::kSlotRows: return slot_rows ? max_tokens * topk * hidden * 2 : 0;
      case Region::kCounters: return counter_words * 4;
      default: return 0;
    }
  }

  MOK_HOST_DEVICE int64_t offset(Region region) const {
    int64_t bytes = 0;
    for (int r = 0; r < static_cast<int>(region); ++r) {
      bytes += align(region_bytes(static_cast<Region>(r))) + kGuardBytes;
    }
    return bytes;
  }

  // The guard that follows `region`: [guard_offset, guard_offset + kGuardBytes).
  MOK_HOST_DEVICE int64_t guard_offset(Region region) const {
    return offset(region) + align(region_bytes(region));
  }

  MOK_HOST_DEVICE int64_t total_bytes() const { return offset(Region::kNumRegions); }

  // Address of `region` in the copy whose base is `base` (a peer's or this rank's).
  template <typename T>
  MOK_HOST_DEVICE T* at(uint64_t base, Region region) const {
    return reinterpret_cast<T*>(base + static_cast<uint64_t>(offset(region)));
  }
};

}  // namespace mok::layout
