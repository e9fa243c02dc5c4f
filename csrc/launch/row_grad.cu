// Host launcher for mok/roles/row_grad.cuh: picks the block size and vectors per thread from the
// hidden size alone, so a row's float32 sum order never depends on anything but H.
#include "launch/row_grad.h"

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/roles/row_grad.cuh"

namespace mok::launch {
namespace {

using row_grad::kMaxThreads;
using row_grad::kMaxVecsPerThread;
using row_grad::kPreferredThreads;
using row_grad::kVec;
using row_grad::kWarpSize;

struct RowGradShape {
  int vecs_per_thread;
  int threads;  // a multiple of 32
};

// The fewest vectors per thread (1, 2, 4, 8) that fit the row in kPreferredThreads threads, else
// 8 with up to kMaxThreads threads. NOTE: a pure function of hidden (the sum order depends on it).
RowGradShape shape_for(int64_t hidden) {
  const int64_t num_vecs = hidden / kVec;
  int vecs_per_thread = 1;
  while (vecs_per_thread < kMaxVecsPerThread &&
         num_vecs > int64_t{kPreferredThreads} * vecs_per_thread) {
    vecs_per_thread *= 2;
  }
  const int64_t threads = (num_vecs + vecs_per_thread - 1) / vecs_per_thread;
  const int64_t rounded = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
  return {vecs_per_thread, static_cast<int>(rounded < kWarpSize ? kWarpSize : rounded)};
}

bool is_aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void moe_row_grad(const MoeRowGradArgs& args, cudaStream_t stream) {
  MOK_HOST_CHECK(args.num_rows >= 0 && args.num_rows <= INT32_MAX,
                 "moe_row_grad: num_rows=%lld must be in [0, 2^31)",
                 static_cast<long long>(args.num_rows));
  MOK_HOST_CHECK(args.hidden > 0 && args.hidden % kVec == 0,
                 "moe_row_grad: hidden=%lld must be a positive multiple of %d (16-byte vectors)",
                 static_cast<long long>(args.hidden), kVec);
  MOK_HOST_CHECK(args.hidden <= row_grad::kMaxHidden, "moe_row_grad: hidden=%lld exceeds %lld",
                 static_cast<long long>(args.hidden),
                 static_cast<long long>(row_grad::kMaxHidden));
  if (args.num_rows == 0) return;
  MOK_HOST_CHECK(is_aligned_16(args.d_rows) && is_aligned_16(args.y) && is_aligned_16(args.dy),
                 "moe_row_grad: d_rows, y and dy must be 16-byte aligned");
  const row_grad::RowGradParams params{
      static_cast<const __nv_bfloat16*>(args.d_rows), static_cast<const __nv_bfloat16*>(args.y),
      args.w_rows, args.row_tok, args.d_row_w, static_cast<__nv_bfloat16*>(args.dy), args.hidden};
  const RowGradShape shape = shape_for(args.hidden);
  MOK_HOST_CHECK(shape.threads <= kMaxThreads, "moe_row_grad: %d threads for hidden=%lld",
                 shape.threads, static_cast<long long>(args.hidden));
  const dim3 grid(static_cast<unsigned>(args.num_rows));
  switch (shape.vecs_per_thread) {
    case 1:
      row_grad::row_grad_kernel<1><<<grid, shape.threads, 0, stream>>>(params);
      break;
    case 2:
      row_grad::row_grad_kernel<2><<<grid, shape.threads, 0, stream>>>(params);
      break;
    case 4:
      row_grad::row_grad_kernel<4><<<grid, shape.threads, 0, stream>>>(params);
      break;
    default:
      row_grad::row_grad_kernel<8><<<grid, shape.threads, 0, stream>>>(params);
      break;
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::launch
