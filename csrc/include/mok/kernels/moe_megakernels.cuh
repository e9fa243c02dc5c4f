// Kernel: the forward megakernel (sm_90a), one persistent launch per rank per pass. Thin: its
// parameters and its shared memory. Every CTA runs GEMM tasks (roles/megakernel_compute.cuh), the
// first num_comm_ctas after pulling each round's rows (roles/megakernel_comm.cuh); task order,
// waits and the round barrier: roles/megakernel_tasks.cuh. Host launcher: launch/moe_megakernel.cu.
// NOTE: include from one translation unit only (it defines the __global__).
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
constexpr size_t kMegaSmemBytes = sizeof(roles::MegaComputeStorage) + kMegaSmemAlign;

// Passed by value (__grid_constant__): the TMA descriptors stay in parameter space.
struct MegaKernelParams {
  roles::MegaParams p;
  gemm::MegaGemmParams gemm;
};
static_assert(sizeof(MegaKernelParams) <= 4096, "kernel parameters must fit the classic 4 KB");

// The dynamic shared memory base, rounded up to kMegaSmemAlign (kMegaSmemBytes has the slack).
MOK_DEVICE roles::MegaComputeStorage& compute_storage(char* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t pad = (kMegaSmemAlign - addr % kMegaSmemAlign) % kMegaSmemAlign;
  return *reinterpret_cast<roles::MegaComputeStorage*>(smem + pad);
}

// NOTE: no function calls anywhere below (no printf, no 64-bit division): ptxas would ignore
// setmaxnreg and serialise wgmma.
__global__ void __launch_bounds__(kMegaThreads, 1)
    moe_forward_megakernel(const __grid_constant__ MegaKernelParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  roles::cta_role(params.p, params.gemm, compute_storage(smem));
#endif
}

}  // namespace mok::kernels
