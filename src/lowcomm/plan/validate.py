"""The planner checked against figures nobody here measured, and memory measured here.

* :func:`validate_megatron`: the time model against Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21,
  https://arxiv.org/abs/2104.04473), Table 1: ten GPT models from 1.7B to 1T parameters on up to
  3072 A100 GPUs (Selene), their TP/PP/GPU count/batch, and the achieved teraFLOP/s per GPU
  (eq. 3 counting, full recompute). Micro-batch and interleaving as in the repository's
  ``examples/sc21/run_table_1.sh`` (NVIDIA/Megatron-LM), fp16, no flash attention (2021).
* :func:`validate_frontier`: the Frontier study (Dash et al. 2023, arXiv 2312.12705): the
  authors' layouts for 22B / 175B / 1T, their 38.38% / 36.14% / 31.96% of peak, and the rank
  each gets among the planner's feasible candidates for the same devices and global batch.
* :func:`validate_published`: Megatron-Core's H100 table, Llama 3 405B and BLOOM-176B
  (:data:`PUBLISHED_RUNS`): the best layout with the fields each source states, against its
  published throughput, and that layout's rank.
* :func:`validate_memory`: the memory model against peak memory measured on this machine
  (:mod:`lowcomm.plan.measure`).

A100's GEMM efficiency is calibrated on the Megatron-LM table, H100's on Megatron-Core's and
MI250X's on Frontier's (:mod:`lowcomm.plan.presets`); Llama 3 and BLOOM are held out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lowcomm.plan.presets import FRONTIER_MODELS, MEGATRON_TABLE1, MODELS, cluster_preset
from lowcomm.plan.search import evaluate, plan, rank_of
from lowcomm.plan.spec import PRECISIONS, Layout

__all__ = [
    "FRONTIER_ROWS",
    "MEGATRON_ROWS",
    "MEGATRON_URL",
    "PUBLISHED_RUNS",
    "PublishedRun",
    "validate_frontier",
    "validate_megatron",
    "validate_memory",
    "validate_published",
]

INTERLEAVE_SEARCH = (1, 2, 3, 4, 6, 7, 8)
"""Virtual stages per device searched where a source does not state them."""

MEGATRON_URL = "https://arxiv.org/abs/2104.04473"
FRONTIER_URL = "https://arxiv.org/abs/2312.12705"

MEGATRON_ROWS: tuple[tuple[str, int, int, int, int, float, int, int], ...] = (
    # preset, TP, PP, GPUs, global batch, published TFLOP/s per GPU, micro-batch, interleave
    ("gpt-1.7b", 1, 1, 32, 512, 137, 16, 1),
    ("gpt-3.6b", 2, 1, 64, 512, 138, 16, 1),
    ("gpt-7.5b", 4, 1, 128, 512, 142, 16, 1),
    ("gpt-18b", 8, 1, 256, 1024, 135, 8, 1),
    ("gpt-39b", 8, 2, 512, 1536, 138, 4, 1),
    ("gpt-76b", 8, 4, 1024, 1792, 140, 2, 3),
    ("gpt-145b", 8, 8, 1536, 2304, 148, 2, 2),
    ("gpt-310b", 8, 16, 1920, 2160, 155, 1, 2),
    ("gpt-530b", 8, 35, 2520, 2520, 163, 1, 3),
    ("gpt-1t", 8, 64, 3072, 3072, 163, 1, 1),
)
"""Narayanan et al. 2021, Table 1; micro-batch and virtual stages from run_table_1.sh."""

FRONTIER_ROWS: tuple[tuple[str, int, int, Layout, float], ...] = (
    # preset, nodes (8 GCDs each), global batch, the authors' layout, published % of peak
    ("frontier-22b", 2, 640, Layout(tp=1, pp=8, dp=2, zero=0, recompute="full"), 38.38),
    ("frontier-175b", 16, 640, Layout(tp=4, pp=16, dp=2, zero=1, recompute="full"), 36.14),
    ("frontier-1t", 128, 1024, Layout(tp=4, pp=128, dp=2, zero=1, recompute="full"), 31.96),
)
"""Dash et al. 2023: layouts from DESIGN.md and the authors' launch scripts (micro-batch 1, flash
attention, activation checkpointing), percentages from the abstract."""


def validate_megatron() -> list[dict[str, Any]]:
    """Predicted against published TFLOP/s per GPU for every row of Table 1, and the rank of
    the published layout among the planner's feasible layouts for the same GPUs and batch with
    the techniques of 2021 (no flash attention, ZeRO, sequence parallelism or selective
    recompute; 1–4 virtual stages)."""
    rows = []
    for name, tp, pp, gpus, batch, published, micro, interleave in MEGATRON_ROWS:
        model = MEGATRON_TABLE1[name]
        cluster = cluster_preset("dgx-a100", gpus // 8)
        layout = Layout(
            tp=tp,
            pp=pp,
            dp=gpus // (tp * pp),
            micro_batch=micro,
            recompute="full",
            flash_attention=False,
            interleave=interleave,
        )
        cand = evaluate(model, PRECISIONS["bf16"], cluster, layout, batch)
        # the 2021 toolbox: no ZeRO, no sequence parallelism, full or no recompute
        result = plan(
            model,
            PRECISIONS["bf16"],
            cluster,
            batch,
            flash_attention=False,
            interleave=(1, 2, 3, 4),
            zero_stages=(0,),
            recompute=("none", "full"),
            fixed={"sequence_parallel": False},
        )
        rows.append(
            {
                "model": name,
                "parameters_b": model.parameters() / 1e9,
                "layout": layout.label(),
                "gpus": gpus,
                "global_batch": batch,
                "predicted_tflops": cand.time.tflops_per_device,
                "published_tflops": published,
                "ratio": cand.time.tflops_per_device / published,
                "predicted_percent": cand.time.percent_of_peak,
                "memory_gb": cand.memory.total / 1e9,
                "feasible": cand.feasible,
                "rank": rank_of(result, layout),
                "candidates": len(result.candidates),
                "best_layout": result.candidates[0].layout.label(),
            }
        )
    return rows


def validate_frontier() -> list[dict[str, Any]]:
    """The authors' layout on Frontier: predicted against published percent of peak, and its
    rank among the planner's feasible candidates."""
    rows = []
    for name, nodes, batch, layout, published in FRONTIER_ROWS:
        model = FRONTIER_MODELS[name]
        cluster = cluster_preset("frontier", nodes)
        precision = PRECISIONS["bf16"]
        result = plan(model, precision, cluster, batch)
        theirs = evaluate(model, precision, cluster, layout, batch)
        best = result.candidates[0] if result.candidates else None
        rows.append(
            {
                "model": name,
                "gcds": cluster.devices,
                "global_batch": batch,
                "authors_layout": layout.label(),
                "predicted_percent": theirs.time.percent_of_peak,
                "published_percent": published,
                "ratio": theirs.time.percent_of_peak / published,
                "rank": rank_of(result, layout),
                "candidates": len(result.candidates),
                "best_layout": best.layout.label() if best else None,
                "best_percent": best.time.percent_of_peak if best else None,
                "best_mfu_percent": 100 * best.time.mfu if best else None,
                "authors_mfu_percent": 100 * theirs.time.mfu,
                "best_speedup": (
                    best.time.tokens_per_s / theirs.time.tokens_per_s if best else None
                ),
            }
        )
    return rows


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: what it trained, on what, with which layout fields it
    states, and its measured throughput per device."""

    table: str
    """Which validation table it belongs to (``megatron-core``, ``llama3``, ``bloom``)."""
    model: str
    """A model preset."""
    cluster: str
    """A cluster preset."""
    nodes: int
    global_batch: int
    fixed: dict[str, Any]
    """The layout fields the source states (:func:`~lowcomm.plan.spec.parse_layout` names);
    the rest (micro-batch, recompute, virtual stages, ...) are searched."""
    published_tflops: float
    counted: str
    """"model": FLOPs without recompute (MFU × peak); "hardware": with recompute."""
    calibrated: bool
    """Whether the device's GEMM efficiency was calibrated on this table (presets)."""
    flash_attention: bool = True


_MCORE_ROWS = (
    # model, TP, PP, GPUs, global batch, published TFLOP/s per GPU (DP 48 throughout)
    ("mcore-1.7b", 1, 1, 48, 192, 408.8),
    ("mcore-7.1b", 2, 1, 96, 192, 465.9),
    ("mcore-16b", 4, 1, 192, 192, 489.1),
    ("mcore-32b", 8, 1, 384, 192, 459.6),
    ("mcore-70b", 8, 2, 768, 384, 419.7),
    ("mcore-119b", 8, 4, 1536, 768, 420.5),
    ("mcore-177b", 8, 6, 2304, 1152, 432.8),
    ("mcore-314b", 8, 8, 3072, 1536, 474.4),
    ("mcore-462b", 8, 16, 6144, 3072, 459.9),
)

PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    *(
        PublishedRun(
            table="megatron-core",
            model=name,
            cluster="dgx-h100",
            nodes=gpus // 8,
            global_batch=batch,
            fixed={
                "tp": tp,
                "pp": pp,
                "dp": 48,
                "zero": 1,
                "dp_overlap": True,
                **({"sequence_parallel": True, "tp_overlap": True} if tp > 1 else {}),
            },
            published_tflops=tflops,
            counted="model",
            calibrated=True,
        )
        for name, tp, pp, gpus, batch, tflops in _MCORE_ROWS
    ),
    *(
        PublishedRun(
            table="llama3",
            model="llama3-405b",
            cluster="dgx-h100",
            nodes=dp * 16,  # TP 8 x PP 16 = 128 GPUs per replica, 8 per node
            global_batch=2048,  # 16M tokens of 8,192-token sequences
            fixed={"tp": 8, "pp": 16, "dp": dp, "zero": 1, "recompute": "none", "dp_overlap": True},
            published_tflops=tflops,
            counted="model",
            calibrated=False,
        )
        for dp, tflops in ((64, 430.0), (128, 400.0))
    ),
    PublishedRun(
        table="bloom",
        model="bloom-176b",
        cluster="dgx-a100",
        nodes=48,
        global_batch=2048,
        fixed={
            "tp": 4,
            "pp": 12,
            "dp": 8,
            "zero": 1,
            "micro_batch": 2,
            "recompute": "full",
            "sequence_parallel": False,
        },
        published_tflops=149.77,
        counted="hardware",
        calibrated=False,
        flash_attention=False,
    ),
)
"""Published runs beyond Megatron-LM 2021 and the Frontier study.

* ``megatron-core``: Megatron-LM's H100 scaling table (NVIDIA/Megatron-LM README,
  ``images/model_table.png``, commit f2e5db402c, 2024-07-15): TP, PP, DP 48, global batch and
  per-GPU teraFLOP/s (MFU × 989) as published; the README states the distributed optimizer and
  DP, TP and PP communication overlapped (``--overlap-grad-reduce``, ``--tp-comm-overlap``).
* ``llama3``: Llama 3 405B (Grattafiori et al. 2024, "The Llama 3 Herd of Models",
  arXiv 2407.21783, Table 4): 8,192 GPUs at TP 8, PP 16, DP 64 and 16,384 at DP 128, 16M-token
  batches of 8,192-token sequences, 430 and 400 TFLOP/s per GPU (BF16 MFU 43% and 41%), no
  activation checkpointing at 8K; FSDP (gradient reduction overlapped); an interleaved schedule
  with the first and last stage one layer lighter (§3.3.2).
* ``bloom``: BLOOM-176B (bigscience-workshop/bigscience, ``train/tr11-176B-ml``: README and
  the slurm script): 384 A100 80GB, TP 4, PP 12, DP 8, micro-batch 2, global batch 2,048,
  activation checkpointing, ZeRO-1, 149.77 "hardware" TFLOP/s per GPU (recompute counted; the
  README's log at the end of the first epoch), no flash attention (2022).
"""


def validate_published(tables: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Each published run: the best layout the planner finds with the fields the source
    states (the rest searched, interleaving included), its predicted throughput against the
    published one, and the rank of that layout among every feasible layout of the unrestricted
    search."""
    rows = []
    precision = PRECISIONS["bf16"]
    for run in PUBLISHED_RUNS:
        if tables is not None and run.table not in tables:
            continue
        model = MODELS[run.model]
        cluster = cluster_preset(run.cluster, run.nodes)
        search: dict[str, Any] = {
            "interleave": INTERLEAVE_SEARCH,
            "flash_attention": run.flash_attention,
        }
        result = plan(model, precision, cluster, run.global_batch, fixed=run.fixed, **search)
        pool = list(result.candidates)
        if not pool:
            # the throughput of the layout is still compared; that it does not fit is reported
            pool = sorted(
                (c for c in result.infeasible if all(r.startswith("needs ") for r in c.reasons)),
                key=lambda c: -c.time.tokens_per_s,
            )
        if not pool:
            reasons = sorted({r for c in result.infeasible for r in c.reasons})
            raise ValueError(f"{run.model}: no layout with {run.fixed} can run: {reasons}")
        best = pool[0]
        flops = best.time.tflops_per_device
        if run.counted == "model":
            flops = best.time.mfu * cluster.peak_flops / 1e12
        free = {k: v for k, v in run.fixed.items() if k in ("tp_overlap", "dp_overlap")}
        everything = plan(model, precision, cluster, run.global_batch, fixed=free or None, **search)
        rows.append(
            {
                "table": run.table,
                "model": run.model,
                "parameters_b": model.parameters() / 1e9,
                "devices": cluster.devices,
                "global_batch": run.global_batch,
                "layout": best.layout.label(),
                "predicted_tflops": flops,
                "published_tflops": run.published_tflops,
                "counted": run.counted,
                "ratio": flops / run.published_tflops,
                "memory_gb": best.memory.total / 1e9,
                "fits": best.feasible,
                "rank": rank_of(everything, best.layout),
                "candidates": len(everything.candidates),
                "best_layout": everything.candidates[0].layout.label(),
                "calibrated": run.calibrated,
            }
        )
    return rows


def validate_memory(
    world: int = 2, cases: Sequence[Any] | None = None, shape: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """Measured against predicted peak memory (:func:`~lowcomm.plan.measure.
    measure_peak_memory`) on ``world`` gloo processes."""
    from lowcomm.plan.measure import default_cases, measure_peak_memory

    return measure_peak_memory(
        list(default_cases() if cases is None else cases), world=world, shape=shape
    )
