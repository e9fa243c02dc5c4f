// Thin wrappers over the PTX instructions the kernels use: streaming global loads and stores,
// acquire/release flag accesses and proxy fences, and the float32 -> fp8 conversion. Torch-free;
// device only.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::ptx {

// Chained launches (Hopper's programmatic dependent launch; launch/chain.h launches them): a
// kernel launched chained may start while the kernel before it on the stream still runs.
// chain_wait() returns once that kernel has finished and its writes are visible; before it, the
// kernel has the GPU's attention but none of the previous kernel's results. Outside a chained
// launch (or before sm_90) both calls do nothing.
// NOTE: every thread of a kernel launched chained calls chain_wait() before it touches global
// memory and before any early return: a kernel whose CTAs all returned without it could finish
// before the kernel it follows, and the next kernel's wait would not cover that one.
MOK_DEVICE void chain_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream start now (it still waits for this one in chain_wait).
// NOTE: never in a kernel that waits for other CTAs or ranks (a barrier, the megakernels): the
// next kernel's CTAs would hold SMs while this one waits, and a peer kernel on the same GPU
// (virtual ranks) could be kept from the SMs it waits with.
MOK_DEVICE void chain_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of a kernel that only reads what kernels before it wrote: wait for them, then let
// the next kernel start.
MOK_DEVICE void chain_begin() {
  chain_wait();
  chain_release();
}

// 16-byte read-only global load that does not allocate in L1 (data read exactly once).
MOK_DEVICE uint4 ld_global_nc_v4(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

MOK_DEVICE void st_global_v2(void* ptr, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(ptr), "r"(v.x), "r"(v.y) : "memory");
}

MOK_DEVICE void st_global_u32(void* ptr, uint32_t v) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Flag accesses at GPU scope: a release store orders this thread's earlier writes (and, through a
// preceding barrier, its CTA's) before the flag; an acquire load orders later reads after it.
MOK_DEVICE int32_t ld_acquire_gpu(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

// A poll that does not acquire (an acquire load also invalidates the SM's L1 on sm_90): once the
// awaited value is seen, one fence_acq_rel_gpu makes it an acquire.
MOK_DEVICE int32_t ld_relaxed_gpu(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

MOK_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

MOK_DEVICE void st_release_gpu(int32_t* ptr, int32_t value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// Orders this thread's generic-proxy global accesses against its async-proxy (TMA) ones.
MOK_DEVICE void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// `count` arrivals at once on the shared-memory mbarrier at `smem_bar` (its current phase).
MOK_DEVICE void mbarrier_arrive_count(uint32_t smem_bar, uint32_t count) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_bar),
               "r"(count)
               : "memory");
}

// A hint: the 128-byte line holding ptr into this SM's L1 (no register held, nothing waits).
MOK_DEVICE void prefetch_global_l1(const void* ptr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
}

// 16 bytes global -> shared, asynchronously (cp.async, L2 only): `src_bytes` of them read from
// `src` (16 or 0), the rest zero-filled. Completion: cp.async.mbarrier.arrive or wait_group.
MOK_DEVICE void cp_async_16_zfill(uint32_t smem_dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// 4 bytes global -> shared, asynchronously (cp.async.ca: the 4-byte form caches in L1): `src_bytes`
// of them read from `src` (4 or 0), the rest zero-filled.
MOK_DEVICE void cp_async_4_zfill(uint32_t smem_dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// Waits for all of this thread's cp.async copies.
MOK_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// A hint: the 128-byte line holding ptr into L2 (no register held, nothing waits).
MOK_DEVICE void prefetch_global_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// Named barrier `id` over `threads` threads of the CTA (id 0 is __syncthreads's).
MOK_DEVICE void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at named barrier `id` over `threads` threads without waiting for it.
MOK_DEVICE void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Two floats -> two float8_e4m3fn bytes (lo in bits 0..7), round-to-nearest-even, saturating to
// +-448. NOTE: callers clamp to [-448, 448] and handle NaN themselves, so saturation never
// changes a result; the sign of zero is kept.
MOK_DEVICE uint16_t cvt_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(out) : "f"(lo), "f"(hi));
  return out;
#else
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE,
                                                        __NV_E4M3));
#endif
}

}  // namespace mok::ptx
