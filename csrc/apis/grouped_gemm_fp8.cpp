#include "apis/grouped_gemm_fp8.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "apis/grouped_gemm_checks.h"
#include "apis/tensor_checks.h"
#include "launch/grouped_gemm_fp8.h"

namespace mok::apis {
namespace {

constexpr int64_t kBlock = 128;  // mirrors mok::gemm::kFp8ScaleBlock

void check_fp8_dim(const char* op, const char* what, int64_t value) {
  TORCH_CHECK(value > 0 && value % kBlock == 0, op, ": ", what, "=", value,
              " must be a positive multiple of 128 (the FP8 scale blocks); pad it");
  TORCH_CHECK(value < (int64_t{1} << 31), op, ": ", what, "=", value, " exceeds int32");
}

void check_fp8(const char* op, const char* name, const at::Tensor& t, int64_t dim,
               const at::Tensor& like) {
  check_matrix(op, name, t, dim, like, at::kFloat8_e4m3fn,
               "float8_e4m3fn (quantise with ops.fp8_blockwise_quantize)");
}

void check_scales(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                  at::IntArrayRef shape) {
  check_matrix(op, name, t, static_cast<int64_t>(shape.size()), like, at::kFloat, "float32");
  check_shape(op, name, t, shape);
}

// The operand checks every FP8 op shares: a [rows, K] + scales [rows, K / 128], b [G, N, K] +
// scales [G, N / 128, K / 128], offs.
launch::Fp8GroupedGemmArgs operand_args(const char* op, const at::Tensor& a,
                                        const at::Tensor& a_scales, const at::Tensor& b,
                                        const at::Tensor& b_scales, const at::Tensor& offs) {
  check_fp8(op, "a", a, 2, a);
  check_fp8(op, "b", b, 3, a);
  const int64_t rows = a.size(0), k = a.size(1), groups = b.size(0), n = b.size(1);
  check_fp8_dim(op, "k (a.shape[1])", k);
  check_fp8_dim(op, "n (b.shape[1])", n);
  check_shape(op, "b", b, {groups, n, k});
  check_scales(op, "a_scales", a_scales, a, {rows, k / kBlock});
  check_scales(op, "b_scales", b_scales, a, {groups, n / kBlock, k / kBlock});
  check_offs(op, offs, groups, a);
  launch::Fp8GroupedGemmArgs args;
  args.a = a.data_ptr();
  args.a_scales = a_scales.data_ptr<float>();
  args.b = b.data_ptr();
  args.b_scales = b_scales.data_ptr<float>();
  args.offs = offs.data_ptr<int32_t>();
  args.num_groups = static_cast<int>(groups);
  args.num_rows = rows;
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  return args;
}

template <class Launch>
void launch_with_workspace(const at::Tensor& a, launch::Fp8GroupedGemmArgs& args, Launch launch) {
  const c10::cuda::CUDAGuard device_guard(a.device());
  const auto bytes =
      static_cast<int64_t>(launch::grouped_gemm_fp8_workspace_bytes(args.num_groups));
  at::Tensor workspace = at::empty({bytes}, a.options().dtype(at::kByte));
  args.workspace = workspace.data_ptr();
  launch(args, stream_of(a));
}

}  // namespace

void grouped_gemm_fp8_nt_out(const at::Tensor& a, const at::Tensor& a_scales,
                             const at::Tensor& b, const at::Tensor& b_scales,
                             const at::Tensor& offs, const at::Tensor& out,
                             std::string_view schedule, std::string_view raster, int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_fp8_nt";
  auto args = operand_args(kOp, a, a_scales, b, b_scales, offs);
  check_bf16(kOp, "out", out, 2, a);
  check_shape(kOp, "out", out, {a.size(0), b.size(1)});
  args.out = out.data_ptr();
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/true);
  launch_with_workspace(a, args, launch::grouped_gemm_fp8_nt);
}

void grouped_gemm_fp8_l1_swiglu_out(const at::Tensor& x, const at::Tensor& x_scales,
                                    const at::Tensor& w_gu, const at::Tensor& w_gu_scales,
                                    const at::Tensor& offs, const at::Tensor& act_q,
                                    const at::Tensor& act_q_scales,
                                    const std::optional<at::Tensor>& act,
                                    const std::optional<at::Tensor>& h, bool pow2_scales,
                                    std::string_view schedule, std::string_view raster,
                                    int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_fp8_l1_swiglu";
  auto args = operand_args(kOp, x, x_scales, w_gu, w_gu_scales, offs);
  const int64_t rows = x.size(0), two_i = w_gu.size(1), inter = two_i / 2;
  TORCH_CHECK(two_i % (2 * kBlock) == 0, kOp, ": 2I=", two_i,
              " must be a multiple of 256 (I a multiple of 128: the act blocks the FP8 L2 reads)");
  check_fp8(kOp, "act_q", act_q, 2, x);
  check_shape(kOp, "act_q", act_q, {rows, inter});
  check_scales(kOp, "act_q_scales", act_q_scales, x, {rows, inter / kBlock});
  args.act_q = act_q.data_ptr();
  args.act_q_scales = act_q_scales.data_ptr<float>();
  args.act_q_pow2 = pow2_scales;
  at::Tensor act_scratch;  // the bf16 act the quantisation pass reads, when not asked for
  if (act.has_value() && act->numel() > 0) {
    check_bf16(kOp, "act", *act, 2, x);
    check_shape(kOp, "act", *act, {rows, inter});
    args.out = act->data_ptr();
  } else {
    act_scratch = at::empty({rows, inter}, x.options().dtype(at::kBFloat16));
    args.act_scratch = act_scratch.data_ptr();
  }
  if (h.has_value() && h->numel() > 0) {
    check_bf16(kOp, "h", *h, 2, x);
    check_shape(kOp, "h", *h, {rows, two_i});
    args.h = h->data_ptr();
  }
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/false);
  launch_with_workspace(x, args, launch::grouped_gemm_fp8_l1_swiglu);
}

}  // namespace mok::apis
