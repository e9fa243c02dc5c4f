#!/usr/bin/env bash
# Regenerates docs/PERF.md and docs/perf.png with scripts/perf_report.py from the records that
# page is made of: edit the lists below (not the page) when a record is added or retired.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R=docs/results
PY="${PYTHON:-python3}"
records=(
  bench_moe_h100_ep1_chained_16d8959_qwen3-30b-a3b_unchained.json
  bench_moe_h100_ep1_chained_16d8959_qwen3-30b-a3b_chained.json
  bench_moe_h100_ep1_chained_16d8959_mixtral-8x7b_unchained.json
  bench_moe_h100_ep1_chained_9f518d5_qwen3-30b-a3b.json
  bench_moe_h100_ep1_chained_8d98f6d_qwen3_1.json
  bench_moe_h100_ep1_chained_8d98f6d_qwen3_2.json
  bench_moe_h100_ep1_chained_8d98f6d_mixtral.json
  bench_moe_h200_ep1_graph_9edf5e4_rows_qwen3_fwdbwd.json
  bench_moe_h200_ep1_graph_9edf5e4_rows_deepseek-v3_16384.json
  bench_moe_h200_ep1_graph_9edf5e4_rows_qwen3-30b-a3b.json
  bench_moe_h200_ep1_graph_9edf5e4_rows_deepseek-v3.json
  bench_moe_h200_ep1_fp8mega_deepseek_d4c27b6.json
  bench_moe_h200_ep1_graph_ac16e4f_rows.json
  bench_moe_h200_ep1_fp8mega_deepseek_ac16e4f_rows.json
  bench_moe_h200_ep1_graph_82f068c.json
  bench_moe_h200_ep1_fp8mega_deepseek_82f068c.json
  bench_moe_h200_ep1_graph_25c52a9.json
  bench_moe_h100_ep1_rows_qwen3_f92b268.json
  bench_moe_h200_ep1_ceiling_0d9dae0.json
  bench_moe_h200_ep1_ceiling_f94e43d.json
  bench_moe_h200_ep1_cluster2_efe26e3.json
  bench_moe_h200_ep1_b2b_7098afa.json
  bench_moe_h200_ep1_bwd_4a24211.json
  bench_moe_h200_ep1_bwd_15fe76a.json
  bench_moe_h200_ep1_bwd_34ef3a1.json
  bench_moe_h200_ep1_maingrad_bwd_15fe76a.json
  bench_moe_h200_ep1_abd30ba.json
  bench_moe_h200_ep1_graph_c19af20.json
  bench_moe_h200x2_ep2_b6e971e.json
  bench_moe_h200x2_ep1_b6e971e.json
  bench_moe_h200_ep1_deepseek_fc524bd.json
)
compares=(  # BEFORE AFTER pairs
  bench_moe_h100_ep1_main_grad_main_91efcac.json bench_moe_h100_ep1_main_grad_2c295e3.json
  bench_moe_h100_ep1_main_grad_main_91efcac.json bench_moe_h100_ep1_main_grad_reduce_89e1648.json
  bench_moe_h200_ep1_graph_82f068c.json bench_moe_h200_ep1_graph_ac16e4f_rows.json
  bench_moe_h200_ep1_maingrad_deepseek_82f068c.json bench_moe_h200_ep1_maingrad_deepseek_f92b268.json
  bench_moe_h200_ep1_hostab_82f068c_1.json bench_moe_h200_ep1_hostab_269f051_1.json
  bench_moe_h200_ep1_hostab_82f068c_2.json bench_moe_h200_ep1_hostab_269f051_2.json
  bench_moe_h100_ep1_hostab_31d4a38_1.json bench_moe_h100_ep1_hostab_14bf0d4_1.json
  bench_moe_h100_ep1_hostab_31d4a38_2.json bench_moe_h100_ep1_hostab_14bf0d4_2.json
  bench_moe_h100_ep1_hostab_31d4a38_3.json bench_moe_h100_ep1_hostab_14bf0d4_3.json
  bench_moe_h100_ep1_fwdgraph_527358d_1.json bench_moe_h100_ep1_fwdgraph_f92b268_1.json
  bench_moe_h100_ep1_fwdgraph_527358d_2.json bench_moe_h100_ep1_fwdgraph_f92b268_2.json
  bench_moe_h100_ep1_maingrad_527358d_1.json bench_moe_h100_ep1_maingrad_f92b268_1.json
  bench_moe_h100_ep1_maingrad_527358d_2.json bench_moe_h100_ep1_maingrad_f92b268_2.json
  bench_moe_h100_ep1_maingrad_527358d_3.json bench_moe_h100_ep1_maingrad_f92b268_3.json
  bench_moe_h200_ep1_graph_ed574ac.json bench_moe_h200_ep1_graph_2defa24.json
  bench_moe_h200_ep1_graph_62ca1f1.json bench_moe_h200_ep1_graph_05618ca.json
  bench_moe_h200_ep1_bwd_15fe76a.json bench_moe_h200_ep1_bwd_4a24211.json
  bench_moe_h200_ep1_abd30ba.json bench_moe_h200_ep1_bwd_15fe76a.json
  bench_moe_h200_ep1_3b98cc0.json bench_moe_h200_ep1_abd30ba.json
  bench_moe_h200_ep1_abd30ba.json bench_moe_h200_ep1_d7463ac.json
)
traces=(
  megakernel_trace_h100_ced3dd8_clock_keep.json
  megakernel_trace_h100_ced3dd8_clock_fp8.json
  megakernel_trace_bwd_h100_ced3dd8_clock.json
  megakernel_trace_h100_16d8959_split_keep.json
  megakernel_trace_bwd_h100_16d8959_split.json
  megakernel_trace_h100_16d8959_keep_diag.json
  megakernel_trace_h100_16d8959-exp-nosilu_keep_diag.json
  megakernel_trace_h100_16d8959-exp-nofence_keep_diag.json
  megakernel_trace_h200_6011da7_rows_in_place_off.json
  megakernel_trace_h200_8fdbd6b_rows_in_place_ab.json
  megakernel_trace_h200_82f068c_rows_in_place_ab.json
  megakernel_trace_h200_d4c27b6_rows_pull.json
  megakernel_trace_h200_d4c27b6_rows_in_place.json
  megakernel_trace_bwd_h200_527358d.json
  megakernel_trace_bwd_h200_82f068c.json
  megakernel_trace_h100_f92b268_fp8_pull.json
  megakernel_trace_h100_f92b268_fp8_in_place.json
  megakernel_trace_bwd_h100_527358d_ab.json
  megakernel_trace_bwd_h100_f92b268_ab.json
  megakernel_trace_h200_ed574ac_keep.json
  megakernel_trace_bwd_h200_ed574ac.json
  megakernel_trace_h200_e05a227_keep.json
  megakernel_trace_h200_efe26e3_cluster2_keep.json
  megakernel_trace_bwd_h200_e05a227.json
  megakernel_trace_bwd_h200_efe26e3_cluster2.json
  megakernel_trace_h200_62ca1f1_keep.json
  megakernel_trace_h200_05618ca_keep.json
  megakernel_trace_bwd_h200_62ca1f1.json
  megakernel_trace_bwd_h200_05618ca.json
  megakernel_trace_h200_bd40079.json
  megakernel_trace_h200_bd40079_qwen3_comm8.json
  megakernel_trace_h200_9665dea.json
  megakernel_trace_h200_9665dea_qwen3_comm8.json
  megakernel_trace_h200_3941f23.json
  megakernel_trace_h200_3941f23_qwen3_comm8.json
  megakernel_trace_h200_3941f23_qwen3_comm16.json
  megakernel_trace_h200_bd40079_qwen3_rerun.json
  megakernel_trace_h200_0599c9f_qwen3.json
  megakernel_trace_h200_bd81656.json
  megakernel_trace_h200_53dea2a.json
  megakernel_trace_bwd_h200_bd81656.json
  megakernel_trace_bwd_h200_15fe76a.json
  megakernel_trace_h200_f4b7c9a_fp8.json
  megakernel_trace_h200_f4b7c9a_fp8_exp_nopromotion.json
  megakernel_trace_h200_f4b7c9a_fp8_exp_halfb.json
  megakernel_trace_h200_58060f8_fp8.json
  megakernel_trace_h200_f1633e7_fp8_gaps.json
  megakernel_trace_h200_788a417_fp8.json
  megakernel_trace_h200_f1633e7_gaps.json
  megakernel_trace_h200_788a417.json
  megakernel_trace_h200_6d02663_fp8.json
  megakernel_trace_h200_6d02663.json
  megakernel_trace_h200_aad5166.json
  megakernel_trace_h200_6d02663_run_bulk.json
  megakernel_trace_h200_5327061_bulk.json
  megakernel_trace_h200_6d02663_run_bulk_fp8.json
  megakernel_trace_h200_5327061_bulk_fp8.json
  megakernel_trace_h200_6d02663_stagepull.json
  megakernel_trace_h200_db4c163_stagepull.json
  megakernel_trace_h200_fefeac9_pull.json
  megakernel_trace_h200_fefeac9_in_place.json
  megakernel_trace_h200_fefeac9_pull_2.json
  megakernel_trace_h200_fefeac9_in_place_2.json
)
args=()
for r in "${records[@]}"; do args+=("$R/$r"); done
for ((i = 0; i < ${#compares[@]}; i += 2)); do
  args+=(--compare "$R/${compares[i]}" "$R/${compares[i + 1]}")
done
# session 45's same-call A/B on one H100: main's build first (the tables' baseline), then the
# builds with the patches docs/results/exp_*_62c71f9 / 54353b1 / 686e1b8
args+=(--trace-ab)
for b in 62c71f9 62c71f9-exp-evictb 62c71f9-exp-evictout 62c71f9-exp-both 62c71f9-exp-block8; do
  for r in 1 2; do
    args+=("$R/megakernel_trace_h100_${b}_ab_$r.json" "$R/megakernel_trace_h100_${b}_ab_${r}_fp8.json")
  done
done
for b in 62c71f9 62c71f9-exp-block8; do
  for r in 1 2; do
    args+=("$R/megakernel_trace_h100_${b}_ab16k_$r.json" "$R/megakernel_trace_h100_${b}_ab16k_${r}_fp8.json")
  done
done
# session 46's same-call A/B on one H100 (the forward split by m-tile rows): main's build, then
# it with the swapped tail tile (docs/results/exp_tail_swap_035726b.patch)
for b in 4de199e 4de199e-exp-tailswap; do
  for r in 1 2; do args+=("$R/megakernel_trace_h100_${b}_tiles_$r.json"); done
done
# session 47's same-call A/B on one H100 (the weight stream): main's build, then it with the
# weight tiles prefetched into the L2 4 and 8 k-tiles ahead (docs/results/
# exp_weight_prefetch{4,8}_95ad45f.patch) and with every task reading expert 0's first two
# n-tiles, which stay in the L2 (exp_weights_from_l2_fc49499.patch; wrong outputs, timing only)
for b in 4de199e 4de199e-exp-wpf4 4de199e-exp-wpf8 4de199e-exp-wl2; do
  for r in 1 2; do
    args+=("$R/megakernel_trace_h100_${b}_weights_$r.json" "$R/megakernel_trace_h100_${b}_weights_${r}_fp8.json")
  done
done
args+=(--trace)
for t in "${traces[@]}"; do args+=("$R/$t"); done
args+=(--ncu)
for n in ncu_megakernel_h200_369bd08_qwen3_in_place.json ncu_megakernel_h200_369bd08_qwen3_pull.json \
  ncu_megakernel_h200_0599c9f.json ncu_megakernel_h200_7098afa_qwen3_bwd.json \
  ncu_megakernel_h200_7098afa_deepseek.json ncu_megakernel_h200_7098afa_deepseek_bwd.json \
  ncu_megakernel_h200_7098afa_mixtral.json ncu_megakernel_h200_3bf75fe_fp8.json \
  ncu_megakernel_h200_07a7f29_fp8.json; do
  args+=("$R/$n")
done
args+=(--rounds)
for r in bench_moe_h100_ep1_rounds_grad_qwen3-30b-a3b_a339d7c_ab.json \
  bench_moe_h100_ep1_rounds_grad_qwen3-30b-a3b_6971ba6_ab.json \
  bench_moe_h100_ep1_rounds_grad_mixtral-8x7b_a339d7c_ab.json \
  bench_moe_h100_ep1_rounds_grad_mixtral-8x7b_6971ba6_ab.json \
  bench_moe_h100_ep1_rounds_main_grad_qwen3-30b-a3b_6971ba6.json \
  bench_moe_h100_ep1_rounds_main_grad_mixtral-8x7b_6971ba6.json \
  bench_moe_h100_ep1_rounds_grad_qwen3-30b-a3b_fa23952.json \
  bench_moe_h100_ep1_rounds_grad_mixtral-8x7b_fa23952.json; do
  args+=("$R/$r")
done
args+=(--bwd-wgrad)
for b in wgw-e1a044d_ab3 wgwi-56239db_ab3 wgw-e1a044d_ab wgred-999790f_ab2 wgred-999790f_ab \
  wgredi-510d1b6_ab wgsync-f38445e_ab d2dd0f4 abdc97f; do
  for m in main_grad grad; do args+=("$R/bench_moe_h100_ep1_bwd_wgrad_${m}_$b.json"); done
done
args+=(--wgrad-schedule)
for m in grad main_grad; do
  args+=("$R/bench_moe_h100_ep1_wgrad_cluster2_${m}_79c42ae.json" \
    "$R/bench_moe_h100_ep1_wgrad_cluster2_${m}_mixtral_79c42ae.json")
done
args+=(--breakdown "$R/megakernel_breakdown_h200_4320131.json")
args+=(--padding "$R/tile_padding_29ce1e8.json" --wgrad "$R/wgrad_traffic_3e5174d.json")
args+=(--host "$R/profile_host_h100_ep1_5d6d242.json" "$R/profile_host_h200_ep1_82f068c.json" "$R/profile_host_h200_ep1_269f051.json" \
  "$R/profile_host_h200_ep1_5ecc1bd_steps.json" "$R/profile_host_h100_ep1_31d4a38.json" "$R/profile_host_h100_ep1_14bf0d4.json" \
  "$R/profile_host_h100_ep1_9f62ae1.json" "$R/profile_host_h200_ep1_1b6f463.json" "$R/profile_host_h200_ep1_9d6aef5.json" \
  "$R/profile_host_h200_ep1_fefeac9.json")
args+=(--profile "$R/profile_moe_h200_ep1_82f068c_scan_deepseek.json" \
  "$R/profile_moe_h200_ep1_527358d_scan_deepseek.json" "$R/profile_moe_h200_ep1_82f068c_maingrad.json" \
  "$R/profile_moe_h100_ep1_9f62ae1_scan.json" "$R/profile_moe_h100_ep1_31d4a38_scan.json" \
  "$R/profile_moe_h100_ep1_f92b268_ab.json" "$R/profile_moe_h100_ep1_527358d_ab.json" "$R/profile_moe_h200_ep1_0d9dae0.json" "$R/profile_moe_h200_ep1_edf94f1.json" "$R/profile_moe_h200_ep1_2defa24.json" "$R/profile_moe_h200_ep1_ed574ac.json" \
  "$R/profile_moe_h200_ep1_0905465.json" --notes docs/perf_notes.md)
exec "$PY" scripts/perf_report.py "${args[@]}" --md docs/PERF.md --png docs/perf.png
