// Shared host-side runner of the blockwise-FP8 grouped-GEMM launchers.
#pragma once

#include "launch/grouped_gemm_fp8.h"
#include "launch/grouped_gemm_impl.cuh"
#include "mok/scheduler/grouped_problems_fp8.cuh"

namespace mok::launch::detail {

// NOTE: one generous layout for the problem arrays (strides at most 16 bytes), as AnyArrays.
using AnyFp8Arrays = gemm::Fp8ProblemArrays<AnyStride, AnyStride, AnyStride>;

inline void check_fp8(const Fp8GroupedGemmArgs& args, const char* op) {
  MOK_HOST_CHECK(args.num_groups > 0, "%s: num_groups=%d must be positive", op, args.num_groups);
  MOK_HOST_CHECK(args.offs != nullptr && args.workspace != nullptr, "%s: null offs/workspace", op);
  MOK_HOST_CHECK(args.a != nullptr && args.b != nullptr && args.a_scales != nullptr &&
                     args.b_scales != nullptr,
                 "%s: null operand or scales", op);
  MOK_HOST_CHECK(reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0,
                 "%s: workspace must be 256-byte aligned", op);
  MOK_HOST_CHECK(args.n % gemm::kFp8ScaleBlock == 0 && args.k % gemm::kFp8ScaleBlock == 0,
                 "%s: n=%d and k=%d must be multiples of 128 (the FP8 scale blocks)", op, args.n,
                 args.k);
  const int swizzle = args.tuning.swizzle;
  MOK_HOST_CHECK(swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8,
                 "%s: tuning swizzle=%d must be 1, 2, 4 or 8", op, swizzle);
}

// A rows-in-M FP8 problem from the args; the caller sets d (and aux).
inline gemm::Fp8ProblemDesc fp8_desc(const Fp8GroupedGemmArgs& args) {
  gemm::Fp8ProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.n = args.n;
  desc.k = args.k;
  const int64_t k_blocks = args.k / gemm::kFp8ScaleBlock;
  desc.a = {args.a, args.k, 0};
  desc.b = {args.b, 0, int64_t{args.n} * args.k};
  desc.sfa = {args.a_scales, k_blocks, 0};
  desc.sfb = {args.b_scales, 0, int64_t{args.n} / gemm::kFp8ScaleBlock * k_blocks};
  return desc;
}

// Builds the problem arrays on the device, then runs `Config::Gemm` (grouped_gemm_impl.cuh's
// run_grouped, with the FP8 mainloop's scale arguments).
template <class Config, class MakeEpilogue>
void run_fp8(const gemm::Fp8ProblemDesc& desc, void* workspace, const GemmTuning& tuning,
             cudaStream_t stream, MakeEpilogue make_epilogue) {
  using Gemm = typename Config::Gemm;
  using Arrays = gemm::Fp8ProblemArrays<typename Config::StrideA, typename Config::StrideB,
                                        typename Config::StrideD>;
  static_assert(sizeof(typename Config::StrideA) <= 16 && sizeof(typename Config::StrideB) <= 16 &&
                sizeof(typename Config::StrideD) <= 16);
  const int num_groups = desc.num_groups;
  Arrays arrays = Arrays::carve(workspace, num_groups);
  constexpr int kThreads = 128;
  gemm::build_fp8_problems<<<(num_groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
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
      {arrays.ptr_a, arrays.stride_a, arrays.ptr_b, arrays.stride_b, arrays.ptr_sfa,
       arrays.layout_sfa, arrays.ptr_sfb, arrays.layout_sfb},
      make_epilogue(arrays),
      hw_info};
  using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
  arguments.scheduler.raster_order =
      tuning.raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  arguments.scheduler.max_swizzle_size = tuning.swizzle;
  Gemm gemm;
  MOK_HOST_CHECK(gemm.can_implement(arguments) == cutlass::Status::kSuccess,
                 "FP8 grouped GEMM: CUTLASS cannot implement this problem");
  const size_t cutlass_bytes = Gemm::get_workspace_size(arguments);
  MOK_HOST_CHECK(cutlass_bytes <= kCutlassWorkspaceBytesPerSm * hw_info.sm_count,
                 "FP8 grouped GEMM: CUTLASS workspace %zu bytes exceeds the reserved %zu",
                 cutlass_bytes, kCutlassWorkspaceBytesPerSm * hw_info.sm_count);
  void* cutlass_workspace = static_cast<char*>(workspace) + AnyFp8Arrays::bytes(num_groups);
  MOK_HOST_CHECK(gemm.initialize(arguments, cutlass_workspace, stream) == cutlass::Status::kSuccess,
                 "FP8 grouped GEMM: CUTLASS initialize failed");
  MOK_HOST_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, "FP8 grouped GEMM: launch failed");
  MOK_CUDA_CHECK(cudaGetLastError());
}

template <class Epilogue, class Schedule = gemm::Fp8Cooperative>
struct Fp8Config {
  using Gemm = typename gemm::GroupedGemmFp8<Epilogue, Schedule>::Gemm;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
};

}  // namespace mok::launch::detail
