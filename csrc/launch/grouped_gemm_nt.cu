// out = a @ b[g]^T per group (the L2 forward: act @ W_down^T), and its flag-waiting variant.
#include "launch/grouped_gemm_impl.cuh"

namespace mok::launch {
namespace {
template <class Schedule, class Shape = gemm::ProblemShape>
using NTConfig = detail::Config<gemm::RowMajor, gemm::ColumnMajor,
                                gemm::PlainEpilogue<gemm::RowMajor, Schedule>, Schedule, Shape>;
template <class Schedule>
using NTPlainConfig = NTConfig<Schedule>;
template <class Schedule>
using NTWaitConfig = NTConfig<Schedule, gemm::FlagWaitProblemShape>;
}  // namespace

void grouped_gemm_nt(const GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_nt");
  detail::run_plain_tuned<NTPlainConfig>(detail::rows_in_m_desc(args), args, stream);
}

void grouped_gemm_nt_wait(const GroupedGemmArgs& args, const FlagWaitArgs& wait,
                          cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_nt_wait");
  detail::check_flag_wait(wait, "mok::grouped_gemm_nt_wait");
  const gemm::GroupedProblemDesc desc = detail::rows_in_m_desc(args);
  const auto set_wait = [&](auto& scheduler) {
    scheduler.wait = detail::flag_wait_params(args, wait);
  };
  detail::with_schedule(args.tuning, [&](auto tag) {
    using Config = NTWaitConfig<typename decltype(tag)::type>;
    detail::run_grouped<Config>(desc, args.workspace, args.tuning, stream,
                                [](const auto& a) { return detail::plain_epilogue<Config>(a); },
                                set_wait);
  });
}

}  // namespace mok::launch
