// Torch-free host launchers for the grouped (per-expert) GEMMs of the MoE expert MLP on sm_90a.
// Plain pointers, sizes and a stream; every launch is asynchronous (no host synchronisation).
//
// Groups follow torch._grouped_mm: offs[g] (int32, device, [num_groups]) is the END row of group
// g; group g owns rows [offs[g-1], offs[g]) of the row-major activations, offs[-1] = 0.
// All tensors are contiguous bf16 (the accumulating weight gradient's output: fp32) with 16-byte
// aligned bases; every dim below is a multiple of 8 (16 for the SwiGLU ops' 2I).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace mok::launch {

// The order output tiles run in (results are bitwise the same for every setting: each output
// tile is computed the same way). Mirrors ops.grouped_gemm.GemmTuning; the torch ops take it as
// their trailing (schedule, raster, swizzle) arguments.
struct GemmTuning {
  bool pingpong = false;        // schedule: cooperative (default) | pingpong (plain-epilogue ops)
  bool cluster2 = false;        // schedule: cooperative_cluster2 (the weight-gradient ops only)
  bool raster_along_n = false;  // raster: m (default) | n, which tile index runs fastest
  int swizzle = 1;              // tile swizzle width: 1 (default) | 2 | 4 | 8
};

struct GroupedGemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  void* aux = nullptr;   // op-specific, see below; may be null where optional
  void* aux2 = nullptr;  // op-specific, see below; may be null where optional
  const int32_t* offs = nullptr;
  int num_groups = 0;
  int m = 0;  // weight-gradient op only
  int n = 0;
  int k = 0;
  void* workspace = nullptr;  // 256-byte aligned, grouped_gemm_workspace_bytes(num_groups)
  GemmTuning tuning;          // pingpong: nt, nn, tn and nt_wait only (the SwiGLU ops refuse it);
                              // cluster2: tn and tn_accumulate only (the others refuse it)
};

// Scratch bytes any op below needs for `num_groups` groups on the current device.
size_t grouped_gemm_workspace_bytes(int num_groups);

// L1 forward, SwiGLU fused: a = x [rows, k], b = w_gu [G, n=2I, k] (gate/up interleaved in
// blocks of 8 rows), out = act [rows, n/2]; aux (optional) = h [rows, n], the pre-activation.
void grouped_gemm_l1_swiglu(const GroupedGemmArgs& args, cudaStream_t stream);

// out[rows, n] = a[rows, k] @ b[g]^T with b [G, n, k] (L2 forward).
void grouped_gemm_nt(const GroupedGemmArgs& args, cudaStream_t stream);

// out[rows, n] = a[rows, k] @ b[g] with b [G, k, n] (L1 data gradient).
void grouped_gemm_nn(const GroupedGemmArgs& args, cudaStream_t stream);

// L2 data gradient, SwiGLU backward fused: d_act = a[rows, k] @ b[g] with a = d_y, b = w_down
// [G, k=H, n=I]; aux = h [rows, 2n] (read); out = d_h [rows, 2n] (interleaved like h);
// aux2 (optional) = act [rows, n], recomputed.
void grouped_gemm_dswiglu(const GroupedGemmArgs& args, cudaStream_t stream);

// Weight gradient: out[g] [m, n] = a_g^T @ b_g, a [rows, m], b [rows, n], summed over group g's
// rows in a fixed order; a group with no rows gets zeros.
void grouped_gemm_tn(const GroupedGemmArgs& args, cudaStream_t stream);

// How the fp32 accumulating weight gradient adds a tile into its buffer; every choice lands the
// same bits (old + the tile's fp32 sum, rounded once). Mirrors ops.grouped_gemm.ACCUMULATE_STORES.
//   kLoad    the epilogue loads the buffer's tile by TMA, adds, stores it back: the consumer
//            warpgroups wait for the load, tile by tile.
//   kReduce  the tile leaves by TMA reduce-add and the L2 adds it: the consumers go on at once,
//            but the L2's reduce rate bounds the op where the mainloops are short.
//   kAuto    kReduce where the groups average at least kReduceAddMinRowsPerGroup rows (the
//            mainloop's K: rows of `a` over groups, known on the host), else kLoad.
enum class AccumulateStore { kAuto, kLoad, kReduce };
// Where the line comes from: docs/GEMM.md's store table (one H100: the reduce behind the
// read-back at 512 rows a group, level at 1024, ahead at 2048).
constexpr int kReduceAddMinRowsPerGroup = 1024;

// Accumulating weight gradient (gradient-accumulation fusion): out is an fp32 [G, m, n] buffer
// (16-byte aligned) and out[g] += a_g^T @ b_g in the GEMM's epilogue, summed over group g's rows
// in the same fixed order as grouped_gemm_tn, added as `store` says (rows: a's, for kAuto); a
// group with no rows leaves its part of out untouched.
void grouped_gemm_tn_accumulate(const GroupedGemmArgs& args, AccumulateStore store, int64_t rows,
                                cudaStream_t stream);
// The same into a bf16 [G, m, n] buffer: out[g] = bf16(out[g] + a_g^T @ b_g), the sum in fp32
// rounded once (a weight's .grad summed over macrobatch rounds in place).
void grouped_gemm_tn_accumulate_bf16(const GroupedGemmArgs& args, cudaStream_t stream);

// The per-tile flag wait (csrc/include/mok/scheduler/flag_wait.cuh): before loading the A rows
// [r0, r1) of an output tile, the kernel waits until ready[f] >= epoch for every flag f covering
// them, flag f covering global rows [f * rows_per_flag, (f + 1) * rows_per_flag). A tile still
// waiting after timeout_ns writes `error` (int32 [8], device or pinned host memory, optional)
// and traps.
struct FlagWaitArgs {
  const int32_t* ready = nullptr;  // int32 [num_flags], device
  int num_flags = 0;
  int rows_per_flag = 1;
  int32_t epoch = 1;
  int64_t timeout_ns = 10'000'000'000;
  int32_t* error = nullptr;
};

// grouped_gemm_nt / grouped_gemm_l1_swiglu, each tile first waiting for its rows of `a` / `x`.
void grouped_gemm_nt_wait(const GroupedGemmArgs& args, const FlagWaitArgs& wait,
                          cudaStream_t stream);
void grouped_gemm_l1_swiglu_wait(const GroupedGemmArgs& args, const FlagWaitArgs& wait,
                                 cudaStream_t stream);

}  // namespace mok::launch
