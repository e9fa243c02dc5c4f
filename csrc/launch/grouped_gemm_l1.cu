// L1 forward with SwiGLU fused in the epilogue (and its flag-waiting variant), and the shared
// workspace size.
#include "launch/grouped_gemm_impl.cuh"
#include "mok/roles/epilogue_swiglu.cuh"

namespace mok::launch {
namespace {
using Epilogue = gemm::SwigluEpilogue<gemm::SwigluMode::kForward>;
using L1Config = detail::Config<gemm::RowMajor, gemm::ColumnMajor, Epilogue>;
using L1WaitConfig = detail::Config<gemm::RowMajor, gemm::ColumnMajor, Epilogue, gemm::Cooperative,
                                    gemm::FlagWaitProblemShape>;

void check_l1(const GroupedGemmArgs& args, const char* op) {
  detail::check_common(args, op);
  detail::check_cooperative(args, op);
  MOK_HOST_CHECK(args.n % 16 == 0, "%s: n=2I=%d must be a multiple of 16", op, args.n);
}

gemm::GroupedProblemDesc l1_desc(const GroupedGemmArgs& args) {
  gemm::GroupedProblemDesc desc = detail::rows_in_m_desc(args);
  desc.d = {args.out, args.n / 2, 0};  // act [rows, I]
  desc.aux = {args.aux, args.n, 0};
  return desc;
}

template <class Config, class SetScheduler = detail::DefaultScheduler>
void run_l1(const GroupedGemmArgs& args, cudaStream_t stream, SetScheduler set_scheduler = {}) {
  const bool write_h = args.aux != nullptr;
  detail::run_grouped<Config>(
      l1_desc(args), args.workspace, args.tuning, stream,
      [&](const auto& arrays) {
        typename Epilogue::Arguments epi;
        epi.ptr_out = arrays.ptr_d;
        epi.ptr_aux = arrays.ptr_aux;
        epi.write_aux = write_h;
        return epi;
      },
      set_scheduler);
}
}  // namespace

size_t grouped_gemm_workspace_bytes(int num_groups) {
  return detail::arrays_bytes(num_groups) +
         detail::kCutlassWorkspaceBytesPerSm * detail::sm_count_of_current_device();
}

void grouped_gemm_l1_swiglu(const GroupedGemmArgs& args, cudaStream_t stream) {
  check_l1(args, "mok::grouped_gemm_l1_swiglu");
  run_l1<L1Config>(args, stream);
}

void grouped_gemm_l1_swiglu_wait(const GroupedGemmArgs& args, const FlagWaitArgs& wait,
                                 cudaStream_t stream) {
  check_l1(args, "mok::grouped_gemm_l1_swiglu_wait");
  detail::check_flag_wait(wait, "mok::grouped_gemm_l1_swiglu_wait");
  run_l1<L1WaitConfig>(args, stream, [&](auto& scheduler) {
    scheduler.wait = detail::flag_wait_params(args, wait);
  });
}

}  // namespace mok::launch
