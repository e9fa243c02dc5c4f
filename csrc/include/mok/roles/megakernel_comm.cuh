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
constexpr int kPullMinLanes = 8;  // lanes per row at least: 128-byte pieces of a row per load
// NOTE: a local copy (EP 1) or an NVLink read moves about (bytes in flight) / latency: with one
// row of 8 vectors per lane in flight (qwen3-30b-a3b's 4 KB rows, 32 KB per CTA) a comm SM pulled
// 20-40 GB/s. Now a warp copies 32 / lanes rows at a time, each lane kPullVectors vectors of its
// own row (strided by the row's lanes), all loaded before any is stored; the per-vector work is
// one address step and one bound check (a version that had every lane walk every row of the
// batch, a shuffle and a row/column step per vector, was slower than one row per warp: the
// pulls became instruction-bound). 128 registers of loads: the consumers' mainloop needs more.

// Lanes per row of hidden/8 16-byte vectors: the fewest (a power of two, kPullMinLanes..32)
// that hold a row in kPullVectors per lane, 32 for longer rows (copied in chunks).
MOK_DEVICE int pull_lanes_per_row(int vecs) {
  int lanes = kPullMinLanes;
  while (lanes < 32 && lanes * kPullVectors < vecs) lanes *= 2;
  return lanes;
}

// The pulling warps (warp index `warp` of kPullWarps): ring rows [row_begin, row_end) of round
// `round`; warp w copies rows row_begin + w + kPullWarps * j. Ring row x_ring[ring_row] = token t
// of rank s for src = row_src[ring_row] = s * T_max + t, or zeros for src < 0.
// NOTE: hidden % 8 == 0, so a row is whole 16-byte vectors.
MOK_DEVICE void pull_minibatch(const MegaParams& p, int round, int row_begin, int row_end,
                               int warp) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t* row_src = p.row_src + static_cast<int64_t>(round) * p.ring_rows;
  const int vecs = p.hidden / 8;
  const int lanes = pull_lanes_per_row(vecs);
  const int batch_rows = 32 / lanes;
  const int sub = lane % lanes;  // this lane's first vector of its row
  const int mine = row_end - row_begin - warp;
  const int num_rows = mine > 0 ? (mine + kPullWarps - 1) / kPullWarps : 0;
  for (int j0 = 0; j0 < num_rows; j0 += batch_rows) {
    const int j = j0 + lane / lanes;  // this lane's row of the warp's rows
    const bool has_row = j < num_rows;
    const int64_t ring_row = row_begin + warp + static_cast<int64_t>(kPullWarps) * j;
    const uint4* src = nullptr;
    if (has_row) {
      const int64_t s_t = row_src[ring_row];
      if (s_t >= 0) {
        const uint32_t s = static_cast<uint32_t>(s_t) / static_cast<uint32_t>(p.max_tokens);
        const uint32_t t = static_cast<uint32_t>(s_t) % static_cast<uint32_t>(p.max_tokens);
        src = reinterpret_cast<const uint4*>(p.peer_bases[s] + p.tokens_offset) +
              static_cast<int64_t>(t) * vecs;  // peer memory
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(p.x_ring) + ring_row * vecs;
    // NOTE: one chunk unless a row exceeds 32 lanes x kPullVectors vectors (hidden > 8192).
    for (int c0 = sub; c0 < vecs; c0 += lanes * kPullVectors) {
      uint4 v[kPullVectors];
#pragma unroll
      for (int u = 0; u < kPullVectors; ++u) {
        const int i = c0 + u * lanes;
        v[u] = make_uint4(0, 0, 0, 0);
        // NOTE: the source tokens are not written while the megakernel runs (a cross-rank
        // barrier preceded it), so the non-coherent path is safe; each vector is read once.
        if (src != nullptr && i < vecs) v[u] = ptx::ld_global_nc_v4(src + i);
      }
#pragma unroll
      for (int u = 0; u < kPullVectors; ++u) {
        const int i = c0 + u * lanes;
        if (has_row && i < vecs) dst[i] = v[u];
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
