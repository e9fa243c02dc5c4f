// out = dequant(a) @ dequant(b[g])^T per group, blockwise FP8 (the FP8 L2 forward), and the FP8
// launchers' shared workspace size.
#include "launch/grouped_gemm_fp8_impl.cuh"

namespace mok::launch {
namespace {
template <class Schedule>
using NTConfig = detail::Fp8Config<gemm::PlainEpilogue<gemm::RowMajor, Schedule>, Schedule>;

template <class Config>
void run_nt(const Fp8GroupedGemmArgs& args, cudaStream_t stream) {
  gemm::Fp8ProblemDesc desc = detail::fp8_desc(args);
  desc.d = {args.out, args.n, 0};
  detail::run_fp8<Config>(desc, args.workspace, args.tuning, stream,
                          [](const auto& arrays) { return detail::plain_epilogue<Config>(arrays); });
}
}  // namespace

size_t grouped_gemm_fp8_workspace_bytes(int num_groups) {
  return detail::AnyFp8Arrays::bytes(num_groups) +
         detail::kCutlassWorkspaceBytesPerSm * detail::sm_count_of_current_device();
}

void grouped_gemm_fp8_nt(const Fp8GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_fp8(args, "mok::grouped_gemm_fp8_nt");
  MOK_HOST_CHECK(args.out != nullptr, "mok::grouped_gemm_fp8_nt: null out");
  if (args.tuning.pingpong) {
    run_nt<NTConfig<gemm::Fp8Pingpong>>(args, stream);
  } else {
    run_nt<NTConfig<gemm::Fp8Cooperative>>(args, stream);
  }
}

}  // namespace mok::launch
