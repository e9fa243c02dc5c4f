#include "apis/row_grad.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "launch/row_grad.h"

namespace mok::apis {
namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
           const at::Tensor& d_rows) {
  TORCH_CHECK(t.is_cuda(), "mok::moe_row_grad: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == d_rows.device(), "mok::moe_row_grad: ", name, " is on ", t.device(),
              " but d_rows is on ", d_rows.device());
  TORCH_CHECK(t.scalar_type() == dtype, "mok::moe_row_grad: ", name, " has dtype ",
              t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.dim() == dim, "mok::moe_row_grad: ", name, " has shape ", t.sizes(), ", expected ",
              dim, " dims");
  TORCH_CHECK(t.is_contiguous(), "mok::moe_row_grad: ", name, " must be contiguous");
}

bool is_aligned_16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_row_grad(const at::Tensor& d_rows, const at::Tensor& y,
                                                const at::Tensor& w_rows,
                                                const at::Tensor& row_tok) {
  check(d_rows, "d_rows", at::kBFloat16, 2, d_rows);
  check(y, "y", at::kBFloat16, 2, d_rows);
  check(w_rows, "w_rows", at::kFloat, 1, d_rows);
  check(row_tok, "row_tok", at::kLong, 1, d_rows);
  const int64_t num_rows = d_rows.size(0), hidden = d_rows.size(1);
  TORCH_CHECK(y.sizes() == d_rows.sizes(), "mok::moe_row_grad: y has shape ", y.sizes(),
              " but d_rows has shape ", d_rows.sizes(), "; they must match");
  TORCH_CHECK(w_rows.size(0) == num_rows && row_tok.size(0) == num_rows,
              "mok::moe_row_grad: w_rows ", w_rows.sizes(), " and row_tok ", row_tok.sizes(),
              " must both be [", num_rows, "] (one entry per row of d_rows)");
  TORCH_CHECK(hidden % 8 == 0 && hidden > 0, "mok::moe_row_grad: hidden=", hidden,
              " (d_rows.shape[1]) must be a positive multiple of 8 (16-byte bf16 vectors); pad it");
  TORCH_CHECK(num_rows == 0 || (is_aligned_16(d_rows) && is_aligned_16(y)),
              "mok::moe_row_grad: d_rows and y must start on a 16-byte boundary (a view at an "
              "odd offset is not); pass a fresh .contiguous() copy");
  c10::cuda::CUDAGuard guard(d_rows.device());
  auto d_row_w = at::empty({num_rows}, d_rows.options().dtype(at::kFloat));
  auto dy = at::empty({num_rows, hidden}, d_rows.options());
  launch::MoeRowGradArgs a;
  a.d_rows = d_rows.data_ptr();
  a.y = y.data_ptr();
  a.w_rows = w_rows.data_ptr<float>();
  a.row_tok = row_tok.data_ptr<int64_t>();
  a.d_row_w = d_row_w.data_ptr<float>();
  a.dy = dy.data_ptr();
  a.num_rows = num_rows;
  a.hidden = hidden;
  launch::moe_row_grad(a, c10::cuda::getCurrentCUDAStream(d_rows.device().index()).stream());
  return {d_row_w, dy};
}

}  // namespace mok::apis
