"""A Megatron-Core training run from one YAML file: GPTModel, DDP, Adam, mock data.

Used by ``scripts/pretrain_gpt_mok.py`` and the tests. Everything is Megatron-Core's own machinery
(``parallel_state``, ``GPTModel``, ``DistributedDataParallel``, ``get_megatron_optimizer``,
``get_forward_backward_func``, ``finalize_model_grads``); MoK only enters through the layer spec.
On a machine without a GPU the CPU shim (``cpu_shim.install``) is applied first.

Mock data: each sequence is an arithmetic progression modulo the vocabulary with a random start
and a stride from a small set, so the loss falls quickly from ln(vocab) once the model reads the
stride from the context. Batches depend only on (seed, data-parallel rank, step, micro-batch),
so a run is reproducible and the alltoall comparison sees the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mok_megatron import functional
from mok_megatron.memory import memory_sample

from . import cpu_shim
from .yaml_config import MoKRunConfig

__all__ = ["MockBatch", "RunResult", "build_gpt_model", "mock_batches", "setup_parallel", "train"]

_NUM_STRIDES = 4  # strides 1..4: the model must infer which from the context


@dataclass
class MockBatch:
    """tokens / labels / loss_mask / position_ids: [B, S] (int64, int64, float32, int64);
    attention_mask: [1, 1, S, S] bool (True = masked) or None (Megatron's causal default)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None


@dataclass
class RunResult:
    """Per-step losses (averaged over data-parallel ranks), the wall time of the loop and this
    rank's memory after every step (``mok_megatron.memory.memory_sample``): memory_kind
    "cuda_reserved" (memory_bytes the caching allocator's reserved bytes, memory_allocated_bytes
    its allocated bytes) or "rss" (memory_bytes the process's resident set; no allocated)."""

    losses: list[float]
    seconds: float
    dispatcher: str
    memory_kind: str = ""
    memory_bytes: list[int] = field(default_factory=list)
    memory_allocated_bytes: list[int] = field(default_factory=list)


def setup_parallel(run: MoKRunConfig) -> None:
    """Megatron's process groups and RNG on an initialised ``torch.distributed`` world."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if run.training.resolved_device() == "cpu":
        cpu_shim.install()
    if not parallel_state.model_parallel_is_initialized():
        run.initialize_model_parallel()
    model_parallel_cuda_manual_seed(run.training.seed, force_reset_rng=True)
    torch.manual_seed(run.training.seed)


def build_gpt_model(run: MoKRunConfig, dispatcher: str):
    """A GPTModel for this rank's pipeline stage; MoE layers are MoK's when dispatcher='mok'."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from .layer_specs import get_gpt_decoder_block_mok_spec

    config = run.transformer_config(dispatcher)
    use_te = _use_te(run)
    if dispatcher == "mok":
        spec = get_gpt_decoder_block_mok_spec(
            config, use_te, fused_experts=run.layer.fused_experts, **run.layer_params()
        )
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    model = GPTModel(
        config, spec, **run.gpt_model_kwargs(),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )  # fmt: skip
    return model.to(run.training.resolved_device())


def _use_te(run: MoKRunConfig) -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE and run.training.resolved_device() == "cuda"


def mock_batches(run: MoKRunConfig, step: int, num_micro: int) -> list[MockBatch]:
    """This data-parallel rank's micro-batches for one step (see the module docstring)."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    b, s, v = run.training.micro_batch_size, run.gpt("seq_length"), run.gpt("vocab_size")
    device = run.training.resolved_device()
    # Megatron's default causal mask is made on 'cuda' literally; on CPU pass it explicitly.
    mask = torch.ones(s, s).triu(1).bool()[None, None] if device == "cpu" else None
    batches = []
    for micro in range(num_micro):
        seed = ((run.training.seed * 1_000 + dp_rank) * 1_000_000 + step) * 1_000 + micro
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, v, (b, 1), generator=gen)
        stride = torch.randint(1, _NUM_STRIDES + 1, (b, 1), generator=gen)
        seq = (start + stride * torch.arange(s + 1)) % v
        batches.append(MockBatch(
            tokens=seq[:, :-1].to(device), labels=seq[:, 1:].to(device),
            loss_mask=torch.ones(b, s, device=device),
            position_ids=torch.arange(s, device=device).expand(b, s), attention_mask=mask,
        ))  # fmt: skip
    return batches


def _forward_step(data_iterator: Iterator[MockBatch], model):
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)

    def loss_func(per_token_loss: torch.Tensor):
        loss = (per_token_loss.float() * batch.loss_mask).sum() / batch.loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _wrap_for_training(run: MoKRunConfig, model):
    """Megatron DDP and Adam (expert parameters reduced over the expert-data-parallel group)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    t = run.training
    if t.resolved_device() == "cpu":
        config.finalize_model_grads_func = finalize_model_grads
        return ddp_model, CpuAdam(ddp_model, t)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
        bf16=t.dtype == "bfloat16", params_dtype=t.torch_dtype(),
    )  # fmt: skip
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return ddp_model, optimizer


class CpuAdam:
    """AdamW with global-norm clipping on DDP's reduced ``main_grad``s, for CPU runs.

    Megatron's optimizers allocate on ``device='cuda'`` literally, so CPU runs step here instead:
    the same update rule (decoupled weight decay except on 1-D parameters, clipping by the norm
    over all ranks' gradients). Supports tensor- and pipeline-parallel size 1, the CPU demo.
    """

    def __init__(self, ddp_model, training) -> None:
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() > 1 or (
            parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            raise ValueError("CPU training supports tensor/pipeline-parallel size 1; use a GPU")
        self.params = [p for p in ddp_model.parameters() if p.requires_grad]
        groups = [
            {
                "params": [p for p in self.params if p.dim() > 1],
                "weight_decay": training.weight_decay,
            },
            {"params": [p for p in self.params if p.dim() <= 1], "weight_decay": 0.0},
        ]
        self.adam = torch.optim.AdamW(groups, lr=training.lr, betas=(0.9, 0.999), eps=1e-8)
        self.clip_grad = training.clip_grad
        self.ep_group = parallel_state.get_expert_model_parallel_group()

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def step(self) -> float:
        """Clip by the global gradient norm, take an Adam step; returns the norm."""
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        dense = sum(float(p.grad.double().square().sum()) for p in self.params if _is_dense(p))
        expert = torch.tensor(
            [sum(float(p.grad.double().square().sum()) for p in self.params if not _is_dense(p))],
            dtype=torch.float64,
        )
        dist.all_reduce(expert, group=self.ep_group)
        norm = (dense + float(expert)) ** 0.5
        if self.clip_grad > 0 and norm > self.clip_grad:
            for p in self.params:
                p.grad.mul_(self.clip_grad / (norm + 1e-6))
        self.adam.step()
        return norm


def _is_dense(p) -> bool:
    return getattr(p, "allreduce", True)


def _num_micro_batches(run: MoKRunConfig) -> int:
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    mbs = run.training.micro_batch_size
    gbs = run.training.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise ValueError(
            f"training.global_batch_size={gbs} must be a multiple of micro_batch_size x data-"
            f"parallel size = {mbs} x {dp}"
        )
    return gbs // (mbs * dp)


def _train_step(run, model, optimizer, step: int, num_micro: int) -> float:
    """One optimizer step; returns the loss averaged over micro-batches and DP ranks."""
    from megatron.core import parallel_state

    model.zero_grad_buffer()
    optimizer.zero_grad()
    batches = mock_batches(run, step, num_micro)
    if run.training.resolved_device() == "cpu":
        losses = _forward_backward_cpu(model, batches)
    else:
        losses = _forward_backward_megatron(run, model, batches)
    optimizer.step()
    return _reduce_loss(losses, parallel_state, run.training.resolved_device())


def _forward_backward_megatron(run, model, batches: list[MockBatch]) -> list[dict]:
    """Megatron's schedule (pipeline-parallel aware; it allocates on 'cuda' literally)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=run.gpt("seq_length"),
        micro_batch_size=run.training.micro_batch_size, forward_only=False,
    )  # fmt: skip


def _forward_backward_cpu(model, batches: list[MockBatch]) -> list[dict]:
    """What Megatron's no-pipelining schedule does, on CPU: per micro-batch forward, loss / N
    (and the MoE aux-loss scale 1 / N), backward; then ``finalize_model_grads`` (DP reduce)."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    data, logged = iter(batches), []
    for _ in batches:
        output, loss_func = _forward_step(data, model)
        loss, report = loss_func(output)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / len(batches))
        (loss / len(batches)).backward()
        logged.append(report)
    model.config.finalize_model_grads_func([model])
    return logged


def _reduce_loss(losses: list[dict], parallel_state, device: str) -> float:
    """Mean 'lm loss' over micro-batches and ranks of the last pipeline stage (all ranks agree;
    tensor-parallel replicas hold equal losses, so the mean is the data-parallel mean)."""
    local = torch.zeros(2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage():
        local[0] = sum(float(d["lm loss"]) for d in losses)
        local[1] = len(losses)
    dist.all_reduce(local)
    return float(local[0] / local[1])


def train(
    run: MoKRunConfig,
    dispatcher: str = "mok",
    *,
    load_from: str | None = None,
    save_initial_to: str | None = None,
    progress: bool = True,
) -> RunResult:
    """Train ``run.training.train_iters`` steps with ``dispatcher`` ('mok' or a stock one).

    load_from / save_initial_to: a distributed-checkpoint directory to load the initial weights
    from / save them to (how the alltoall comparison starts from MoK's exact weights).
    """
    import time

    setup_parallel(run)
    model = build_gpt_model(run, dispatcher)
    if save_initial_to:
        _save_weights(model, save_initial_to)
    if load_from:
        _load_weights(model, load_from)
    model, optimizer = _wrap_for_training(run, model)
    num_micro = _num_micro_batches(run)
    bar = _progress_bar(run, dispatcher, progress)
    losses, memory, start = [], [], time.perf_counter()
    for step in range(run.training.train_iters):
        losses.append(_train_step(run, model, optimizer, step, num_micro))
        functional.poll_errors()  # the loss is on the host: every pass's error bits are too
        memory.append(memory_sample(run.training.resolved_device()))  # host-side, no sync
        _report(bar, step, losses[-1], run.training.train_iters)
    if bar is not None:
        bar.close()
    return RunResult(
        losses=losses, seconds=time.perf_counter() - start, dispatcher=dispatcher,
        memory_kind=memory[0].kind if memory else "", memory_bytes=[m.bytes for m in memory],
        memory_allocated_bytes=[m.allocated_bytes for m in memory if m.allocated_bytes is not None],
    )  # fmt: skip


def _progress_bar(run, dispatcher, enabled):
    if not enabled or dist.get_rank() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=run.training.train_iters, desc=f"train [{dispatcher}]", unit="step")


def _report(bar, step: int, loss: float, total: int) -> None:
    """The loss of every step on rank 0: under the progress bar, or as a plain line."""
    line = f"step {step + 1:4d}/{total}  loss {loss:.6f}"
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.write(line)
    elif dist.get_rank() == 0:
        print(line, flush=True)


def _save_weights(model, directory: str) -> None:
    import os

    from megatron.core import dist_checkpointing

    from .parity import require_checkpoint_writer

    require_checkpoint_writer()
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def _load_weights(model, directory: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state, strict=True)


def replace_training(run: MoKRunConfig, **changes) -> MoKRunConfig:
    """A copy of ``run`` with some training fields changed (e.g. fewer steps in tests)."""
    return dataclasses.replace(run, training=dataclasses.replace(run.training, **changes))


@dataclass
class PretrainOptions:
    """What ``scripts/pretrain_gpt_mok.py`` asks of every rank."""

    dispatcher: str = "mok"
    compare_dispatcher: str | None = None
    checkpoint_dir: str | None = None  # shared by all ranks; holds the initial weights to compare
    progress: bool = True


@dataclass
class PretrainReport:
    """Rank 0's summary: the MoK run and, with a comparison, the stock run."""

    main: RunResult
    compare: RunResult | None

    def max_loss_difference(self) -> float | None:
        if self.compare is None:
            return None
        return max(abs(a - b) for a, b in zip(self.main.losses, self.compare.losses))


def pretrain_rank(rank: int, world_size: int, run: MoKRunConfig, options: PretrainOptions):
    """The body of one rank (``torch.distributed`` already initialised): train, maybe compare."""
    del rank, world_size
    ckpt = options.checkpoint_dir if options.compare_dispatcher else None
    main = train(run, options.dispatcher, save_initial_to=ckpt, progress=options.progress)
    compare = None
    if options.compare_dispatcher:
        compare = train(run, options.compare_dispatcher, load_from=ckpt, progress=options.progress)
    return PretrainReport(main=main, compare=compare)
