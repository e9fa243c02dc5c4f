// Role: the blockwise-FP8 grouped GEMM's per-group problem arrays, built on the device from the
// row offsets (as grouped_problems.cuh does for the BF16 engine: the host never reads a row
// count). Besides the operands they hold each group's scale pointers and scale layouts
// (grouped_gemm_fp8_config.cuh gives the layouts).
#pragma once

#include <cstdint>

#include "mok/roles/grouped_gemm_fp8_config.cuh"
#include "mok/scheduler/grouped_problems.cuh"

namespace mok::gemm {

// The device arrays of one FP8 launch, carved out of one workspace buffer.
template <class StrideA, class StrideB, class StrideD>
struct Fp8ProblemArrays {
  ProblemSize* problems = nullptr;
  const Fp8Element** ptr_a = nullptr;
  const Fp8Element** ptr_b = nullptr;
  const ScaleElement** ptr_sfa = nullptr;
  const ScaleElement** ptr_sfb = nullptr;
  Element** ptr_d = nullptr;
  Element** ptr_aux = nullptr;  // the L1 epilogue's h (may stay unused)
  StrideA* stride_a = nullptr;
  StrideB* stride_b = nullptr;
  StrideD* stride_d = nullptr;
  Fp8LayoutSFA* layout_sfa = nullptr;
  Fp8LayoutSFB* layout_sfb = nullptr;

  static constexpr size_t kNumPointerArrays = 6;
  static constexpr size_t round_up(size_t x) {
    return GroupedProblemArrays<StrideA, StrideB, StrideD>::round_up(x);
  }

  static size_t bytes(int num_groups) {
    const size_t g = static_cast<size_t>(num_groups);
    return round_up(g * sizeof(ProblemSize)) + kNumPointerArrays * round_up(g * sizeof(void*)) +
           round_up(g * sizeof(StrideA)) + round_up(g * sizeof(StrideB)) +
           round_up(g * sizeof(StrideD)) + round_up(g * sizeof(Fp8LayoutSFA)) +
           round_up(g * sizeof(Fp8LayoutSFB));
  }

  // `buffer` must be 256-byte aligned and hold bytes(num_groups).
  static Fp8ProblemArrays carve(void* buffer, int num_groups) {
    const size_t g = static_cast<size_t>(num_groups);
    char* p = static_cast<char*>(buffer);
    auto take = [&](size_t n) { char* q = p; p += round_up(n); return q; };
    Fp8ProblemArrays a;
    a.problems = reinterpret_cast<ProblemSize*>(take(g * sizeof(ProblemSize)));
    a.ptr_a = reinterpret_cast<const Fp8Element**>(take(g * sizeof(void*)));
    a.ptr_b = reinterpret_cast<const Fp8Element**>(take(g * sizeof(void*)));
    a.ptr_sfa = reinterpret_cast<const ScaleElement**>(take(g * sizeof(void*)));
    a.ptr_sfb = reinterpret_cast<const ScaleElement**>(take(g * sizeof(void*)));
    a.ptr_d = reinterpret_cast<Element**>(take(g * sizeof(void*)));
    a.ptr_aux = reinterpret_cast<Element**>(take(g * sizeof(void*)));
    a.stride_a = reinterpret_cast<StrideA*>(take(g * sizeof(StrideA)));
    a.stride_b = reinterpret_cast<StrideB*>(take(g * sizeof(StrideB)));
    a.stride_d = reinterpret_cast<StrideD*>(take(g * sizeof(StrideD)));
    a.layout_sfa = reinterpret_cast<Fp8LayoutSFA*>(take(g * sizeof(Fp8LayoutSFA)));
    a.layout_sfb = reinterpret_cast<Fp8LayoutSFB*>(take(g * sizeof(Fp8LayoutSFB)));
    return a;
  }
};

// A rows-in-M FP8 problem: group g's rows of A [rows, k] times B[g] ([n, k]) into D [rows, n_d].
// Steps count elements of each operand's own type (scales: floats).
struct Fp8ProblemDesc {
  const int32_t* offs = nullptr;
  int num_groups = 0;
  int n = 0;
  int k = 0;
  OperandStep a, b, sfa, sfb, d, aux;
};

// One thread per group.
template <class StrideA, class StrideB, class StrideD>
__global__ void build_fp8_problems(Fp8ProblemDesc desc,
                                   Fp8ProblemArrays<StrideA, StrideB, StrideD> out) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= desc.num_groups) return;
  const int64_t row_begin = g == 0 ? 0 : desc.offs[g - 1];
  const int m = static_cast<int>(desc.offs[g] - row_begin);
  out.problems[g] = ProblemSize{m, desc.n, desc.k};
  out.ptr_a[g] = operand_ptr<const Fp8Element>(desc.a, row_begin, g);
  out.ptr_b[g] = operand_ptr<const Fp8Element>(desc.b, row_begin, g);
  out.ptr_sfa[g] = operand_ptr<const ScaleElement>(desc.sfa, row_begin, g);
  out.ptr_sfb[g] = operand_ptr<const ScaleElement>(desc.sfb, row_begin, g);
  out.ptr_d[g] = operand_ptr<Element>(desc.d, row_begin, g);
  out.ptr_aux[g] = operand_ptr<Element>(desc.aux, row_begin, g);
  out.stride_a[g] = packed_stride<StrideA>(m, desc.k);
  out.stride_b[g] = packed_stride<StrideB>(desc.n, desc.k);
  out.stride_d[g] = packed_stride<StrideD>(m, desc.n);
  // NOTE: the mainloop rebuilds these from the problem shape; they are filled for its Params.
  out.layout_sfa[g] = Fp8ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, desc.n, desc.k, 1));
  out.layout_sfb[g] = Fp8ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, desc.n, desc.k, 1));
}

}  // namespace mok::gemm
