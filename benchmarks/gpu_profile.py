"""The outer algorithms' host work on one device, in the library's own loop (no ``lowcomm
train``): per configuration, milliseconds a step against no algorithm, and under torch.profiler
over 24 steps (two syncs) the host's synchronisations with the device, copies, host reads and
kernel launches. A diagnostic for a GPU (12 x 768 GPT, batch 32 x 256, bf16 autocast); on the
CPU it runs a 2 x 64 model. From the repository root::

    PYTHONPATH=src python benchmarks/gpu_profile.py                  # the default list
    PYTHONPATH=src python benchmarks/gpu_profile.py none co2:compression=int4
    PYTHONPATH=src python benchmarks/gpu_profile.py --steps 24 none  # shorter

A configuration is ``none``, ``ddp`` or ``ALGO[:KEY=VALUE,...]`` with ALGO one of co2, diloco,
streaming and the keywords of its constructor (``sync_every=12``, ``sync_warmup=0`` unless
given). ``--steps N``: time N steps (default 48) after N/2 of warm-up, then profile N/2 more
(with H = 12 and N = 48 these hold two syncs). One line of JSON a configuration;
configurations run one after the other in one process (a world of one: NCCL on a GPU, gloo on
the CPU)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

DEFAULT = [
    "none",
    "co2:compression=none",
    "co2:compression=int4",
    "co2:compression=int8",
    "co2:sync_warmup=96,sync_warmup_compression=int8",
    "diloco:compression=none",
    "ddp",
]
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")


def _value(v: str) -> Any:
    return None if v == "none" else int(v) if v.isdigit() else v


def main(kinds: list[str], steps: int = 48) -> None:
    import lowcomm
    from lowcomm.models.gpt import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    layers, embd, heads, batch, block = (12, 768, 12, 32, 256) if cuda else (2, 64, 4, 4, 32)
    algos = {"co2": lowcomm.CO2, "diloco": lowcomm.DiLoCo, "streaming": lowcomm.StreamingDiLoCo}

    def build(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, block_size=block, n_layer=layers, n_head=heads, n_embd=embd)
        model: torch.nn.Module = GPT(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        if kind == "none":
            return model, opt, None
        if kind == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model), opt, None
        name, _, rest = kind.partition(":")
        kwargs: dict[str, Any] = {"sync_every": 12, "sync_warmup": 0}
        kwargs.update({k: _value(v) for k, v in (p.split("=") for p in rest.split(",") if p)})
        return model, opt, algos[name](model, opt, **kwargs)

    def run(kind: str) -> dict[str, Any]:
        model, opt, algo = build(kind)

        def step() -> None:
            x = torch.randint(0, 256, (batch, block + 1), device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(x[:, :-1])
                logits = logits[0] if isinstance(logits, tuple) else logits
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, 256), x[:, 1:].reshape(-1)
                )
            loss.backward()
            opt.step()
            opt.zero_grad()
            if algo is not None:
                algo.step()

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        for _ in range(steps // 2):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        ms = (time.perf_counter() - t0) / steps * 1e3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps // 2):
                step()
            sync()
        events = prof.key_averages()

        def count(*keys: str) -> int:
            return sum(e.count for e in events if e.key in keys)

        top = [
            (e.key, e.count, round(e.self_cpu_time_total / 1e3, 1))
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
        ]
        top_device = [
            (e.key[:60], e.count, round(e.self_device_time_total / 1e3, 2))
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]
        ]
        if algo is not None:
            algo.finish()
        return {
            "ms_per_step": round(ms, 2),
            "host_syncs": count(*SYNCS),
            "memcpy": count("cudaMemcpyAsync"),
            "host_reads": count("aten::_local_scalar_dense"),
            "launches": count(*LAUNCHES),
            "top_self_cpu_ms": top,
            "top_self_device_ms": top_device,
        }

    base = None
    for kind in kinds:
        try:
            row = run(kind)
        except Exception as e:  # a diagnostic: report the configuration that failed, go on
            row = {"error": repr(e)[:300]}
        if kind == "none":
            base = row.get("ms_per_step")
        if base and "ms_per_step" in row:
            row["of_none"] = round(base / row["ms_per_step"], 3)
        print(kind, json.dumps(row), flush=True)
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    args = sys.argv[1:]
    n = 48
    if args[:1] == ["--steps"]:
        n, args = int(args[1]), args[2:]
    try:
        main(args or DEFAULT, n)
    finally:
        dist.destroy_process_group()
