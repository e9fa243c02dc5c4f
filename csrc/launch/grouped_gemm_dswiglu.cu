// L2 data gradient with the SwiGLU backward fused in the epilogue: d_act = d_y @ W_down[g],
// then d_h = dSwiGLU(d_act, h) (and act recomputed, if asked).
#include "launch/grouped_gemm_impl.cuh"
#include "mok/roles/epilogue_swiglu.cuh"

namespace mok::launch {
namespace {
using Epilogue = gemm::SwigluEpilogue<gemm::SwigluMode::kBackward>;
using DSwigluConfig = detail::Config<gemm::RowMajor, gemm::RowMajor, Epilogue>;
}  // namespace

void grouped_gemm_dswiglu(const GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_dswiglu");
  detail::check_cooperative(args, "mok::grouped_gemm_dswiglu");
  MOK_HOST_CHECK(args.aux != nullptr, "mok::grouped_gemm_dswiglu: h (aux) is required");
  gemm::GroupedProblemDesc desc = detail::rows_in_m_desc(args);
  desc.d = {args.out, 2 * int64_t{args.n}, 0};  // d_h [rows, 2I]
  desc.aux = {args.aux, 2 * int64_t{args.n}, 0};
  desc.aux2 = {args.aux2, args.n, 0};
  const bool write_act = args.aux2 != nullptr;
  detail::run_grouped<DSwigluConfig>(
      desc, args.workspace, args.tuning, stream, [&](const auto& arrays) {
        typename Epilogue::Arguments epi;
        epi.ptr_out = arrays.ptr_d;
        epi.ptr_aux = arrays.ptr_aux;
        epi.ptr_aux2 = arrays.ptr_aux2;
        epi.write_aux2 = write_act;
        return epi;
      });
}

}  // namespace mok::launch
