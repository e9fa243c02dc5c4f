// The one translation unit that includes torch's op registry: every mok:: op's schema and its
// CUDA kernel registration. Fake (meta) implementations live next to each op's Python wrapper,
// named by set_python_module below.
//
// To add an op family: append one section to each of the two blocks below (schemas, then CUDA
// impls), in the same order, with the apis/ header it binds.
#include <Python.h>
#include <torch/library.h>

#include "apis/comm.h"
#include "apis/fp8_blockwise.h"
#include "apis/moe.h"
#include "apis/moe_mega.h"
#include "apis/routing.h"
#include "apis/mxfp8.h"
#include "apis/row_grad.h"

// Importing mok_megatron._C runs the static registrations below; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(mok, m) {
  // ---- mxfp8: csrc/apis/mxfp8.h; fakes in mok_megatron/ops/mxfp8.py ------------------------
  m.set_python_module("mok_megatron.ops.mxfp8");
  m.def("mxfp8_quantize(Tensor w, bool rowwise, bool colwise) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "mxfp8_quantize_out(Tensor w, bool rowwise, bool colwise, Tensor(a!) row_data, "
      "Tensor(b!) row_scales, Tensor(c!) col_data, Tensor(d!) col_scales) -> ()");
  // ---- fp8_blockwise: csrc/apis/fp8_blockwise.h; fakes in mok_megatron/ops/fp8_blockwise.py --
  m.set_python_module("mok_megatron.ops.fp8_blockwise");
  m.def(
      "fp8_blockwise_quantize(Tensor x, int block_rows, int block_cols, bool pow2_scales) -> "
      "(Tensor, Tensor)");
  m.def(
      "fp8_blockwise_quantize_out(Tensor x, int block_rows, int block_cols, bool pow2_scales, "
      "Tensor(a!) data, Tensor(b!) scales) -> ()");
  // ---- moe (stage-1 expert-parallel MoE): csrc/apis/moe.h; fakes in mok_megatron/ops/moe.py ---
  m.set_python_module("mok_megatron.ops.moe");
  m.def(
      "moe_workspace_layout(int num_ranks, int max_tokens, int topk, int hidden, int slot_rows, "
      "int counter_words) -> int[]",
      &mok::apis::moe_workspace_layout);
  m.def("moe_fp8_packed_row_width(int hidden) -> int", &mok::apis::moe_fp8_packed_row_width);
  m.def(
      "moe_mega_shape(int row_capacity, int num_local_experts, int hidden, int inter, "
      "int minibatch_rows, int macrobatch_rows) -> int[]",
      &mok::apis::moe_mega_shape);
  m.def(
      "moe_mega_order_block(int routed_rows, int num_local_experts, int l1_ntiles, int num_ctas) "
      "-> int",
      &mok::apis::moe_mega_order_block);
  m.def("moe_comm_fields() -> str[]", &mok::apis::moe_comm_fields);
  // ---- moe_mega (the megakernels): csrc/apis/moe_mega.h --------------------------------------
  m.def("moe_mega_plan_fields() -> str[]", &mok::apis::moe_mega_plan_fields);
  m.def("moe_mega_forward_fields() -> str[]", &mok::apis::moe_mega_forward_fields);
  m.def("moe_mega_backward_fields() -> str[]", &mok::apis::moe_mega_backward_fields);
  m.def(
      "moe_mega_plan(Tensor topk, Tensor router_weights, int[] comm, int num_experts, "
      "int row_capacity, int token_capacity, int inter, int minibatch, int macrobatch) -> Tensor[]");
  m.def(
      "moe_mega_forward(Tensor x, Tensor topk, Tensor router_weights, Tensor w_gate_up, "
      "Tensor w_down, Tensor? shared_out, Tensor[] plan, int[] comm, int num_experts, "
      "int row_capacity, int token_capacity, int minibatch, int macrobatch, int num_comm_sms, "
      "int num_sms, bool save, bool keep_y, int stall_minibatch, bool trace=False, "
      "int cluster=1, int stall_l2_cta=-1, Tensor? w_gate_up_scales=None, "
      "Tensor? w_down_scales=None, bool rows_in_place=False, bool keep_rings=False, "
      "int order_block=0) -> Tensor[]");
  m.def(
      "moe_mega_backward(Tensor d_out, Tensor topk, Tensor[] plan, Tensor act_ring, "
      "Tensor h_ring, Tensor w_gate_up, Tensor w_down, Tensor? shared_dx, int[] comm, "
      "int num_experts, int row_capacity, int minibatch, int macrobatch, int num_comm_sms, "
      "int num_sms, int stall_minibatch, bool trace=False, int cluster=1, int round=-1, "
      "Tensor(a!)? wgrad_down=None, bool wgrad_accumulate=False, bool wgrad_interleave=False) "
      "-> Tensor[]");
  m.def("moe_gather_routing(Tensor topk, Tensor weights, int[] comm) -> (Tensor, Tensor)");
  m.def("routing_to_topk(Tensor probs, Tensor routing_map, int topk) -> (Tensor, Tensor)");
  m.def(
      "moe_build_schedule(Tensor global_topk, int rank, int num_experts, int row_capacity, "
      "int token_capacity) -> Tensor[]");
  m.def("moe_dispatch(Tensor x, Tensor recv_token_src, int[] comm) -> Tensor");
  m.def(
      "moe_combine(Tensor rows, Tensor token_rows, Tensor recv_token_src, Tensor? slot_weights, "
      "Tensor send_to, Tensor? shared_out, int num_tokens, int[] comm, Tensor(a!)? acc=None, "
      "int row_begin=0, bool first=True, bool last=True, Tensor? rows2=None) -> Tensor");
  m.def(
      "moe_combine_slots(Tensor row_values, Tensor token_rows, Tensor recv_token_src, "
      "Tensor send_to, int num_tokens, int[] comm) -> Tensor");
  m.def("moe_gather_rows(Tensor src, Tensor row_tok) -> Tensor");
  m.def("moe_fp8_pack_rows(Tensor data, Tensor scales) -> Tensor");
  m.def("moe_gather_rows_fp8(Tensor packed, Tensor row_tok, int hidden) -> (Tensor, Tensor)");
  m.def("moe_swiglu(Tensor g, Tensor u) -> Tensor");
  m.def("moe_swiglu_backward(Tensor da, Tensor g, Tensor u) -> (Tensor, Tensor)");
  m.def("moe_swiglu_interleaved(Tensor h) -> Tensor");
  m.def("moe_swiglu_interleaved_backward(Tensor da, Tensor h) -> Tensor");
  m.def(
      "moe_row_grad(Tensor d_rows, Tensor y, Tensor w_rows, Tensor row_tok) -> (Tensor, Tensor)");
  m.def(
      "moe_accumulate_groups(Tensor(a!) total, Tensor part, Tensor offs, Tensor first_round, "
      "int round) -> ()");
}

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  // ---- mxfp8 --------------------------------------------------------------------------------
  m.impl("mxfp8_quantize", &mok::apis::mxfp8_quantize);
  m.impl("mxfp8_quantize_out", &mok::apis::mxfp8_quantize_out);
  // ---- fp8_blockwise ------------------------------------------------------------------------
  m.impl("fp8_blockwise_quantize", &mok::apis::fp8_blockwise_quantize);
  m.impl("fp8_blockwise_quantize_out", &mok::apis::fp8_blockwise_quantize_out);
  // ---- moe ---------------------------------------------------------------------------------
  m.impl("moe_gather_routing", &mok::apis::moe_gather_routing);
  m.impl("routing_to_topk", &mok::apis::routing_to_topk);  // csrc/apis/routing.h
  m.impl("moe_build_schedule", &mok::apis::moe_build_schedule);
  m.impl("moe_dispatch", &mok::apis::moe_dispatch);
  m.impl("moe_combine", &mok::apis::moe_combine);
  m.impl("moe_combine_slots", &mok::apis::moe_combine_slots);
  m.impl("moe_gather_rows", &mok::apis::moe_gather_rows);
  m.impl("moe_fp8_pack_rows", &mok::apis::moe_fp8_pack_rows);
  m.impl("moe_gather_rows_fp8", &mok::apis::moe_gather_rows_fp8);
  m.impl("moe_swiglu", &mok::apis::moe_swiglu);
  m.impl("moe_swiglu_backward", &mok::apis::moe_swiglu_backward);
  m.impl("moe_swiglu_interleaved", &mok::apis::moe_swiglu_interleaved);
  m.impl("moe_swiglu_interleaved_backward", &mok::apis::moe_swiglu_interleaved_backward);
  m.impl("moe_row_grad", &mok::apis::moe_row_grad);  // csrc/apis/row_grad.h
  m.impl("moe_accumulate_groups", &mok::apis::moe_accumulate_groups);
  m.impl("moe_mega_plan", &mok::apis::moe_mega_plan);
  m.impl("moe_mega_forward", &mok::apis::moe_mega_forward);
  m.impl("moe_mega_backward", &mok::apis::moe_mega_backward);
}

// ==== grouped_gemm: the expert GEMM engine (issue 7) ==========================================
// Owned by the grouped-GEMM work: csrc/apis/grouped_gemm.h; wrappers and fakes in
// mok_megatron/ops/grouped_gemm.py. A fragment, so it stays independent of the blocks above.
#include "apis/grouped_gemm.h"

TORCH_LIBRARY_FRAGMENT(mok, m) {
  m.set_python_module("mok_megatron.ops.grouped_gemm");
  // Every op ends with the tile order (launch::GemmTuning, apis/grouped_gemm.h): results are
  // bitwise the same for every setting; the SwiGLU ops refuse schedule "pingpong".
#define MOK_GEMM_TUNING_SCHEMA "str schedule=\"cooperative\", str raster=\"m\", int swizzle=1"
  m.def(
      "grouped_gemm_l1_swiglu_out(Tensor x, Tensor w_gu, Tensor offs, Tensor(a!) act, "
      "Tensor(b!)? h, " MOK_GEMM_TUNING_SCHEMA ") -> ()");
  m.def("grouped_gemm_nt_out(Tensor a, Tensor b, Tensor offs, Tensor(a!) out, "
        MOK_GEMM_TUNING_SCHEMA ") -> ()");
  m.def("grouped_gemm_nn_out(Tensor a, Tensor b, Tensor offs, Tensor(a!) out, "
        MOK_GEMM_TUNING_SCHEMA ") -> ()");
  m.def(
      "grouped_gemm_dswiglu_out(Tensor d_y, Tensor w_down, Tensor h, Tensor offs, "
      "Tensor(a!) d_h, Tensor(b!)? act, " MOK_GEMM_TUNING_SCHEMA ") -> ()");
  m.def("grouped_gemm_tn_out(Tensor a, Tensor b, Tensor offs, Tensor(a!) out, "
        MOK_GEMM_TUNING_SCHEMA ") -> ()");
  // acc += the weight gradient, in the epilogue (fp32 acc: gradient-accumulation fusion).
  m.def("grouped_gemm_tn_accumulate_out(Tensor a, Tensor b, Tensor offs, Tensor(a!) acc, "
        MOK_GEMM_TUNING_SCHEMA ", str store=\"auto\") -> ()");
  // The forward ops with the per-tile flag wait (csrc/include/mok/scheduler/flag_wait.cuh).
  m.def(
      "grouped_gemm_nt_wait_out(Tensor a, Tensor b, Tensor offs, Tensor ready, int rows_per_flag, "
      "int epoch, int timeout_ms, Tensor(a!) out, Tensor(b!)? error, " MOK_GEMM_TUNING_SCHEMA
      ") -> ()");
  m.def(
      "grouped_gemm_l1_swiglu_wait_out(Tensor x, Tensor w_gu, Tensor offs, Tensor ready, "
      "int rows_per_flag, int epoch, int timeout_ms, Tensor(a!) act, Tensor(b!)? h, "
      "Tensor(c!)? error, " MOK_GEMM_TUNING_SCHEMA ") -> ()");
#undef MOK_GEMM_TUNING_SCHEMA
}

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  m.impl("grouped_gemm_l1_swiglu_out", &mok::apis::grouped_gemm_l1_swiglu_out);
  m.impl("grouped_gemm_nt_out", &mok::apis::grouped_gemm_nt_out);
  m.impl("grouped_gemm_nn_out", &mok::apis::grouped_gemm_nn_out);
  m.impl("grouped_gemm_dswiglu_out", &mok::apis::grouped_gemm_dswiglu_out);
  m.impl("grouped_gemm_tn_out", &mok::apis::grouped_gemm_tn_out);
  m.impl("grouped_gemm_tn_accumulate_out", &mok::apis::grouped_gemm_tn_accumulate_out);
  m.impl("grouped_gemm_nt_wait_out", &mok::apis::grouped_gemm_nt_wait_out);
  m.impl("grouped_gemm_l1_swiglu_wait_out", &mok::apis::grouped_gemm_l1_swiglu_wait_out);
}

// ==== grouped_gemm_fp8: the blockwise-FP8 expert GEMMs (issue 15) ============================
// csrc/apis/grouped_gemm_fp8.h; wrappers and fakes in mok_megatron/ops/grouped_gemm_fp8.py.
#include "apis/grouped_gemm_fp8.h"

TORCH_LIBRARY_FRAGMENT(mok, m) {
  m.set_python_module("mok_megatron.ops.grouped_gemm_fp8");
#define MOK_GEMM_TUNING_SCHEMA "str schedule=\"cooperative\", str raster=\"m\", int swizzle=1"
  m.def("grouped_gemm_fp8_nt_out(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, "
        "Tensor offs, Tensor(a!) out, " MOK_GEMM_TUNING_SCHEMA ") -> ()");
  m.def(
      "grouped_gemm_fp8_l1_swiglu_out(Tensor x, Tensor x_scales, Tensor w_gu, "
      "Tensor w_gu_scales, Tensor offs, Tensor(a!) act_q, Tensor(b!) act_q_scales, "
      "Tensor(c!)? act, Tensor(d!)? h, bool pow2_scales=False, " MOK_GEMM_TUNING_SCHEMA
      ") -> ()");
#undef MOK_GEMM_TUNING_SCHEMA
}

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  m.impl("grouped_gemm_fp8_nt_out", &mok::apis::grouped_gemm_fp8_nt_out);
  m.impl("grouped_gemm_fp8_l1_swiglu_out", &mok::apis::grouped_gemm_fp8_l1_swiglu_out);
}
