// Accumulating weight gradient: acc[g] += a_g^T @ b_g over group g's rows, in the GEMM's epilogue
// (Megatron's gradient-accumulation fusion: acc is the fp32 main_grad; or a bf16 .grad summed over
// macrobatch rounds). The mainloop is the plain weight gradient's (grouped_gemm_tn.cu), so
// acc_before + its fp32 accumulator, rounded once to acc's type, is what lands (read back by the
// epilogue, or for fp32 added by the L2 through TMA reduce-add: AccumulateStore); a group without
// rows has no tiles and its part of acc is left untouched.
#include <type_traits>

#include "launch/grouped_gemm_impl.cuh"

namespace mok::launch {
namespace {
// Where the accumulator's tile is added (every choice lands the same bits: old + the tile's fp32
// sum, rounded once to the accumulator's type):
//   kLoad   gemm::AccumulateEpilogue: D = C + accumulator with C = D, the tile read back by the
//           epilogue (fp32 or bf16);
//   kReduce gemm::ReduceAddEpilogue: D = accumulator, sent by TMA reduce-add, the L2 adding it
//           into the buffer (fp32 only: a bf16 reduce would round the accumulator first).
template <class Schedule, class ElementAcc, AccumulateStore kStore>
using TNAccumulateConfig = std::conditional_t<
    kStore == AccumulateStore::kReduce,
    detail::Config<gemm::ColumnMajor, gemm::RowMajor,
                   gemm::ReduceAddEpilogue<gemm::RowMajor, Schedule>, Schedule,
                   gemm::ProblemShape, ElementAcc>,
    detail::Config<gemm::ColumnMajor, gemm::RowMajor,
                   gemm::AccumulateEpilogue<gemm::RowMajor, Schedule, ElementAcc>, Schedule,
                   gemm::ProblemShape, ElementAcc>>;

template <class Schedule, class ElementAcc, AccumulateStore kStore>
void run_accumulate(const gemm::GroupedProblemDesc& desc, const GroupedGemmArgs& args,
                    cudaStream_t stream) {
  static_assert(kStore != AccumulateStore::kAuto);
  static_assert(kStore == AccumulateStore::kLoad || std::is_same_v<ElementAcc, gemm::AccumElement>);
  using Config = TNAccumulateConfig<Schedule, ElementAcc, kStore>;
  detail::run_grouped<Config>(desc, args.workspace, args.tuning, stream, [](const auto& arrays) {
    if constexpr (kStore == AccumulateStore::kReduce) {
      return detail::plain_epilogue<Config>(arrays);  // D = accumulator, reduce-added into D
    } else {
      return detail::accumulate_epilogue<Config>(arrays);
    }
  });
}

template <AccumulateStore kStore, class ElementAcc>
void run_scheduled(const gemm::GroupedProblemDesc& desc, const GroupedGemmArgs& args,
                   cudaStream_t stream) {
  detail::with_schedule</*kHasCluster2=*/true>(args.tuning, [&](auto tag) {
    run_accumulate<typename decltype(tag)::type, ElementAcc, kStore>(desc, args, stream);
  });
}

// The problem: group g's rows are the K of its [m, n] sum; a group without rows gets M = 0 (no
// tiles), so its part of the accumulator is never touched.
gemm::GroupedProblemDesc accumulate_desc(const GroupedGemmArgs& args, const char* op) {
  detail::check_common(args, op);
  MOK_HOST_CHECK(reinterpret_cast<uintptr_t>(args.out) % 16 == 0,
                 "%s: the accumulator must be 16-byte aligned (TMA)", op);
  gemm::GroupedProblemDesc desc;
  desc.offs = args.offs;
  desc.num_groups = args.num_groups;
  desc.rows = gemm::GroupedRows::kRowsInK;
  desc.m = args.m;
  desc.n = args.n;
  desc.a = {args.a, args.m, 0};
  desc.b = {args.b, args.n, 0};
  desc.d = {args.out, 0, int64_t{args.m} * args.n};  // accumulator elements (Config::ElementD)
  return desc;
}
}  // namespace

void grouped_gemm_tn_accumulate(const GroupedGemmArgs& args, AccumulateStore store, int64_t rows,
                                cudaStream_t stream) {
  constexpr const char* kOp = "mok::grouped_gemm_tn_accumulate";
  const auto desc = accumulate_desc(args, kOp);
  if (store == AccumulateStore::kAuto) {
    store = rows >= int64_t{kReduceAddMinRowsPerGroup} * args.num_groups ? AccumulateStore::kReduce
                                                                          : AccumulateStore::kLoad;
  }
  if (store == AccumulateStore::kReduce) {
    run_scheduled<AccumulateStore::kReduce, gemm::AccumElement>(desc, args, stream);
  } else {
    run_scheduled<AccumulateStore::kLoad, gemm::AccumElement>(desc, args, stream);
  }
}

void grouped_gemm_tn_accumulate_bf16(const GroupedGemmArgs& args, cudaStream_t stream) {
  const auto desc = accumulate_desc(args, "mok::grouped_gemm_tn_accumulate (bf16)");
  run_scheduled<AccumulateStore::kLoad, gemm::Element>(desc, args, stream);
}

}  // namespace mok::launch
