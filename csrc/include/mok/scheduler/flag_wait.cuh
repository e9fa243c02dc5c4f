// Role: the grouped-GEMM tile scheduler with a per-tile "wait for this flag" hook. It is CUTLASS's
// group-aware persistent scheduler (PersistentTileSchedulerSm90Group: same tile order, same
// results) plus one step: before the TMA producer warp loads the A operand of an output tile, it
// waits until the rows of A that tile reads have landed. A persistent megakernel whose comm warps
// pull minibatches of rows into A uses it to start a tile as soon as its rows are there; the
// tests drive it with flags set in advance or from another stream.
//
// Flag semantics (one rule, also in docs/GEMM.md):
//   ready: int32 [num_flags]; flag f covers the GLOBAL rows [f * rows_per_flag, (f+1) *
//   rows_per_flag) of A (the row-major activations, rows of all groups concatenated as offs says).
//   A tile of group g covering rows [r0, r1) waits until ready[f] >= epoch (signed compare) for
//   every f in [r0 / rows_per_flag, (r1 - 1) / rows_per_flag]. The writer stores its rows, then
//   sets the flag with release semantics (st.release.gpu, a fence then a store, or a
//   stream-ordered copy); the waiter reads it with ld.acquire.gpu, then fences the async (TMA)
//   proxy.
//   Epochs let one flag array serve many passes without a reset: pass i waits for >= i.
//
// Who waits: only the mainloop producer warp (warp 0, the one that issues the TMA loads). The
// consumer warpgroups wait on the shared-memory pipeline as always, so nothing else changes.
// The wait sits in fetch_next_work / initial_work_tile_info, i.e. right after the producer has
// issued the previous tile's last K-stage, so the check (with flags already set: two L2 round
// trips, offs then the flags) overlaps the consumers' remaining stages, though not fully.
//
// Never hangs: a tile that is still waiting after timeout_ns (globaltimer) writes an error record
// (layout FlagWaitError below: the flag, its value, the epoch, the group and the tile's rows) and
// traps, so the launch fails instead of hanging. The record lives in pinned, mapped host memory
// (or device memory), so the host can still read it, and name the flag, after the trap has left
// the CUDA context unusable (mok_megatron.ops.grouped_gemm.check_flag_wait_error).
//
// Cost: the hook is a separate kernel instantiation, selected by the problem-shape type
// FlagWaitProblemShape; kernels built with the plain ProblemShape use CUTLASS's scheduler
// unchanged, so the ops without flags compile to exactly the code they had before (same SASS).
// When used with every flag already set, one H200 measured +0.7-2.4% (L1+SwiGLU) and
// +3.5-7.6% (nt) against the plain ops (docs/GEMM.md, "Per-tile flag wait").
//
// NOTE: relies on warp 0 being the mainloop TMA producer warp, true of CUTLASS's sm90 ptr-array
// cooperative and pingpong kernels (producer warpgroup 0, ProducerWarpRole::Mainloop = 0).
#pragma once

#include <cstdint>

// NOTE: first: CUTLASS's scheduler headers need the pipeline headers this one pulls in.
#include "mok/roles/grouped_gemm_config.cuh"

#include <cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "mok/comm/barrier.cuh"
#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"

namespace mok::gemm {

// The error record: int32 words, all zero until a tile times out. Mirrored in
// mok_megatron/ops/grouped_gemm.py (FLAG_WAIT_ERROR_FIELDS).
enum FlagWaitError : int {
  kFlagWaitErrTimedOut = 0,  // 1 once a tile gave up
  kFlagWaitErrFlag = 1,      // index into ready of the flag still short of the epoch
  kFlagWaitErrSeen = 2,      // its value, last read
  kFlagWaitErrEpoch = 3,     // the value waited for
  kFlagWaitErrGroup = 4,     // group (expert) of the tile
  kFlagWaitErrRowBegin = 5,  // first global row of the tile
  kFlagWaitErrRowEnd = 6,    // one past its last row
  kFlagWaitErrTimeoutMs = 7,
  kFlagWaitErrWords = 8,
};

struct FlagWaitParams {
  const int32_t* ready = nullptr;  // [num_flags]; null: the hook is off
  const int32_t* offs = nullptr;   // [num_groups] end rows, the GEMM's own offs
  int num_flags = 0;
  int rows_per_flag = 1;
  int32_t epoch = 0;
  int64_t timeout_ns = 0;
  int32_t* error = nullptr;  // [kFlagWaitErrWords] or null
};

// The problem-shape type that selects FlagWaitGroupScheduler (see the selector at the end).
struct FlagWaitProblemShape : ProblemShape {};

namespace flag_wait_detail {

using ptx::ld_acquire_gpu;
// Orders the acquired generic-proxy writes before this thread's later TMA (async-proxy) reads.
using ptx::fence_proxy_async_global;

// Records the wait (first writer only, best effort across CTAs), then traps.
// NOTE: no printf here: any function call (vprintf is one) in the GEMM kernel makes ptxas ignore
// setmaxnreg and serialise the wgmma pipeline. The host decodes the record instead.
MOK_DEVICE void report_timeout(int32_t* error, int flag, int32_t seen, int32_t epoch,
                               int64_t timeout_ns, int group, int row_begin, int row_end) {
  if (error != nullptr) {
    volatile int32_t* err = error;
    if (err[kFlagWaitErrTimedOut] == 0) {
      err[kFlagWaitErrFlag] = flag;
      err[kFlagWaitErrSeen] = seen;
      err[kFlagWaitErrEpoch] = epoch;
      err[kFlagWaitErrGroup] = group;
      err[kFlagWaitErrRowBegin] = row_begin;
      err[kFlagWaitErrRowEnd] = row_end;
      err[kFlagWaitErrTimeoutMs] = static_cast<int32_t>(timeout_ns / 1000000);
      __threadfence_system();
      err[kFlagWaitErrTimedOut] = 1;
      __threadfence_system();
    }
  }
  __trap();
}

}  // namespace flag_wait_detail

// Warp-collective (all 32 lanes converged): waits until ready[f] >= epoch for every flag covering
// global rows [row_begin, row_end), row_end > row_begin; lanes poll 32 flags at a time.
// NOTE: rows are int32 (offs is), so the divisions below stay 32-bit (no 64-bit divide routine).
MOK_DEVICE void wait_rows_ready(const FlagWaitParams& p, int group, int row_begin, int row_end) {
  constexpr uint32_t kFullMask = 0xffffffffu;
  constexpr uint32_t kMaxSleepNs = 512;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int first = row_begin / p.rows_per_flag;
  const int last = min((row_end - 1) / p.rows_per_flag, p.num_flags - 1);
  uint64_t start_ns = 0;
  uint32_t sleep_ns = 0;
  for (int base = first; base <= last; base += 32) {
    const int flag = base + lane;
    for (;;) {
      const int32_t seen =
          flag <= last ? flag_wait_detail::ld_acquire_gpu(p.ready + flag) : p.epoch;
      const uint32_t waiting = __ballot_sync(kFullMask, seen < p.epoch);
      if (waiting == 0) break;
      const uint64_t now = __shfl_sync(kFullMask, comm::global_timer_ns(), 0);  // warp-uniform
      if (start_ns == 0) {
        start_ns = now;
      } else if (static_cast<int64_t>(now - start_ns) > p.timeout_ns &&
                 lane == __ffs(static_cast<int>(waiting)) - 1) {
        flag_wait_detail::report_timeout(p.error, flag, seen, p.epoch, p.timeout_ns, group,
                                         row_begin, row_end);
      }
      sleep_ns = sleep_ns == 0 ? 32 : min(2 * sleep_ns, kMaxSleepNs);
      __nanosleep(sleep_ns);
    }
  }
  flag_wait_detail::fence_proxy_async_global();
}

// CUTLASS's group scheduler plus the wait: same Arguments/Params (with `wait` added), same tile
// order; the mainloop producer warp waits for each tile's rows before returning the tile.
template <class GroupProblemShape, int kStages>
class FlagWaitGroupScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape,
                                                                             kStages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, kStages>;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using SchedulerResponse = typename Base::SchedulerResponse;
  struct Arguments : Base::Arguments {
    FlagWaitParams wait{};
  };
  struct Params : Base::Params {
    FlagWaitParams wait{};
  };

  template <class TileShape, class ClusterShape, class... Rest>
  static Params to_underlying_arguments(GroupProblemShape problem_shapes, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, Rest... rest) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shapes, tile_shape, cluster_shape, hw_info, arguments, rest...);
    params.wait = arguments.wait;
    return params;
  }

  FlagWaitGroupScheduler() = default;

  CUTLASS_DEVICE FlagWaitGroupScheduler(Params const& params, SchedulerResponse* response_ptr)
      : Base(params, response_ptr), wait_(params.wait) {}

  template <class ClusterShape>
  CUTLASS_DEVICE auto initial_work_tile_info(ClusterShape cluster_shape) {
    auto work = Base::initial_work_tile_info(cluster_shape);
    wait_before_load(work);
    return work;
  }

  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline& pipeline, PipelineState state) {
    auto next = Base::fetch_next_work(work, pipeline, state);
    wait_before_load(cute::get<0>(next));
    return next;
  }

 private:
  CUTLASS_DEVICE void wait_before_load(WorkTileInfo const& work) const {
    if (threadIdx.x / 32 != 0 || !work.is_valid() || wait_.ready == nullptr) return;
    const int group = work.L_idx;
    const int group_begin = group == 0 ? 0 : wait_.offs[group - 1];
    const int group_end = wait_.offs[group];
    const int tile_m = this->scheduler_params.cta_shape_.m();
    const int row_begin = group_begin + work.M_idx * tile_m;
    const int row_end = min(row_begin + tile_m, group_end);
    // NOTE: swizzle rounding can hand out tiles past the group's rows (TMA loads zeros there).
    if (row_end > row_begin) wait_rows_ready(wait_, group, row_begin, row_end);
  }

  FlagWaitParams wait_;
};

}  // namespace mok::gemm

// Grouped kernels whose problem shape is FlagWaitProblemShape get FlagWaitGroupScheduler.
namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t kStages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, kStages,
                             mok::gemm::FlagWaitProblemShape> {
  using Scheduler = mok::gemm::FlagWaitGroupScheduler<mok::gemm::FlagWaitProblemShape,
                                                      static_cast<int>(kStages)>;
};
}  // namespace cutlass::gemm::kernel::detail
