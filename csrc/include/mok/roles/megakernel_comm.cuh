// Role: the megakernel's comm work. The first num_comm_ctas CTAs, each round, first pull the
// round's routed rows from the source ranks' token buffers (peer memory over NVLink, 16-byte
// vector loads, several rows' in flight per warp) into the ring, minibatch by minibatch,
// releasing each minibatch's arrive flag, which the L1 tasks reading those rows wait on
// (roles/megakernel_compute.cuh); then they take
// GEMM tasks like every other CTA. The pulls run on the CTA's two consumer warpgroups (the
// producer warpgroup holds 40 registers per thread, setmaxnreg).
#pragma once

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/roles/megakernel_tasks.cuh"

namespace mok::roles {

constexpr int kPullWarps = 8;     // the consumer warpgroups' warps
constexpr int kPullVectors = 32;  // 16-byte loads in flight per lane: 128 KB per CTA
// NOTE: a local copy (EP 1) or an NVLink read moves about (bytes in flight) / latency: with one
// row of 8 vectors per lane in flight (qwen3-30b-a3b's 4 KB rows, 32 KB per CTA) a comm SM pulled
// 20-40 GB/s. A warp now loads several rows' vectors before it stores any (kPullVectors per lane,
// 128 registers; the consumers' mainloop needs more, so the pulls do not raise their count).

// The pulling warps (warp index `warp` of kPullWarps): ring rows [row_begin, row_end) of round
// `round`; warp w copies rows row_begin + w + kPullWarps * j. Ring row x_ring[ring_row] = token t
// of rank s for src = row_src[ring_row] = s * T_max + t, or zeros for src < 0.
// NOTE: hidden % 8 == 0, so a row is whole 16-byte vectors.
MOK_DEVICE void pull_minibatch(const MegaParams& p, int round, int row_begin, int row_end,
                               int warp) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t* row_src = p.row_src + static_cast<int64_t>(round) * p.ring_rows;
  const int vecs = p.hidden / 8;
  const int per_row = (vecs + 31) / 32;                // one row's vectors per lane
  const int chunk = min(per_row, kPullVectors);        // of them, per batch
  const int batch_rows = max(1, kPullVectors / per_row);  // rows per batch (<= 32)
  const int mine = row_end - row_begin - warp;
  const int num_rows = mine > 0 ? (mine + kPullWarps - 1) / kPullWarps : 0;
  uint4* ring = reinterpret_cast<uint4*>(p.x_ring);
  for (int j0 = 0; j0 < num_rows; j0 += batch_rows) {
    const int n = min(batch_rows, num_rows - j0);
    // Lane r < n holds the source address of the batch's row r (0: zeros).
    uint64_t my_src = 0;
    if (lane < n) {
      const int64_t src = row_src[row_begin + warp + kPullWarps * (j0 + lane)];
      if (src >= 0) {
        const uint32_t s = static_cast<uint32_t>(src) / static_cast<uint32_t>(p.max_tokens);
        const uint32_t t = static_cast<uint32_t>(src) % static_cast<uint32_t>(p.max_tokens);
        my_src = p.peer_bases[s] + p.tokens_offset +
                 static_cast<uint64_t>(t) * static_cast<uint64_t>(p.hidden) * 2;  // peer memory
      }
    }
    for (int c0 = 0; c0 < per_row; c0 += chunk) {  // once, unless a row exceeds kPullVectors
      uint4 v[kPullVectors];
      int r = 0, c = c0;  // v[u] is vector c * 32 + lane of the batch's row r
#pragma unroll
      for (int u = 0; u < kPullVectors; ++u) {
        const uint64_t src = __shfl_sync(0xffffffffu, my_src, r < n ? r : 0);
        const int i = c * 32 + lane;
        v[u] = make_uint4(0, 0, 0, 0);
        // NOTE: the source tokens are not written while the megakernel runs (a cross-rank
        // barrier preceded it), so the non-coherent path is safe; each vector is read once.
        if (r < n && src != 0 && i < vecs) {
          v[u] = ptx::ld_global_nc_v4(reinterpret_cast<const uint4*>(src) + i);
        }
        if (++c == c0 + chunk) {
          c = c0;
          ++r;
        }
      }
      r = 0;
      c = c0;
#pragma unroll
      for (int u = 0; u < kPullVectors; ++u) {
        const int i = c * 32 + lane;
        if (r < n && i < vecs) {
          const int64_t ring_row = row_begin + warp + kPullWarps * (j0 + r);
          ring[ring_row * vecs + i] = v[u];
        }
        if (++c == c0 + chunk) {
          c = c0;
          ++r;
        }
      }
    }
  }
}

// Ring rows round `round` uses: up to the last m-tile's end (0 without tiles).
MOK_DEVICE int rows_used(const MegaParams& p, int round) {
  const int num_mtiles = p.tile_count[round];
  return num_mtiles > 0 ? p.tile(round, num_mtiles - 1).row_end : 0;
}

// The pulling warps (the 256 threads of the consumer warpgroups, `warp` = their warp index):
// every minibatch of round `round` this comm CTA owns (mb % num_comm_ctas == comm_idx), in
// increasing mb; each pulled, then released with arrive[mb] = gen. `sync` is a barrier over
// exactly those threads.
template <class Sync>
MOK_DEVICE void comm_round(const MegaParams& p, int comm_idx, int round, int32_t gen, int warp,
                           Sync sync) {
  const int used = rows_used(p, round);
  for (int mb = comm_idx; mb * p.minibatch_rows < used; mb += p.num_comm_ctas) {
    const int row_begin = mb * p.minibatch_rows;
    pull_minibatch(p, round, row_begin, min(row_begin + p.minibatch_rows, used), warp);
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
