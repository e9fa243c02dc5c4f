// out = a @ b[g] per group (the L1 data gradient: d_h @ W_gu).
#include "launch/grouped_gemm_impl.cuh"

namespace mok::launch {
namespace {
template <class Schedule>
using NNConfig = detail::Config<gemm::RowMajor, gemm::RowMajor,
                                gemm::PlainEpilogue<gemm::RowMajor, Schedule>, Schedule>;
}  // namespace

void grouped_gemm_nn(const GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_nn");
  detail::run_plain_tuned<NNConfig>(detail::rows_in_m_desc(args), args, stream);
}

}  // namespace mok::launch
