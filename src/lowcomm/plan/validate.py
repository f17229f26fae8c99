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
* :func:`validate_memory`: the memory model against peak memory measured on this machine
  (:mod:`lowcomm.plan.measure`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lowcomm.plan.presets import FRONTIER_MODELS, MEGATRON_TABLE1, cluster_preset
from lowcomm.plan.search import evaluate, plan, rank_of
from lowcomm.plan.spec import PRECISIONS, Layout

__all__ = [
    "FRONTIER_ROWS",
    "MEGATRON_ROWS",
    "MEGATRON_URL",
    "validate_frontier",
    "validate_megatron",
    "validate_memory",
]

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
    """Predicted against published TFLOP/s per GPU for every row of Table 1."""
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


def validate_memory(
    world: int = 2, cases: Sequence[Any] | None = None, shape: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """Measured against predicted peak memory (:func:`~lowcomm.plan.measure.
    measure_peak_memory`) on ``world`` gloo processes."""
    from lowcomm.plan.measure import default_cases, measure_peak_memory

    return measure_peak_memory(
        list(default_cases() if cases is None else cases), world=world, shape=shape
    )
