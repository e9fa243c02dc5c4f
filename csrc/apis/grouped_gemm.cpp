#include "apis/grouped_gemm.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string_view>

#include "apis/grouped_gemm_checks.h"
#include "launch/grouped_gemm.h"

namespace mok::apis {
namespace {

// Allocates the scratch buffer and launches on the current stream of `x`'s device.
template <class Launch>
void launch_with_workspace(const at::Tensor& x, launch::GroupedGemmArgs& args, Launch launch) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  const auto bytes = static_cast<int64_t>(launch::grouped_gemm_workspace_bytes(args.num_groups));
  at::Tensor workspace = at::empty({bytes}, x.options().dtype(at::kByte));
  args.workspace = workspace.data_ptr();
  launch(args, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

launch::GroupedGemmArgs base_args(const at::Tensor& a, const at::Tensor& b,
                                  const at::Tensor& offs, const at::Tensor& out) {
  launch::GroupedGemmArgs args;
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.out = out.data_ptr();
  args.offs = offs.data_ptr<int32_t>();
  args.num_groups = static_cast<int>(offs.size(0));
  return args;
}

launch::GroupedGemmArgs l1_swiglu_args(const char* kOp, const at::Tensor& x,
                                       const at::Tensor& w_gu, const at::Tensor& offs,
                                       const at::Tensor& act, const std::optional<at::Tensor>& h) {
  check_bf16(kOp, "x", x, 2, x);
  check_bf16(kOp, "w_gu", w_gu, 3, x);
  const int64_t rows = x.size(0), hidden = x.size(1), two_i = w_gu.size(1);
  check_dim(kOp, "hidden", hidden, 8);
  check_dim(kOp, "2 * intermediate (w_gu.shape[1])", two_i, 16);
  check_shape(kOp, "w_gu", w_gu, {w_gu.size(0), two_i, hidden});
  check_offs(kOp, offs, w_gu.size(0), x);
  check_bf16(kOp, "act", act, 2, x);
  check_shape(kOp, "act", act, {rows, two_i / 2});
  auto args = base_args(x, w_gu, offs, act);
  args.n = static_cast<int>(two_i);
  args.k = static_cast<int>(hidden);
  if (h.has_value() && h->numel() > 0) {
    check_bf16(kOp, "h", *h, 2, x);
    check_shape(kOp, "h", *h, {rows, two_i});
    args.aux = h->data_ptr();
  }
  return args;
}

// out [rows, n] = a [rows, k] @ op(b[g]): b is [G, n, k] (b_transposed: a @ b[g]^T, the NT
// op) or [G, k, n] (a @ b[g], the NN op).
launch::GroupedGemmArgs rows_in_m_args(const char* kOp, const at::Tensor& a, const at::Tensor& b,
                                       const at::Tensor& offs, const at::Tensor& out,
                                       bool b_transposed) {
  check_bf16(kOp, "a", a, 2, a);
  check_bf16(kOp, "b", b, 3, a);
  const int64_t k = a.size(1), n = b.size(b_transposed ? 1 : 2);
  check_dim(kOp, "k", k, 8);
  check_dim(kOp, "n", n, 8);
  if (b_transposed) {
    check_shape(kOp, "b", b, {b.size(0), n, k});
  } else {
    check_shape(kOp, "b", b, {b.size(0), k, n});
  }
  check_offs(kOp, offs, b.size(0), a);
  check_bf16(kOp, "out", out, 2, a);
  check_shape(kOp, "out", out, {a.size(0), n});
  auto args = base_args(a, b, offs, out);
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  return args;
}

// ready: int32 [>= ceil(rows / rows_per_flag)] next to `x`; error: int32 [>= 8], CUDA on x's
// device or pinned CPU (readable after a trap), or absent.
launch::FlagWaitArgs flag_wait_args(const char* op, const at::Tensor& x, const at::Tensor& ready,
                                    int64_t rows_per_flag, int64_t epoch, int64_t timeout_ms,
                                    const std::optional<at::Tensor>& error) {
  TORCH_CHECK(ready.device() == x.device(), op, ": ready is on ", ready.device(), ", expected ",
              x.device());
  TORCH_CHECK(ready.scalar_type() == at::kInt, op, ": ready.dtype=", ready.scalar_type(),
              " must be int32 (one counter per block of rows_per_flag rows)");
  TORCH_CHECK(ready.dim() == 1 && ready.is_contiguous(), op, ": ready.shape=", ready.sizes(),
              " must be one contiguous dim");
  TORCH_CHECK(rows_per_flag > 0 && rows_per_flag <= INT32_MAX, op,
              ": rows_per_flag=", rows_per_flag, " must be a positive int32");
  const int64_t needed = std::max<int64_t>(1, (x.size(0) + rows_per_flag - 1) / rows_per_flag);
  TORCH_CHECK(ready.numel() >= needed && ready.numel() <= INT32_MAX, op, ": ready has ",
              ready.numel(), " flags; ", x.size(0), " rows at rows_per_flag=", rows_per_flag,
              " need ", needed);
  TORCH_CHECK(epoch >= INT32_MIN && epoch <= INT32_MAX, op, ": epoch=", epoch,
              " must fit int32 (flags are int32)");
  TORCH_CHECK(timeout_ms > 0 && timeout_ms <= int64_t{1} << 31, op, ": timeout_ms=", timeout_ms,
              " must be positive (a device wait never waits forever)");
  launch::FlagWaitArgs wait;
  wait.ready = ready.data_ptr<int32_t>();
  wait.num_flags = static_cast<int>(ready.numel());
  wait.rows_per_flag = static_cast<int>(rows_per_flag);
  wait.epoch = static_cast<int32_t>(epoch);
  wait.timeout_ns = timeout_ms * 1000000;
  if (error.has_value() && error->numel() > 0) {
    const bool on_device = error->device() == x.device();
    TORCH_CHECK(on_device || (error->is_cpu() && error->is_pinned()), op, ": error is on ",
                error->device(), "; it must be on ", x.device(), " or in pinned CPU memory");
    TORCH_CHECK(error->scalar_type() == at::kInt && error->is_contiguous() && error->numel() >= 8,
                op, ": error must be a contiguous int32 tensor of >= 8 words, got ",
                error->scalar_type(), " ", error->sizes());
    wait.error = error->data_ptr<int32_t>();
  }
  return wait;
}

}  // namespace

void grouped_gemm_l1_swiglu_out(const at::Tensor& x, const at::Tensor& w_gu,
                                const at::Tensor& offs, const at::Tensor& act,
                                const std::optional<at::Tensor>& h, std::string_view schedule,
                                std::string_view raster, int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_l1_swiglu";
  auto args = l1_swiglu_args(kOp, x, w_gu, offs, act, h);
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/false);
  launch_with_workspace(x, args, launch::grouped_gemm_l1_swiglu);
}

void grouped_gemm_nt_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                         const at::Tensor& out, std::string_view schedule, std::string_view raster,
                         int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_nt";
  auto args = rows_in_m_args(kOp, a, b, offs, out, /*b_transposed=*/true);
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/true);
  launch_with_workspace(a, args, launch::grouped_gemm_nt);
}

void grouped_gemm_nn_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                         const at::Tensor& out, std::string_view schedule, std::string_view raster,
                         int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_nn";
  auto args = rows_in_m_args(kOp, a, b, offs, out, /*b_transposed=*/false);
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/true);
  launch_with_workspace(a, args, launch::grouped_gemm_nn);
}

void grouped_gemm_dswiglu_out(const at::Tensor& d_y, const at::Tensor& w_down,
                              const at::Tensor& h, const at::Tensor& offs, const at::Tensor& d_h,
                              const std::optional<at::Tensor>& act, std::string_view schedule,
                              std::string_view raster, int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_dswiglu";
  check_bf16(kOp, "d_y", d_y, 2, d_y);
  check_bf16(kOp, "w_down", w_down, 3, d_y);
  const int64_t rows = d_y.size(0), hidden = d_y.size(1), inter = w_down.size(2);
  check_dim(kOp, "hidden", hidden, 8);
  check_dim(kOp, "intermediate", inter, 8);
  check_shape(kOp, "w_down", w_down, {w_down.size(0), hidden, inter});
  check_offs(kOp, offs, w_down.size(0), d_y);
  check_bf16(kOp, "h", h, 2, d_y);
  check_shape(kOp, "h", h, {rows, 2 * inter});
  check_bf16(kOp, "d_h", d_h, 2, d_y);
  check_shape(kOp, "d_h", d_h, {rows, 2 * inter});
  auto args = base_args(d_y, w_down, offs, d_h);
  args.n = static_cast<int>(inter);
  args.k = static_cast<int>(hidden);
  args.aux = h.data_ptr();
  if (act.has_value() && act->numel() > 0) {
    check_bf16(kOp, "act", *act, 2, d_y);
    check_shape(kOp, "act", *act, {rows, inter});
    args.aux2 = act->data_ptr();
  }
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/false);
  launch_with_workspace(d_y, args, launch::grouped_gemm_dswiglu);
}

// The weight-gradient ops' args: `out` (named `out_name`) [G, M, N], bf16 or the fp32
// accumulator, for a [rows, M] and b [rows, N]; out's dtype is the caller's check.
launch::GroupedGemmArgs wgrad_args(const char* kOp, const at::Tensor& a, const at::Tensor& b,
                                   const at::Tensor& offs, const at::Tensor& out,
                                   const char* out_name, std::string_view schedule,
                                   std::string_view raster, int64_t swizzle) {
  check_bf16(kOp, "a", a, 2, a);
  check_bf16(kOp, "b", b, 2, a);
  const int64_t m = a.size(1), n = b.size(1);
  TORCH_CHECK(b.size(0) == a.size(0), kOp, ": a and b must have the same rows, got ", a.sizes(),
              " and ", b.sizes());
  check_dim(kOp, "m", m, 8);
  check_dim(kOp, "n", n, 8);
  check_offs(kOp, offs, out.size(0), a);
  check_shape(kOp, out_name, out, {out.size(0), m, n});
  auto args = base_args(a, b, offs, out);
  args.m = static_cast<int>(m);
  args.n = static_cast<int>(n);
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/true,
                            /*has_cluster2=*/true);
  return args;
}

void grouped_gemm_tn_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                         const at::Tensor& out, std::string_view schedule, std::string_view raster,
                         int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_tn";
  check_bf16(kOp, "out", out, 3, a);
  auto args = wgrad_args(kOp, a, b, offs, out, "out", schedule, raster, swizzle);
  launch_with_workspace(a, args, launch::grouped_gemm_tn);
}

void grouped_gemm_tn_accumulate_out(const at::Tensor& a, const at::Tensor& b,
                                    const at::Tensor& offs, const at::Tensor& acc,
                                    std::string_view schedule, std::string_view raster,
                                    int64_t swizzle, std::string_view store) {
  constexpr const char* kOp = "mok::grouped_gemm_tn_accumulate";
  const bool bf16 = acc.scalar_type() == at::kBFloat16;
  check_matrix(kOp, "acc", acc, 3, a, bf16 ? at::kBFloat16 : at::kFloat,
               "float32 (like Megatron's main_grad) or bfloat16 (a .grad summed in place)");
  auto args = wgrad_args(kOp, a, b, offs, acc, "acc", schedule, raster, swizzle);
  launch::AccumulateStore how = launch::AccumulateStore::kAuto;
  if (store == "load") {
    how = launch::AccumulateStore::kLoad;
  } else if (store == "reduce") {
    how = launch::AccumulateStore::kReduce;
  } else {
    TORCH_CHECK(store == "auto", kOp, ": store='", store,
                "' must be 'auto' (the default), 'load' or 'reduce'");
  }
  TORCH_CHECK(!bf16 || how != launch::AccumulateStore::kReduce, kOp,
              ": store='reduce' adds float32 accumulators only (a bfloat16 reduce would round the "
              "sum before adding it); use 'auto' or 'load' for a bfloat16 acc");
  if (bf16) {
    launch_with_workspace(a, args, launch::grouped_gemm_tn_accumulate_bf16);
    return;
  }
  launch_with_workspace(a, args, [&](const launch::GroupedGemmArgs& gemm, cudaStream_t stream) {
    launch::grouped_gemm_tn_accumulate(gemm, how, a.size(0), stream);
  });
}

void grouped_gemm_nt_wait_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                              const at::Tensor& ready, int64_t rows_per_flag, int64_t epoch,
                              int64_t timeout_ms, const at::Tensor& out,
                              const std::optional<at::Tensor>& error, std::string_view schedule,
                              std::string_view raster, int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_nt_wait";
  auto args = rows_in_m_args(kOp, a, b, offs, out, /*b_transposed=*/true);
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/true);
  const auto wait = flag_wait_args(kOp, a, ready, rows_per_flag, epoch, timeout_ms, error);
  launch_with_workspace(a, args, [&](const launch::GroupedGemmArgs& gemm, cudaStream_t stream) {
    launch::grouped_gemm_nt_wait(gemm, wait, stream);
  });
}

void grouped_gemm_l1_swiglu_wait_out(const at::Tensor& x, const at::Tensor& w_gu,
                                     const at::Tensor& offs, const at::Tensor& ready,
                                     int64_t rows_per_flag, int64_t epoch, int64_t timeout_ms,
                                     const at::Tensor& act, const std::optional<at::Tensor>& h,
                                     const std::optional<at::Tensor>& error,
                                     std::string_view schedule, std::string_view raster,
                                     int64_t swizzle) {
  constexpr const char* kOp = "mok::grouped_gemm_l1_swiglu_wait";
  auto args = l1_swiglu_args(kOp, x, w_gu, offs, act, h);
  args.tuning = tuning_args(kOp, schedule, raster, swizzle, /*has_pingpong=*/false);
  const auto wait = flag_wait_args(kOp, x, ready, rows_per_flag, epoch, timeout_ms, error);
  launch_with_workspace(x, args, [&](const launch::GroupedGemmArgs& gemm, cudaStream_t stream) {
    launch::grouped_gemm_l1_swiglu_wait(gemm, wait, stream);
  });
}

}  // namespace mok::apis
