"""mok::moe_row_grad (the fused per-row step at the start of the CUDA backward) against a float64
oracle and PyTorch's own unfused formula.

d_row_w: relative error within 1e-5 of a float64 sum (products of bf16 values are exact in
float32, only the float32 sum order differs); exactly 0 on padding rows. dy: bitwise equal to
``(d_rows.float() * w_rows[:, None]).to(torch.bfloat16)``. Both bitwise identical run after run
and independent of where a row sits. Fresh random inputs per check (never zeros; padding rows
carry nonzero d_rows and NaN y); outputs land in poisoned memory (``testing.poison``).
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron import ops
from mok_megatron.ops.moe import moe_row_grad
from mok_megatron.testing.poison import poisoned_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not ops.has_op("moe_row_grad"),
        reason=f"mok::moe_row_grad not built: {ops.extension_error() or 'op missing'}",
    ),
]

HIDDENS = [72, 2048, 4096, 7168]  # 72: an odd number of 16-byte vectors, one partial warp
ROWS = [0, 1, 37, 4096]
RTOL = 1e-5


def random_rows(num_rows: int, hidden: int, live: torch.Tensor | None = None):
    """Fresh inputs: d_rows, y [P, H] bf16 (nonzero, a random power-of-two scale per row);
    w_rows [P] float32 in [0.05, 1), 0 on padding rows; row_tok [P] int64, -1 on padding rows
    (NaN y there). ``live`` [P] bool picks the live rows; by default about 3 in 4, with row 0
    live at row_tok 0 and row 1 padding."""
    dev = torch.device("cuda")
    if live is None:
        live = torch.rand(num_rows, device=dev) < 0.75
        live[:2] = torch.tensor([True, False], device=dev)[: min(num_rows, 2)]
    scale = torch.exp2(torch.randint(-6, 3, (num_rows, 1), device=dev).float())
    d_rows = (torch.randn(num_rows, hidden, device=dev) * scale).to(torch.bfloat16)
    y = torch.randn(num_rows, hidden, device=dev).to(torch.bfloat16)
    d_rows[d_rows == 0] = 1.0  # never zeros
    y[y == 0] = -1.0
    y[~live] = float("nan")  # a padding row's y is never used
    row_tok = torch.randint(0, 1 << 20, (num_rows,), device=dev, dtype=torch.int64)
    row_tok[:1] = 0  # 0 is a live token index, not padding
    row_tok[~live] = -1
    w_rows = torch.where(live, torch.rand(num_rows, device=dev) * 0.95 + 0.05, 0.0)
    return d_rows, y, w_rows, row_tok


def expected(d_rows, y, w_rows, row_tok):
    """(d_row_w float64 oracle, sum_h |d * y| per row, dy from PyTorch's unfused formula)."""
    live = (row_tok >= 0)[:, None]
    prod = d_rows.double() * torch.where(live, y.double(), 0.0)
    d_row_w = torch.where(live[:, 0], prod.sum(-1), 0.0)
    dy = (d_rows.float() * w_rows[:, None]).to(torch.bfloat16)
    return d_row_w, prod.abs().sum(-1), dy


def poisoned_run(d_rows, y, w_rows, row_tok):
    """moe_row_grad with its outputs in poisoned memory (``testing.poison``: NaN in float32 and
    bf16 alike, every size class), checked to have come from it."""
    with poisoned_memory() as mem:
        d_row_w, dy = moe_row_grad(d_rows, y, w_rows, row_tok)
    mem.assert_covers(d_row_w=d_row_w, dy=dy)
    return d_row_w, dy


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    bad = (bits(got) != bits(want)).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} of {got.numel()} elements differ; first at "
        f"{bad[0].tolist()}: got {got[tuple(bad[0])].item()} want {want[tuple(bad[0])].item()}"
    )


def check_against_oracle(inputs, d_row_w, dy):
    d_rows, y, w_rows, row_tok = inputs
    want_w, abs_sum, want_dy = expected(*inputs)
    num_rows, hidden = d_rows.shape
    assert d_row_w.shape == (num_rows,) and d_row_w.dtype == torch.float32
    assert dy.shape == (num_rows, hidden) and dy.dtype == torch.bfloat16
    assert d_row_w.is_contiguous() and dy.is_contiguous()
    assert_bitwise(dy, want_dy, "dy")
    if num_rows == 0:
        return
    assert not d_row_w.isnan().any(), "d_row_w has NaN"
    pad = row_tok < 0
    assert_bitwise(d_row_w[pad], torch.zeros_like(d_row_w[pad]), "d_row_w on padding rows")
    assert (dy[pad].float() == 0).all(), "dy on padding rows must be 0"
    err = (d_row_w.double() - want_w).abs()
    worst = (err / abs_sum.clamp(min=torch.finfo(torch.float64).tiny)).max().item()
    assert worst < RTOL, f"d_row_w: per-row error / sum|d*y| = {worst:.3g} >= {RTOL}"
    # NOTE: over many rows the norm-wise error is a stable statistic; over a handful it is
    # ill-conditioned (one row whose dot product cancels), and the per-row bound above holds.
    if (~pad).sum() >= 32:
        norm_err = (err.norm() / want_w.norm()).item()
        assert norm_err < RTOL, f"d_row_w: relative error {norm_err:.3g} >= {RTOL}"


@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("num_rows", ROWS)
def test_matches_oracle(num_rows, hidden):
    for _ in range(2):  # fresh inputs each check
        inputs = random_rows(num_rows, hidden)
        check_against_oracle(inputs, *poisoned_run(*inputs))


@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("all_live", [False, True])
def test_all_padding_or_all_live(hidden, all_live):
    live = torch.full((37,), all_live, device="cuda")
    inputs = random_rows(37, hidden, live=live)
    check_against_oracle(inputs, *poisoned_run(*inputs))


@pytest.mark.parametrize("hidden", HIDDENS)
def test_bitwise_run_to_run_and_row_position(hidden):
    """Same inputs -> same bits, every run; a row's sum does not depend on its place or on P."""
    inputs = random_rows(4096, hidden)
    runs = [poisoned_run(*inputs) for _ in range(3)]  # all kept alive: no stale block reused
    for d_row_w, dy in runs[1:]:
        assert_bitwise(d_row_w, runs[0][0], "d_row_w (run to run)")
        assert_bitwise(dy, runs[0][1], "dy (run to run)")
    perm = torch.randperm(4096, device="cuda")[:37]
    sub = tuple(t[perm].contiguous() for t in inputs)
    d_row_w, dy = poisoned_run(*sub)
    assert_bitwise(d_row_w, runs[0][0][perm], "d_row_w (rows moved)")
    assert_bitwise(dy, runs[0][1][perm], "dy (rows moved)")


def test_no_host_sync_and_graph_capture():
    inputs = random_rows(256, 2048)
    want_w, want_dy = moe_row_grad(*inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_row_grad(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_w, got_dy = moe_row_grad(*inputs)
    got_w.fill_(float("nan"))
    got_dy.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(got_w, want_w, "d_row_w (graph replay)")
    assert_bitwise(got_dy, want_dy, "dy (graph replay)")


def test_bad_input():
    d_rows, y, w_rows, row_tok = random_rows(16, 64)
    misaligned = torch.randn(16 * 64 + 4, device="cuda").to(torch.bfloat16)[4:].view(16, 64)
    assert misaligned.data_ptr() % 16 != 0
    wide = torch.randn(1, 32776, device="cuda").to(torch.bfloat16)
    cases = [
        ((d_rows.float(), y, w_rows, row_tok), r"d_rows has dtype Float, expected BFloat16"),
        ((d_rows, y.half(), w_rows, row_tok), r"y has dtype Half, expected BFloat16"),
        ((d_rows, y, w_rows.double(), row_tok), r"w_rows has dtype Double, expected Float"),
        ((d_rows, y, w_rows, row_tok.int()), r"row_tok has dtype Int, expected Long"),
        ((d_rows[:, :36], y[:, :36], w_rows, row_tok), r"d_rows must be contiguous"),
        ((d_rows[:, :36].contiguous(), y[:, :36].contiguous(), w_rows, row_tok),
         r"hidden=36 .* must be a positive multiple of 8"),
        ((d_rows, y[:8], w_rows, row_tok), r"y has shape \[8, 64\] but d_rows has shape"),
        ((d_rows, y, w_rows[:8], row_tok), r"w_rows \[8\] and row_tok \[16\] must both be"),
        ((d_rows, y, w_rows, row_tok.cpu()), r"row_tok must be a CUDA tensor"),
        ((d_rows[0], y, w_rows, row_tok), r"d_rows has shape \[64\], expected 2 dims"),
        ((misaligned, y, w_rows, row_tok), r"d_rows and y must start on a 16-byte boundary"),
        ((wide, wide, w_rows[:1], row_tok[:1]), r"hidden=32776 exceeds 32768"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            moe_row_grad(*args)
