#include "apis/moe.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "apis/comm.h"
#include "apis/tensor_arena.h"
#include "apis/tensor_checks.h"
#include "launch/chain.h"
#include "launch/moe.h"
#include "mok/common/fp8_blockwise.cuh"
#include "mok/layout/mega.cuh"

namespace mok::apis {

std::vector<int64_t> moe_workspace_layout(int64_t num_ranks, int64_t max_tokens, int64_t topk,
                                          int64_t hidden, int64_t slot_rows,
                                          int64_t counter_words) {
  TORCH_CHECK(num_ranks >= 1 && max_tokens >= 0 && topk >= 1 && hidden >= 1 &&
                  (slot_rows == 0 || slot_rows == 1) && counter_words >= 0,
              "mok::moe_workspace_layout: bad shape");
  const layout::WorkspaceLayout lay{num_ranks, max_tokens, topk, hidden, slot_rows, counter_words};
  constexpr int kRegions = static_cast<int>(layout::Region::kNumRegions);
  std::vector<int64_t> out{lay.total_bytes(), layout::WorkspaceLayout::kGuardBytes};
  for (int r = 0; r < kRegions; ++r) out.push_back(lay.offset(static_cast<layout::Region>(r)));
  for (int r = 0; r < kRegions; ++r) {
    out.push_back(lay.guard_offset(static_cast<layout::Region>(r)));
  }
  return out;
}

std::vector<int64_t> moe_mega_shape(int64_t row_capacity, int64_t num_local_experts,
                                    int64_t hidden, int64_t inter, int64_t minibatch_rows,
                                    int64_t macrobatch_rows) {
  TORCH_CHECK(row_capacity >= 1 && num_local_experts >= 1 && hidden >= 8 && inter >= 8 &&
                  minibatch_rows >= 1 && macrobatch_rows >= minibatch_rows,
              "mok::moe_mega_shape: bad shape (C=", row_capacity, ", E_l=", num_local_experts,
              ", H=", hidden, ", I=", inter, ", minibatch=", minibatch_rows, ", macrobatch=",
              macrobatch_rows, ")");
  const layout::MegaShape s{row_capacity, num_local_experts, hidden,
                            inter,        minibatch_rows,    macrobatch_rows};
  return {s.padded_rows(), s.num_rounds(),  s.ring_rows(),  s.num_minibatches(),
          s.max_tiles(),   s.l1_ntiles(),   s.l2_ntiles(), s.counter_words(), s.max_tasks()};
}

int64_t moe_mega_order_block(int64_t routed_rows, int64_t num_local_experts, int64_t l1_ntiles,
                             int64_t num_ctas) {
  TORCH_CHECK(routed_rows >= 0 && num_local_experts >= 1 && l1_ntiles >= 1 && num_ctas >= 1,
              "mok::moe_mega_order_block: bad arguments (rows=", routed_rows, ", E_l=",
              num_local_experts, ", l1_ntiles=", l1_ntiles, ", num_ctas=", num_ctas, ")");
  return layout::auto_order_block(routed_rows, num_local_experts, l1_ntiles, num_ctas);
}

std::tuple<at::Tensor, at::Tensor> moe_gather_routing(const at::Tensor& topk,
                                                      const at::Tensor& weights,
                                                      at::IntArrayRef comm_ints) {
  const auto comm = comm_of(comm_ints);
  const launch::ChainScope chain(comm.chained);
  check(topk, "topk", at::kLong, 2);
  check(weights, "weights", at::kFloat, 2);
  TORCH_CHECK(topk.size(0) <= comm.lay.max_tokens && topk.size(1) == comm.lay.topk &&
                  weights.sizes() == topk.sizes(),
              "mok::moe_gather_routing: topk ", topk.sizes(), " / weights ", weights.sizes(),
              " do not fit [<=", comm.lay.max_tokens, ", ", comm.lay.topk, "]");
  c10::cuda::CUDAGuard guard(topk.device());
  const auto& lay = comm.lay;
  auto global_topk = at::empty({lay.num_ranks, lay.max_tokens, lay.topk}, opts(topk, at::kLong));
  auto global_weights =
      at::empty({lay.num_ranks, lay.max_tokens, lay.topk}, opts(topk, at::kFloat));
  launch::moe_gather_routing(comm, topk.data_ptr<int64_t>(), weights.data_ptr<float>(),
                             static_cast<int>(topk.size(0)), global_topk.data_ptr<int64_t>(),
                             global_weights.data_ptr<float>(), stream_of(topk));
  return {global_topk, global_weights};
}

ScheduleTensors make_schedule(const at::Tensor& global_topk, int64_t rank, int64_t num_experts,
                              int64_t row_capacity, int64_t token_capacity) {
  check(global_topk, "global_topk", at::kLong, 3);
  const int64_t w = global_topk.size(0), t_max = global_topk.size(1), k = global_topk.size(2);
  TORCH_CHECK(num_experts % w == 0 && rank >= 0 && rank < w && row_capacity >= 0 &&
                  token_capacity >= 0 && w * t_max * k < (int64_t{1} << 30),
              "mok::moe_build_schedule: bad arguments");
  c10::cuda::CUDAGuard guard(global_topk.device());
  scheduler::ScheduleParams p{};
  p.global_topk = global_topk.data_ptr<int64_t>();
  p.rank = static_cast<int>(rank);
  p.num_ranks = static_cast<int>(w);
  p.max_tokens = static_cast<int>(t_max);
  p.topk = static_cast<int>(k);
  p.num_experts = static_cast<int>(num_experts);
  p.num_local_experts = static_cast<int>(num_experts / w);
  p.row_capacity = static_cast<int>(row_capacity);
  p.token_capacity = static_cast<int>(token_capacity);
  const int64_t chunks = p.num_chunks(), e_l = p.num_local_experts;
  const int64_t scratch_ints = chunks * e_l + chunks * w + chunks;
  // One allocation for the schedule's tensors and its scratch (apis/tensor_arena.h).
  TensorArena arena(global_topk);
  for (const int64_t n : {row_capacity, row_capacity, row_capacity, row_capacity, row_capacity,
                          e_l + 1, int64_t{1}, token_capacity, w * t_max, int64_t{1}}) {
    arena.add({n}, at::kLong);
  }
  arena.add({token_capacity, k}, at::kLong);
  arena.add({t_max, w}, at::kBool);
  arena.add({}, at::kInt);  // 0-dim, as the reference
  const int slot_row_index = arena.add({w * t_max * k}, at::kInt);
  const int scratch_index = arena.add({scratch_ints + w * t_max + p.num_token_chunks()}, at::kInt);
  std::vector<at::Tensor> out = arena.make();
  const at::Tensor slot_row = out[slot_row_index];
  int* s = out[scratch_index].data_ptr<int>();
  out.resize(slot_row_index);  // the schedule's fields
  p.chunk_expert_rows = s;
  p.chunk_rank_slots = s + chunks * e_l;
  p.chunk_bad = p.chunk_rank_slots + chunks * w;
  p.token_pos = p.chunk_bad + chunks;
  p.chunk_tokens = p.token_pos + w * t_max;
  p.slot_row = slot_row.data_ptr<int>();
  p.row_expert = out[0].data_ptr<int64_t>();
  p.row_src_rank = out[1].data_ptr<int64_t>();
  p.row_src_token = out[2].data_ptr<int64_t>();
  p.row_src_slot = out[3].data_ptr<int64_t>();
  p.row_token_idx = out[4].data_ptr<int64_t>();
  p.expert_offsets = out[5].data_ptr<int64_t>();
  p.num_rows = out[6].data_ptr<int64_t>();
  p.recv_token_src = out[7].data_ptr<int64_t>();
  p.recv_token_pos = out[8].data_ptr<int64_t>();
  p.num_recv_tokens = out[9].data_ptr<int64_t>();
  p.token_rows = out[10].data_ptr<int64_t>();
  p.send_to = out[11].data_ptr<bool>();
  p.error_flags = out[12].data_ptr<int32_t>();
  launch::moe_build_schedule(p, stream_of(global_topk));
  return {out, slot_row};
}

std::vector<at::Tensor> moe_build_schedule(const at::Tensor& global_topk, int64_t rank,
                                           int64_t num_experts, int64_t row_capacity,
                                           int64_t token_capacity) {
  return make_schedule(global_topk, rank, num_experts, row_capacity, token_capacity).fields;
}

at::Tensor moe_dispatch(const at::Tensor& x, const at::Tensor& recv_token_src,
                        at::IntArrayRef comm_ints) {
  const auto comm = comm_of(comm_ints);
  const launch::ChainScope chain(comm.chained);
  check(x, "x", at::kBFloat16, 2);
  check(recv_token_src, "recv_token_src", at::kLong, 1);
  TORCH_CHECK(x.size(0) <= comm.lay.max_tokens && x.size(1) <= comm.lay.hidden &&
                  x.size(1) % 8 == 0,
              "mok::moe_dispatch: x ", x.sizes(), " does not fit the workspace (at most ",
              comm.lay.max_tokens, " rows of at most hidden=", comm.lay.hidden,
              " columns, a multiple of 8: the tokens, or their packed FP8 rows)");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t num_recv = recv_token_src.size(0);
  auto recv = at::empty({num_recv, x.size(1)}, x.options());
  launch::moe_dispatch(comm, x.data_ptr(), static_cast<int>(x.size(0)), x.size(1),
                       recv_token_src.data_ptr<int64_t>(), static_cast<int>(num_recv),
                       recv.data_ptr(), stream_of(x));
  return recv;
}

at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& token_rows,
                       const at::Tensor& recv_token_src,
                       const std::optional<at::Tensor>& slot_weights, const at::Tensor& send_to,
                       const std::optional<at::Tensor>& shared_out, int64_t num_tokens,
                       at::IntArrayRef comm_ints, const std::optional<at::Tensor>& acc,
                       int64_t row_begin, bool first, bool last,
                       const std::optional<at::Tensor>& rows2) {
  const auto comm = comm_of(comm_ints);
  const auto& lay = comm.lay;
  check(rows, "rows", at::kBFloat16, 2);
  check(token_rows, "token_rows", at::kLong, 2);
  check(recv_token_src, "recv_token_src", at::kLong, 1);
  check(send_to, "send_to", at::kBool, 2);
  TORCH_CHECK(rows.size(1) == lay.hidden && token_rows.size(1) == lay.topk &&
                  token_rows.size(0) == recv_token_src.size(0) && num_tokens <= lay.max_tokens &&
                  send_to.size(0) == lay.max_tokens && send_to.size(1) == lay.num_ranks,
              "mok::moe_combine: shapes do not fit the workspace");
  launch::MoeCombineArgs a;
  if (slot_weights.has_value()) {
    check(*slot_weights, "slot_weights", at::kFloat, 3);
    TORCH_CHECK(slot_weights->numel() == lay.num_ranks * lay.max_tokens * lay.topk,
                "mok::moe_combine: slot_weights must be [W, T_max, K]");
    a.slot_weights = slot_weights->data_ptr<float>();
  }
  if (shared_out.has_value()) {
    check(*shared_out, "shared_out", at::kBFloat16, 2);
    TORCH_CHECK(shared_out->size(0) == num_tokens && shared_out->size(1) == lay.hidden,
                "mok::moe_combine: shared_out must be [T, H]");
    a.shared_out = shared_out->data_ptr();
  }
  if (rows2.has_value()) {
    check(*rows2, "rows2", at::kBFloat16, 2);
    TORCH_CHECK(rows2->sizes() == rows.sizes(), "mok::moe_combine: rows2 ", rows2->sizes(),
                " must match rows ", rows.sizes());
    a.rows2 = rows2->data_ptr();
  }
  TORCH_CHECK(row_begin >= 0, "mok::moe_combine: row_begin must be >= 0");
  a.row_begin = row_begin;
  a.row_end = row_begin + rows.size(0);
  if (!(first && last)) {  // macrobatch rounds: a float32 accumulator carries the sums
    TORCH_CHECK(acc.has_value(), "mok::moe_combine: rounds (first/last not both true) need acc");
    check(*acc, "acc", at::kFloat, 2);
    TORCH_CHECK(acc->size(0) == recv_token_src.size(0) && acc->size(1) == lay.hidden,
                "mok::moe_combine: acc must be [C_tok, H] float32");
    if (!first) a.acc_in = acc->data_ptr<float>();
    if (!last) a.acc_out = acc->data_ptr<float>();
  }
  c10::cuda::CUDAGuard guard(rows.device());
  auto out = at::empty({last ? num_tokens : 0, lay.hidden}, rows.options());
  a.rows = rows.data_ptr();
  a.token_rows = token_rows.data_ptr<int64_t>();
  a.recv_token_src = recv_token_src.data_ptr<int64_t>();
  a.num_recv = static_cast<int>(recv_token_src.size(0));
  a.send_to = send_to.data_ptr<bool>();
  a.out = out.data_ptr();
  a.num_tokens = static_cast<int>(num_tokens);
  launch::moe_combine(comm, a, stream_of(rows));
  return out;
}

at::Tensor moe_combine_slots(const at::Tensor& row_values, const at::Tensor& token_rows,
                             const at::Tensor& recv_token_src, const at::Tensor& send_to,
                             int64_t num_tokens, at::IntArrayRef comm_ints) {
  const auto comm = comm_of(comm_ints);
  const auto& lay = comm.lay;
  check(row_values, "row_values", at::kFloat, 1);
  check(token_rows, "token_rows", at::kLong, 2);
  check(recv_token_src, "recv_token_src", at::kLong, 1);
  check(send_to, "send_to", at::kBool, 2);
  TORCH_CHECK(token_rows.size(1) == lay.topk && token_rows.size(0) == recv_token_src.size(0) &&
                  num_tokens <= lay.max_tokens,
              "mok::moe_combine_slots: shapes do not fit the workspace");
  c10::cuda::CUDAGuard guard(row_values.device());
  auto out = at::empty({num_tokens, lay.topk}, row_values.options());
  launch::moe_combine_slots(comm, row_values.data_ptr<float>(), token_rows.data_ptr<int64_t>(),
                            recv_token_src.data_ptr<int64_t>(),
                            static_cast<int>(recv_token_src.size(0)), send_to.data_ptr<bool>(),
                            out.data_ptr<float>(), static_cast<int>(num_tokens),
                            stream_of(row_values));
  return out;
}

at::Tensor moe_gather_rows(const at::Tensor& src, const at::Tensor& row_tok) {
  check(src, "src", at::kBFloat16, 2);
  check(row_tok, "row_tok", at::kLong, 1);
  TORCH_CHECK(src.size(1) % 8 == 0, "mok::moe_gather_rows: hidden=", src.size(1),
              " must be a multiple of 8 (16-byte rows)");
  c10::cuda::CUDAGuard guard(src.device());
  auto out = at::empty({row_tok.size(0), src.size(1)}, src.options());
  launch::moe_gather_rows(src.data_ptr(), row_tok.data_ptr<int64_t>(), out.data_ptr(),
                          row_tok.size(0), src.size(1), stream_of(src));
  return out;
}

int64_t moe_fp8_packed_row_width(int64_t hidden) {
  TORCH_CHECK(hidden > 0 && hidden % fp8_blockwise::kBlock == 0,
              "mok::moe_fp8_packed_row_width: hidden=", hidden,
              " must be a positive multiple of 128 (the FP8 scale blocks)");
  return fp8_blockwise::packed_row_bytes(hidden) / 2;
}

at::Tensor moe_fp8_pack_rows(const at::Tensor& data, const at::Tensor& scales) {
  check(data, "data", at::kFloat8_e4m3fn, 2);
  check(scales, "scales", at::kFloat, 2);
  const int64_t rows = data.size(0), hidden = data.size(1);
  TORCH_CHECK(hidden % fp8_blockwise::kBlock == 0 && scales.size(0) == rows &&
                  scales.size(1) == hidden / fp8_blockwise::kBlock,
              "mok::moe_fp8_pack_rows: data ", data.sizes(), " and scales ", scales.sizes(),
              " must be one (1, 128)-quantised [R, H] (H a multiple of 128) and its [R, H / 128]");
  c10::cuda::CUDAGuard guard(data.device());
  auto packed = at::empty({rows, moe_fp8_packed_row_width(hidden)}, opts(data, at::kBFloat16));
  launch::moe_fp8_pack_rows(data.data_ptr(), scales.data_ptr<float>(), rows, hidden,
                            packed.data_ptr(), stream_of(data));
  return packed;
}

std::tuple<at::Tensor, at::Tensor> moe_gather_rows_fp8(const at::Tensor& packed,
                                                       const at::Tensor& row_tok,
                                                       int64_t hidden) {
  check(packed, "packed", at::kBFloat16, 2);
  check(row_tok, "row_tok", at::kLong, 1);
  TORCH_CHECK(hidden > 0 && hidden % fp8_blockwise::kBlock == 0 &&
                  packed.size(1) == moe_fp8_packed_row_width(hidden),
              "mok::moe_gather_rows_fp8: packed ", packed.sizes(), " are not the packed FP8 rows "
              "of hidden=", hidden, " (moe_fp8_pack_rows' [R, ", moe_fp8_packed_row_width(hidden),
              "] bf16)");
  c10::cuda::CUDAGuard guard(packed.device());
  const int64_t rows = row_tok.size(0);
  auto data = at::empty({rows, hidden}, opts(packed, at::kFloat8_e4m3fn));
  auto scales = at::empty({rows, hidden / fp8_blockwise::kBlock}, opts(packed, at::kFloat));
  launch::moe_gather_rows_fp8(packed.data_ptr(), row_tok.data_ptr<int64_t>(), data.data_ptr(),
                              scales.data_ptr<float>(), rows, hidden, stream_of(packed));
  return {data, scales};
}

namespace {
// A [P, C] bf16 CUDA row set with unit column stride (rows may be strided): its row stride.
int64_t swiglu_rows(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.dim() == 2, "mok::", op, ": ",
              name, " must be a 2-D bfloat16 CUDA tensor, got ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "mok::", op, ": ", name,
              " must have unit column stride (rows may be strided)");
  return t.size(0) > 1 ? t.stride(0) : t.size(1);
}

// g, u: [P, I] bf16 CUDA, unit column stride, any row stride (e.g. the halves of [P, 2I]).
launch::MoeSwigluArgs swiglu_args(const at::Tensor& g, const at::Tensor& u, const char* op) {
  launch::MoeSwigluArgs a;
  a.g_ld = swiglu_rows(g, "g", op);
  a.u_ld = swiglu_rows(u, "u", op);
  TORCH_CHECK(g.sizes() == u.sizes(), "mok::", op, ": g ", g.sizes(), " and u ", u.sizes(),
              " must have one shape [P, I]");
  a.g = g.data_ptr();
  a.u = u.data_ptr();
  a.num_rows = g.size(0);
  a.inter = g.size(1);
  return a;
}

// h: [P, 2I] bf16, gate and up columns interleaved in blocks of 8 (ops.interleave_gate_up).
launch::MoeSwigluArgs swiglu_interleaved_args(const at::Tensor& h, const char* op) {
  launch::MoeSwigluArgs a;
  a.g_ld = a.u_ld = swiglu_rows(h, "h", op);
  TORCH_CHECK(h.size(1) % 16 == 0, "mok::", op, ": h has ", h.size(1),
              " columns; the interleaved gate/up layout needs a multiple of 16 (I % 8 == 0)");
  const auto* base = static_cast<const at::BFloat16*>(h.data_ptr());
  a.g = base;
  a.u = base + 8;
  a.num_rows = h.size(0);
  a.inter = h.size(1) / 2;
  a.blk_stride = 16;
  return a;
}
}  // namespace

at::Tensor moe_swiglu(const at::Tensor& g, const at::Tensor& u) {
  const auto a = swiglu_args(g, u, "moe_swiglu");
  c10::cuda::CUDAGuard guard(g.device());
  auto out = at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous));
  launch::moe_swiglu_forward(a, out.data_ptr(), stream_of(g));
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_swiglu_backward(const at::Tensor& da, const at::Tensor& g,
                                                       const at::Tensor& u) {
  check(da, "da", at::kBFloat16, 2);
  const auto a = swiglu_args(g, u, "moe_swiglu_backward");
  TORCH_CHECK(da.sizes() == g.sizes(), "mok::moe_swiglu_backward: da ", da.sizes(),
              " must match g and u ", g.sizes());
  TORCH_CHECK(da.device() == g.device() && u.device() == g.device(),
              "mok::moe_swiglu_backward: da, g and u must be on one device");
  c10::cuda::CUDAGuard guard(g.device());
  auto dg = at::empty(da.sizes(), da.options());
  auto du = at::empty(da.sizes(), da.options());
  launch::moe_swiglu_backward(a, da.data_ptr(), dg.data_ptr(), a.inter, du.data_ptr(), a.inter,
                              stream_of(g));
  return {dg, du};
}

at::Tensor moe_swiglu_interleaved(const at::Tensor& h) {
  const auto a = swiglu_interleaved_args(h, "moe_swiglu_interleaved");
  c10::cuda::CUDAGuard guard(h.device());
  auto out = at::empty({a.num_rows, a.inter}, h.options());  // contiguous
  launch::moe_swiglu_forward(a, out.data_ptr(), stream_of(h));
  return out;
}

at::Tensor moe_swiglu_interleaved_backward(const at::Tensor& da, const at::Tensor& h) {
  constexpr const char* kOp = "moe_swiglu_interleaved_backward";
  check(da, "da", at::kBFloat16, 2);
  const auto a = swiglu_interleaved_args(h, kOp);
  TORCH_CHECK(da.size(0) == a.num_rows && da.size(1) == a.inter, "mok::", kOp, ": da ",
              da.sizes(), " must be [P, I] = [", a.num_rows, ", ", a.inter, "] for h ", h.sizes());
  TORCH_CHECK(da.device() == h.device(), "mok::", kOp, ": da is on ", da.device(), ", h on ",
              h.device());
  c10::cuda::CUDAGuard guard(h.device());
  auto d_h = at::empty({a.num_rows, 2 * a.inter}, da.options());
  auto* out = static_cast<at::BFloat16*>(d_h.data_ptr());
  launch::moe_swiglu_backward(a, da.data_ptr(), out, 2 * a.inter, out + 8, 2 * a.inter,
                              stream_of(h));
  return d_h;
}

void moe_accumulate_groups(const at::Tensor& total, const at::Tensor& part, const at::Tensor& offs,
                           const at::Tensor& first_round, int64_t round) {
  check(total, "total", at::kBFloat16, 3);
  check(part, "part", at::kBFloat16, 3);
  check(offs, "offs", at::kInt, 1);
  check(first_round, "first_round", at::kInt, 1);
  TORCH_CHECK(total.sizes() == part.sizes() && offs.size(0) == total.size(0) &&
                  first_round.size(0) == total.size(0),
              "mok::moe_accumulate_groups: total and part must be [G, M, N], offs and first_round "
              "[G]");
  TORCH_CHECK(round >= 0, "mok::moe_accumulate_groups: round must be >= 0");
  c10::cuda::CUDAGuard guard(total.device());
  launch::moe_accumulate_groups(total.data_ptr(), part.data_ptr(), offs.data_ptr<int>(),
                                first_round.data_ptr<int>(), static_cast<int>(round),
                                total.size(0), total.size(1) * total.size(2), stream_of(total));
}

}  // namespace mok::apis
