// Accumulating weight gradient: acc[g] += a_g^T @ b_g over group g's rows, in the GEMM's epilogue
// (Megatron's gradient-accumulation fusion: acc is the fp32 main_grad; or a bf16 .grad summed over
// macrobatch rounds). The mainloop is the plain weight gradient's (grouped_gemm_tn.cu), so
// acc_before + its fp32 accumulator, rounded once to acc's type, is what lands (for fp32 added by
// the L2 through TMA reduce-add); a group without rows has no tiles and its part of acc is left
// untouched.
#include <type_traits>

#include "launch/grouped_gemm_impl.cuh"

namespace mok::launch {
namespace {
// fp32 (main_grad): the sourceless epilogue whose store is a TMA reduce-add (the L2 adds the tile
// into the accumulator; gemm::ReduceAddEpilogue). bf16: D = C + accumulator, C read back by the
// epilogue (gemm::AccumulateEpilogue), the sum rounded once to bf16.
template <class Schedule, class ElementAcc>
using TNAccumulateConfig = std::conditional_t<
    std::is_same_v<ElementAcc, gemm::AccumElement>,
    detail::Config<gemm::ColumnMajor, gemm::RowMajor,
                   gemm::ReduceAddEpilogue<gemm::RowMajor, Schedule>, Schedule,
                   gemm::ProblemShape, ElementAcc>,
    detail::Config<gemm::ColumnMajor, gemm::RowMajor,
                   gemm::AccumulateEpilogue<gemm::RowMajor, Schedule, ElementAcc>, Schedule,
                   gemm::ProblemShape, ElementAcc>>;

template <class Schedule, class ElementAcc>
void run_accumulate(const gemm::GroupedProblemDesc& desc, const GroupedGemmArgs& args,
                    cudaStream_t stream) {
  using Config = TNAccumulateConfig<Schedule, ElementAcc>;
  detail::run_grouped<Config>(desc, args.workspace, args.tuning, stream, [](const auto& arrays) {
    if constexpr (std::is_same_v<ElementAcc, gemm::AccumElement>) {
      return detail::plain_epilogue<Config>(arrays);  // D = accumulator, reduce-added into D
    } else {
      return detail::accumulate_epilogue<Config>(arrays);
    }
  });
}

template <class ElementAcc>
void accumulate_into(const GroupedGemmArgs& args, cudaStream_t stream, const char* op) {
  detail::check_common(args, op);
  MOK_HOST_CHECK(reinterpret_cast<uintptr_t>(args.out) % 16 == 0,
                 "%s: the accumulator must be 16-byte aligned (TMA)", op);
  gemm::GroupedProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.rows = gemm::GroupedRows::kRowsInK;  // a group without rows gets M = 0: no tiles
  desc.m = args.m;
  desc.n = args.n;
  desc.a = {args.a, args.m, 0};
  desc.b = {args.b, args.n, 0};
  desc.d = {args.out, 0, int64_t{args.m} * args.n};  // ElementAcc elements (Config::ElementD)
  if (args.tuning.pingpong) {
    run_accumulate<gemm::Pingpong, ElementAcc>(desc, args, stream);
  } else {
    run_accumulate<gemm::Cooperative, ElementAcc>(desc, args, stream);
  }
}
}  // namespace

void grouped_gemm_tn_accumulate(const GroupedGemmArgs& args, cudaStream_t stream) {
  accumulate_into<gemm::AccumElement>(args, stream, "mok::grouped_gemm_tn_accumulate");
}

void grouped_gemm_tn_accumulate_bf16(const GroupedGemmArgs& args, cudaStream_t stream) {
  accumulate_into<gemm::Element>(args, stream, "mok::grouped_gemm_tn_accumulate (bf16)");
}

}  // namespace mok::launch
