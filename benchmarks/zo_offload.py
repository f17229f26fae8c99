"""ZO2's offloading on a GPU: MeZO's blockwise step with the blocks streamed from host memory
(``MeZO(offload=True)``) against the same step with the whole model resident, side by side in
one process, then the largest model that fits offloaded on the device at hand. From the
repository root::

    PYTHONPATH=src python benchmarks/zo_offload.py                 # 24 x 2048 GPT, fp32
    PYTHONPATH=src python benchmarks/zo_offload.py --no-largest    # the comparison only
    PYTHONPATH=src python benchmarks/zo_offload.py --device cpu --layers 3 --embd 32 \\
        --heads 2 --seq 16 --batch 2 --steps 2 --width-step 32 --max-params 1e5  # on the CPU

**The comparison** (the same GPT built from the same seed twice, byte tokens, a random batch on
the device): ``--warmup`` steps, then ``--steps`` timed steps of each of ``resident``
(``blockwise=True``, the model on the device) and ``offloaded`` (``offload=True``, the blocks in
pinned host memory through ``--buffers`` device buffers); per run the tokens/s (two forwards per
token, as MeZO counts a step's tokens once), the peak device memory over the timed steps
(``torch.cuda.max_memory_allocated``), and whether the offloaded run is bit-identical to the
resident one (every step's L₊, L₋, g and the parameters' digest after the pending update).

**The largest model that fits offloaded**: at the same depth, the widest GPT (width a multiple of
``--width-step``, 256; 64 per head) whose offloaded step fits, by the planner's parameter counts
(:class:`lowcomm.plan.spec.ModelSpec`) and this estimate: on the device the embeddings and head,
``buffers`` blocks, one transient z and the dual forward's activations; in pinned host memory
the parameters, within ``--host-fraction`` of the memory available and ``--max-params``
parameters (its build and two steps must fit the check's budget). It is built and run for
``--largest-steps`` steps; its peak device memory is reported against the estimate, and the
memory the same model would need resident.

One line of JSON per run, then a summary; exit status 1 when the offloaded run is not
bit-identical or a run fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

HEAD_SIZE = 64


def _heads(width: int) -> int:
    return width // HEAD_SIZE if width % HEAD_SIZE == 0 else 1


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--embd", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--buffers", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--largest", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--largest-steps", type=int, default=2)
    p.add_argument("--host-fraction", type=float, default=0.5)
    p.add_argument("--max-params", type=float, default=6e9)
    p.add_argument("--width-step", type=int, default=256)
    return p.parse_args(argv)


def _dtype(name: str) -> torch.dtype:
    return torch.float32 if name == "fp32" else torch.bfloat16


def _model(layers: int, embd: int, heads: int, seq: int, dtype: torch.dtype) -> Any:
    from lowcomm.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=256, block_size=seq, n_layer=layers, n_head=heads, n_embd=embd, dropout=0.0
    )
    return GPT(cfg).to(dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(
    kind: str,
    *,
    device: torch.device,
    layers: int,
    embd: int,
    heads: int,
    seq: int,
    batch: int,
    steps: int,
    warmup: int,
    buffers: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """``kind`` resident or offloaded: ``warmup`` + ``steps`` MeZO steps; tokens/s, peak device
    memory, the steps' losses and the parameters' digest."""
    from lowcomm.zo import MeZO

    model = _model(layers, embd, heads, seq, dtype)
    offload = kind == "offloaded"
    if not offload:
        model.to(device)
    zo = MeZO(
        model,
        lr=1e-6,
        eps=1e-3,
        blockwise=True,
        offload=offload,
        device=device if offload else None,
        offload_buffers=buffers,
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (batch, seq), generator=gen).to(device)
    y = torch.randint(0, 256, (batch, seq), generator=gen).to(device)
    losses = []
    for _ in range(warmup):
        losses.append(zo.step(stages=model.zo_stages(x, y)))
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(zo.step(stages=model.zo_stages(x, y)))
    _sync(device)
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    zo.flush()
    digest = zo.digest()
    parameters = sum(p.numel() for p in model.parameters())
    row = {
        "run": kind,
        "layers": layers,
        "embd": embd,
        "parameters": parameters,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "tokens_per_s": steps * batch * seq / elapsed,
        "step_s": elapsed / steps,
        "peak_device_bytes": peak,
        "losses": [[r.loss_plus[0], r.loss_minus[0], r.projected_grads[0]] for r in losses],
        "digest": digest,
        "offload": zo.offloader.summary() if zo.offloader is not None else None,
    }
    del zo, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def estimate(
    layers: int, embd: int, seq: int, batch: int, buffers: int, element: int
) -> dict[str, float]:
    """Device and host bytes of an offloaded step, and the device bytes of a resident one, by
    the planner's parameter counts and the activations of a dual forward (see the module
    docstring)."""
    from lowcomm.plan.spec import ModelSpec

    spec = ModelSpec(
        layers=layers, hidden=embd, heads=_heads(embd), vocab=256, seq=seq, dropout=False
    )
    block = spec.layer_parameters() * element
    ends = (spec.embedding_parameters() + spec.head_parameters()) * element
    z = 2 * 4 * embd * embd * element  # the largest tensor's z and its scaled copy
    tokens = batch * seq
    # a block's working set in one forward (qkv, attention output, the 4h MLP, the residuals),
    # both forwards' outputs held, and the head's logits and their softmax
    activations = tokens * (12 * embd + 2 * 256) * max(element, 4)
    return {
        "parameters": float(spec.parameters()),
        "device_offloaded": ends + buffers * block + z + activations,
        "device_resident": spec.parameters() * element + z + activations,
        "host_offloaded": spec.parameters() * element,
    }


def _host_available() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def largest(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The widest GPT of ``--layers`` blocks whose offloaded step fits; built and run."""
    element = 4 if args.dtype == "fp32" else 2
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        device_budget = 0.9 * free
    else:
        device_budget = float("inf")
    host_budget = args.host_fraction * _host_available()
    embd, bound = 0, "none"
    width = args.width_step
    while True:
        e = estimate(args.layers, width, args.seq, args.batch, args.buffers, element)
        if e["device_offloaded"] > device_budget:
            bound = "device memory"
        elif e["host_offloaded"] > host_budget:
            bound = "host memory"
        elif e["parameters"] > args.max_params:
            bound = "--max-params"
        else:
            embd, width = width, width + args.width_step
            continue
        break
    if embd == 0:
        return {"run": "largest", "error": f"no width fits ({bound})"}
    e = estimate(args.layers, embd, args.seq, args.batch, args.buffers, element)
    row = run(
        "offloaded",
        device=device,
        layers=args.layers,
        embd=embd,
        heads=_heads(embd),
        seq=args.seq,
        batch=args.batch,
        steps=args.largest_steps,
        warmup=0,
        buffers=args.buffers,
        dtype=_dtype(args.dtype),
    )
    row.update(
        run="largest",
        bound=bound,
        estimated_device_bytes=e["device_offloaded"],
        resident_would_need_bytes=e["device_resident"],
        device_budget_bytes=device_budget if device_budget != float("inf") else None,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = {
        "device": device,
        "layers": args.layers,
        "embd": args.embd,
        "heads": args.heads,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "buffers": args.buffers,
        "dtype": _dtype(args.dtype),
    }
    rows = {kind: run(kind, **shape) for kind in ("resident", "offloaded")}
    for row in rows.values():
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    resident, offloaded = rows["resident"], rows["offloaded"]
    identical = (
        resident["losses"] == offloaded["losses"] and resident["digest"] == offloaded["digest"]
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; {args.layers} x {args.embd} GPT, {resident['parameters']:,} parameters")
    print(f"offloaded bit-identical to resident: {identical}")
    speed = offloaded["tokens_per_s"] / resident["tokens_per_s"]
    print(f"tokens/s offloaded / resident: {speed:.2f}")
    if resident["peak_device_bytes"]:
        ratio = offloaded["peak_device_bytes"] / resident["peak_device_bytes"]
        print(
            f"peak device memory: offloaded {offloaded['peak_device_bytes'] / 2**30:.2f} GiB, "
            f"resident {resident['peak_device_bytes'] / 2**30:.2f} GiB ({ratio:.2f})"
        )
    ok = identical
    if args.largest:
        big = largest(args, device)
        print(json.dumps({k: v for k, v in big.items() if k != "losses"}), flush=True)
        if "error" in big:
            ok = False
        else:
            peak = big["peak_device_bytes"]
            print(
                f"largest offloaded: {args.layers} x {big['embd']}, {big['parameters']:,} "
                f"parameters ({big['parameter_bytes'] / 2**30:.1f} GiB, bound: {big['bound']}), "
                f"{big['tokens_per_s']:,.0f} tokens/s, peak device "
                + (f"{peak / 2**30:.2f} GiB" if peak else "-")
                + f" (estimated {big['estimated_device_bytes'] / 2**30:.2f}); resident it would "
                f"need {big['resident_would_need_bytes'] / 2**30:.1f} GiB"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
