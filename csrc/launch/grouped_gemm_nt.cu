// out = a @ b[g]^T per group (the L2 forward: act @ W_down^T), and its flag-waiting variant.
#include "launch/grouped_gemm_impl.cuh"

namespace mok::launch {
namespace {
template <class Schedule, class Shape = gemm::ProblemShape>
using NTConfig = detail::Config<gemm::RowMajor, gemm::ColumnMajor,
                                gemm::PlainEpilogue<gemm::RowMajor, Schedule>, Schedule, Shape>;
template <class Schedule>
using NTWaitConfig = NTConfig<Schedule, gemm::FlagWaitProblemShape>;

gemm::GroupedProblemDesc nt_desc(const GroupedGemmArgs& args) {
  gemm::GroupedProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.n = args.n;
  desc.k = args.k;
  desc.a = {args.a, args.k, 0};
  desc.b = {args.b, 0, int64_t{args.n} * args.k};
  desc.d = {args.out, args.n, 0};
  return desc;
}
}  // namespace

void grouped_gemm_nt(const GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_nt");
  const gemm::GroupedProblemDesc desc = nt_desc(args);
  if (detail::tuning_from_env().pingpong) {
    detail::run_plain<NTConfig<gemm::Pingpong>>(desc, args.workspace, stream);
  } else {
    detail::run_plain<NTConfig<gemm::Cooperative>>(desc, args.workspace, stream);
  }
}

void grouped_gemm_nt_wait(const GroupedGemmArgs& args, const FlagWaitArgs& wait,
                          cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_nt_wait");
  detail::check_flag_wait(wait, "mok::grouped_gemm_nt_wait");
  const gemm::GroupedProblemDesc desc = nt_desc(args);
  const auto set_wait = [&](auto& scheduler) {
    scheduler.wait = detail::flag_wait_params(args, wait);
  };
  if (detail::tuning_from_env().pingpong) {
    using Config = NTWaitConfig<gemm::Pingpong>;
    detail::run_grouped<Config>(desc, args.workspace, stream,
                                [](const auto& a) { return detail::plain_epilogue<Config>(a); },
                                set_wait);
  } else {
    using Config = NTWaitConfig<gemm::Cooperative>;
    detail::run_grouped<Config>(desc, args.workspace, stream,
                                [](const auto& a) { return detail::plain_epilogue<Config>(a); },
                                set_wait);
  }
}

}  // namespace mok::launch
