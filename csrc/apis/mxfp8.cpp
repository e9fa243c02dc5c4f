#include "apis/mxfp8.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <vector>

#include "apis/quantize_input.h"
#include "launch/mxfp8.h"

namespace mok::apis {
namespace {

constexpr int64_t kBlockSize = 32;  // mirrors mok::mxfp8::kBlockSize

launch::Mxfp8InputType input_type_of(const at::Tensor& w) {
  return quantize_input_type(w, "mok::mxfp8_quantize", "w");
}

void check_input(const at::Tensor& w, bool rowwise, bool colwise) {
  TORCH_CHECK(rowwise || colwise, "mok::mxfp8_quantize: ask for rowwise and/or colwise output");
  TORCH_CHECK(w.is_cuda(), "mok::mxfp8_quantize: w must be a CUDA tensor, got ", w.device());
  TORCH_CHECK(w.dim() >= 2, "mok::mxfp8_quantize: w must have at least 2 dims, got shape ",
              w.sizes());
  TORCH_CHECK(w.is_contiguous(), "mok::mxfp8_quantize: w must be contiguous; call .contiguous()");
  input_type_of(w);
  TORCH_CHECK(!rowwise || w.size(-1) % kBlockSize == 0, "mok::mxfp8_quantize: rowwise blocks ",
              kBlockSize, " elements of the last dim, but w.shape[-1]=", w.size(-1),
              " is not a multiple of ", kBlockSize, "; pad it");
  TORCH_CHECK(!colwise || w.size(-2) % kBlockSize == 0, "mok::mxfp8_quantize: colwise blocks ",
              kBlockSize, " elements of dim -2, but w.shape[-2]=", w.size(-2),
              " is not a multiple of ", kBlockSize, "; pad it");
}

std::vector<int64_t> row_scale_shape(const at::Tensor& w) {
  std::vector<int64_t> shape(w.sizes().begin(), w.sizes().end());
  shape.back() /= kBlockSize;
  return shape;
}

std::vector<int64_t> col_scale_shape(const at::Tensor& w) {
  std::vector<int64_t> shape(w.sizes().begin(), w.sizes().end());
  shape[shape.size() - 2] /= kBlockSize;
  return shape;
}

void check_output(const char* name, const at::Tensor& out, const at::Tensor& w,
                  at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(out.device() == w.device(), "mok::mxfp8_quantize_out: ", name, " is on ",
              out.device(), " but w is on ", w.device());
  TORCH_CHECK(out.scalar_type() == dtype, "mok::mxfp8_quantize_out: ", name, ".dtype=",
              out.scalar_type(), " must be ", dtype);
  TORCH_CHECK(out.sizes() == shape, "mok::mxfp8_quantize_out: ", name, ".shape=", out.sizes(),
              " must be ", shape);
  TORCH_CHECK(out.is_contiguous(), "mok::mxfp8_quantize_out: ", name, " must be contiguous");
}

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

}  // namespace

void mxfp8_quantize_out(const at::Tensor& w, bool rowwise, bool colwise,
                        const at::Tensor& row_data, const at::Tensor& row_scales,
                        const at::Tensor& col_data, const at::Tensor& col_scales) {
  check_input(w, rowwise, colwise);
  launch::Mxfp8QuantizeArgs args;
  args.input = w.data_ptr();
  args.input_type = input_type_of(w);
  args.num_cols = w.size(-1);
  args.num_rows = w.numel() == 0 ? 0 : w.numel() / args.num_cols;
  if (rowwise) {
    check_output("row_data", row_data, w, w.sizes(), at::kFloat8_e4m3fn);
    check_output("row_scales", row_scales, w, row_scale_shape(w), at::kByte);
    args.row_data = bytes_of(row_data);
    args.row_scales = bytes_of(row_scales);
  }
  if (colwise) {
    check_output("col_data", col_data, w, w.sizes(), at::kFloat8_e4m3fn);
    check_output("col_scales", col_scales, w, col_scale_shape(w), at::kByte);
    args.col_data = bytes_of(col_data);
    args.col_scales = bytes_of(col_scales);
  }
  const c10::cuda::CUDAGuard device_guard(w.device());
  launch::mxfp8_quantize(args, c10::cuda::getCurrentCUDAStream(w.device().index()).stream());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mxfp8_quantize(const at::Tensor& w,
                                                                          bool rowwise,
                                                                          bool colwise) {
  check_input(w, rowwise, colwise);
  const auto data_options = w.options().dtype(at::kFloat8_e4m3fn);
  const auto scale_options = w.options().dtype(at::kByte);
  const auto empty_data = [&] { return at::empty({0}, data_options); };
  const auto empty_scales = [&] { return at::empty({0}, scale_options); };
  at::Tensor row_data = rowwise ? at::empty(w.sizes(), data_options) : empty_data();
  at::Tensor row_scales = rowwise ? at::empty(row_scale_shape(w), scale_options) : empty_scales();
  at::Tensor col_data = colwise ? at::empty(w.sizes(), data_options) : empty_data();
  at::Tensor col_scales = colwise ? at::empty(col_scale_shape(w), scale_options) : empty_scales();
  mxfp8_quantize_out(w, rowwise, colwise, row_data, row_scales, col_data, col_scales);
  return {row_data, row_scales, col_data, col_scales};
}

}  // namespace mok::apis
