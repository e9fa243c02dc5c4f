// Shared host-side runner for the grouped-GEMM launchers (each .cu instantiates its CUTLASS
// kernels: the SwiGLU ops one, the plain ops one per schedule).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "launch/grouped_gemm.h"
#include "mok/common/macros.cuh"
#include "mok/scheduler/flag_wait.cuh"
#include "mok/scheduler/grouped_problems.cuh"

namespace mok::launch::detail {

// NOTE: one generous layout for every op (stride types are at most 16 bytes), so a single
// workspace size serves all launchers.
using AnyStride = cute::Stride<int64_t, cute::_1, int64_t>;
using AnyArrays = gemm::GroupedProblemArrays<AnyStride, AnyStride, AnyStride>;
constexpr size_t kCutlassWorkspaceBytesPerSm = 4096;  // >= 2 TMA descriptors + scheduler state

inline int sm_count_of_current_device() {
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  int count = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

inline size_t arrays_bytes(int num_groups) { return AnyArrays::bytes(num_groups); }

inline void check_common(const GroupedGemmArgs& args, const char* op) {
  MOK_HOST_CHECK(args.num_groups > 0, "%s: num_groups=%d must be positive", op, args.num_groups);
  MOK_HOST_CHECK(args.offs != nullptr && args.workspace != nullptr, "%s: null offs/workspace", op);
  MOK_HOST_CHECK(reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0,
                 "%s: workspace must be 256-byte aligned", op);
  MOK_HOST_CHECK(args.n % 8 == 0 && args.k % 8 == 0 && args.m % 8 == 0,
                 "%s: m=%d, n=%d, k=%d must be multiples of 8 (16-byte TMA rows)", op, args.m,
                 args.n, args.k);
  const int swizzle = args.tuning.swizzle;
  MOK_HOST_CHECK(swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8,
                 "%s: tuning swizzle=%d must be 1, 2, 4 or 8", op, swizzle);
}

// The SwiGLU epilogues have a cooperative kernel only: an op asked for pingpong refuses it.
inline void check_cooperative(const GroupedGemmArgs& args, const char* op) {
  MOK_HOST_CHECK(!args.tuning.pingpong,
                 "%s: the pingpong schedule is for the plain-epilogue ops (nt, nn, tn, nt_wait); "
                 "the SwiGLU epilogue runs cooperative only",
                 op);
}

inline void check_flag_wait(const FlagWaitArgs& wait, const char* op) {
  MOK_HOST_CHECK(wait.ready != nullptr && wait.num_flags > 0, "%s: ready must hold >= 1 flag", op);
  MOK_HOST_CHECK(wait.rows_per_flag > 0, "%s: rows_per_flag=%d must be positive", op,
                 wait.rows_per_flag);
  MOK_HOST_CHECK(wait.timeout_ns > 0, "%s: the flag-wait timeout must be positive", op);
}

inline gemm::FlagWaitParams flag_wait_params(const GroupedGemmArgs& args,
                                             const FlagWaitArgs& wait) {
  gemm::FlagWaitParams p;
  p.ready = wait.ready;
  p.offs = args.offs;
  p.num_flags = wait.num_flags;
  p.rows_per_flag = wait.rows_per_flag;
  p.epoch = wait.epoch;
  p.timeout_ns = wait.timeout_ns;
  p.error = wait.error;
  return p;
}

// Leaves the tile scheduler's extra arguments at their defaults.
struct DefaultScheduler {
  template <class SchedulerArguments>
  void operator()(SchedulerArguments&) const {}
};

// Builds the device-side problem arrays, then runs the CUTLASS kernel `Config::Gemm` in the tile
// order `tuning` gives (its schedule is the caller's choice of Config).
// `make_epilogue(arrays)` returns the epilogue arguments; `set_scheduler(arguments.scheduler)`
// fills a custom scheduler's extra arguments (the flag wait's).
template <class Config, class MakeEpilogue, class SetScheduler = DefaultScheduler>
void run_grouped(const gemm::GroupedProblemDesc& desc, void* workspace, const GemmTuning& tuning,
                 cudaStream_t stream, MakeEpilogue make_epilogue,
                 SetScheduler set_scheduler = {}) {
  using Gemm = typename Config::Gemm;
  using Arrays = gemm::GroupedProblemArrays<typename Config::StrideA, typename Config::StrideB,
                                            typename Config::StrideD, typename Config::ElementD>;
  static_assert(sizeof(typename Config::StrideA) <= 16 && sizeof(typename Config::StrideB) <= 16 &&
                sizeof(typename Config::StrideD) <= 16);
  const int num_groups = desc.num_groups;
  Arrays arrays = Arrays::carve(workspace, num_groups);
  constexpr int kThreads = 128;
  gemm::build_grouped_problems<<<(num_groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      desc, arrays);
  MOK_CUDA_CHECK(cudaGetLastError());

  cutlass::KernelHardwareInfo hw_info;
  MOK_CUDA_CHECK(cudaGetDevice(&hw_info.device_id));
  hw_info.sm_count = sm_count_of_current_device();
  typename Gemm::GemmKernel::ProblemShape problem_shape;
  problem_shape.num_groups = num_groups;
  problem_shape.problem_shapes = arrays.problems;
  problem_shape.host_problem_shapes = nullptr;
  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      problem_shape,
      {arrays.ptr_a, arrays.stride_a, arrays.ptr_b, arrays.stride_b},
      make_epilogue(arrays),
      hw_info};
  using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
  arguments.scheduler.raster_order =
      tuning.raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  arguments.scheduler.max_swizzle_size = tuning.swizzle;
  set_scheduler(arguments.scheduler);
  Gemm gemm;
  MOK_HOST_CHECK(gemm.can_implement(arguments) == cutlass::Status::kSuccess,
                 "grouped GEMM: CUTLASS cannot implement this problem");
  const size_t cutlass_bytes = Gemm::get_workspace_size(arguments);
  MOK_HOST_CHECK(cutlass_bytes <= kCutlassWorkspaceBytesPerSm * hw_info.sm_count,
                 "grouped GEMM: CUTLASS workspace %zu bytes exceeds the reserved %zu",
                 cutlass_bytes, kCutlassWorkspaceBytesPerSm * hw_info.sm_count);
  void* cutlass_workspace = static_cast<char*>(workspace) + arrays_bytes(num_groups);
  MOK_HOST_CHECK(gemm.initialize(arguments, cutlass_workspace, stream) == cutlass::Status::kSuccess,
                 "grouped GEMM: CUTLASS initialize failed");
  MOK_HOST_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, "grouped GEMM: launch failed");
  MOK_CUDA_CHECK(cudaGetLastError());
}

// Epilogue arguments of the plain (bf16 store) epilogue.
template <class Config, class Arrays>
typename Config::Gemm::GemmKernel::EpilogueArguments plain_epilogue(const Arrays& arrays) {
  typename Config::Gemm::GemmKernel::EpilogueArguments epi{};
  epi.thread.alpha = 1.0f;
  epi.thread.beta = 0.0f;
  epi.ptr_C = nullptr;
  epi.dC = nullptr;
  epi.ptr_D = arrays.ptr_d;
  epi.dD = arrays.stride_d;
  return epi;
}

// Epilogue arguments of the accumulating epilogue (gemm::AccumulateEpilogue): C and D are the
// same fp32 buffer, D = C + accumulator.
template <class Config, class Arrays>
typename Config::Gemm::GemmKernel::EpilogueArguments accumulate_epilogue(const Arrays& arrays) {
  using Kernel = typename Config::Gemm::GemmKernel;
  using ElementAcc = typename Config::ElementD;
  static_assert(std::is_same_v<ElementAcc, gemm::AccumElement> ||
                std::is_same_v<ElementAcc, gemm::Element>);
  static_assert(std::is_same_v<typename Kernel::InternalStrideC, typename Kernel::InternalStrideD>,
                "C and D share one stride array");
  typename Kernel::EpilogueArguments epi{};
  epi.thread.alpha = 1.0f;
  epi.thread.beta = 1.0f;
  epi.ptr_C = const_cast<const ElementAcc**>(arrays.ptr_d);
  epi.dC = arrays.stride_d;
  epi.ptr_D = arrays.ptr_d;
  epi.dD = arrays.stride_d;
  return epi;
}

template <class Config>
void run_plain(const gemm::GroupedProblemDesc& desc, const GroupedGemmArgs& args,
               cudaStream_t stream) {
  run_grouped<Config>(desc, args.workspace, args.tuning, stream,
                      [](const auto& arrays) { return plain_epilogue<Config>(arrays); });
}

// The schedule `tuning` picks, handed to `fn` as ScheduleTag<Schedule>{} (`typename
// decltype(tag)::type` inside), so every launcher chooses the same way. kHasCluster2: the op has a
// gemm::CooperativeCluster2 kernel (the weight gradients'); the others refuse that schedule.
template <class Schedule>
struct ScheduleTag {
  using type = Schedule;
};

template <bool kHasCluster2 = false, class Fn>
void with_schedule(const GemmTuning& tuning, Fn&& fn) {
  if constexpr (kHasCluster2) {
    if (tuning.cluster2) {
      fn(ScheduleTag<gemm::CooperativeCluster2>{});
      return;
    }
  } else {
    MOK_HOST_CHECK(!tuning.cluster2,
                   "grouped GEMM: the cooperative_cluster2 schedule is for the weight-gradient ops "
                   "(grouped_gemm_tn, _tn_accumulate) only");
  }
  if (tuning.pingpong) {
    fn(ScheduleTag<gemm::Pingpong>{});
  } else {
    fn(ScheduleTag<gemm::Cooperative>{});
  }
}

// The plain-epilogue GEMM on the schedule args.tuning picks; ConfigOf<Schedule> is its Config.
template <template <class> class ConfigOf, bool kHasCluster2 = false>
void run_plain_tuned(const gemm::GroupedProblemDesc& desc, const GroupedGemmArgs& args,
                     cudaStream_t stream) {
  with_schedule<kHasCluster2>(args.tuning, [&](auto tag) {
    run_plain<ConfigOf<typename decltype(tag)::type>>(desc, args, stream);
  });
}

// A rows-in-M problem (forward, data gradients): group g's rows of A [rows, k] times B[g]
// (n x k elements per group) into D [rows, n]. Fused epilogues adjust d and set aux / aux2.
inline gemm::GroupedProblemDesc rows_in_m_desc(const GroupedGemmArgs& args) {
  gemm::GroupedProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.n = args.n;
  desc.k = args.k;
  desc.a = {args.a, args.k, 0};
  desc.b = {args.b, 0, int64_t{args.n} * args.k};
  desc.d = {args.out, args.n, 0};
  return desc;
}

// `OutElement` (Config::ElementD): the element type the epilogue stores (bf16; the accumulating
// weight gradient's fp32 or bf16).
template <class LayoutA, class LayoutB, class Epilogue, class Schedule = gemm::Cooperative,
          class Shape = gemm::ProblemShape, class OutElement = gemm::Element>
struct Config {
  using Gemm = typename gemm::GroupedGemm<LayoutA, LayoutB, Epilogue, Schedule, Shape>::Gemm;
  using ElementD = OutElement;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
};

}  // namespace mok::launch::detail
