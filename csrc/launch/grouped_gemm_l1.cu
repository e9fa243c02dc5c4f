// L1 forward with SwiGLU fused in the epilogue, and the shared workspace size.
#include "launch/grouped_gemm_impl.cuh"
#include "mok/roles/epilogue_swiglu.cuh"

namespace mok::launch {
namespace {
using Epilogue = gemm::SwigluEpilogue<gemm::SwigluMode::kForward>;
using L1Config = detail::Config<gemm::RowMajor, gemm::ColumnMajor, Epilogue>;
}  // namespace

size_t grouped_gemm_workspace_bytes(int num_groups) {
  return detail::arrays_bytes(num_groups) +
         detail::kCutlassWorkspaceBytesPerSm * detail::sm_count_of_current_device();
}

void grouped_gemm_l1_swiglu(const GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_l1_swiglu");
  MOK_HOST_CHECK(args.n % 16 == 0, "mok::grouped_gemm_l1_swiglu: n=2I=%d must be a multiple of 16",
                 args.n);
  gemm::GroupedProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.n = args.n;
  desc.k = args.k;
  desc.a = {args.a, args.k, 0};
  desc.b = {args.b, 0, int64_t{args.n} * args.k};
  desc.d = {args.out, args.n / 2, 0};
  desc.aux = {args.aux, args.n, 0};
  const bool write_h = args.aux != nullptr;
  detail::run_grouped<L1Config>(desc, args.workspace, stream, [&](const auto& arrays) {
    typename Epilogue::Arguments epi;
    epi.ptr_out = arrays.ptr_d;
    epi.ptr_aux = arrays.ptr_aux;
    epi.write_aux = write_h;
    return epi;
  });
}

}  // namespace mok::launch
