"""``MoKConfig``: the knobs of the MoK layer (the five of DESIGN.md, the CUDA forward path, which
expert GEMMs run on the GEMM engine, the device-wait timeout and the backward schedule), and how
they are validated and stored.

Every field carries its documentation in ``metadata["help"]``: Megatron's ``--mok-*`` flags and the
YAML loader are generated from it, so the dataclass is the one source of truth. The C++ launchers
check what their kernels need of these values again (MOK_HOST_CHECK), naming the same rule.

Not every backend uses every knob (``KNOB_USERS``); a non-default value that the chosen backend
ignores is reported once with a warning when the workspace is made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["MoKConfig", "AUTO", "AUTO_FALLBACKS", "BWD_SCHEDULES", "BWD_WGRADS", "CUDA_FORWARDS",
           "DEFAULT_WAIT_TIMEOUT_MS", "ENGINE_STEPS", "EXPERT_GEMMS", "EXPERT_PRECISIONS",
           "FP8_BACKWARDS", "FWD_ROWS", "MEGAKERNEL_CLUSTERS", "MOK_ROW_ALIGN", "KNOB_USERS", "LayerDims",
           "engine_step_list",
           "tuned_fwd_rows", "tuned_table_path",
           "warn_ignored_knobs"]  # fmt: skip

#: A knob left "auto" takes its value from the tuned table of the GPU and EP size the workspace
#: runs on (``mok_megatron/tuned/<gpu>_ep<N>.yaml``, written by scripts/tune.py), else from
#: AUTO_FALLBACKS.
AUTO = "auto"
#: The knobs that may be "auto", and their values where no tuned table covers the GPU and EP size.
AUTO_FALLBACKS = {"fwd_num_comm_sms": 16, "bwd_num_comm_sms": 20, "minibatch_size": 256}
#: Where the tuned tables live (package data).
TUNED_DIR = Path(__file__).resolve().parent.parent / "tuned"
#: Row tile height of the expert GEMMs: minibatches and macrobatches are multiples of it.
MOK_ROW_ALIGN = 128
#: Backward schedules that are implemented ("minibatch", the finer-overlap non-bitwise mode of
#: DESIGN.md, is rejected until the backward megakernel offers it).
BWD_SCHEDULES = ("macrobatch",)
#: The CUDA backend's forward paths (MoKConfig.cuda_forward).
CUDA_FORWARDS = ("auto", "megakernel", "stage1")
#: The CUDA backend's backward paths (MoKConfig.cuda_backward).
CUDA_BACKWARDS = ("auto", "megakernel", "stage1")
#: The weight gradients the backward megakernel computes inside its launch (MoKConfig.bwd_wgrad):
#: none ("off"), or the down weight's, after the data gradients' tasks ("down") or among them
#: ("down_interleaved").
BWD_WGRADS = ("off", "down", "down_interleaved")
#: CTAs per cluster of the megakernels (MoKConfig.megakernel_cluster; layout::kMaxClusterCtas).
MEGAKERNEL_CLUSTERS = (1, 2)
#: How the forward megakernel's L1 tiles get their token rows (MoKConfig.fwd_rows).
FWD_ROWS = ("auto", "in_place", "pull")
#: M-tiles per block of the forward megakernel's task order (MoKConfig.megakernel_order_block;
#: layout::valid_order_block), besides "auto".
ORDER_BLOCKS = (8, 16)
#: The fused gate/up form's GEMM steps the expert GEMM engine can run (MoKConfig.expert_gemm):
#: "l1" L1 + SwiGLU (forward, and the rounds' recompute), "dswiglu" the L2 dgrad + SwiGLU
#: backward, and the plain GEMMs: "l2" the L2 forward, "dgrad" the dgrads (against W_down without
#: "dswiglu", and against W_gu), "wgrad" the weight gradients.
ENGINE_STEPS = ("l1", "dswiglu", "l2", "dgrad", "wgrad")
#: The named choices of MoKConfig.expert_gemm; a list of ENGINE_STEPS joined by "," or "+" is
#: the other form.
EXPERT_GEMMS = ("auto", "torch", "engine")
#: The routed experts' GEMM precisions (MoKConfig.expert_precision): "bf16", or "fp8_blockwise",
#: the Hopper FP8 recipe (ops.fp8_blockwise: E4M3, (1, 128) activation and (128, 128) weight
#: blocks with float32 scales) for the forward's expert GEMMs.
EXPERT_PRECISIONS = ("bf16", "fp8_blockwise")
#: What of the backward runs in blockwise FP8 under expert_precision="fp8_blockwise"
#: (MoKConfig.fp8_backward): nothing ("bf16"), or the two data-gradient GEMMs ("dgrad").
FP8_BACKWARDS = ("bf16", "dgrad")
#: Device waits give up after this long unless MoKConfig.wait_timeout_ms says otherwise.
DEFAULT_WAIT_TIMEOUT_MS = 10_000
#: Every backward schedule the design names (flags accept these; MoKConfig says which run).
KNOWN_BWD_SCHEDULES = ("macrobatch", "minibatch")
#: Which backend (and CUDA path) uses each knob whose effect depends on it; the README's knob
#: table says the same. ``schedule_capacity_multiplier`` sizes every backend's schedule.
KNOB_USERS = {
    "fwd_num_comm_sms": ("cuda/megakernel",),
    "bwd_num_comm_sms": ("cuda/megakernel",),
    "minibatch_size": ("cuda/megakernel",),
    "macrobatch_size": ("cuda/stage1", "cuda/megakernel"),
    "cuda_forward": ("cuda/stage1", "cuda/megakernel"),
    "cuda_backward": ("cuda/megakernel",),
    "bwd_wgrad": ("cuda/megakernel",),
    "megakernel_cluster": ("cuda/megakernel",),
    "fwd_rows": ("cuda/megakernel",),
    "megakernel_order_block": ("cuda/megakernel",),
    # the megakernel's backward is stage 1's, which runs the expert GEMM engine
    "expert_gemm": ("cuda/stage1", "cuda/megakernel"),
    "expert_precision": ("reference", "cuda/stage1", "cuda/megakernel"),
    "fp8_backward": ("reference", "cuda/stage1"),
    "wait_timeout_ms": ("reference", "cuda/stage1", "cuda/megakernel"),
    "chained_launches": ("cuda/stage1", "cuda/megakernel"),
}


def _knob(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class MoKConfig:
    """The knobs of one MoK layer; all ranks of an expert-parallel group must hold equal configs."""

    fwd_num_comm_sms: int | str = _knob(
        AUTO,
        "SMs that pull tokens in the megakernel's forward before they run GEMM tasks too; 'auto': "
        "the GPU's tuned table (scripts/tune.py), else 16.",
    )
    bwd_num_comm_sms: int | str = _knob(
        AUTO,
        "SMs that pull d_out rows in the backward megakernel before they run GEMM tasks too; "
        "'auto': the GPU's tuned table (scripts/tune.py, swept apart from the forward), else 20.",
    )
    minibatch_size: int | str = _knob(
        AUTO,
        "Overlap granularity: routed rows whose arrival releases GEMM work (multiple of 128); "
        "'auto': the GPU's tuned table (scripts/tune.py), else 256.",
    )
    macrobatch_size: int = _knob(
        131072,
        "Routed rows in flight at once (the ring's capacity); a schedule with more rows runs in "
        "further rounds, which bounds buffer memory (the backward then recomputes each round's "
        "activations: stage 1 all of them, the backward megakernel all but the last round's, "
        "which the forward's rings still hold). Multiple of minibatch_size.",
    )
    schedule_capacity_multiplier: float = _knob(
        2.0,
        "Capacity of the routed schedule relative to a perfectly balanced load (>= 1). Raise it "
        "for skewed routing; a value >= the EP size can never overflow.",
    )
    cuda_forward: str = _knob(
        "stage1",
        "The CUDA backend's forward: 'stage1' (the sequence of kernels; the default until the "
        "megakernel, faster at every EP-1 point of docs/PERF.md, has run at EP >= 2 on real "
        "GPUs), 'megakernel' (one persistent launch per pass; sm_90a and the fused gate/up "
        "weights of MoKExperts) or 'auto' (the megakernel wherever it can run the call, else "
        "stage 1).",
    )
    cuda_backward: str = _knob(
        "auto",
        "The CUDA backend's backward after a megakernel forward: 'auto' (the backward megakernel "
        "where the forward kept its activation rings: one round, or bf16 experts in macrobatch "
        "rounds, taken last round first, one launch each, earlier rounds recomputed; else stage "
        "1), 'megakernel' (that, or an error saying why it cannot run) or 'stage1' (the "
        "sequence of kernels). The weight gradients are stage 1's grouped GEMMs either way; "
        "after a stage-1 forward the backward is stage 1's.",
    )
    bwd_wgrad: str = _knob(
        "off",
        "Weight gradients the backward megakernel computes inside its launch: 'off' (all of "
        "them stage 1's grouped GEMMs after it), 'down' (the down weight's, as tasks after its "
        "data-gradient tasks, each tile one CTA's over the expert's rows in order, bitwise the "
        "engine's grouped GEMM; stored, or added into main_grad) or 'down_interleaved' (the "
        "same tasks among the data gradients', in chunks: the same result). Either needs the "
        "backward megakernel in one macrobatch round with megakernel_cluster=1: a backward in "
        "rounds, or stage 1's, runs the grouped GEMM as with 'off'. Off by default until it is "
        "timed faster (docs/MEGAKERNEL.md).",
    )
    expert_gemm: str = _knob(
        "auto",
        "Which GEMMs of the fused gate/up weight form (MoKExperts') the CUDA backend runs on the "
        "expert GEMM engine rather than torch._grouped_mm: 'auto' (the steps that win on Hopper, "
        "and the weight gradients when they accumulate into caller buffers such as main_grad; "
        "none where the engine cannot run, with a warning), 'torch' (none), 'engine' (all), or "
        "engine steps joined by ',' or '+' from l1, dswiglu, l2, dgrad, wgrad (docs/GEMM.md).",
    )
    expert_precision: str = _knob(
        "bf16",
        "The routed experts' forward GEMMs: 'bf16', or 'fp8_blockwise' (the Hopper FP8 recipe of "
        "Megatron's --fp8-recipe blockwise: E4M3 with (1, 128) activation and (128, 128) weight "
        "blocks, float32 scales; weights quantised once per weight update). The backward is "
        "BF16 unless fp8_backward says otherwise (docs/FP8.md). fp8_blockwise runs on the "
        "reference backend, the CUDA backend's stage 1, and its FP8 megakernel forward with "
        "cuda_forward='megakernel' ('auto' runs stage 1 for FP8).",
    )
    fp8_backward: str = _knob(
        "bf16",
        "With expert_precision='fp8_blockwise', what of the backward runs in FP8: 'bf16' "
        "(nothing: the gradient of the BF16 layer at the FP8 forward's activations) or 'dgrad' "
        "(the two data-gradient GEMMs: the weighted output rows and the gate/up gradients "
        "quantised in (1, 128) blocks, the weights' FP8 copies transposed; the weight gradients "
        "stay BF16). Any value but 'bf16' needs fp8_blockwise.",
    )
    wait_timeout_ms: int = _knob(
        DEFAULT_WAIT_TIMEOUT_MS,
        "Every device-side wait of the CUDA backend (barriers, the megakernel's rows and tiles) "
        "gives up after this many milliseconds, reporting rank, phase and flag, and fails the "
        "launch instead of hanging; the reference backend's collectives on gloo likewise (a "
        "monitored barrier before each). Raise it for slow starts.",
    )
    bwd_schedule: str = _knob(
        "macrobatch",
        "Backward schedule: 'macrobatch' (deterministic, the only one implemented; 'minibatch', "
        "finer overlap with a weight-gradient order that is not fixed, is not built yet).",
    )
    megakernel_cluster: int = _knob(
        1,
        "CTAs per cluster of the megakernels' GEMM tiles: 1, or 2 (the two CTAs of a cluster run "
        "two n-tiles of one m-tile and share its A tile by TMA multicast, a sixth less L2 traffic "
        "per k-tile; fwd_num_comm_sms and bwd_num_comm_sms must then be even). 2 gives bitwise the "
        "results of 1 and was no faster on one H200 (docs/PERF.md), so 1 stays the default.",
    )

    fwd_rows: str = _knob(
        "auto",
        "How the forward megakernel's L1 tiles get their token rows: 'pull' (the comm SMs, "
        "fwd_num_comm_sms of them, copy each routed row into the ring, minibatch by minibatch), "
        "'in_place' (one rank only, megakernel_cluster=1: each L1 tile loads its rows from the "
        "token rows themselves, x quantised in place with FP8 experts, the producer warpgroup "
        "copying them into each stage, and no SM pulls) "
        "or 'auto' (the GPU's tuned table's choice for the layer's shape and precision where "
        "it names 'pull' (scripts/tune.py --rows: the rows were faster pulled there), else "
        "in_place where it can run, else pull). Bitwise the same results.",
    )

    megakernel_order_block: int | str = _knob(
        "auto",
        "M-tiles per block of the forward megakernel's task order: 8 or 16 (a block's L1 tasks "
        "run n-tile by n-tile over its m-tiles, then its L2 tasks), or 'auto': the one whose "
        "wave of L1 tasks reads fewer distinct bytes from HBM for the layer's shape "
        "(layout::auto_order_block, ops.moe.moe_mega_order_block: 8 where one wave covers a "
        "block of 8's n-tiles and each expert has few m-tiles, as deepseek-v3 at 8192 tokens a "
        "rank, whose "
        "megakernel was 5% faster with 8 on one H100; else 16). Bitwise the same results.",
    )

    chained_launches: bool = _knob(
        False,
        "True: the CUDA backend launches a pass's kernels chained on Hopper (programmatic "
        "dependent launch: the schedule, the plan, the megakernels, the slot sums): each may "
        "start while the kernel before it on the stream finishes and waits for it on the "
        "device, which hides the launch gaps between them. False (the default): plain stream "
        "order. Bitwise the same results; on one H100 the timed forward was 1.01-1.03x faster "
        "chained and back to back it went either way (docs/PERF.md), so it stays opt-in.",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.chained_launches, bool):
            raise TypeError(
                f"MoKConfig.chained_launches={self.chained_launches!r} must be True or False"
            )
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms", "minibatch_size", "macrobatch_size",
                     "wait_timeout_ms"):  # fmt: skip
            value = getattr(self, name)
            if name in AUTO_FALLBACKS and value == AUTO:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                allowed = "an int or 'auto'" if name in AUTO_FALLBACKS else "an int"
                raise TypeError(f"MoKConfig.{name}={value!r} must be {allowed}")
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            if getattr(self, name) != AUTO and not 1 <= getattr(self, name) <= 128:
                raise ValueError(
                    f"MoKConfig.{name}={getattr(self, name)} must be in [1, 128] (SMs given to "
                    "communication); try 20"
                )
        if self.minibatch_size != AUTO:
            _check_multiple(
                "minibatch_size", self.minibatch_size, MOK_ROW_ALIGN, "the GEMM tile height"
            )
            _check_multiple(
                "macrobatch_size", self.macrobatch_size, self.minibatch_size, "minibatch_size"
            )
        else:
            _check_multiple(
                "macrobatch_size", self.macrobatch_size, MOK_ROW_ALIGN, "the GEMM tile height"
            )
        cap = self.schedule_capacity_multiplier
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1.0:
            raise ValueError(
                f"MoKConfig.schedule_capacity_multiplier={cap!r} must be a number >= 1.0 (the "
                "schedule holds at least a balanced load); try 2.0"
            )
        object.__setattr__(self, "schedule_capacity_multiplier", float(cap))
        if self.cuda_forward not in CUDA_FORWARDS:
            raise ValueError(
                f"MoKConfig.cuda_forward={self.cuda_forward!r} must be one of {CUDA_FORWARDS}; "
                "'stage1' is the default, 'auto' picks the megakernel where it can run"
            )
        if self.cuda_backward not in CUDA_BACKWARDS:
            raise ValueError(
                f"MoKConfig.cuda_backward={self.cuda_backward!r} must be one of "
                f"{CUDA_BACKWARDS}; 'auto' picks the backward megakernel where it can run"
            )
        if self.bwd_wgrad not in BWD_WGRADS:
            raise ValueError(
                f"MoKConfig.bwd_wgrad={self.bwd_wgrad!r} must be one of {BWD_WGRADS}; 'off' is "
                "the default"
            )
        block = self.megakernel_order_block
        if block != AUTO and (type(block) is not int or block not in ORDER_BLOCKS):
            raise ValueError(
                f"MoKConfig.megakernel_order_block={block!r} must be 'auto' or one of "
                f"{ORDER_BLOCKS} (m-tiles per block of the forward megakernel's task order)"
            )
        cluster = self.megakernel_cluster
        if type(cluster) is not int or cluster not in MEGAKERNEL_CLUSTERS:
            raise ValueError(
                f"MoKConfig.megakernel_cluster={cluster!r} must be one of {MEGAKERNEL_CLUSTERS} "
                "(CTAs per cluster); 1 is the default"
            )
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            value = getattr(self, name)
            if value != AUTO and value % cluster != 0:
                raise ValueError(
                    f"MoKConfig.{name}={value} must be a multiple of megakernel_cluster={cluster} "
                    f"(so that a cluster's CTAs start their tasks together); try {value + 1}"
                )
        if self.bwd_wgrad != "off" and (
            self.cuda_backward == "stage1"
            or self.cuda_forward == "stage1"
            or cluster != 1
            or self.expert_precision != "bf16"
        ):
            raise ValueError(
                f"MoKConfig.bwd_wgrad={self.bwd_wgrad!r} is the backward megakernel's, bf16 "
                f"experts without clusters (cuda_forward={self.cuda_forward!r}, cuda_backward="
                f"{self.cuda_backward!r}, megakernel_cluster={cluster}, expert_precision="
                f"{self.expert_precision!r}); set cuda_forward='megakernel' or 'auto', "
                "cuda_backward='auto' or 'megakernel', megakernel_cluster=1 and "
                "expert_precision='bf16', or bwd_wgrad='off'"
            )
        if self.cuda_backward == "megakernel" and self.cuda_forward == "stage1":
            raise ValueError(
                "MoKConfig.cuda_backward='megakernel' needs the megakernel's forward (it reads "
                "its plan and kept rings); set cuda_forward='megakernel' or 'auto', or "
                "cuda_backward='auto'"
            )
        _check_expert_gemm(self.expert_gemm)
        if self.expert_precision not in EXPERT_PRECISIONS:
            raise ValueError(
                f"MoKConfig.expert_precision={self.expert_precision!r} must be one of "
                f"{EXPERT_PRECISIONS}; 'bf16' is the default"
            )
        if self.fp8_backward not in FP8_BACKWARDS:
            raise ValueError(
                f"MoKConfig.fp8_backward={self.fp8_backward!r} must be one of {FP8_BACKWARDS}; "
                "'bf16' is the default"
            )
        if self.fp8_backward != "bf16" and self.expert_precision != "fp8_blockwise":
            raise ValueError(
                f"MoKConfig.fp8_backward={self.fp8_backward!r} needs "
                f"expert_precision='fp8_blockwise' (it is {self.expert_precision!r}): the FP8 "
                "backward reads the FP8 forward's weight copies; set both, or fp8_backward='bf16'"
            )
        if self.expert_precision != "bf16" and self.cuda_backward == "megakernel":
            raise ValueError(
                f"MoKConfig.cuda_backward='megakernel' with expert_precision="
                f"{self.expert_precision!r}: FP8 experts' backward is stage 1's (its router-weight "
                "gradient reads the FP8 forward's output rows); set cuda_backward='auto' or 'stage1'"
            )
        if (
            self.expert_precision != "bf16"
            and self.cuda_forward != "stage1"
            and self.megakernel_cluster != 1
        ):
            raise ValueError(
                f"MoKConfig.expert_precision={self.expert_precision!r} with "
                f"megakernel_cluster={self.megakernel_cluster}: the FP8 megakernel runs without "
                "clusters; set megakernel_cluster=1 (or cuda_forward='stage1')"
            )
        if self.fwd_rows not in FWD_ROWS:
            raise ValueError(
                f"MoKConfig.fwd_rows={self.fwd_rows!r} must be one of {FWD_ROWS}; 'auto' is the "
                "default"
            )
        if self.fwd_rows == "in_place" and self.megakernel_cluster != 1:
            raise ValueError(
                f"MoKConfig.fwd_rows='in_place' with megakernel_cluster={self.megakernel_cluster}:"
                " rows in place are the megakernel's without clusters; set fwd_rows='auto' or "
                "'pull'"
            )
        if not 1 <= self.wait_timeout_ms < 2**31:
            raise ValueError(
                f"MoKConfig.wait_timeout_ms={self.wait_timeout_ms} must be a positive number of "
                "milliseconds below 2**31 (a device wait never waits forever; error records are "
                f"int32); try {DEFAULT_WAIT_TIMEOUT_MS}"
            )
        if self.bwd_schedule == "minibatch":
            raise ValueError(
                "MoKConfig.bwd_schedule='minibatch' is not implemented: no backend has the "
                "finer-overlap backward yet; 'macrobatch' (deterministic) is the one implemented, "
                "use it"
            )
        if self.bwd_schedule not in BWD_SCHEDULES:
            raise ValueError(
                f"MoKConfig.bwd_schedule={self.bwd_schedule!r} must be one of {BWD_SCHEDULES}; "
                "'macrobatch' is the deterministic default"
            )

    # ------------------------------------------------------------------------------ "auto" knobs
    def resolve(
        self, device: torch.device | str | None, num_ranks: int, layer: LayerDims | None = None
    ) -> MoKConfig:
        """This config with every "auto" knob replaced: from the tuned table of ``device``'s GPU
        at this EP size (``tuned_table_path``) where there is one, else ``AUTO_FALLBACKS``. From
        the table, the knobs tuned for ``layer``'s shape where the table has that shape (its
        ``shapes:`` entries), else its ``mok:`` section (the best over all its shapes).
        fwd_rows 'auto' becomes 'pull' where the table names 'pull' for the layer and its
        precision (``tuned_fwd_rows``: scripts/tune.py --rows), and stays 'auto' otherwise.

        The workspace resolves its config when it is made; a config without "auto" knobs is
        returned as it is. Raises if the resolved knobs break a rule (macrobatch_size a multiple
        of minibatch_size)."""
        auto = [name for name in AUTO_FALLBACKS if getattr(self, name) == AUTO]
        if not auto and self.fwd_rows != AUTO:
            return self
        path = tuned_table_path(device, num_ranks)
        table = _tuned_knobs(path, layer, self.expert_precision)
        values = {name: table.get(name, AUTO_FALLBACKS[name]) for name in auto}
        # NOTE: fwd_rows 'auto' becomes 'pull' where the table says the rows were faster pulled;
        # a table's 'in_place' leaves 'auto', which reads them in place only where that can run
        # (one rank, no clusters, not FP8's staged rounds: functional/cuda/mega.rows_in_place).
        if self.fwd_rows == AUTO and tuned_fwd_rows(path, layer, self.expert_precision) == "pull":
            values["fwd_rows"] = "pull"
        if not values:
            return self
        try:
            return dataclasses.replace(self, **values)
        except ValueError as e:
            source = f"the tuned table {path}" if table else "the fallbacks"
            raise ValueError(
                f"{e} (the 'auto' knobs {values} come from {source}; set them explicitly)"
            ) from None

    # ----------------------------------------------------------------------------- dict / YAML
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MoKConfig:
        """Build from a mapping; unknown keys raise an error that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown MoKConfig key(s) {unknown}; the knobs are {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> MoKConfig:
        """Read the ``mok:`` section of a YAML file (a file holding only the knobs also works)."""
        return cls.from_dict(cls.yaml_knobs(path))

    @staticmethod
    def yaml_knobs(path: str | Path) -> dict[str, Any]:
        """The knobs of a YAML file's ``mok:`` section (or of a file holding only them), as a
        mapping, not yet validated (``from_dict`` does that)."""
        import yaml

        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: expected a mapping with a 'mok:' section, got {type(doc)}")
        section = doc.get("mok", doc)
        if not isinstance(section, dict):
            raise ValueError(f"{path}: the 'mok:' section must be a mapping of MoKConfig knobs")
        return dict(section)

    def to_yaml(self, path: str | Path) -> None:
        """Write the knobs as a ``mok:`` section."""
        import yaml

        with open(path, "w") as f:
            yaml.safe_dump({"mok": self.to_dict()}, f, sort_keys=False)

    # ------------------------------------------------------------------------- cross-rank check
    def fingerprint(self) -> int:
        """A 63-bit hash of the knobs, equal on every rank that holds an equal config."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1

    def check_same_across_ranks(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        """Raise on every rank if any rank of ``group`` holds a different config.

        A collective: call it on all ranks (the workspace does, when it is made).
        """
        if not dist.is_available() or not dist.is_initialized():
            return
        from .rank_wait import wait_for_ranks

        wait_for_ranks(group, self.wait_timeout_ms, "workspace: config check")
        mine = torch.tensor([self.fingerprint()], dtype=torch.int64, device=device)
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if int(lo.item()) != int(hi.item()):  # host-visible point: workspace creation only
            raise ValueError(
                f"MoKConfig differs across the ranks of the expert-parallel group (this rank: "
                f"{self.to_dict()}); every rank must use the same config (same YAML / flags)"
            )


def tuned_table_path(device: torch.device | str | None, num_ranks: int) -> Path | None:
    """``TUNED_DIR/<gpu>_ep<num_ranks>.yaml`` for a CUDA ``device`` (<gpu>: the last word of its
    name, lower case, e.g. "h200", as scripts/tune.py names the tables), or None."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    gpu = torch.cuda.get_device_name(torch.device(device)).split()[-1].lower()
    return TUNED_DIR / f"{gpu}_ep{num_ranks}.yaml"


class LayerDims(NamedTuple):
    """The MoE layer's shape, as a tuned table's ``shapes:`` entries record it."""

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    topk: int


#: The forward megakernel's pair of "auto" knobs, as a tuned table's entries name them; its
#: ``fp8_blockwise:`` entries (scripts/tune.py --fp8) hold only these: FP8's backward is stage 1's,
#: so bwd_num_comm_sms stays the BF16 one.
FORWARD_TUNED_KNOBS = ("fwd_num_comm_sms", "minibatch_size")


def _fp8_pair(section: dict | None) -> dict:
    """The forward pair of an ``fp8_blockwise:`` entry (none: {})."""
    return {n: v for n, v in (section or {}).items() if n in FORWARD_TUNED_KNOBS}


def _tuned_knobs(
    path: Path | None, layer: LayerDims | None = None, precision: str = "bf16"
) -> dict[str, int]:
    """The "auto"-able knobs of a tuned table ({} without a table): those of its ``shapes:``
    entry for ``layer`` (all four dimensions equal) where it has one with every knob, else its
    ``mok:`` section's. With FP8 experts (``precision`` 'fp8_blockwise') the forward pair comes
    from that shape entry's ``fp8_blockwise:`` where it has one (even in an entry without BF16
    knobs), else (no FP8 sweep of the shape) from the shape entry itself, else from the table's
    ``fp8_blockwise:`` section."""
    doc = _load_table(path)
    fp8 = precision == "fp8_blockwise"
    section = dict(doc.get("mok", {}))
    if fp8:
        section.update(_fp8_pair(doc.get("fp8_blockwise")))
    entry = _shape_entry(doc, layer)
    if entry is not None:
        if all(n in entry for n in AUTO_FALLBACKS):  # the shape's BF16 sweep
            section = dict(entry)
        if fp8:  # its FP8 sweep (an entry may hold only that: tune.py --fp8 of a new shape)
            section.update(_fp8_pair(entry.get("fp8_blockwise")))
    knobs = {name: section[name] for name in AUTO_FALLBACKS if name in section}
    for name, value in knobs.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: mok.{name}={value!r} must be an int; rerun scripts/tune.py")
    return knobs


def tuned_fwd_rows(
    path: Path | None, layer: LayerDims | None = None, precision: str = "bf16"
) -> str | None:
    """The tuned table's fwd_rows for ``layer`` and ``precision`` (scripts/tune.py --rows), or
    None where it names none: BF16 from the shape's entry, else the ``mok:`` section; FP8
    experts (``precision`` 'fp8_blockwise', whose rows in place are another kernel's) only from
    the shape's ``fp8_blockwise:`` entry, else the table's ``fp8_blockwise:`` section."""
    doc = _load_table(path)
    entry = _shape_entry(doc, layer) or {}
    if precision == "fp8_blockwise":
        sections = (entry.get("fp8_blockwise") or {}, doc.get("fp8_blockwise") or {})
    else:
        sections = (entry, doc.get("mok") or {})
    for section in sections:
        if "fwd_rows" in section:
            value = section["fwd_rows"]
            if value not in ("in_place", "pull"):
                raise ValueError(f"{path}: fwd_rows={value!r} must be 'in_place' or 'pull'; "
                                 "rerun scripts/tune.py --rows")  # fmt: skip
            return value
    return None


def _load_table(path: Path | None) -> dict:
    """A tuned table's contents ({} where there is none)."""
    if path is None or not path.is_file():
        return {}
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def _shape_entry(doc: dict, layer: LayerDims | None) -> dict | None:
    """The table's ``shapes:`` entry of ``layer`` (all four dimensions equal), or None."""
    if layer is None:
        return None
    for entry in (doc.get("shapes") or {}).values():
        if [entry.get(name) for name in LayerDims._fields] == list(layer):
            return entry
    return None


_WARNED: set[tuple[str, str]] = set()


def warn_ignored_knobs(config: MoKConfig, path: str) -> list[str]:
    """Warn once per (knob, path) for each knob set away from its default that ``path`` (a
    backend, or "cuda/<path>") does not use; returns the names of those knobs."""
    import warnings

    defaults = MoKConfig()
    ignored = []
    for name, users in KNOB_USERS.items():
        if getattr(config, name) == getattr(defaults, name) or path in users:
            continue
        ignored.append(name)
        if (name, path) not in _WARNED:
            _WARNED.add((name, path))
            where = ", ".join(users) if users else "no backend yet"
            warnings.warn(
                f"MoKConfig.{name}={getattr(config, name)} has no effect on the {path} backend "
                f"(used by: {where}); it is carried but changes nothing here",
                stacklevel=3,
            )
    return ignored


def engine_step_list(choice: str) -> tuple[str, ...]:
    """The steps a MoKConfig.expert_gemm list names: "l1,l2" or "l1+wgrad" -> ("l1", ...)."""
    return tuple(s.strip() for s in choice.replace("+", ",").split(","))


def _check_expert_gemm(choice: Any) -> None:
    if isinstance(choice, str) and (
        choice in EXPERT_GEMMS or set(engine_step_list(choice)) <= set(ENGINE_STEPS)
    ):
        return
    raise ValueError(
        f"MoKConfig.expert_gemm={choice!r} must be one of {EXPERT_GEMMS} or engine steps from "
        f"{ENGINE_STEPS} joined by ',' or '+' (e.g. 'l1,l2'); 'auto' is the default"
    )


def _check_multiple(name: str, value: int, multiple: int, what: str) -> None:
    if value <= 0 or value % multiple:
        fix = max(multiple, (value + multiple - 1) // multiple * multiple)
        raise ValueError(
            f"MoKConfig.{name}={value} must be a positive multiple of {multiple} ({what}); "
            f"try {fix}"
        )
