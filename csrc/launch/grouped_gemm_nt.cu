// out = a @ b[g]^T per group (the L2 forward: act @ W_down^T).
#include "launch/grouped_gemm_impl.cuh"

namespace mok::launch {
namespace {
template <class Schedule>
using NTConfig = detail::Config<gemm::RowMajor, gemm::ColumnMajor,
                                gemm::PlainEpilogue<gemm::RowMajor, Schedule>, Schedule>;
}  // namespace

void grouped_gemm_nt(const GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_nt");
  gemm::GroupedProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.n = args.n;
  desc.k = args.k;
  desc.a = {args.a, args.k, 0};
  desc.b = {args.b, 0, int64_t{args.n} * args.k};
  desc.d = {args.out, args.n, 0};
  if (detail::tuning_from_env().pingpong) {
    detail::run_plain<NTConfig<gemm::Pingpong>>(desc, args.workspace, stream);
  } else {
    detail::run_plain<NTConfig<gemm::Cooperative>>(desc, args.workspace, stream);
  }
}

}  // namespace mok::launch
