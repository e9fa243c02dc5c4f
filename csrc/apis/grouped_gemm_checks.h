// Tensor checks shared by the grouped-GEMM ops (apis/grouped_gemm.cpp, the BF16 engine, and
// apis/grouped_gemm_fp8.cpp, the blockwise-FP8 one): each error names the op, the tensor, the
// rule and the fix.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string_view>

#include "launch/grouped_gemm.h"

namespace mok::apis {

inline void check_matrix(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                  const at::Tensor& like, at::ScalarType dtype, const char* why) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but ",
              like.device(), " was expected");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, ".dtype=", t.scalar_type(), " must be ",
              why);
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dims, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous; call .contiguous()");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              " must be 16-byte aligned (TMA); it is a misaligned view");
}

inline void check_bf16(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                const at::Tensor& like) {
  check_matrix(op, name, t, dim, like, at::kBFloat16, "bfloat16");
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, ".shape=", t.sizes(), " must be ", shape);
}

inline void check_offs(const char* op, const at::Tensor& offs, int64_t num_groups, const at::Tensor& x) {
  TORCH_CHECK(offs.device() == x.device(), op, ": offs is on ", offs.device(), ", expected ",
              x.device());
  TORCH_CHECK(offs.scalar_type() == at::kInt, op, ": offs.dtype=", offs.scalar_type(),
              " must be int32 (end rows per group, as torch._grouped_mm)");
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == num_groups && offs.is_contiguous(), op,
              ": offs.shape=", offs.sizes(), " must be [", num_groups, "] (one end row per group)");
}

inline void check_dim(const char* op, const char* what, int64_t value, int64_t multiple) {
  TORCH_CHECK(value % multiple == 0 && value > 0, op, ": ", what, "=", value,
              " must be a positive multiple of ", multiple, " (16-byte TMA rows); pad it");
  TORCH_CHECK(value < (int64_t{1} << 31), op, ": ", what, "=", value, " exceeds int32");
}

// The tile order from an op's trailing arguments. `has_pingpong`: the op has a pingpong kernel
// (the plain-epilogue ops); the SwiGLU ops refuse pingpong rather than ignore it. `has_cluster2`:
// the op has a cooperative_cluster2 kernel (the weight gradients); the others refuse it.
inline launch::GemmTuning tuning_args(const char* op, std::string_view schedule, std::string_view raster,
                               int64_t swizzle, bool has_pingpong, bool has_cluster2 = false) {
  TORCH_CHECK(schedule == "cooperative" || schedule == "pingpong" ||
                  schedule == "cooperative_cluster2",
              op, ": schedule='", schedule,
              "' must be 'cooperative', 'pingpong' or 'cooperative_cluster2'");
  TORCH_CHECK(has_pingpong || schedule != "pingpong", op,
              ": schedule='pingpong' is only for the plain-epilogue ops (grouped_gemm_nt, _nn, "
              "_tn, _nt_wait); the SwiGLU epilogue runs on the cooperative schedule: use "
              "'cooperative'");
  TORCH_CHECK(has_cluster2 || schedule != "cooperative_cluster2", op,
              ": schedule='cooperative_cluster2' is only for the weight-gradient ops "
              "(grouped_gemm_tn, _tn_accumulate): use 'cooperative'");
  TORCH_CHECK(raster == "m" || raster == "n", op, ": raster='", raster, "' must be 'm' or 'n'");
  TORCH_CHECK(swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8, op,
              ": swizzle=", swizzle, " must be 1, 2, 4 or 8");
  launch::GemmTuning tuning;
  tuning.pingpong = schedule == "pingpong";
  tuning.cluster2 = schedule == "cooperative_cluster2";
  tuning.raster_along_n = raster == "n";
  tuning.swizzle = static_cast<int>(swizzle);
  return tuning;
}

}  // namespace mok::apis
