// Role: turn device-side group (expert) row offsets into the per-group problem sizes, operand
// pointers and strides that the grouped-GEMM kernel reads, on the device, so the host never
// learns a row count (no synchronisation; CUDA-graph safe).
//
// Offsets follow torch._grouped_mm: offs[g] is the END row of group g (int32, [num_groups],
// non-decreasing), group g owns rows [offs[g-1], offs[g]) with offs[-1] = 0.
//
// Two shapes of grouped problem:
//   kRowsInM  (forward, dgrad): group g is (rows_g x K) @ op(B_g) -> (rows_g x N); M = rows_g.
//   kRowsInK  (weight grad):    group g is A_g^T (M x rows_g) @ B_g (rows_g x N) -> (M x N);
//                               K = rows_g; a group with no rows gets M = 0 (no tiles) and its
//                               output is zero-filled by zero_empty_groups below (or, for
//                               the accumulating weight gradient, left untouched).
#pragma once

#include <cstdint>

#include "mok/roles/grouped_gemm_config.cuh"

namespace mok::gemm {

enum class GroupedRows : int { kRowsInM = 0, kRowsInK = 1 };

// Where one operand of group g starts: base + row_begin_g * per_row + g * per_group (elements).
struct OperandStep {
  const void* base = nullptr;
  int64_t per_row = 0;
  int64_t per_group = 0;
};

// The device arrays one launch needs, carved out of one workspace buffer. `ElementD` is the
// output's element type (bf16, or fp32 for the accumulating weight gradient): D's offsets count
// its elements. NOTE: the arrays hold pointers and strides only: bytes() is one for any ElementD.
template <class StrideA, class StrideB, class StrideD, class ElementD = Element>
struct GroupedProblemArrays {
  ProblemSize* problems = nullptr;
  const Element** ptr_a = nullptr;
  const Element** ptr_b = nullptr;
  ElementD** ptr_d = nullptr;
  Element** ptr_aux = nullptr;  // fused-epilogue extra operand (may stay unused)
  Element** ptr_aux2 = nullptr;
  StrideA* stride_a = nullptr;
  StrideB* stride_b = nullptr;
  StrideD* stride_d = nullptr;

  static constexpr size_t kAlign = 256;
  static constexpr size_t round_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

  static size_t bytes(int num_groups) {
    const size_t g = static_cast<size_t>(num_groups);
    return round_up(g * sizeof(ProblemSize)) + 5 * round_up(g * sizeof(void*)) +
           round_up(g * sizeof(StrideA)) + round_up(g * sizeof(StrideB)) +
           round_up(g * sizeof(StrideD));
  }

  // `buffer` must be 256-byte aligned and hold bytes(num_groups).
  static GroupedProblemArrays carve(void* buffer, int num_groups) {
    const size_t g = static_cast<size_t>(num_groups);
    char* p = static_cast<char*>(buffer);
    GroupedProblemArrays a;
    auto take = [&](size_t n) { char* q = p; p += round_up(n); return q; };
    a.problems = reinterpret_cast<ProblemSize*>(take(g * sizeof(ProblemSize)));
    a.ptr_a = reinterpret_cast<const Element**>(take(g * sizeof(void*)));
    a.ptr_b = reinterpret_cast<const Element**>(take(g * sizeof(void*)));
    a.ptr_d = reinterpret_cast<ElementD**>(take(g * sizeof(void*)));
    a.ptr_aux = reinterpret_cast<Element**>(take(g * sizeof(void*)));
    a.ptr_aux2 = reinterpret_cast<Element**>(take(g * sizeof(void*)));
    a.stride_a = reinterpret_cast<StrideA*>(take(g * sizeof(StrideA)));
    a.stride_b = reinterpret_cast<StrideB*>(take(g * sizeof(StrideB)));
    a.stride_d = reinterpret_cast<StrideD*>(take(g * sizeof(StrideD)));
    return a;
  }
};

// Operand steps count elements of each operand's own type (A, B, aux: bf16; D: ElementD above).
struct GroupedProblemDesc {
  const int32_t* offs = nullptr;  // [num_groups] end rows
  int num_groups = 0;
  GroupedRows rows = GroupedRows::kRowsInM;
  int m = 0;  // kRowsInK only (the rows-in-M problem takes M from offs)
  int n = 0;
  int k = 0;  // kRowsInM only
  OperandStep a, b, d, aux, aux2;
};

template <class T>
__device__ __forceinline__ T* operand_ptr(const OperandStep& s, int64_t row_begin, int g) {
  return static_cast<T*>(const_cast<void*>(s.base)) + row_begin * s.per_row + g * s.per_group;
}

// A packed stride for a (extent0, extent1, 1) tensor whose contiguous mode is the static _1.
template <class Stride>
__device__ __forceinline__ Stride packed_stride(int extent0, int extent1) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<1>(s))>>::value) {
    cute::get<0>(s) = extent1;
  } else {
    cute::get<1>(s) = extent0;
  }
  if constexpr (!cute::is_static<cute::remove_cvref_t<decltype(cute::get<2>(s))>>::value) {
    cute::get<2>(s) = static_cast<int64_t>(extent0) * extent1;
  }
  return s;
}

// One thread per group.
template <class StrideA, class StrideB, class StrideD, class ElementD>
__global__ void build_grouped_problems(
    GroupedProblemDesc desc, GroupedProblemArrays<StrideA, StrideB, StrideD, ElementD> out) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= desc.num_groups) return;
  const int64_t row_begin = g == 0 ? 0 : desc.offs[g - 1];
  const int rows = static_cast<int>(desc.offs[g] - row_begin);
  int m, n = desc.n, k;
  if (desc.rows == GroupedRows::kRowsInM) {
    m = rows;
    k = desc.k;
  } else {
    m = rows > 0 ? desc.m : 0;  // K = 0 would leave the accumulators unwritten
    k = rows;
  }
  out.problems[g] = ProblemSize{m, n, k};
  out.ptr_a[g] = operand_ptr<const Element>(desc.a, row_begin, g);
  out.ptr_b[g] = operand_ptr<const Element>(desc.b, row_begin, g);
  out.ptr_d[g] = operand_ptr<ElementD>(desc.d, row_begin, g);
  out.ptr_aux[g] = operand_ptr<Element>(desc.aux, row_begin, g);
  out.ptr_aux2[g] = operand_ptr<Element>(desc.aux2, row_begin, g);
  out.stride_a[g] = packed_stride<StrideA>(m, k);
  out.stride_b[g] = packed_stride<StrideB>(n, k);
  out.stride_d[g] = packed_stride<StrideD>(m, n);
}

// Weight gradients: zero the [m, n] output of every group that has no rows (deterministic, no
// host sync). grid = (blocks per group, num_groups). A template so every TU may include it.
template <class T>
__global__ void zero_empty_groups(const int32_t* offs, T* d, int64_t group_elems) {
  const int g = blockIdx.y;
  const int32_t row_begin = g == 0 ? 0 : offs[g - 1];
  if (offs[g] != row_begin) return;
  uint4* out = reinterpret_cast<uint4*>(d + g * group_elems);
  const int64_t num_vec = group_elems / 8;  // NOTE: group_elems % 8 == 0 (checked by the launcher)
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < num_vec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace mok::gemm
