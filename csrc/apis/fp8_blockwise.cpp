#include "apis/fp8_blockwise.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <vector>

#include "apis/quantize_input.h"
#include "launch/fp8_blockwise.h"

namespace mok::apis {
namespace {

constexpr int64_t kBlock = 128;  // mirrors mok::fp8_blockwise::kBlock

launch::Mxfp8InputType input_type_of(const at::Tensor& x) {
  return quantize_input_type(x, "mok::fp8_blockwise_quantize", "x");
}

void check_input(const at::Tensor& x, int64_t block_rows, int64_t block_cols) {
  const bool known = (block_rows == 1 && block_cols == kBlock) ||
                     (block_rows == kBlock && block_cols == 1) ||
                     (block_rows == kBlock && block_cols == kBlock);
  TORCH_CHECK(known, "mok::fp8_blockwise_quantize: block (", block_rows, ", ", block_cols,
              ") is not (1, 128), (128, 1) or (128, 128)");
  TORCH_CHECK(x.is_cuda(), "mok::fp8_blockwise_quantize: x must be a CUDA tensor, got ",
              x.device());
  TORCH_CHECK(x.dim() >= 2, "mok::fp8_blockwise_quantize: x must have at least 2 dims, got ",
              x.sizes());
  TORCH_CHECK(x.is_contiguous(), "mok::fp8_blockwise_quantize: x must be contiguous");
  input_type_of(x);
  TORCH_CHECK(x.size(-2) % block_rows == 0 && x.size(-1) % block_cols == 0,
              "mok::fp8_blockwise_quantize: x.shape=", x.sizes(), " is not a whole number of (",
              block_rows, ", ", block_cols, ") blocks; pad it");
}

std::vector<int64_t> scale_shape(const at::Tensor& x, int64_t block_rows, int64_t block_cols) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[shape.size() - 2] /= block_rows;
  shape.back() /= block_cols;
  return shape;
}

void check_output(const char* name, const at::Tensor& out, const at::Tensor& x,
                  at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(out.device() == x.device(), "mok::fp8_blockwise_quantize_out: ", name, " is on ",
              out.device(), " but x is on ", x.device());
  TORCH_CHECK(out.scalar_type() == dtype, "mok::fp8_blockwise_quantize_out: ", name, ".dtype=",
              out.scalar_type(), " must be ", dtype);
  TORCH_CHECK(out.sizes() == shape, "mok::fp8_blockwise_quantize_out: ", name, ".shape=",
              out.sizes(), " must be ", shape);
  TORCH_CHECK(out.is_contiguous(), "mok::fp8_blockwise_quantize_out: ", name,
              " must be contiguous");
}

}  // namespace

void fp8_blockwise_quantize_out(const at::Tensor& x, int64_t block_rows, int64_t block_cols,
                                bool pow2_scales, const at::Tensor& data,
                                const at::Tensor& scales) {
  check_input(x, block_rows, block_cols);
  check_output("data", data, x, x.sizes(), at::kFloat8_e4m3fn);
  check_output("scales", scales, x, scale_shape(x, block_rows, block_cols), at::kFloat);
  launch::Fp8BlockwiseQuantizeArgs args;
  args.input = x.data_ptr();
  args.input_type = input_type_of(x);
  args.num_cols = x.size(-1);
  args.num_rows = x.numel() == 0 ? 0 : x.numel() / args.num_cols;
  args.block_rows = static_cast<int>(block_rows);
  args.block_cols = static_cast<int>(block_cols);
  args.pow2 = pow2_scales;
  args.data = static_cast<uint8_t*>(data.data_ptr());
  args.scales = scales.data_ptr<float>();
  const c10::cuda::CUDAGuard device_guard(x.device());
  launch::fp8_blockwise_quantize(args,
                                 c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

std::tuple<at::Tensor, at::Tensor> fp8_blockwise_quantize(const at::Tensor& x, int64_t block_rows,
                                                          int64_t block_cols, bool pow2_scales) {
  check_input(x, block_rows, block_cols);
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales =
      at::empty(scale_shape(x, block_rows, block_cols), x.options().dtype(at::kFloat));
  fp8_blockwise_quantize_out(x, block_rows, block_cols, pow2_scales, data, scales);
  return {data, scales};
}

}  // namespace mok::apis
