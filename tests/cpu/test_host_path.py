"""The forward's host path, made cheaper, means the same: what it keeps between calls is never
stale (each cache misses when what it stands for changes) and its checks' one-test good cases
let by exactly what the rules do, so bad input raises as it did. The fused layer's kept
workspace (Megatron-Core's side): tests/cpu/megatron/test_layer_workspace.py."""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

from mok_megatron.functional import MoKConfig, api, schedule
from mok_megatron.functional.cuda import experts as cuda_experts
from mok_megatron.functional.cuda import mega
from mok_megatron.functional.schedule import MoKSchedule

SM90_WHY = None
SM80_WHY = "mok_megatron._C is built for sm_90a and this GPU is sm_80"


@pytest.fixture
def capabilities(monkeypatch):
    """A fake torch.cuda.get_device_capability (cuda:0 is sm_90, cuda:1 sm_80, the current
    device sm_90); returns the list of devices it was asked about."""
    asked = []
    by_index = {0: (9, 0), 1: (8, 0), None: (9, 0)}

    def capability(device=None):
        index = device.index if isinstance(device, torch.device) else device
        asked.append(index)
        return by_index[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    cuda_experts._capability_of_index.cache_clear()
    yield asked
    cuda_experts._capability_of_index.cache_clear()


def test_device_capability_is_asked_once_per_device_index(capabilities):
    for _ in range(3):
        assert cuda_experts.not_hopper(torch.device("cuda", 0)) is SM90_WHY
        assert cuda_experts.not_hopper(torch.device("cuda", 1)) == SM80_WHY
    assert capabilities == [0, 1]


def test_the_current_device_is_asked_every_time(capabilities):
    """An index-less device is whichever is current, which may change: never cached."""
    for _ in range(2):
        assert cuda_experts.not_hopper(torch.device("cuda")) is SM90_WHY
    assert capabilities == [None, None]


def test_a_device_that_is_not_cuda_asks_nothing(capabilities):
    assert cuda_experts.not_hopper(torch.device("cpu")) == "the device is cpu, not a CUDA GPU"
    assert cuda_experts.not_hopper(None) == "the device is None, not a CUDA GPU"
    assert capabilities == []


def test_a_gpu_that_cannot_run_the_engine_still_raises_every_time(capabilities, monkeypatch):
    """For the GPU's reason (the grouped-GEMM ops stubbed as built: without them that reason
    would come first)."""
    monkeypatch.setattr(cuda_experts.gg, "grouped_gemm_available", lambda: True)
    why = r"expert_gemm='engine' but the expert GEMM engine can't run: " + re.escape(SM80_WHY)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=why):
            cuda_experts.engine_steps("engine", torch.device("cuda", 1))


@pytest.mark.parametrize("accumulate", [False, True, None, 1])
def test_engine_steps_name_the_same_steps(capabilities, monkeypatch, accumulate):
    monkeypatch.setattr(cuda_experts.gg, "grouped_gemm_available", lambda: True)
    sm90 = torch.device("cuda", 0)
    auto = cuda_experts.AUTO_ENGINE_STEPS + (("wgrad",) if accumulate else ())
    assert cuda_experts.engine_steps("auto", sm90, accumulate) == auto
    assert cuda_experts.engine_steps("engine", sm90, accumulate) == cuda_experts.ENGINE_STEPS
    assert cuda_experts.engine_steps("torch", sm90, accumulate) == ()
    assert cuda_experts.engine_steps("l1+l2", sm90, accumulate) == ("l1", "l2")
    with pytest.raises(ValueError, match="choose auto, torch, engine or a comma list"):
        cuda_experts.engine_steps("l1,fp8", sm90, accumulate)


def test_the_megakernel_asks_the_experts_module_for_the_gpus_reason(monkeypatch):
    """Through the module imported once, so a stub of ``experts.not_hopper`` reaches it."""
    monkeypatch.setattr(cuda_experts, "not_hopper", lambda device: f"stubbed for {device}")
    assert mega.unsupported_reasons(torch.device("cuda", 0))[-1] == "stubbed for cuda:0"


# ------------------------------------------------------------------------- tensor checks
WS = types.SimpleNamespace(device=torch.device("cpu"))


class _Subclass(torch.Tensor):
    """A tensor subclass: not a plain tensor, so it meets the rules one by one."""


def _misaligned(dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(9, dtype=dtype)[1:]  # 4 bytes past a 16-byte boundary (fp32)


GOOD = {
    "tensor": lambda: torch.zeros(4, 8),
    "parameter": lambda: torch.nn.Parameter(torch.zeros(4, 8)),
    "subclass": lambda: torch.zeros(4, 8).as_subclass(_Subclass),
    "empty at an odd offset": lambda: _misaligned()[:0].view(0, 1).expand(0, 8),
}
BAD = {
    "not a tensor": (lambda: [[0.0] * 8] * 4, TypeError, r"^t must be a torch\.Tensor, got list$"),
    "dtype": (lambda: torch.zeros(4, 8, dtype=torch.float64), TypeError,
              r"^t has dtype torch\.float64; expected one of \[torch\.float32\]$"),
    "dims": (lambda: torch.zeros(32), ValueError, r"^t has 1 dims \(shape \(32,\)\); expected 2$"),
    "device": (lambda: torch.zeros(4, 8, device="meta"), ValueError,
               r"^t is on meta but the workspace is on cpu$"),
    "not contiguous": (lambda: torch.zeros(8, 4).T, ValueError,
                       r"^t must be contiguous \(call \.contiguous\(\) on it\)$"),
    "misaligned": (lambda: _misaligned().view(1, 8), ValueError,
                   r"^t starts at an address that is not 16-byte aligned \(why\); pass t\.clone\(\) "
                   r"\(a fresh tensor\), or a view that starts at a multiple of 4 float32 elements$"),
    "misaligned parameter": (lambda: torch.nn.Parameter(_misaligned().view(1, 8)), ValueError,
                             r"^t starts at an address that is not 16-byte aligned"),
    "misaligned subclass": (lambda: _misaligned().view(1, 8).as_subclass(_Subclass), ValueError,
                            r"^t starts at an address that is not 16-byte aligned"),
}  # fmt: skip


#: The good tensors of a plain type (tensor or parameter), which the one-test good case lets by.
PLAIN_GOOD = ("tensor", "parameter", "empty at an odd offset")


@pytest.mark.parametrize("kind", list(GOOD))
def test_a_good_tensor_passes(kind, monkeypatch):
    """A plain one in the one-test good case (the rules one by one raise here if they run), a
    subclass through the rules."""
    ran, real_rules = [], api._check_tensor_rules

    def rules(*args):
        if kind in PLAIN_GOOD:
            raise AssertionError(f"a good {kind} met the rules one by one: no fast path taken")
        ran.append(args)
        real_rules(*args)

    monkeypatch.setattr(api, "_check_tensor_rules", rules)
    api._check_tensor("t", GOOD[kind](), WS, dtypes=(torch.float32,), ndim=2, why="why")
    assert len(ran) == (kind not in PLAIN_GOOD)


@pytest.mark.parametrize("kind", list(BAD))
def test_each_broken_rule_raises_its_own_error(kind):
    make, error, pattern = BAD[kind]
    with pytest.raises(error, match=pattern):
        api._check_tensor("t", make(), WS, dtypes=(torch.float32,), ndim=2, why="why")


def test_the_first_broken_rule_is_the_one_named():
    """A tensor that breaks several rules gets the error of the first, as rule by rule."""
    t = torch.zeros(8, 4, dtype=torch.float64, device="meta").T
    with pytest.raises(TypeError, match="dtype"):
        api._check_tensor("t", t, WS, dtypes=(torch.float32,), ndim=2)
    with pytest.raises(ValueError, match="on meta"):
        api._check_tensor("t", t, WS, dtypes=(torch.float64,), ndim=2)


def test_a_config_is_checked_by_value_unless_it_is_the_workspaces_own():
    given = MoKConfig()
    ws = types.SimpleNamespace(config=dataclasses.replace(given, minibatch_size=128),
                               given_config=given)  # fmt: skip
    for config in (ws.config, given, MoKConfig(), dataclasses.replace(given, minibatch_size=128)):
        api._check_config(ws, config)
    with pytest.raises(ValueError, match="differs from the one the workspace was made with"):
        api._check_config(ws, MoKConfig(minibatch_size=512))


# ------------------------------------------------------------------------ pending schedule
SIZES = dict(rank=1, num_ranks=2, num_tokens=6, max_tokens=8, topk=2, num_local_experts=3,
             row_capacity=128, token_capacity=16)  # fmt: skip


def test_a_pending_schedule_holds_what_init_would_set_but_its_tensors():
    sched = MoKSchedule.pending(build=lambda s: None, **SIZES)
    made = MoKSchedule(**SIZES, **dict.fromkeys(MoKSchedule.INTEGER_FIELDS))
    want = {k: v for k, v in vars(made).items() if k not in MoKSchedule.INTEGER_FIELDS}
    assert {k: v for k, v in vars(sched).items() if k != "_build"} == want
    assert sched.is_pending() and sched.global_weights is None and sched.weights_source is None


def test_a_pending_schedule_builds_on_the_first_read_of_a_tensor():
    built = []

    def build(s):
        built.append(s)
        s.fill({name: torch.zeros(1) for name in MoKSchedule.INTEGER_FIELDS})

    sched = MoKSchedule.pending(build=build, **SIZES)
    assert sched.row_expert.shape == (1,) and built == [sched] and not sched.is_pending()


@pytest.mark.parametrize("change", ["missing", "unknown"])
def test_a_pending_schedule_with_other_sizes_raises_as_init_does(change):
    sizes = dict(SIZES)
    if change == "missing":
        del sizes["topk"]
    else:
        sizes["num_experts"] = 3
    with pytest.raises(TypeError, match="topk" if change == "missing" else "num_experts"):
        MoKSchedule.pending(build=lambda s: None, **sizes)


def _schedule_with(addition):
    """A dataclass with MoKSchedule's fields and ``addition``: a field or a __post_init__."""
    namespace = {"__post_init__": lambda self: None} if addition == "__post_init__" else {}
    extra = {"init=False": dataclasses.field(default=0, init=False),
             "default_factory": dataclasses.field(default_factory=list)}  # fmt: skip
    fields = [(f.name, f.type, f) for f in dataclasses.fields(MoKSchedule)]
    if addition in extra:
        fields.append(("extra", int, extra[addition]))
    return dataclasses.make_dataclass("Schedule", fields, namespace=namespace)


def test_a_schedule_init_that_pending_would_skip_raises_on_import():
    schedule._check_init_only_sets_fields(MoKSchedule)
    for addition in ("__post_init__", "init=False", "default_factory"):
        with pytest.raises(TypeError, match=re.escape(addition) + r"\)?; update pending"):
            schedule._check_init_only_sets_fields(_schedule_with(addition))
