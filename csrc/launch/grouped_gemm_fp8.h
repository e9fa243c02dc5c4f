// Torch-free host launchers for the blockwise-FP8 grouped GEMMs on sm_90a (issue 15): plain
// pointers, sizes and a stream; every launch is asynchronous (no host synchronisation).
//
// Groups follow launch/grouped_gemm.h (offs[g] = the END row of group g, int32 on the device).
// Operands are e4m3 with float32 scales in the layouts of roles/grouped_gemm_fp8_config.cuh:
// a [rows, k] with a_scales [rows, k / 128]; b [G, n, k] with b_scales [G, n / 128, k / 128].
// k and n are multiples of 128; bases 16-byte aligned; the output is bf16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "launch/grouped_gemm.h"  // GemmTuning

namespace mok::launch {

struct Fp8GroupedGemmArgs {
  const void* a = nullptr;  // e4m3 [rows, k]
  const float* a_scales = nullptr;
  const void* b = nullptr;  // e4m3 [G, n, k]
  const float* b_scales = nullptr;
  const int32_t* offs = nullptr;
  int num_groups = 0;
  int64_t num_rows = 0;  // rows of a (the L1 op's quantisation pass)
  int n = 0;
  int k = 0;
  void* out = nullptr;  // bf16 [rows, n] (nt); the L1 op: act [rows, n / 2], optional
  void* h = nullptr;    // L1 op: bf16 [rows, n], optional
  void* act_q = nullptr;         // L1 op: act e4m3 [rows, n / 2]
  float* act_q_scales = nullptr;  // L1 op: [rows, n / 256]
  bool act_q_pow2 = false;
  void* act_scratch = nullptr;  // L1 op without `out`: bf16 [rows, n / 2] for act
  void* workspace = nullptr;  // 256-byte aligned, grouped_gemm_fp8_workspace_bytes(num_groups)
  GemmTuning tuning;          // pingpong: the nt op only
};

size_t grouped_gemm_fp8_workspace_bytes(int num_groups);

// out [rows, n] = dequant(a) @ dequant(b[g])^T per group (the FP8 L2 forward; L1 without SwiGLU).
void grouped_gemm_fp8_nt(const Fp8GroupedGemmArgs& args, cudaStream_t stream);

// The FP8 L1 forward: h = a @ b[g]^T with b = w_gu (gate/up interleaved, n = 2I), SwiGLU in
// the epilogue writing act = silu(g) * u (bf16) into out (or act_scratch), then act quantised
// to (1 x 128) blocks into act_q / act_q_scales (the FP8 L2's input) by a second kernel over
// the rows before offs[-1]; h written if non-null. I = n / 2 must be a multiple of 128.
// NOTE: two kernels, not one: an in-epilogue quantisation needs a row's 128 act columns (256 h
// columns) in one CTA, and the FP8 tile is 128 wide (grouped_gemm_fp8_config.cuh).
void grouped_gemm_fp8_l1_swiglu(const Fp8GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace mok::launch
