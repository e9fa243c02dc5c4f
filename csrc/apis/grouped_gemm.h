// Torch-facing grouped-GEMM ops for the MoE expert MLP (sm_90a): check tensors, build
// mok::launch::GroupedGemmArgs, launch on the current stream. Registered in python_api.cpp
// (section "grouped_gemm"); Python wrappers and fakes in mok_megatron/ops/grouped_gemm.py.
//
// Every op writes into caller-provided outputs (the wrappers allocate them). offs: int32
// [num_groups] end rows (torch._grouped_mm's convention); rows at or past offs[-1] are not
// written. All tensors are contiguous CUDA bf16 on one device (but the fp32 accumulator).
//
// Every op ends with the tile order (launch::GemmTuning; results are bitwise the same for every
// setting): schedule "cooperative" | "pingpong" (the plain-epilogue ops nt, nn, tn, nt_wait; the
// SwiGLU ops refuse pingpong), raster "m" | "n", swizzle 1 | 2 | 4 | 8.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

namespace mok::apis {

// act [rows, I] = silu(g) * u with h = x @ w_gu[g]^T; x [rows, H], w_gu [G, 2I, H] gate/up
// interleaved in blocks of 8 rows; h [rows, 2I] (optional) receives the pre-activation.
void grouped_gemm_l1_swiglu_out(const at::Tensor& x, const at::Tensor& w_gu,
                                const at::Tensor& offs, const at::Tensor& act,
                                const std::optional<at::Tensor>& h, std::string_view schedule,
                                std::string_view raster, int64_t swizzle);

// out [rows, N] = a [rows, K] @ b[g]^T, b [G, N, K].
void grouped_gemm_nt_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                         const at::Tensor& out, std::string_view schedule, std::string_view raster,
                         int64_t swizzle);

// out [rows, N] = a [rows, K] @ b[g], b [G, K, N].
void grouped_gemm_nn_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                         const at::Tensor& out, std::string_view schedule, std::string_view raster,
                         int64_t swizzle);

// d_h [rows, 2I] = SwiGLU backward of d_act = d_y [rows, H] @ w_down[g] (w_down [G, H, I]) at
// h [rows, 2I] (interleaved); act [rows, I] (optional) receives silu(g) * u.
void grouped_gemm_dswiglu_out(const at::Tensor& d_y, const at::Tensor& w_down,
                              const at::Tensor& h, const at::Tensor& offs, const at::Tensor& d_h,
                              const std::optional<at::Tensor>& act, std::string_view schedule,
                              std::string_view raster, int64_t swizzle);

// out [G, M, N] = a_g^T @ b_g over group g's rows, a [rows, M], b [rows, N]; zeros for a group
// without rows.
void grouped_gemm_tn_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                         const at::Tensor& out, std::string_view schedule, std::string_view raster,
                         int64_t swizzle);

// acc [G, M, N] += a_g^T @ b_g over group g's rows (fp32 or bf16 acc, 16-byte aligned: TMA
// reads and writes it), in grouped_gemm_tn's order; a group without rows leaves acc[g] untouched.
// store: "auto" | "load" | "reduce" (fp32 only), launch::AccumulateStore.
void grouped_gemm_tn_accumulate_out(const at::Tensor& a, const at::Tensor& b,
                                    const at::Tensor& offs, const at::Tensor& acc,
                                    std::string_view schedule, std::string_view raster,
                                    int64_t swizzle, std::string_view store);

// The same two forward ops with the per-tile flag wait: a tile reading rows [r0, r1) of a / x first
// waits until ready[f] >= epoch for f in [r0 / rows_per_flag, (r1 - 1) / rows_per_flag];
// ready: int32 [>= ceil(rows / rows_per_flag)], CUDA. After timeout_ms the kernel writes `error`
// (int32 [8], CUDA or pinned CPU, optional; layout in csrc/include/mok/scheduler/flag_wait.cuh)
// and traps.
void grouped_gemm_nt_wait_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                              const at::Tensor& ready, int64_t rows_per_flag, int64_t epoch,
                              int64_t timeout_ms, const at::Tensor& out,
                              const std::optional<at::Tensor>& error, std::string_view schedule,
                              std::string_view raster, int64_t swizzle);
void grouped_gemm_l1_swiglu_wait_out(const at::Tensor& x, const at::Tensor& w_gu,
                                     const at::Tensor& offs, const at::Tensor& ready,
                                     int64_t rows_per_flag, int64_t epoch, int64_t timeout_ms,
                                     const at::Tensor& act, const std::optional<at::Tensor>& h,
                                     const std::optional<at::Tensor>& error,
                                     std::string_view schedule, std::string_view raster,
                                     int64_t swizzle);

}  // namespace mok::apis
