// Role: the megakernel's comm work. The first num_comm_ctas CTAs, each round, first pull the
// round's routed rows from the source ranks' token buffers (peer memory over NVLink, 16-byte
// vector loads) into the ring, minibatch by minibatch, releasing each minibatch's arrive flag,
// which the L1 tasks reading those rows wait on (roles/megakernel_compute.cuh); then they take
// GEMM tasks like every other CTA. The pulls run on the CTA's two consumer warpgroups (the
// producer warpgroup holds 40 registers per thread, setmaxnreg).
#pragma once

#include <cstdint>

#include "mok/common/fp8_blockwise.cuh"
#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/roles/megakernel_tasks.cuh"

namespace mok::roles {

constexpr int kPullWarps = 8;    // the consumer warpgroups' warps
constexpr int kPullUnroll = 8;   // 16-byte loads in flight per lane
// NOTE: more loads in flight per lane (several rows per warp, 16 or 32 vectors per lane: commits
// 025df57, 9665dea and 3941f23) made the pulls slower, not faster, in their traces (the comm CTAs'
// pull share and the L1 tasks' stalls grew on qwen3-30b-a3b and deepseek-v3; docs/perf_notes.md):
// one row per warp stays until a profile says what bounds a comm SM's copy.

// The token row of src = s * T_max + t (rank s's token t, `row_bytes` a row), or null for src < 0:
// in the peer's tokens region, or at one rank in the token rows themselves.
MOK_DEVICE const uint8_t* token_row(const MegaParams& p, int64_t src, int row_bytes) {
  if (src < 0) return nullptr;
  const uint32_t s = static_cast<uint32_t>(src) / static_cast<uint32_t>(p.max_tokens);
  const uint32_t t = static_cast<uint32_t>(src) % static_cast<uint32_t>(p.max_tokens);
  const uint8_t* tokens = p.local_tokens != nullptr
                              ? p.local_tokens  // one rank: the rows in place
                              : reinterpret_cast<const uint8_t*>(p.peer_bases[s] + p.tokens_offset);
  return tokens + static_cast<int64_t>(t) * row_bytes;  // peer's or x
}

// One warp: dst[0, vecs) = row[0, vecs) (16-byte vectors), or zeros where row is null.
MOK_DEVICE void copy_row(uint4* dst, const uint4* row, int vecs, int lane) {
  for (int base = 0; base < vecs; base += 32 * kPullUnroll) {
    uint4 v[kPullUnroll];
#pragma unroll
    for (int u = 0; u < kPullUnroll; ++u) {
      const int i = base + u * 32 + lane;
      v[u] = make_uint4(0, 0, 0, 0);
      // NOTE: the source tokens are not written while the megakernel runs (a cross-rank barrier
      // preceded it), so the non-coherent path is safe; each vector is read once.
      if (row != nullptr && i < vecs) v[u] = ptx::ld_global_nc_v4(row + i);
    }
#pragma unroll
    for (int u = 0; u < kPullUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < vecs) dst[i] = v[u];
    }
  }
}

// One warp: ring row x_ring[ring_row] = token t of rank s for src = s * T_max + t, or zeros for
// src < 0. NOTE: hidden % 8 == 0, so a row is whole 16-byte vectors.
MOK_DEVICE void pull_row(const MegaParams& p, int64_t src, int ring_row, int lane) {
  const int vecs = p.hidden / 8;
  uint4* dst = reinterpret_cast<uint4*>(p.x_ring) + static_cast<int64_t>(ring_row) * vecs;
  copy_row(dst, reinterpret_cast<const uint4*>(token_row(p, src, p.hidden * 2)), vecs, lane);
}

// The FP8 forward's (roles/megakernel_fp8.cuh): the token's (1, 128)-quantised row into
// x8_ring[ring_row] and its hidden / 128 scales into the row's column of the M-major scale
// region; src < 0: zeros and scale 1 (an all-zero row's quantisation, as stage 1's row gather
// gives). The row: stage 1's packed FP8 row (hidden e4m3 bytes, then the scales) in a tokens
// region, or at one rank the quantised x in place (its data rows, and its scales rows in
// local_token_scales). NOTE: hidden % 128 == 0 (the host checks).
MOK_DEVICE void pull_row_fp8(const MegaParams& p, int64_t src, int ring_row, int lane) {
  const int vecs = p.hidden / 16;
  const int blocks = p.hidden / fp8_blockwise::kBlock;
  const uint8_t* row = token_row(p, src, p.token_row_bytes);
  copy_row(reinterpret_cast<uint4*>(p.x8_ring + static_cast<int64_t>(ring_row) * p.hidden),
           reinterpret_cast<const uint4*>(row), vecs, lane);
  // The row's scales: beside its quantised row in place (one rank), else after the packed row's
  // data; none for an empty row (row == nullptr: scale 1 below).
  const float* scales = nullptr;
  if (row != nullptr) {
    const uint32_t t = static_cast<uint32_t>(src) % static_cast<uint32_t>(p.max_tokens);
    scales = p.local_token_scales != nullptr
                 ? p.local_token_scales + static_cast<int64_t>(t) * blocks
                 : reinterpret_cast<const float*>(row + p.hidden);
  }
  for (int kb = lane; kb < blocks; kb += 32) {
    // NOTE: read-only during the launch, as the data (copy_row)
    p.x_scales[static_cast<int64_t>(kb) * p.scale_stride + ring_row] =
        row != nullptr ? __ldg(scales + kb) : 1.0f;
  }
}

// The pulling warps (warp index `warp` of kPullWarps): ring rows [row_begin, row_end) of round
// `round`, one warp per row.
template <bool kFp8>
MOK_DEVICE void pull_minibatch(const MegaParams& p, int round, int row_begin, int row_end,
                               int warp) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t* row_src = p.row_src + static_cast<int64_t>(round) * p.ring_rows;
  for (int row = row_begin + warp; row < row_end; row += kPullWarps) {
    if constexpr (kFp8) {
      pull_row_fp8(p, row_src[row], row, lane);
    } else {
      pull_row(p, row_src[row], row, lane);
    }
  }
}

// Ring rows round `round` uses: up to the last m-tile's end (0 without tiles). With the
// backward's down-weight gradient tasks (MegaParams::wgrad, one round), also up to the last
// expert's last k-tile, whose rows past the plan's rows are then zero rows (row_src -1), not
// whatever the ring held: they meet B's zeros, and 0 * NaN would not be 0.
MOK_DEVICE int rows_used(const MegaParams& p, int round) {
  const int num_mtiles = p.tile_count[round];
  const int used = num_mtiles > 0 ? p.tile(round, num_mtiles - 1).row_end : 0;
  if (!p.wgrad) return used;
  const int last_end = p.wgrad_ends[p.num_local_experts - 1];
  return max(used, min(p.ring_rows, last_end + layout::kWgradRowAlign));
}

// The pulling warps (the 256 threads of the consumer warpgroups, `warp` = their warp index):
// every minibatch of round `round` this comm CTA owns (mb % num_comm_ctas == comm_idx), in
// increasing mb; each pulled, then released with arrive[mb] = gen. `sync` is a barrier over
// exactly those threads.
template <bool kFp8, class Sync>
MOK_DEVICE void comm_round(const MegaParams& p, int comm_idx, int round, int32_t gen, int warp,
                           Sync sync) {
  const int used = rows_used(p, round);
  for (int mb = comm_idx; mb * p.minibatch_rows < used; mb += p.num_comm_ctas) {
    const int row_begin = mb * p.minibatch_rows;
    pull_minibatch<kFp8>(p, round, row_begin, min(row_begin + p.minibatch_rows, used), warp);
    // NOTE: the rows are read by TMA (the async proxy): each writer fences its own generic
    // stores against it before the barrier; the reader fences again after its acquire.
    ptx::fence_proxy_async_global();
    sync();
    const bool stalled = round == 0 && mb == p.stall_minibatch;  // fault injection (tests)
    // NOTE: the release is cumulative over the barrier above: no further fence.
    if (warp == 0 && threadIdx.x % 32 == 0 && !stalled) {
      ptx::st_release_gpu(p.counters + p.arrive_word + mb, gen);
    }
  }
}

}  // namespace mok::roles
