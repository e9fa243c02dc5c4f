#include "apis/moe_mega.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <tuple>
#include <utility>

#include "apis/comm.h"
#include "apis/fp8_blockwise.h"
#include "apis/moe.h"
#include "apis/tensor_arena.h"
#include "apis/tensor_checks.h"
#include "launch/chain.h"
#include "launch/moe_mega.h"
#include "launch/moe_megakernel.h"
#include "mok/common/fp8_blockwise.cuh"

namespace mok::apis {
namespace {

enum PlanField : int {
#define MOK_FIELD_ENUM(name) kPlan_##name,
  MOK_MEGA_PLAN_FIELDS(MOK_FIELD_ENUM)
#undef MOK_FIELD_ENUM
      kPlanNumFields
};

enum ForwardField : int {
#define MOK_FIELD_ENUM(name) kForward_##name,
  MOK_MEGA_FORWARD_FIELDS(MOK_FIELD_ENUM)
#undef MOK_FIELD_ENUM
      kForwardNumFields
};

enum BackwardField : int {
#define MOK_FIELD_ENUM(name) kBackward_##name,
  MOK_MEGA_BACKWARD_FIELDS(MOK_FIELD_ENUM)
#undef MOK_FIELD_ENUM
      kBackwardNumFields
};

layout::MegaShape mega_shape(const launch::MoeComm& comm, int64_t row_capacity,
                             int64_t num_local_experts, int64_t inter, int64_t minibatch,
                             int64_t macrobatch) {
  TORCH_CHECK(minibatch >= layout::kBlockM && minibatch % layout::kBlockM == 0 &&
                  macrobatch >= minibatch && macrobatch % minibatch == 0,
              "mok::moe_mega: minibatch_size=", minibatch, " must be a multiple of ",
              layout::kBlockM, " and macrobatch_size=", macrobatch, " a multiple of it");
  TORCH_CHECK(inter % 8 == 0 && comm.lay.hidden % 8 == 0, "mok::moe_mega: hidden=",
              comm.lay.hidden, " and intermediate=", inter, " must be multiples of 8");
  return layout::MegaShape{row_capacity,   num_local_experts, comm.lay.hidden,
                           inter,          minibatch,         macrobatch};
}

// The plan tensors from a schedule (the plan kernels, scheduler/plan.cuh).
void add_plan(std::vector<at::Tensor>& t, const layout::MegaShape& s, const launch::MoeComm& comm,
              int64_t token_capacity, cudaStream_t stream) {
  const int64_t e_l = s.num_local_experts, padded = s.num_rounds() * s.ring_rows();
  static_assert(sizeof(layout::MegaTile) == 16);
  // One allocation for the plan's tensors (apis/tensor_arena.h): kept together, by the schedule.
  const std::pair<int, std::pair<std::vector<int64_t>, at::ScalarType>> specs[] = {
      {kPlan_pad_start, {{e_l}, at::kLong}},
      {kPlan_offs, {{e_l}, at::kInt}},
      {kPlan_expert_rows, {{e_l}, at::kLong}},
      {kPlan_first_round, {{e_l}, at::kInt}},
      {kPlan_prow, {{s.row_capacity}, at::kLong}},
      {kPlan_row_tok, {{padded}, at::kLong}},
      {kPlan_w_rows, {{padded}, at::kFloat}},
      {kPlan_row_src, {{padded}, at::kLong}},
      {kPlan_row_dst, {{padded}, at::kLong}},
      {kPlan_token_rows_padded, {{token_capacity, comm.lay.topk}, at::kLong}},
      {kPlan_tile_count, {{s.num_rounds()}, at::kInt}},
      {kPlan_tiles, {{s.num_rounds(), s.max_tiles(), 4}, at::kInt}},
  };
  TensorArena arena(t[kPlan_global_topk]);
  for (const auto& [field, spec] : specs) arena.add(spec.first, spec.second);
  const std::vector<at::Tensor> made = arena.make();
  for (size_t i = 0; i < made.size(); ++i) t[specs[i].first] = made[i];
  scheduler::PlanParams p;
  p.shape = s;
  p.num_ranks = static_cast<int>(comm.lay.num_ranks);
  p.max_tokens = static_cast<int>(comm.lay.max_tokens);
  p.topk = static_cast<int>(comm.lay.topk);
  p.token_capacity = static_cast<int>(token_capacity);
  p.expert_offsets = t[kPlan_expert_offsets].data_ptr<int64_t>();
  p.row_expert = t[kPlan_row_expert].data_ptr<int64_t>();
  p.row_src_rank = t[kPlan_row_src_rank].data_ptr<int64_t>();
  p.row_src_token = t[kPlan_row_src_token].data_ptr<int64_t>();
  p.row_src_slot = t[kPlan_row_src_slot].data_ptr<int64_t>();
  p.row_token_idx = t[kPlan_row_token_idx].data_ptr<int64_t>();
  p.token_rows = t[kPlan_token_rows].data_ptr<int64_t>();
  p.global_weights = t[kPlan_global_weights].data_ptr<float>();
  p.pad_start = t[kPlan_pad_start].data_ptr<int64_t>();
  p.offs = t[kPlan_offs].data_ptr<int32_t>();
  p.expert_rows = t[kPlan_expert_rows].data_ptr<int64_t>();
  p.first_round = t[kPlan_first_round].data_ptr<int32_t>();
  p.prow = t[kPlan_prow].data_ptr<int64_t>();
  p.row_tok = t[kPlan_row_tok].data_ptr<int64_t>();
  p.w_rows = t[kPlan_w_rows].data_ptr<float>();
  p.row_src = t[kPlan_row_src].data_ptr<int64_t>();
  p.row_dst = t[kPlan_row_dst].data_ptr<int64_t>();
  p.token_rows_padded = t[kPlan_token_rows_padded].data_ptr<int64_t>();
  p.tile_count = t[kPlan_tile_count].data_ptr<int32_t>();
  p.tiles = reinterpret_cast<layout::MegaTile*>(t[kPlan_tiles].data_ptr<int32_t>());
  launch::moe_build_plan(p, stream);
}

std::vector<at::Tensor> build_plan(const at::Tensor& topk, const at::Tensor& router_weights,
                                   at::IntArrayRef comm_ints, const launch::MoeComm& comm,
                                   int64_t num_experts, int64_t row_capacity,
                                   int64_t token_capacity, const layout::MegaShape& shape) {
  auto [global_topk, global_weights] = moe_gather_routing(topk, router_weights, comm_ints);
  auto sched = make_schedule(global_topk, comm.rank, num_experts, row_capacity, token_capacity);
  std::vector<at::Tensor> t(kPlanNumFields);
  t[kPlan_global_topk] = global_topk;
  t[kPlan_global_weights] = global_weights;
  for (size_t i = 0; i < sched.fields.size(); ++i) t[kPlan_row_expert + i] = sched.fields[i];
  t[kPlan_slot_row] = sched.slot_row;
  add_plan(t, shape, comm, token_capacity, stream_of(topk));
  return t;
}

// The grid: num_sms CTAs (0: every SM, in clusters as many as the device holds at once),
// rounded down to whole clusters of `cluster` CTAs, checked against the device and the comm CTAs
// (`knob` names the MoKConfig field in the error).
int mega_grid(const at::Tensor& x, int64_t num_sms, int64_t num_comm_sms, int64_t cluster,
              bool backward, const char* knob) {
  int device_sms = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount,
                                        x.device().index()));
  TORCH_CHECK(layout::valid_cluster_ctas(cluster), "mok::moe_mega: megakernel_cluster=", cluster,
              " must be 1 or ", layout::kMaxClusterCtas);
  int given = num_sms > 0 ? static_cast<int>(num_sms) : device_sms;
  if (num_sms <= 0 && cluster > 1) {
    const int resident = launch::megakernel_resident_ctas(backward, static_cast<int>(cluster));
    if (resident > 0 && resident < given) given = resident;
  }
  const int grid = given / static_cast<int>(cluster) * static_cast<int>(cluster);
  TORCH_CHECK(cluster == 1 || grid >= 2 * cluster, "mok::moe_mega: ", given, " SMs hold fewer "
              "than two clusters of megakernel_cluster=", cluster, " CTAs (one pulls, one takes "
              "tasks from the start); give the megakernel more SMs or megakernel_cluster=1");
  TORCH_CHECK(grid <= device_sms && num_comm_sms >= 1 && num_comm_sms < grid, "mok::moe_mega: ",
              knob, "=", num_comm_sms, " must be in [1, ", grid - 1, "] (the megakernel has ",
              grid, " SMs of ", device_sms, "); lower ", knob);
  TORCH_CHECK(num_comm_sms % cluster == 0, "mok::moe_mega: ", knob, "=", num_comm_sms,
              " must be a multiple of megakernel_cluster=", cluster, " (a cluster's CTAs pull and "
              "take tasks together); use an even ", knob, " or megakernel_cluster=1");
  return grid;
}

// The timeline's buffers (zeros: the kernel adds into them), [0, ...] each when not tracing.
std::pair<at::Tensor, at::Tensor> trace_buffers(const at::Tensor& like, bool trace, int grid,
                                                const layout::MegaShape& shape) {
  const auto i64 = opts(like, at::kLong);
  const auto buffer = [&](std::vector<int64_t> sizes) {
    if (trace) return at::zeros(sizes, i64);
    sizes[0] = 0;
    return at::empty(sizes, i64);
  };
  return {buffer({grid, layout::kTraceCtaWords}),
          buffer({shape.num_rounds(), shape.max_tasks(), layout::kTraceTaskWords})};
}

// The token rows the megakernel reads in place (MegaArgs::local_tokens), or null where they are
// staged into the tokens region for the ranks to pull. At one rank no peer reads them, so the
// staging copy and its barriers are only cost (a copy of every token row, 0.14 ms of
// deepseek-v3's 8192-token forward in its profile). Rows that are not 16-byte aligned (a view's
// offset; the Python API refuses them, a direct op call may not) are staged as at several ranks.
const void* tokens_in_place(const launch::MoeComm& comm, const at::Tensor& rows) {
  const bool one_rank = comm.lay.num_ranks == 1;
  return one_rank && reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0 ? rows.data_ptr()
                                                                            : nullptr;
}

// The launch arguments both megakernels share: the workspace, the shape, the grid, the plan.
launch::MegaArgs mega_args(const launch::MoeComm& comm, const layout::MegaShape& shape, int grid,
                           int64_t num_comm_sms, int64_t cluster,
                           const std::vector<at::Tensor>& plan,
                           int64_t stall_minibatch, at::Tensor& trace_ctas,
                           at::Tensor& trace_tasks) {
  launch::MegaArgs a;
  a.lay = comm.lay;
  a.peer_bases = comm.peer_bases;
  a.my_base = comm.my_base;
  a.rank = comm.rank;
  a.timeout_ns = comm.timeout_ns;
  a.error = comm.error_record;
  a.shape = shape;
  a.num_ctas = grid;
  a.num_comm_ctas = static_cast<int>(num_comm_sms);
  a.cluster_ctas = static_cast<int>(cluster);
  a.row_src = plan[kPlan_row_src].data_ptr<int64_t>();
  a.row_dst = plan[kPlan_row_dst].data_ptr<int64_t>();
  a.tile_count = plan[kPlan_tile_count].data_ptr<int32_t>();
  a.tiles = reinterpret_cast<const layout::MegaTile*>(plan[kPlan_tiles].data_ptr<int32_t>());
  a.stall_minibatch = static_cast<int>(stall_minibatch);
  if (trace_ctas.numel() > 0) {
    a.trace_ctas = trace_ctas.data_ptr<int64_t>();
    a.trace_tasks = trace_tasks.data_ptr<int64_t>();
  }
  return a;
}

}  // namespace

std::vector<std::string> moe_mega_plan_fields() {
  return {
#define MOK_FIELD_NAME(name) #name,
      MOK_MEGA_PLAN_FIELDS(MOK_FIELD_NAME)
#undef MOK_FIELD_NAME
  };
}

std::vector<std::string> moe_mega_forward_fields() {
  return {
#define MOK_FIELD_NAME(name) #name,
      MOK_MEGA_FORWARD_FIELDS(MOK_FIELD_NAME)
#undef MOK_FIELD_NAME
  };
}

std::vector<std::string> moe_mega_backward_fields() {
  return {
#define MOK_FIELD_NAME(name) #name,
      MOK_MEGA_BACKWARD_FIELDS(MOK_FIELD_NAME)
#undef MOK_FIELD_NAME
  };
}

std::vector<at::Tensor> moe_mega_plan(const at::Tensor& topk, const at::Tensor& router_weights,
                                      at::IntArrayRef comm_ints, int64_t num_experts,
                                      int64_t row_capacity, int64_t token_capacity, int64_t inter,
                                      int64_t minibatch, int64_t macrobatch) {
  const auto comm = comm_of(comm_ints);
  const launch::ChainScope chain(comm.chained);
  c10::cuda::CUDAGuard guard(topk.device());
  const auto shape = mega_shape(comm, row_capacity, num_experts / comm.lay.num_ranks, inter,
                                minibatch, macrobatch);
  return build_plan(topk, router_weights, comm_ints, comm, num_experts, row_capacity,
                    token_capacity, shape);
}

std::vector<at::Tensor> moe_mega_forward(
    const at::Tensor& x, const at::Tensor& topk, const at::Tensor& router_weights,
    const at::Tensor& w_gate_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& shared_out, at::TensorList given_plan,
    at::IntArrayRef comm_ints, int64_t num_experts, int64_t row_capacity, int64_t token_capacity,
    int64_t minibatch, int64_t macrobatch, int64_t num_comm_sms, int64_t num_sms, bool save,
    bool keep_y, int64_t stall_minibatch, bool trace, int64_t cluster, int64_t stall_l2_cta,
    const std::optional<at::Tensor>& w_gate_up_scales,
    const std::optional<at::Tensor>& w_down_scales, bool rows_in_place, bool keep_rings,
    int64_t order_block) {
  const auto comm = comm_of(comm_ints);
  const launch::ChainScope chain(comm.chained);
  const auto& lay = comm.lay;
  const bool fp8 = w_gate_up_scales.has_value();
  // NOTE: checked before anything is enqueued (as the knobs' checks below): a refused call
  // leaves nothing that peers wait on
  TORCH_CHECK(order_block == 0 || layout::valid_order_block(order_block),
              "mok::moe_mega_forward: order_block=", order_block, " must be 0 (auto), ",
              layout::kOrderBlockSmall, " or ", layout::kOrderBlockTiles,
              " (MoKConfig.megakernel_order_block: 'auto', 8 or 16)");
  TORCH_CHECK(fp8 == w_down_scales.has_value(), "mok::moe_mega_forward: w_gate_up_scales and "
              "w_down_scales are both given (FP8 weights) or neither (bf16)");
  check(x, "x", at::kBFloat16, 2);
  check(topk, "topk", at::kLong, 2);
  check(router_weights, "router_weights", at::kFloat, 2);
  TORCH_CHECK(topk.size(0) == x.size(0) && topk.size(1) == lay.topk &&
                  router_weights.sizes() == topk.sizes(),
              "mok::moe_mega_forward: topk ", topk.sizes(), " / router_weights ",
              router_weights.sizes(), " must be [T, K] = [", x.size(0), ", ", lay.topk, "]");
  const auto w_dtype = fp8 ? at::kFloat8_e4m3fn : at::kBFloat16;
  check(w_gate_up, "w_gate_up", w_dtype, 3);
  check(w_down, "w_down", w_dtype, 3);
  const int64_t e_l = num_experts / lay.num_ranks, inter = w_down.size(2);
  if (fp8) {
    constexpr int64_t kBlock = fp8_blockwise::kBlock;
    TORCH_CHECK(lay.hidden % kBlock == 0 && inter % kBlock == 0,
                "mok::moe_mega_forward: FP8 weights need hidden=", lay.hidden,
                " and intermediate=", inter, " to be multiples of 128 (the FP8 blocks)");
    check(*w_gate_up_scales, "w_gate_up_scales", at::kFloat, 3);
    check(*w_down_scales, "w_down_scales", at::kFloat, 3);
    TORCH_CHECK(w_gate_up_scales->sizes() ==
                        at::IntArrayRef({e_l, 2 * inter / kBlock, lay.hidden / kBlock}) &&
                    w_down_scales->sizes() ==
                        at::IntArrayRef({e_l, lay.hidden / kBlock, inter / kBlock}),
                "mok::moe_mega_forward: w_gate_up_scales ", w_gate_up_scales->sizes(),
                " / w_down_scales ", w_down_scales->sizes(), " must be the (128, 128) blocks' [",
                e_l, ", ", 2 * inter / kBlock, ", ", lay.hidden / kBlock, "] / [", e_l, ", ",
                lay.hidden / kBlock, ", ", inter / kBlock, "]");
    TORCH_CHECK(cluster == 1, "mok::moe_mega_forward: the FP8 megakernel runs without clusters "
                "(megakernel_cluster=", cluster, "); use MoKConfig.megakernel_cluster=1 with "
                "expert_precision='fp8_blockwise'");
  }
  TORCH_CHECK(x.size(0) <= lay.max_tokens && x.size(1) == lay.hidden, "mok::moe_mega_forward: x ",
              x.sizes(), " does not fit the workspace [<=", lay.max_tokens, ", ", lay.hidden, "]");
  TORCH_CHECK(w_gate_up.size(0) == e_l && w_gate_up.size(1) == 2 * inter &&
                  w_gate_up.size(2) == lay.hidden && w_down.size(0) == e_l &&
                  w_down.size(1) == lay.hidden,
              "mok::moe_mega_forward: w_gate_up ", w_gate_up.sizes(), " / w_down ",
              w_down.sizes(), " must be [E_l, 2I, H] / [E_l, H, I] with E_l=", e_l);
  if (shared_out.has_value()) {
    check(*shared_out, "shared_out", at::kBFloat16, 2);
    TORCH_CHECK(shared_out->sizes() == x.sizes(), "mok::moe_mega_forward: shared_out must be [T, H]");
  }
  const auto shape = mega_shape(comm, row_capacity, e_l, inter, minibatch, macrobatch);
  TORCH_CHECK(lay.slot_rows == 1 && lay.counter_words >= shape.counter_words(),
              "mok::moe_mega_forward: the workspace was not made for the megakernel (its layout "
              "lacks the slot_rows / counters regions for this shape)");
  TORCH_CHECK(!rows_in_place || (lay.num_ranks == 1 && cluster == 1),
              "mok::moe_mega_forward: rows in place (MoKConfig.fwd_rows='in_place') need one "
              "rank and megakernel_cluster=1 (num_ranks=", lay.num_ranks, ", cluster=", cluster,
              "); use fwd_rows='pull' or 'auto'");
  TORCH_CHECK(!rows_in_place || stall_minibatch < 0, "mok::moe_mega_forward: stall_minibatch "
              "(a test's fault) needs pulled rows, not rows in place");
  // FP8 rows in place read x quantised in place, its data rows and their scales apart
  // (roles/megakernel_fp8.cuh); a forward that keeps its tokens for the backward's rounds
  // stages them as packed rows, which only the pull reads.
  TORCH_CHECK(!(fp8 && rows_in_place && save && shape.num_rounds() > 1 && x.size(0) > 0),
              "mok::moe_mega_forward: FP8 rows in place read x quantised in place, which a forward "
              "of several macrobatch rounds that keeps its tokens for the backward stages "
              "instead; use fwd_rows='pull' (or 'auto', which pulls there)");
  c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = stream_of(x);
  std::vector<at::Tensor> plan;
  if (!given_plan.empty()) {
    TORCH_CHECK(given_plan.size() == kPlanNumFields, "mok::moe_mega_forward: plan must hold ",
                kPlanNumFields, " tensors (moe_mega_plan's) or none");
    plan.assign(given_plan.begin(), given_plan.end());
  } else {
    plan = build_plan(topk, router_weights, comm_ints, comm, num_experts, row_capacity,
                      token_capacity, shape);
  }
  const int grid = mega_grid(x, num_sms, num_comm_sms, cluster, false, "fwd_num_comm_sms");
  TORCH_CHECK(stall_l2_cta >= -1 && stall_l2_cta < grid, "mok::moe_mega_forward: stall_l2_cta=",
              stall_l2_cta, " must be -1 or a CTA of the grid's ", grid);

  const int64_t ring = shape.ring_rows(), rounds = shape.num_rounds();
  const auto bf16 = x.options();
  std::vector<at::Tensor> out(kForwardNumFields);
  const bool keep_rows = save && rounds == 1, keep_tokens = save && rounds > 1;
  TORCH_CHECK(!keep_rings || (keep_tokens && !fp8), "mok::moe_mega_forward: keep_rings keeps "
              "the last round's act and h rings of a bf16 forward of several macrobatch rounds "
              "that saves for a backward (save=", save, ", rounds=", rounds, ", fp8=", fp8, ")");
  if (keep_rows) {
    // NOTE: one allocation each, not an arena: the backward lets each ring go after its last
    // read (y and act in its first step, h and x_rows in its second), which lowers its peak.
    out[kForward_x_ring] = at::empty({fp8 || rows_in_place ? 0 : ring, lay.hidden}, bf16);
    out[kForward_act_ring] = at::empty({ring, inter}, bf16);
    out[kForward_h_ring] = at::empty({ring, 2 * inter}, bf16);
    out[kForward_y_rows] = at::empty({keep_y ? ring : 0, lay.hidden}, bf16);
  } else {  // x_ring (and act_ring unless kept) are dropped after the pass: not in one
            // storage with x_recv
    out[kForward_x_ring] = at::empty({fp8 || rows_in_place ? 0 : ring, lay.hidden}, bf16);
    // FP8: the L2 reads act's FP8 copy; the bf16 act is for a backward only, so none here.
    out[kForward_act_ring] = at::empty({fp8 ? 0 : ring, inter}, bf16);
    // keep_rings: every round's L1 epilogue stores h as well, so both rings end holding the
    // last round that has rows, which the backward in rounds then needs not recompute.
    out[kForward_h_ring] = at::empty({keep_rings ? ring : 0, 2 * inter}, bf16);
    out[kForward_y_rows] = at::empty({0, lay.hidden}, bf16);
  }
  out[kForward_x_recv] = at::empty({keep_tokens ? token_capacity : 0, lay.hidden}, bf16);
  std::tie(out[kForward_trace_ctas], out[kForward_trace_tasks]) =
      trace_buffers(x, trace, grid, shape);
  const int num_tokens = static_cast<int>(x.size(0));
  // The token rows the megakernel pulls: x, or with FP8 weights x quantised in (1, 128) blocks:
  // at one rank read in place as the quantiser wrote them (data rows, scales apart), else
  // staged as stage 1's packed FP8 rows (its FP8 dispatch's; moe_fp8_pack_rows).
  at::Tensor tokens = x, token_scales;
  if (fp8) {
    std::tie(tokens, token_scales) = fp8_blockwise_quantize(x.contiguous(), 1,
                                                            fp8_blockwise::kBlock, false);
  }
  const void* in_place = keep_tokens ? nullptr : tokens_in_place(comm, tokens);
  if (fp8 && in_place == nullptr) {
    tokens = moe_fp8_pack_rows(tokens, token_scales);
    token_scales = at::Tensor();
  }
  // No tokens: no rows to read (and none to pull). Otherwise x is quantised in place here (the
  // check above refused the forward that stages it).
  const bool fp8_rows_in_place = fp8 && rows_in_place && num_tokens > 0;
  TORCH_CHECK(!fp8_rows_in_place || (in_place != nullptr && token_scales.defined()),
              "mok::moe_mega_forward: internal: FP8 rows in place without x quantised in place");
  if (keep_tokens) {  // the backward recomputes rounds from the received tokens
    launch::moe_dispatch(comm, x.data_ptr(), num_tokens, comm.lay.hidden,
                         plan[kPlan_recv_token_src].data_ptr<int64_t>(),
                         static_cast<int>(token_capacity), out[kForward_x_recv].data_ptr(), stream);
  }
  if (in_place == nullptr) {  // NOTE: after a dispatch, whose rows in the tokens region it replaces
    launch::moe_stage_tokens(comm, tokens.data_ptr(), num_tokens, tokens.size(1), stream);
  }
  launch::moe_zero_dropped_slots(comm, plan[kPlan_global_topk].data_ptr<int64_t>(),
                                 plan[kPlan_slot_row].data_ptr<int>(), e_l, stream);
  launch::moe_bump_epoch(comm, static_cast<int>(shape.num_rounds()), stream);

  launch::MegaArgs a = mega_args(comm, shape, grid, num_comm_sms, cluster, plan, stall_minibatch,
                                 out[kForward_trace_ctas], out[kForward_trace_tasks]);
  a.stall_l2_cta = static_cast<int>(stall_l2_cta);
  // 'auto': from the rows this rank's experts are expected to get (every rank sending as many
  // tokens as this one), known before the routing is
  a.order_block = order_block != 0 ? static_cast<int>(order_block)
                                   : layout::auto_order_block(
                                         lay.num_ranks * x.size(0) * topk.size(1) * e_l /
                                             num_experts,
                                         e_l, shape.l1_ntiles(), grid);
  a.local_tokens = in_place;
  a.w_gate_up = w_gate_up.data_ptr();
  a.w_down = w_down.data_ptr();
  a.x_ring = fp8 || rows_in_place ? nullptr : out[kForward_x_ring].data_ptr();
  if (fp8_rows_in_place) {
    a.rows_in_place = true;
    a.token_rows = num_tokens;
  } else if (rows_in_place && !fp8) {
    // x in place, or where the tokens were staged (several rounds kept, unaligned rows) or there
    // are none (a descriptor needs a row: the region's, never read), this rank's tokens region
    const bool staged = in_place == nullptr || num_tokens == 0;
    a.rows_in_place = true;
    a.rows = staged ? lay.at<void>(comm.my_base, layout::Region::kTokens) : in_place;
    a.token_rows = staged ? lay.max_tokens : num_tokens;
  }
  a.act_ring = out[kForward_act_ring].numel() > 0 ? out[kForward_act_ring].data_ptr() : nullptr;
  a.h_ring = keep_rows || keep_rings ? out[kForward_h_ring].data_ptr() : nullptr;
  a.y_rows = keep_rows && keep_y ? out[kForward_y_rows].data_ptr() : nullptr;
  std::vector<at::Tensor> rings;  // FP8: the rings and their M-major scales, for the launch only
  if (fp8) {
    const int64_t stride = shape.fp8_scale_stride(), h = lay.hidden, kb = fp8_blockwise::kBlock;
    TensorArena arena(x);
    arena.add({fp8_rows_in_place ? 0 : ring, h}, at::kByte);  // in place: no x8 ring
    arena.add({h / kb, stride}, at::kFloat);
    arena.add({ring, inter}, at::kByte);
    arena.add({inter / kb, stride}, at::kFloat);
    rings = arena.make();
    a.fp8 = true;
    a.local_token_scales = token_scales.defined() ? token_scales.data_ptr<float>() : nullptr;
    a.w_gate_up_scales = w_gate_up_scales->data_ptr<float>();
    a.w_down_scales = w_down_scales->data_ptr<float>();
    a.x8_ring = rings[0].data_ptr();
    a.x_scales = rings[1].data_ptr<float>();
    a.act8_ring = rings[2].data_ptr();
    a.act_scales = rings[3].data_ptr<float>();
  }
  launch::moe_megakernel(a, stream);

  out[kForward_out] = at::empty({x.size(0), lay.hidden}, bf16);
  launch::moe_reduce_slot_rows(comm, topk.data_ptr<int64_t>(), router_weights.data_ptr<float>(),
                               num_experts, shared_out ? shared_out->data_ptr() : nullptr,
                               out[kForward_out].data_ptr(), num_tokens, stream);
  out.insert(out.end(), plan.begin(), plan.end());
  return out;
}

std::vector<at::Tensor> moe_mega_backward(
    const at::Tensor& d_out, const at::Tensor& topk, at::TensorList given_plan,
    const at::Tensor& act_ring, const at::Tensor& h_ring, const at::Tensor& w_gate_up,
    const at::Tensor& w_down, const std::optional<at::Tensor>& shared_dx,
    at::IntArrayRef comm_ints, int64_t num_experts, int64_t row_capacity, int64_t minibatch,
    int64_t macrobatch, int64_t num_comm_sms, int64_t num_sms, int64_t stall_minibatch,
    bool trace, int64_t cluster, int64_t round,
    const std::optional<at::Tensor>& wgrad_down, bool wgrad_accumulate, bool wgrad_interleave) {
  const auto comm = comm_of(comm_ints);
  const launch::ChainScope chain(comm.chained);
  const auto& lay = comm.lay;
  check(d_out, "d_out", at::kBFloat16, 2);
  check(topk, "topk", at::kLong, 2);
  check(w_gate_up, "w_gate_up", at::kBFloat16, 3);
  check(w_down, "w_down", at::kBFloat16, 3);
  const int64_t e_l = num_experts / lay.num_ranks, inter = w_down.size(2);
  TORCH_CHECK(topk.size(0) == d_out.size(0) && topk.size(1) == lay.topk,
              "mok::moe_mega_backward: topk ", topk.sizes(), " must be [T, K] = [", d_out.size(0),
              ", ", lay.topk, "]");
  TORCH_CHECK(d_out.size(0) <= lay.max_tokens && d_out.size(1) == lay.hidden,
              "mok::moe_mega_backward: d_out ", d_out.sizes(), " does not fit the workspace [<=",
              lay.max_tokens, ", ", lay.hidden, "]");
  TORCH_CHECK(w_gate_up.size(0) == e_l && w_gate_up.size(1) == 2 * inter &&
                  w_gate_up.size(2) == lay.hidden && w_down.size(0) == e_l &&
                  w_down.size(1) == lay.hidden,
              "mok::moe_mega_backward: w_gate_up ", w_gate_up.sizes(), " / w_down ",
              w_down.sizes(), " must be [E_l, 2I, H] / [E_l, H, I] with E_l=", e_l);
  const auto shape = mega_shape(comm, row_capacity, e_l, inter, minibatch, macrobatch);
  const int64_t rounds = shape.num_rounds();
  TORCH_CHECK(rounds == 1 ? round == -1 || round == 0 : round >= 0 && round < rounds,
              "mok::moe_mega_backward: round=", round, " of ", rounds, " macrobatch rounds "
              "(row_capacity=", row_capacity, ", macrobatch_size=", macrobatch, "): one round "
              "takes round -1 (or 0), several one call per round, the last round first");
  // Several rounds: the calls take them last first (the forward's kept rings hold its last
  // rows); the first call stages d_out, round 0's sums the slots every call filled.
  const bool first_call = round == -1 || round == rounds - 1, last_call = round <= 0;
  const int64_t ring = shape.ring_rows(), ring_base = std::max<int64_t>(round, 0) * ring;
  check(act_ring, "act_ring", at::kBFloat16, 2);
  check(h_ring, "h_ring", at::kBFloat16, 2);
  TORCH_CHECK(act_ring.size(0) == ring && act_ring.size(1) == inter && h_ring.size(0) == ring &&
                  h_ring.size(1) == 2 * inter,
              "mok::moe_mega_backward: act_ring ", act_ring.sizes(), " / h_ring ", h_ring.sizes(),
              " must be the forward's kept rings [", ring, ", ", inter, "] / [", ring, ", ",
              2 * inter, "]");
  if (shared_dx.has_value()) {
    check(*shared_dx, "shared_dx", at::kBFloat16, 2);
    TORCH_CHECK(shared_dx->sizes() == d_out.sizes(),
                "mok::moe_mega_backward: shared_dx must be [T, H]");
  }
  TORCH_CHECK(lay.slot_rows == 1 && lay.counter_words >= shape.counter_words(),
              "mok::moe_mega_backward: the workspace was not made for the megakernel (its layout "
              "lacks the slot_rows / counters regions for this shape)");
  TORCH_CHECK(given_plan.size() == kPlanNumFields, "mok::moe_mega_backward: plan must hold ",
              kPlanNumFields, " tensors (the forward's moe_mega_plan)");
  const std::vector<at::Tensor> plan(given_plan.begin(), given_plan.end());
  c10::cuda::CUDAGuard guard(d_out.device());
  const cudaStream_t stream = stream_of(d_out);
  const int grid = mega_grid(d_out, num_sms, num_comm_sms, cluster, true, "bwd_num_comm_sms");
  TORCH_CHECK(wgrad_down.has_value() || !wgrad_interleave,
              "mok::moe_mega_backward: wgrad_interleave orders the down weight's gradient tasks: "
              "it needs wgrad_down");
  if (wgrad_down.has_value()) {
    const at::Tensor& dw = *wgrad_down;
    TORCH_CHECK(dw.scalar_type() == (wgrad_accumulate ? at::kFloat : at::kBFloat16),
                "mok::moe_mega_backward: wgrad_down must be bf16 (stored) or, with "
                "wgrad_accumulate, float32 (main_grad, added into), not ", dw.scalar_type(),
                wgrad_accumulate ? " added into" : " stored");
    TORCH_CHECK(dw.device() == d_out.device() && dw.is_contiguous() && dw.dim() == 3 &&
                    dw.size(0) == e_l && dw.size(1) == lay.hidden && dw.size(2) == inter,
                "mok::moe_mega_backward: wgrad_down ", dw.sizes(), " must be a contiguous [E_l, "
                "H, I] = [", e_l, ", ", lay.hidden, ", ", inter, "] tensor on d_out's device");
    TORCH_CHECK(rounds == 1 && cluster == 1,
                "mok::moe_mega_backward: the down weight's gradient inside the launch "
                "(MoKConfig.bwd_wgrad='down') runs in one macrobatch round without clusters "
                "(rounds=", rounds, ", cluster=", cluster, "); use bwd_wgrad='off'");
  }

  const auto bf16 = d_out.options();
  std::vector<at::Tensor> out(kBackwardNumFields);
  // NOTE: one allocation each: the backward lets d_rows go after the down weight's gradient and
  // d_h after gate/up's.
  out[kBackward_d_rows] = at::empty({ring, lay.hidden}, bf16);
  out[kBackward_d_h] = at::empty({ring, 2 * inter}, bf16);
  out[kBackward_d_row_w] = at::empty({ring}, opts(d_out, at::kFloat));
  const at::Tensor partials = at::empty({ring, shape.dgrad_ntiles()}, opts(d_out, at::kFloat));
  std::tie(out[kBackward_trace_ctas], out[kBackward_trace_tasks]) =
      trace_buffers(d_out, trace, grid, shape);
  const int num_tokens = static_cast<int>(d_out.size(0));
  const void* in_place = tokens_in_place(comm, d_out);
  if (in_place == nullptr && first_call) {
    launch::moe_stage_tokens(comm, d_out.data_ptr(), num_tokens, comm.lay.hidden, stream);
  }
  if (first_call) {
    launch::moe_zero_dropped_slots(comm, plan[kPlan_global_topk].data_ptr<int64_t>(),
                                   plan[kPlan_slot_row].data_ptr<int>(), e_l, stream);
  }
  // Each call a pass of its own for the counters, with the plan's stride (MegaParams::generation).
  launch::moe_bump_epoch(comm, static_cast<int>(rounds), stream);

  launch::MegaArgs a = mega_args(comm, shape, grid, num_comm_sms, cluster, plan, stall_minibatch,
                                 out[kBackward_trace_ctas], out[kBackward_trace_tasks]);
  a.backward = true;
  a.local_tokens = in_place;
  a.w_gate_up = w_gate_up.data_ptr();
  a.w_down = w_down.data_ptr();
  a.x_ring = out[kBackward_d_rows].data_ptr();
  a.act_ring = act_ring.data_ptr();
  a.h_ring = h_ring.data_ptr();
  a.dh_ring = out[kBackward_d_h].data_ptr();
  a.w_rows = plan[kPlan_w_rows].data_ptr<float>();
  a.rw_partials = partials.data_ptr<float>();
  a.round = rounds == 1 ? -1 : static_cast<int>(round);
  // The down weight's gradient in the launch: its B rows first (a buffer alive for the launch).
  at::Tensor wgrad_b, wgrad_starts;
  if (wgrad_down.has_value()) {
    wgrad_b = at::empty({shape.wgrad_b_rows(), inter}, bf16);
    wgrad_starts = at::empty({e_l}, opts(d_out, at::kInt));
    const int32_t* ends = plan[kPlan_offs].data_ptr<int32_t>();
    launch::moe_wgrad_b_rows(act_ring.data_ptr(), plan[kPlan_w_rows].data_ptr<float>(), ends,
                             static_cast<int>(e_l), shape.wgrad_b_rows(), inter,
                             wgrad_starts.data_ptr<int32_t>(), wgrad_b.data_ptr(), stream);
    a.wgrad_b = wgrad_b.data_ptr();
    a.wgrad_ends = ends;
    a.wgrad_b_starts = wgrad_starts.data_ptr<int32_t>();
    a.wgrad_out = wgrad_down->data_ptr();
    a.wgrad_mode = wgrad_accumulate ? layout::kWgradAddF32 : layout::kWgradStore;
    a.wgrad_interleave = wgrad_interleave;
  }
  launch::moe_megakernel(a, stream);

  out[kBackward_d_x] = at::empty({last_call ? d_out.size(0) : 0, lay.hidden}, bf16);
  if (last_call) {
    launch::moe_reduce_slot_rows(comm, topk.data_ptr<int64_t>(), nullptr, num_experts,
                                 shared_dx ? shared_dx->data_ptr() : nullptr,
                                 out[kBackward_d_x].data_ptr(), num_tokens, stream);
  }
  launch::moe_sum_row_partials(partials.data_ptr<float>(), shape.dgrad_ntiles(),
                               plan[kPlan_row_tok].data_ptr<int64_t>() + ring_base,
                               out[kBackward_d_row_w].data_ptr<float>(), ring, stream);
  return out;
}

}  // namespace mok::apis
