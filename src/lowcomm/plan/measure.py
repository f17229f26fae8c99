"""Real peak memory of small GPTs under DDP and ZeRO-1/2/3, to check the memory model against.

N processes on a gloo group (127.0.0.1) each build lowcomm's GPT (no dropout, fp32, PyTorch's
scaled-dot-product attention, which takes its flash kernel on CPU), wrap it as

* ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` + AdamW (ZeRO-0);
* ``zero1``: the same with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (AdamW);
* ``zero2`` / ``zero3``: FSDP2 (``fully_shard`` on every block and the root) with
  ``reshard_after_forward`` False / True (ZeRO-2: the gathered parameters live from forward to
  the end of backward; ZeRO-3: gathered a layer at a time) + AdamW,

with full recompute as ``torch.utils.checkpoint`` around every block, and trains six steps;
gradients stay allocated between steps (``zero_grad(set_to_none=False)``), as the model counts them.
The peak is the largest over the third to sixth steps and over the ranks (FSDP's asynchronous
reduce-scatters make it vary from step to step), from PyTorch's profiler with ``profile_memory``:
every allocation and free of the CPU allocator from before the model is built, summed in time order,
so it is the bytes of live tensors (what ``torch.cuda.max_memory_allocated`` reports on a GPU), not
the process's resident size.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lowcomm.plan.memory import memory
from lowcomm.plan.spec import PRECISIONS, Layout, ModelSpec

__all__ = ["MEASURE_MODES", "MemoryCase", "measure_peak_memory", "predict_case"]

MEASURE_MODES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
STEPS = 6
"""Training steps per case; the peak is the largest over the steps after the first two (the
optimizer state exists and DDP has rebuilt its buckets)."""


@dataclass(frozen=True)
class MemoryCase:
    """One measured configuration."""

    mode: str
    """ddp, zero1, zero2 or zero3."""
    micro_batch: int
    recompute: str = "none"
    """none or full."""

    def __post_init__(self) -> None:
        if self.mode not in MEASURE_MODES:
            raise ValueError(f"mode must be one of {', '.join(MEASURE_MODES)}, got {self.mode!r}")
        if self.recompute not in ("none", "full"):
            raise ValueError(f"recompute must be none or full, got {self.recompute!r}")


def spec_of(shape: dict[str, int]) -> ModelSpec:
    """The :class:`ModelSpec` of lowcomm's GPT with ``shape`` (layers, hidden, heads, vocab,
    seq): GELU MLP, biases, tied embeddings, learned positions, no dropout."""
    return ModelSpec(
        name="lowcomm-gpt",
        layers=shape["layers"],
        hidden=shape["hidden"],
        heads=shape["heads"],
        vocab=shape["vocab"],
        seq=shape["seq"],
        dropout=False,
    )


def predict_case(case: MemoryCase, shape: dict[str, int], world: int) -> float:
    """The memory model's peak bytes for ``case`` (fp32, one micro-batch per step)."""
    layout = Layout(
        dp=world,
        zero=MEASURE_MODES[case.mode] if world > 1 else 0,
        micro_batch=case.micro_batch,
        recompute="full" if case.recompute == "full" else "none",
    )
    return memory(spec_of(shape), PRECISIONS["fp32"], layout, 1).total


def _peak_of_step(prof: Any, step: str) -> int:
    events = prof.profiler.kineto_results.events()
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    start, end = next((e.start_ns(), e.end_ns()) for e in events if e.name() == step)
    live = peak = 0
    for when, nbytes in allocations:
        live += nbytes
        if start <= when <= end:
            peak = max(peak, live)
    return peak


def _measure_one(case: MemoryCase, shape: dict[str, int], world: int) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.checkpoint import checkpoint

    from lowcomm.models.gpt import GPT, GPTConfig

    class Checkpointed(torch.nn.Module):
        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor, packed: Any = None) -> torch.Tensor:
            out = checkpoint(self.block, x, packed, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out

    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=shape["layers"],
        n_embd=shape["hidden"],
        n_head=shape["heads"],
        vocab_size=shape["vocab"],
        block_size=shape["seq"],
        dropout=0.0,
    )
    x = torch.randint(0, shape["vocab"], (case.micro_batch, shape["seq"]))
    y = torch.randint(0, shape["vocab"], (case.micro_batch, shape["seq"]))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = GPT(config)
        if case.recompute == "full":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = Checkpointed(block)
        net: torch.nn.Module = model
        if case.mode in ("ddp", "zero1"):
            net = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            reshard = case.mode == "zero3"
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt: torch.optim.Optimizer
        if case.mode == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4
            )
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        gc.collect()  # set-up leftovers (e.g. DDP's initial broadcast buffers) go before we measure
        for i in range(STEPS):
            with record_function(f"lowcomm-step-{i}"):
                loss = net(x, y)[1]
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=False)
        del net, model, opt
    gc.collect()
    return max(_peak_of_step(prof, f"lowcomm-step-{i}") for i in range(2, STEPS))


def _job(rank: int, world: int, cases: list[MemoryCase], shape: dict[str, int]) -> list[int]:
    return [_measure_one(case, shape, world) for case in cases]


DEFAULT_SHAPE = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8192, "seq": 256}


def default_cases() -> list[MemoryCase]:
    """Every mode at micro-batch 1, 2 and 4, with and without full recompute."""
    return [
        MemoryCase(mode, b, rc)
        for mode in MEASURE_MODES
        for rc in ("none", "full")
        for b in (1, 2, 4)
    ]


def measure_peak_memory(
    cases: Sequence[MemoryCase],
    *,
    world: int = 2,
    shape: dict[str, int] | None = None,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Measure every case on ``world`` gloo processes; one row per case with the largest peak
    over the ranks, the model's prediction and their ratio."""
    from lowcomm.testing import run_workers

    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an integer >= 2 (ZeRO shards over ranks), got {world!r}")
    shape = dict(DEFAULT_SHAPE if shape is None else shape)
    per_rank = run_workers(_job, world, list(cases), shape, timeout_s=timeout_s)
    rows = []
    for i, case in enumerate(cases):
        measured = max(r[i] for r in per_rank)
        predicted = predict_case(case, shape, world)
        rows.append(
            {
                **asdict(case),
                "world": world,
                "measured_bytes": measured,
                "predicted_bytes": predicted,
                "ratio": predicted / measured,
                **{f"model_{k}": v for k, v in shape.items()},
            }
        )
    return rows
