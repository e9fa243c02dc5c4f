// Kernels: the forward and the backward megakernel (sm_90a), one persistent launch per rank per
// pass each. Thin: their parameters and their shared memory. Every CTA runs GEMM tasks
// (roles/megakernel_compute.cuh), the first num_comm_ctas after pulling each round's rows
// (roles/megakernel_comm.cuh); task order, waits and the round barrier:
// roles/megakernel_tasks.cuh. Host launcher: launch/moe_megakernel.cu.
// NOTE: include from one translation unit only (it defines the __global__s).
#pragma once

#include <cstddef>
#include <cstdint>

#include "mok/roles/megakernel_comm.cuh"
#include "mok/roles/megakernel_compute.cuh"
#include "mok/roles/megakernel_tasks.cuh"

namespace mok::kernels {

constexpr int kMegaThreads = 384;  // producer warpgroup + two consumer warpgroups
static_assert(kMegaThreads == 128 + roles::kMegaConsumerThreads, "one producer warpgroup");
constexpr size_t kMegaSmemAlign = 1024;
constexpr size_t kMegaSmemBytes = sizeof(roles::MegaComputeStorage<false>) + kMegaSmemAlign;
constexpr size_t kSm90MaxSmemBytes = 227 * 1024;  // dynamic shared memory of one sm_90 CTA
static_assert(kMegaSmemBytes <= kSm90MaxSmemBytes,
              "the BF16 megakernels' stages, queues and wgrad boxes fit one CTA");
template <int kCluster>
constexpr bool one_smem_size() {
  return sizeof(roles::MegaComputeStorage<true, kCluster>) ==
             sizeof(roles::MegaComputeStorage<false>) &&
         sizeof(roles::MegaComputeStorage<false, kCluster>) ==
             sizeof(roles::MegaComputeStorage<false>);
}
static_assert(one_smem_size<1>() && one_smem_size<layout::kMaxClusterCtas>(),
              "one shared-memory size (and occupancy check) serves both megakernels, in every "
              "cluster size");
// The FP8 forward's: its own stages (roles/megakernel_fp8.cuh).
constexpr size_t kMegaFp8SmemBytes = sizeof(roles::MegaComputeStorage<false, 1, true>) + kMegaSmemAlign;

// Passed by value (__grid_constant__): the TMA descriptors stay in parameter space.
template <bool kBackward, int kCluster, bool kFp8 = false>
struct MegaKernelParams {
  roles::MegaParams p;
  roles::MegaParamsKind<kBackward, kCluster, kFp8> gemm;
};
static_assert(sizeof(MegaKernelParams<false, 1>) <= 4096 &&
                  sizeof(MegaKernelParams<false, 1, true>) <= 4096 &&
                  sizeof(MegaKernelParams<true, 1>) <= 4096 &&
                  sizeof(MegaKernelParams<false, layout::kMaxClusterCtas>) <= 4096 &&
                  sizeof(MegaKernelParams<true, layout::kMaxClusterCtas>) <= 4096,
              "kernel parameters must fit the classic 4 KB");

// The dynamic shared memory base, rounded up to kMegaSmemAlign (kMegaSmemBytes has the slack).
template <bool kBackward, int kCluster, bool kFp8 = false>
MOK_DEVICE roles::MegaComputeStorage<kBackward, kCluster, kFp8>& compute_storage(char* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t pad = (kMegaSmemAlign - addr % kMegaSmemAlign) % kMegaSmemAlign;
  return *reinterpret_cast<roles::MegaComputeStorage<kBackward, kCluster, kFp8>*>(smem + pad);
}

// kCluster: CTAs per cluster, 1 or 2 (launched with that cluster dimension; roles/
// megakernel_compute.cuh says what a cluster shares).
// NOTE: no function calls anywhere below (no printf, no 64-bit division): ptxas would ignore
// setmaxnreg and serialise wgmma.
template <int kCluster>
__global__ void __launch_bounds__(kMegaThreads, 1)
    moe_forward_megakernel(const __grid_constant__ MegaKernelParams<false, kCluster> params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  roles::cta_role<false, kCluster>(params.p, params.gemm, compute_storage<false, kCluster>(smem));
#endif
}

// The FP8 forward (MoKConfig.expert_precision="fp8_blockwise"): the same roles over FP8 rows and
// weights, no clusters (roles/megakernel_fp8.cuh).
__global__ void __launch_bounds__(kMegaThreads, 1)
    moe_forward_megakernel_fp8(const __grid_constant__ MegaKernelParams<false, 1, true> params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  roles::cta_role<false, 1, true>(params.p, params.gemm, compute_storage<false, 1, true>(smem));
#endif
}

// The backward's data gradients: d_out rows pulled into the ring, the L2 dgrad with the SwiGLU
// backward in its epilogue (d_h and the router-weight gradient's partials), then the L1 dgrad,
// whose rows go straight into their sources' slot_rows.
template <int kCluster>
__global__ void __launch_bounds__(kMegaThreads, 1)
    moe_backward_megakernel(const __grid_constant__ MegaKernelParams<true, kCluster> params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  roles::cta_role<true, kCluster>(params.p, params.gemm, compute_storage<true, kCluster>(smem));
#endif
}

}  // namespace mok::kernels
