// Weight gradient: out[g] = a_g^T @ b_g over group g's rows (K = rows, reduced in order by one
// CTA per output tile: deterministic, no split-K).
#include "launch/grouped_gemm_impl.cuh"

namespace mok::launch {
namespace {
template <class Schedule>
using TNConfig = detail::Config<gemm::ColumnMajor, gemm::RowMajor,
                                gemm::PlainEpilogue<gemm::RowMajor, Schedule>, Schedule>;
}  // namespace

void grouped_gemm_tn(const GroupedGemmArgs& args, cudaStream_t stream) {
  detail::check_common(args, "mok::grouped_gemm_tn");
  gemm::GroupedProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.rows = gemm::GroupedRows::kRowsInK;
  desc.m = args.m;
  desc.n = args.n;
  desc.a = {args.a, args.m, 0};
  desc.b = {args.b, args.n, 0};
  desc.d = {args.out, 0, int64_t{args.m} * args.n};
  const int64_t group_elems = int64_t{args.m} * args.n;
  constexpr int kThreads = 256;
  const int64_t blocks_per_group =
      std::min<int64_t>(64, (group_elems / 8 + kThreads - 1) / kThreads);
  const dim3 zero_grid(static_cast<unsigned>(blocks_per_group), args.num_groups);
  gemm::zero_empty_groups<gemm::Element><<<zero_grid, kThreads, 0, stream>>>(
      args.offs, static_cast<gemm::Element*>(args.out), group_elems);
  MOK_CUDA_CHECK(cudaGetLastError());
  detail::run_plain_tuned<TNConfig, /*kHasCluster2=*/true>(desc, args, stream);
}

}  // namespace mok::launch
