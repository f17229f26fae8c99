"""``lowcomm plan``'s command line: a model, a cluster and a global batch -> ranked layouts.

``--validate megatron|frontier|published|memory`` prints a validation table instead (memory
measures on this machine).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Any

from lowcomm.flags import add_flags, fields_of, flag
from lowcomm.plan.presets import CLUSTERS, MODELS, cluster_preset, model_preset
from lowcomm.plan.spec import PRECISIONS, RECOMPUTE, Cluster, ModelSpec, Tier, parse_layout

__all__ = ["add_subcommand"]

VALIDATIONS = ("megatron", "frontier", "published", "memory")


def _int(text: str, flag: str, low: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag} must be an integer >= {low}, got {text!r}") from None
    if value < low:
        raise ValueError(f"{flag} must be an integer >= {low}, got {text!r}")
    return value


def _float(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number > 0, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{flag} must be a finite number > 0, got {text!r}")
    return value


def _model(args: argparse.Namespace) -> ModelSpec:
    dims = ("layers", "hidden", "heads", "vocab", "seq")
    given = {k: getattr(args, k) for k in dims if getattr(args, k, None) is not None}
    if getattr(args, "model", None):
        model = model_preset(args.model)
        if given:
            dims_given: dict[str, Any] = {k: _int(v, f"--{k}") for k, v in given.items()}
            model = replace(model, **dims_given)
        if getattr(args, "kernels", None):
            model = replace(model, kernels=args.kernels)
        return model
    missing = [f"--{k}" for k in dims if k not in given]
    if missing:
        raise ValueError(
            f"give --model (one of {', '.join(MODELS)}) or the dimensions: missing "
            f"{', '.join(missing)}"
        )
    extra: dict[str, Any] = {}
    if getattr(args, "ffn_hidden", None):
        extra["ffn_hidden"] = _int(args.ffn_hidden, "--ffn-hidden")
    if getattr(args, "kv_heads", None):
        extra["kv_heads"] = _int(args.kv_heads, "--kv-heads")
    if getattr(args, "llama", False):
        extra.update(
            gated=True, tied_embeddings=False, learned_positions=False, bias=False, dropout=False
        )
    extra.update({k: _int(v, f"--{k}") for k, v in given.items()})
    if getattr(args, "kernels", None):
        extra["kernels"] = args.kernels
    return ModelSpec(**extra)


def _tier(text: str) -> Tier:
    parts = text.split(":")
    slow = len(parts) == 5 and parts[4] == "slow"
    if len(parts) not in (3, 4, 5) or (len(parts) == 5 and not slow):
        raise ValueError(
            f"--tier {text!r} must be NAME:MEMBERS:GBIT_PER_S[:LATENCY_US[:slow]], e.g. "
            "node:8:2400:5 (devices of a node joined at 2400 Gbit/s each) or "
            "wan:2:10:30000:slow (a slow tier the outer algorithms may cross)"
        )
    latency = float(parts[3]) * 1e-6 if len(parts) >= 4 else 0.0
    return Tier(
        name=parts[0],
        members=_int(parts[1], "--tier members"),
        bandwidth_bps=_float(parts[2], "--tier bandwidth") * 1e9,
        latency_s=latency,
        slow=slow,
    )


def _cluster(args: argparse.Namespace) -> Cluster:
    nodes = _int(args.nodes, "--nodes") if getattr(args, "nodes", None) else 1
    tiers = getattr(args, "tier", None)
    if getattr(args, "cluster", None):
        cluster = cluster_preset(args.cluster, nodes)
        if tiers:
            raise ValueError("give --cluster or --tier, not both")
    else:
        if not tiers:
            raise ValueError(
                f"give --cluster (one of {', '.join(CLUSTERS)}) --nodes N, or the devices: "
                "--tier ... (fastest first) --device-memory-gb --peak-tflops"
            )
        parsed = tuple(_tier(t) for t in tiers)
        needed = ("device_memory_gb", "peak_tflops")
        missing = ["--" + k.replace("_", "-") for k in needed if not getattr(args, k, None)]
        if missing:
            raise ValueError(f"an explicit cluster needs {', '.join(missing)}")
        cluster = Cluster(
            name="custom",
            device_memory_bytes=_float(args.device_memory_gb, "--device-memory-gb") * 1e9,
            peak_flops=_float(args.peak_tflops, "--peak-tflops") * 1e12,
            gemm_efficiency=0.6,
            memory_bandwidth_Bps=2000e9,
            tiers=parsed,
        )
    changes: dict[str, Any] = {}
    if getattr(args, "gemm_efficiency", None):
        changes["gemm_efficiency"] = _float(args.gemm_efficiency, "--gemm-efficiency")
    if getattr(args, "memory_bandwidth_gbs", None):
        changes["memory_bandwidth_Bps"] = (
            _float(args.memory_bandwidth_gbs, "--memory-bandwidth-gbs") * 1e9
        )
    if getattr(args, "device_memory_gb", None) and getattr(args, "cluster", None):
        changes["device_memory_bytes"] = _float(args.device_memory_gb, "--device-memory-gb") * 1e9
    return replace(cluster, **changes) if changes else cluster


def _run_validate(args: argparse.Namespace, prog: str) -> int:
    from lowcomm.plan import report, validate

    which = args.validate
    if which not in VALIDATIONS:
        raise ValueError(f"--validate must be one of {', '.join(VALIDATIONS)}, got {which!r}")
    if which == "megatron":
        rows = validate.validate_megatron()
        text = report.format_megatron(rows)
    elif which == "frontier":
        rows = validate.validate_frontier()
        text = report.format_frontier(rows)
    elif which == "published":
        rows = validate.validate_published()
        text = report.format_published(rows)
    else:
        world = _int(args.world, "--world", low=2) if getattr(args, "world", None) else 2
        rows = validate.validate_memory(world=world)
        text = report.format_memory(rows)
    print(text)
    if getattr(args, "json", None):
        print(f"{prog}: wrote {report.write_json(rows, args.json)}")
    return 0


def _run_plan(args: argparse.Namespace, prog: str) -> int:
    from lowcomm.plan import report
    from lowcomm.plan.search import plan

    if getattr(args, "validate", None):
        return _run_validate(args, prog)
    model = _model(args)
    cluster = _cluster(args)
    if not getattr(args, "global_batch", None):
        raise ValueError("give --global-batch (sequences per iteration, e.g. 1024)")
    batch = _int(args.global_batch, "--global-batch")
    precision_name = getattr(args, "precision", "bf16")
    if precision_name not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}")
    recompute = tuple(getattr(args, "recompute", ",".join(RECOMPUTE)).split(","))
    for r in recompute:
        if r not in RECOMPUTE:
            raise ValueError(f"--recompute takes {', '.join(RECOMPUTE)}, got {r!r}")
    outer_text = getattr(args, "outer", "diloco,co2")
    outer = () if outer_text in ("", "none") else tuple(outer_text.split(","))
    usable = _float(getattr(args, "usable", "0.9"), "--usable")
    if usable > 1:
        raise ValueError(f"--usable is a fraction of the device memory in (0, 1], got {usable}")
    fixed = parse_layout(args.layout) if getattr(args, "layout", None) else None
    interleave = tuple(
        _int(v, "--interleave") for v in str(getattr(args, "interleave", "1,2,4,8")).split(",")
    )
    options: dict[str, Any] = {
        "usable": usable,
        "max_micro_batch": _int(getattr(args, "max_micro_batch", "16"), "--max-micro-batch"),
        "recompute": recompute,
        "flash_attention": not getattr(args, "no_flash", False),
        "outer": outer,
        "sync_every": (
            _int(args.sync_every, "--sync-every") if getattr(args, "sync_every", None) else None
        ),
        "interleave": interleave,
    }
    result = plan(model, PRECISIONS[precision_name], cluster, batch, fixed=fixed, **options)
    top = _int(getattr(args, "top", "10"), "--top")
    if fixed:
        if "interleave" in fixed:  # the rank among layouts with as many virtual stages
            options["interleave"] = tuple(sorted({*interleave, int(fixed["interleave"])}))  # type: ignore[call-overload]
        # overlaps describe the framework, not a choice: the rank is among layouts that share them
        framework = {k: v for k, v in fixed.items() if k in ("tp_overlap", "dp_overlap")}
        full = plan(
            model, PRECISIONS[precision_name], cluster, batch, fixed=framework or None, **options
        )
        print(report.format_layout(result, full, args.layout, top))
    else:
        print(report.format_candidates(result, top))
    written = []
    if getattr(args, "json", None):
        written.append(report.write_json(report.result_json(result), args.json))
    if getattr(args, "plot", None):
        written.append(report.plot_candidates(result, args.plot, top))
    if written:
        print(f"{prog}: wrote {', '.join(written)}")
    if fixed and not result.candidates:
        # the layout asked for cannot run: a bad input, named by the rules it breaks
        broken = (
            result.infeasible[0].reasons
            if result.infeasible
            else tuple(sorted(result.rejected)) or ("no layout keeps it",)
        )
        print(
            f"{prog}: error: --layout {args.layout} cannot run here: {'; '.join(broken)}",
            file=sys.stderr,
        )
        return 2
    return 0 if result.candidates else 1


@dataclass(kw_only=True)
class PlanFlags:
    """The flags of ``lowcomm plan``: each field one flag (the namespace holds those given)."""

    model: str | None = flag(None, metavar="PRESET", doc=f"model preset: {', '.join(MODELS)}")
    layers: str | None = flag(None, metavar="L")
    """transformer layers (with --model: overrides the preset's)"""
    hidden: str | None = flag(None, metavar="H")
    """hidden size"""
    heads: str | None = flag(None, metavar="A")
    """attention heads"""
    vocab: str | None = flag(None, metavar="V")
    """vocabulary size"""
    seq: str | None = flag(None, metavar="S")
    """sequence length"""
    ffn_hidden: str | None = flag(None, metavar="F")
    """MLP width (default 4 x hidden)"""
    kv_heads: str | None = flag(None, metavar="K")
    """key/value heads (grouped-query attention)"""
    llama: bool = flag(False)
    """Llama-style: SwiGLU MLP, RMSNorm, no biases, rotary, untied head"""
    kernels: str | None = flag(None, metavar="{fused,eager}")
    """what SwiGLU and RMSNorm keep for backward: fused kernels (Megatron, Transformer Engine;
    default) or plain PyTorch autograd (more activation memory)"""
    cluster: str | None = flag(None, metavar="PRESET", doc=f"cluster preset: {', '.join(CLUSTERS)}")
    nodes: str | None = flag(None, metavar="N")
    """nodes of the cluster preset (default 1)"""
    tier: list[str] | None = flag(
        None, metavar="NAME:MEMBERS:GBITS[:LATENCY_US[:slow]]", repeat=True
    )
    """an explicit tier, fastest first, repeated: devices of a node, then nodes, then regions;
    'slow' marks a tier the outer algorithms may replace the all-reduce across"""
    device_memory_gb: str | None = flag(None, metavar="GB")
    """memory per device (explicit cluster, or overrides a preset)"""
    peak_tflops: str | None = flag(None, metavar="T")
    """peak dense TFLOP/s per device at the training precision"""
    gemm_efficiency: str | None = flag(None, metavar="E")
    """fraction of peak large GEMMs sustain in training; smaller and thin ones get less (preset's:
    A100 0.669, H100 0.523, MI250X 0.458; explicit cluster 0.6)"""
    memory_bandwidth_gbs: str | None = flag(None, metavar="GBS")
    """device memory bandwidth in GB/s (preset's, or 2000)"""
    global_batch: str | None = flag(None, metavar="B")
    """sequences per iteration"""
    precision: str | None = flag(None, metavar="{bf16,fp32}")
    """bf16 mixed precision with Adam (default) or fp32"""
    recompute: str | None = flag(None, metavar="LIST")
    """recompute modes to search (default none,selective,full)"""
    no_flash: bool = flag(False)
    """no flash attention (the s^2 attention scores are kept)"""
    outer: str | None = flag(None, metavar="A,B")
    """outer algorithms offered where DP crosses a slow tier (default diloco,co2; none)"""
    sync_every: str | None = flag(None, metavar="H")
    """H of the outer algorithms (default: the smallest power of two that keeps the iteration
    within 5% of never synchronising across that tier)"""
    layout: str | None = flag(None, metavar="SPEC")
    """evaluate this layout (any subset of
    tp=,pp=,dp=,vpp=,zero=,mb=,recompute=,sp,order=,outer=,h=, and tpo / dpo for TP / DP
    communication overlapped as Megatron-Core does; the rest searched): its whole breakdown and
    rank, or every rule it breaks"""
    interleave: str | None = flag(None, metavar="LIST")
    """virtual pipeline stages per device searched (default 1,2,4,8; 1: plain 1F1B)"""
    max_micro_batch: str | None = flag(None, metavar="B")
    """largest micro-batch searched (default 16)"""
    usable: str | None = flag(None, metavar="F")
    """fraction of device memory the model may fill (default 0.9)"""
    top: str | None = flag(None, metavar="K")
    """candidates shown (default 10)"""
    json: str | None = flag(None, metavar="PATH")
    """write the candidates (or validation rows) as JSON"""
    plot: str | None = flag(None, metavar="PATH")
    """plot predicted tokens/s against memory per device (PNG)"""
    validate: str | None = flag(None, metavar="{" + ",".join(VALIDATIONS) + "}")
    """print a validation table: megatron (Narayanan et al. 2021 Table 1), frontier (Dash et al.
    2023), published (Megatron-Core on H100, Llama 3 405B, BLOOM-176B), memory (measured here on
    gloo processes, about three minutes)"""
    world: str | None = flag(None, metavar="N")
    """--validate memory: processes (default 2)"""


def add_subcommand(subparsers: Any) -> None:
    """Register ``plan`` on an argparse subparsers object (flags given only, ``SUPPRESS``)."""
    p = subparsers.add_parser(
        "plan",
        help="rank TP/PP/DP/ZeRO/micro-batch layouts of a model on a cluster (a model)",
        description=(
            "Predict memory and throughput of every feasible tensor/pipeline/data-parallel, "
            "ZeRO, micro-batch and recompute layout of a transformer on a cluster of tiers, "
            "with lowcomm's outer algorithms as the data-parallel layer over a slow tier, and "
            "rank them. Predictions, not measurements; --validate shows how they compare with "
            "published and measured figures."
        ),
        argument_default=argparse.SUPPRESS,
    )
    add_flags(p, fields_of(PlanFlags, show_defaults=False))
    p.set_defaults(_run=_run_plan)
