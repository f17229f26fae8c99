"""Real peak memory of small GPTs under DDP and ZeRO-1/2/3, to check the memory model against.

N processes on a gloo group (127.0.0.1) each build lowcomm's GPT (no dropout, fp32), or a
Llama-style model (:mod:`lowcomm.models.llama`: RMSNorm, rotary positions, grouped-query
attention with half as many key/value heads, SwiGLU, untied output layer; ``llama`` runs its
norms and SwiGLU as plain PyTorch autograd does, ``llama-fused`` as fused kernels keep them),
from the same seed and wrap it as

* ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True, init_sync=False)`` + AdamW
  (ZeRO-0; the ranks' parameters are equal by seed, so the initial broadcast, whose flat copy
  of the parameters gloo sometimes keeps alive for the whole run, is skipped);
* ``zero1``: the same with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (AdamW);
* ``zero2`` / ``zero3``: FSDP2 (``fully_shard`` on every block and the root) with
  ``reshard_after_forward`` False / True (ZeRO-2: the gathered parameters live from forward to
  the end of backward; ZeRO-3: gathered a layer at a time) + AdamW. FSDP's reduce-scatter and
  all-gather are replaced by ones that use the buffers a NCCL collective uses and return only
  once gloo's worker thread has let go of them (see :func:`_released`).

Attention is PyTorch's scaled-dot-product attention: its flash kernel on CPU (keeps its output
and log-sum-exp), or its math kernel (keeps the s × s softmax); full recompute puts every block
under ``torch.utils.checkpoint``, selective recompute only the attention core (math kernel).
Six training steps; gradients stay allocated between steps (``zero_grad(set_to_none=False)``),
as the model counts them; the garbage collector runs before each step and not during it (FSDP
holds tensors in reference cycles; collecting at random points made the peak depend on when).

The peak is the largest over the third to sixth steps and over the ranks, from PyTorch's
profiler with ``profile_memory``: the allocations and frees of the CPU allocator from before the
model is built, summed in time order, a free counted only for a block allocated while profiling
(by address, from the trace). So it is the bytes of live tensors (what
``torch.cuda.max_memory_allocated`` reports on a GPU), not the process's resident size.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lowcomm.plan.memory import memory
from lowcomm.plan.spec import PRECISIONS, Layout, ModelSpec

__all__ = ["ARCHS", "MEASURE_MODES", "MemoryCase", "measure_peak_memory", "predict_case"]

MEASURE_MODES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
ARCHS = ("gpt", "llama", "llama-fused")
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
    """none, selective (the attention core recomputed; math attention only) or full."""
    attention: str = "flash"
    """flash (PyTorch's flash kernel: keeps its output and log-sum-exp) or math (keeps the
    s × s softmax)."""
    arch: str = "gpt"
    """gpt, llama (eager SwiGLU and RMSNorm) or llama-fused."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.mode not in MEASURE_MODES:
            raise ValueError(f"mode must be one of {', '.join(MEASURE_MODES)}, got {self.mode!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.attention not in ("flash", "math"):
            raise ValueError(f"attention must be flash or math, got {self.attention!r}")
        if self.recompute == "selective" and self.attention == "flash":
            raise ValueError(
                "selective recompute is what flash attention already does: use "
                "attention='math' with recompute='selective'"
            )


def spec_of(shape: dict[str, int], arch: str = "gpt") -> ModelSpec:
    """The :class:`ModelSpec` of the measured model with ``shape`` (layers, hidden, heads,
    vocab, seq). gpt: lowcomm's GPT (GELU MLP, biases, tied embeddings, learned positions, no
    dropout); llama / llama-fused: :class:`~lowcomm.models.llama.Llama` with half as many
    key/value heads and its default SwiGLU width."""
    if arch == "gpt":
        return ModelSpec(
            name="lowcomm-gpt",
            layers=shape["layers"],
            hidden=shape["hidden"],
            heads=shape["heads"],
            vocab=shape["vocab"],
            seq=shape["seq"],
            dropout=False,
        )
    config = _llama_config(shape, arch)
    return ModelSpec(
        name=arch,
        layers=config.n_layer,
        hidden=config.n_embd,
        heads=config.n_head,
        vocab=config.vocab_size,
        seq=config.block_size,
        ffn_hidden=config.ffn,
        kv_heads=config.kv_heads,
        gated=True,
        tied_embeddings=False,
        learned_positions=False,
        bias=False,
        dropout=False,
        kernels=config.kernels,
    )


def _llama_config(shape: dict[str, int], arch: str) -> Any:
    from lowcomm.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"],
        block_size=shape["seq"],
        n_layer=shape["layers"],
        n_head=shape["heads"],
        n_kv_head=max(1, shape["heads"] // 2),
        n_embd=shape["hidden"],
        kernels="fused" if arch == "llama-fused" else "eager",
    )


def predict_case(case: MemoryCase, shape: dict[str, int], world: int) -> float:
    """The memory model's peak bytes for ``case`` (fp32, one micro-batch per step)."""
    layout = Layout(
        dp=world,
        zero=MEASURE_MODES[case.mode] if world > 1 else 0,
        micro_batch=case.micro_batch,
        recompute=case.recompute,  # type: ignore[arg-type]
        flash_attention=case.attention == "flash",
    )
    return memory(spec_of(shape, case.arch), PRECISIONS["fp32"], layout, 1).total


def _step_peaks(prof: Any, steps: Sequence[str]) -> list[int]:
    """Peak bytes of live allocations during each named step.

    From the profiler's trace, whose memory events carry the block's address: allocations are
    summed in time order from the start of profiling, and a free counts only for a block
    allocated while profiling (the allocator's size table can hold stale sizes of blocks from
    an earlier profile, freed and reused in between).
    """
    with tempfile.TemporaryDirectory(prefix="lowcomm-plan-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    windows = {}
    for e in events:
        if e.get("name") in steps and e.get("ph") == "X":
            windows[e["name"]] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    memory_events = sorted(
        (float(e["ts"]), int(e["args"]["Bytes"]), e["args"]["Addr"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    )
    live, held = 0, {}
    peaks = dict.fromkeys(steps, 0)
    for when, nbytes, addr in memory_events:
        if nbytes > 0:
            held[addr] = nbytes
            live += nbytes
        elif addr in held:
            live -= held.pop(addr)
        for step, (start, end) in windows.items():
            if start <= when <= end:
                peaks[step] = max(peaks[step], live)
    return [peaks[step] for step in steps]


def _measure_one(case: MemoryCase, shape: dict[str, int], world: int) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.checkpoint import checkpoint

    from lowcomm.models.gpt import GPT, GPTConfig

    class Checkpointed(torch.nn.Module):
        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args: Any) -> torch.Tensor:
            out = checkpoint(self.block, *args, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out

    def build() -> torch.nn.Module:
        if case.arch != "gpt":
            from lowcomm.models.llama import Llama

            return Llama(_llama_config(shape, case.arch))
        config = GPTConfig(
            n_layer=shape["layers"],
            n_embd=shape["hidden"],
            n_head=shape["heads"],
            vocab_size=shape["vocab"],
            block_size=shape["seq"],
            dropout=0.0,
        )
        return GPT(config)

    torch.manual_seed(0)
    x = torch.randint(0, shape["vocab"], (case.micro_batch, shape["seq"]))
    y = torch.randint(0, shape["vocab"], (case.micro_batch, shape["seq"]))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build()
        blocks = model.blocks
        assert isinstance(blocks, torch.nn.ModuleList)
        if case.recompute == "full":
            for i, block in enumerate(blocks):
                blocks[i] = Checkpointed(block)
        net: torch.nn.Module = model
        if case.mode in ("ddp", "zero1"):
            # the ranks built identical models (same seed): no initial broadcast, whose flat
            # copy of the parameters gloo may keep alive for the whole run
            net = torch.nn.parallel.DistributedDataParallel(
                model, gradient_as_bucket_view=True, init_sync=False
            )
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            reshard = case.mode == "zero3"
            for block in [*blocks, model]:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
                block.set_custom_reduce_scatter(_all_reduce_scatter())
                block.set_custom_all_gather(_chunk_all_gather())
        opt: torch.optim.Optimizer
        if case.mode == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4
            )
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        with _attention(case):
            for i in range(STEPS):
                # set-up leftovers and the previous step's cyclic garbage (FSDP keeps tensors
                # in reference cycles) go before each step, and the collector waits during it
                gc.collect()
                gc.disable()
                try:
                    with record_function(f"lowcomm-step-{i}"):
                        loss = net(x, y)[1]
                        loss.backward()
                        del loss
                        opt.step()
                        opt.zero_grad(set_to_none=False)
                finally:
                    gc.enable()
        del net, model, opt
    gc.collect()
    return max(_step_peaks(prof, [f"lowcomm-step-{i}" for i in range(2, STEPS)]))


@contextlib.contextmanager
def _released(*tensors: Any) -> Iterator[None]:
    """Wait after a collective until gloo's worker thread has let go of ``tensors``.

    gloo runs a collective on a worker thread, which keeps its own references to the tensors
    for a moment after the caller's wait returns. Where that thread drops the last reference,
    the tensor is freed there, and the profiler records memory events only on the threads it
    profiles (with ``profile_all_threads`` it records none, in PyTorch 2.13): the trace then
    counts the tensor as live for the rest of the run. FSDP's reduce-scatter inputs and
    all-gather outputs, 8.65 MB at a time, made the measured peak grow from step to step and
    differ between runs. The references are counted before the call; after it this waits (at
    most 5 s) until the counts are back, then 2 ms more: with the counts back, about one free
    in 2,400 still happened on gloo's thread, none in 3,600 with the extra wait.
    """
    before = [t._use_count() for t in tensors]
    yield
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if all(t._use_count() <= n for t, n in zip(tensors, before, strict=True)):
            break
        time.sleep(0.0002)
    time.sleep(0.002)


def _all_reduce_scatter() -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

    class AllReduceScatter(DefaultAllocMixin, ReduceScatter):
        """A reduce-scatter as an in-place all-reduce and a copy of this rank's chunk: the
        buffers a NCCL reduce-scatter uses. gloo's own reduce-scatter works on copies of its
        input that its worker thread frees, out of the profiler's sight."""

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> None:
            with _released(input_tensor):
                dist.all_reduce(input_tensor, op=op, group=group)
            chunks = input_tensor.view(group.size(), -1)
            output_tensor.view(-1).copy_(chunks[group.rank()])

    return AllReduceScatter()


def _chunk_all_gather() -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

    class ChunkAllGather(DefaultAllocMixin, AllGather):
        """An all-gather straight into the chunks of the output (no staging copy kept)."""

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> Any:
            chunks = list(output_tensor.view(group.size(), -1).unbind(0))
            flat = input_tensor.view(-1)
            with _released(flat, *chunks):
                dist.all_gather(chunks, flat, group=group)
            return None  # done: FSDP has nothing to wait for

    return ChunkAllGather()


@contextlib.contextmanager
def _attention(case: MemoryCase) -> Iterator[None]:
    """PyTorch's math attention for ``attention="math"``, its core under
    ``torch.utils.checkpoint`` for selective recompute; flash (the default kernel) otherwise."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    if case.attention == "flash":
        yield
        return
    original = F.scaled_dot_product_attention

    def recomputed(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = checkpoint(original, *args, use_reentrant=False, **kwargs)
        assert isinstance(out, torch.Tensor)
        return out

    with sdpa_kernel([SDPBackend.MATH]):
        if case.recompute != "selective":
            yield
            return
        F.scaled_dot_product_attention = recomputed  # the GPT looks it up at each call
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original


def _job(rank: int, world: int, cases: list[MemoryCase], shape: dict[str, int]) -> list[int]:
    # what the process holds before the first case (torch and the rest the fork server
    # imported) is no garbage of a case: moved out of the collector's sight, so that the
    # collection each step starts with costs milliseconds instead of a third of a second.
    # (Memory it held was allocated before any profiling, which the peaks leave out anyway.)
    gc.collect()
    gc.freeze()
    return [_measure_one(case, shape, world) for case in cases]


DEFAULT_SHAPE = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8192, "seq": 256}


def default_cases() -> list[MemoryCase]:
    """The GPT in every mode at micro-batch 1, 2 and 4 with flash attention, without and with
    full recompute, and at micro-batch 2 with math attention, without and with selective
    recompute; the Llama-style model, eager and fused, at micro-batch 2 under DDP, ZeRO-1 and
    ZeRO-3 and with full recompute."""
    cases = [
        MemoryCase(mode, b, rc)
        for mode in MEASURE_MODES
        for rc in ("none", "full")
        for b in (1, 2, 4)
    ]
    cases += [
        MemoryCase(mode, 2, rc, "math") for mode in MEASURE_MODES for rc in ("none", "selective")
    ]
    cases += [
        MemoryCase(mode, 2, rc, arch=arch)
        for arch in ("llama", "llama-fused")
        for mode, rc in (("ddp", "none"), ("zero1", "none"), ("zero3", "none"), ("ddp", "full"))
    ]
    return cases


def measure_peak_memory(
    cases: Sequence[MemoryCase],
    *,
    world: int = 2,
    shape: dict[str, int] | None = None,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Measure every case on ``world`` gloo processes; one row per case with the largest peak
    over the ranks, the model's prediction and their ratio."""
    from lowcomm.procs.workers import run_workers

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
