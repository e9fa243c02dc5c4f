// Torch-facing blockwise-FP8 grouped-GEMM ops (issue 15): check tensors, build
// mok::launch::Fp8GroupedGemmArgs, launch on the current stream. Registered in python_api.cpp
// (section "grouped_gemm_fp8"); wrappers and fakes in mok_megatron/ops/grouped_gemm_fp8.py.
//
// Operands are float8_e4m3fn with float32 scales (ops.fp8_blockwise's format): activations
// a [rows, K] with (1, 128) scales [rows, K / 128]; weights b [G, N, K] with (128, 128) scales
// [G, N / 128, K / 128]; K and N multiples of 128. offs: int32 [G] end rows. Outputs are
// caller-provided; rows at or past offs[-1] are not written.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

namespace mok::apis {

// out [rows, N] bf16 = dequant(a) @ dequant(b[g])^T.
void grouped_gemm_fp8_nt_out(const at::Tensor& a, const at::Tensor& a_scales,
                             const at::Tensor& b, const at::Tensor& b_scales,
                             const at::Tensor& offs, const at::Tensor& out,
                             std::string_view schedule, std::string_view raster, int64_t swizzle);

// The FP8 L1 + SwiGLU: h = dequant(x) @ dequant(w_gu[g])^T (w_gu [G, 2I, H] interleaved),
// act = silu(g) * u (bf16) and act quantised: act_q e4m3 [rows, I], act_q_scales
// [rows, I / 128]; act (bf16 [rows, I]) and h (bf16 [rows, 2I]) written when given (act is
// a scratch buffer otherwise: the quantisation is a second kernel, launch/grouped_gemm_fp8.h).
void grouped_gemm_fp8_l1_swiglu_out(const at::Tensor& x, const at::Tensor& x_scales,
                                    const at::Tensor& w_gu, const at::Tensor& w_gu_scales,
                                    const at::Tensor& offs, const at::Tensor& act_q,
                                    const at::Tensor& act_q_scales,
                                    const std::optional<at::Tensor>& act,
                                    const std::optional<at::Tensor>& h, bool pow2_scales,
                                    std::string_view schedule, std::string_view raster,
                                    int64_t swizzle);

}  // namespace mok::apis
