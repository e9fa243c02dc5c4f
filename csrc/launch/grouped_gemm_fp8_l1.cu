// The blockwise-FP8 L1 forward: SwiGLU in the GEMM epilogue, then act quantised for the FP8 L2.
#include "launch/fp8_blockwise.h"
#include "launch/grouped_gemm_fp8_impl.cuh"
#include "mok/roles/epilogue_swiglu.cuh"

namespace mok::launch {
namespace {
using Epilogue = gemm::SwigluEpilogue<gemm::SwigluMode::kForward>;
using L1Config = detail::Fp8Config<Epilogue, gemm::Fp8Cooperative>;
}  // namespace

void grouped_gemm_fp8_l1_swiglu(const Fp8GroupedGemmArgs& args, cudaStream_t stream) {
  constexpr const char* kOp = "mok::grouped_gemm_fp8_l1_swiglu";
  detail::check_fp8(args, kOp);
  MOK_HOST_CHECK(!args.tuning.pingpong, "%s: the SwiGLU epilogue runs cooperative only", kOp);
  MOK_HOST_CHECK(args.n % (2 * gemm::kFp8ScaleBlock) == 0,
                 "%s: n=2I=%d must be a multiple of 256 (I a multiple of the 128-column act "
                 "blocks the FP8 L2 reads)",
                 kOp, args.n);
  void* act = args.out != nullptr ? args.out : args.act_scratch;
  MOK_HOST_CHECK(act != nullptr && args.act_q != nullptr && args.act_q_scales != nullptr,
                 "%s: null act (out or act_scratch), act_q or act_q_scales", kOp);
  gemm::Fp8ProblemDesc desc = detail::fp8_desc(args);
  const int inter = args.n / 2;
  desc.d = {act, inter, 0};
  desc.aux = {args.h, args.n, 0};
  detail::run_fp8<L1Config>(desc, args.workspace, args.tuning, stream, [&](const auto& arrays) {
    typename Epilogue::Arguments epi;
    epi.ptr_out = arrays.ptr_d;
    epi.ptr_aux = arrays.ptr_aux;
    epi.write_aux = args.h != nullptr;
    return epi;
  });
  Fp8BlockwiseQuantizeArgs quantize;
  quantize.input = act;
  quantize.input_type = Mxfp8InputType::kBFloat16;
  quantize.num_rows = args.num_rows;
  quantize.num_cols = inter;
  quantize.pow2 = args.act_q_pow2;
  quantize.data = static_cast<uint8_t*>(args.act_q);
  quantize.scales = args.act_q_scales;
  quantize.row_limit = args.offs + (args.num_groups - 1);  // rows past offs[-1] stay unwritten
  fp8_blockwise_quantize(quantize, stream);
}

}  // namespace mok::launch
