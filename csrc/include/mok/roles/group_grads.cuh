// Weight gradients per expert group, without a pass over every expert's weights.
//
// A grouped weight-gradient GEMM leaves the output of a group with no rows unwritten. Rather than
// masking the whole [G, M, N] gradient (a weight-sized read and write), one launch visits each
// group and touches only the groups that need it:
//   - a group with no rows anywhere (first_round < 0) is zero-filled, once, in round 0;
//   - a group with no rows in this round's window is left alone;
//   - in the group's first round, its part becomes the total (a copy, unless total is part);
//   - in a later round, the part is added: total = bf16(float(total) + float(part)), the same
//     rounding as a bf16 tensor add, in round order (deterministic, no atomics).
// With one round and total == part, only the empty groups' memory is written.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/common/macros.cuh"

namespace mok::roles {

struct GroupGradParams {
  __nv_bfloat16* total;      // [G, group_elems]
  const __nv_bfloat16* part; // [G, group_elems]: this round's GEMM output (may equal total)
  const int* offs;           // [G] int32 group ends inside this round's window
  const int* first_round;    // [G] int32: the round holding the group's first row, -1 if none
  int round;
  int64_t group_elems;       // a multiple of 8
};

// Grid: (blocks per group, G). Each thread moves 8 bf16 (16 bytes) at a time.
__global__ void accumulate_groups(GroupGradParams p) {
  const int g = blockIdx.y;
  const int first = p.first_round[g];
  const int rows = p.offs[g] - (g > 0 ? p.offs[g - 1] : 0);
  enum { kSkip, kZero, kCopy, kAdd } mode;
  if (first < 0) {
    mode = p.round == 0 ? kZero : kSkip;
  } else if (rows == 0) {
    mode = kSkip;
  } else if (p.round == first) {
    mode = p.total == p.part ? kSkip : kCopy;
  } else {
    mode = kAdd;
  }
  if (mode == kSkip) return;
  const int64_t vecs = p.group_elems / 8, base = static_cast<int64_t>(g) * vecs;
  uint4* total = reinterpret_cast<uint4*>(p.total) + base;
  const uint4* part = reinterpret_cast<const uint4*>(p.part) + base;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (mode == kZero) {
      total[i] = make_uint4(0, 0, 0, 0);
    } else if (mode == kCopy) {
      total[i] = part[i];
    } else {
      uint4 t = total[i];
      const uint4 q = part[i];
      __nv_bfloat162* t2 = reinterpret_cast<__nv_bfloat162*>(&t);
      const __nv_bfloat162* q2 = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 a = __bfloat1622float2(t2[j]), b = __bfloat1622float2(q2[j]);
        t2[j] = __floats2bfloat162_rn(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y));
      }
      total[i] = t;
    }
  }
}

}  // namespace mok::roles
