"""The results of a ``lowcomm bench`` run (``results.json``): the measured cells with their
time to the target loss, the no-sync ceiling per worker count and its noise, the settings and the
machine, and the performance goals each run is checked against.

Example::

    results = assemble_results(spec, rows, overhead, real_skipped=None, latency_applied=True)
    [g["met"] for g in results["goals"]]
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lowcomm.bench.matrix_spec import BenchSpec

__all__ = [
    "CODEC_GOAL",
    "RESULTS_VERSION",
    "assemble_codec_results",
    "assemble_results",
    "codec_goal",
    "interpolate_time_to_target",
]

RESULTS_VERSION = 1

CODEC_GOAL: dict[str, Any] = {
    "size_m": 10.0,
    "layout": "gpt",
    "limit": 8.0,
    "codecs": ["int8", "int4", "int2", "topk:0.01"],
}
"""The target for the codec row (:mod:`lowcomm.bench.codec`): at 10 M parameters (the
``gpt`` layout), encode + decode + error feedback within 8 clones on the CPU, for each of these
codecs."""


def interpolate_time_to_target(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Training time at which the validation loss first reaches ``target``.

    Args:
        curve: ``(tokens, train_s, val_loss)`` points in order.
        target: the validation loss to reach.

    Returns:
        The time, linear between the last evaluation above the target and the first at or below
        it; ``None`` when no evaluation reaches it.
    """
    previous: Sequence[float] | None = None
    for point in curve:
        _, t, loss = point
        if loss <= target:
            if previous is None:
                return float(t)
            _, t0, loss0 = previous
            if loss0 == loss:
                return float(t)
            frac = (loss0 - target) / (loss0 - loss)
            return float(t0 + frac * (t - t0))
        previous = point
    return None


def assemble_results(
    spec: BenchSpec,
    rows: list[dict[str, Any]],
    overhead: dict[str, Any] | None,
    real_skipped: str | None,
    latency_applied: bool,
) -> dict[str, Any]:
    """The ``results.json`` of a run: ``rows`` (one per cell, as the cells ran) with every cell's
    time to the target loss, the ceiling per worker count, the noise of the ceiling ratios, the
    settings, the machine, the overhead micro-benchmark and the goals. The caller adds
    ``memory``, ``command`` and ``elapsed_s``."""
    cells = list(rows)
    ceilings = []
    for w in spec.workers:
        speeds = [r["ceiling_tokens_per_s"] for r in cells if r["workers"] == w]
        if not speeds:
            continue
        ceilings.append(
            {
                "workers": w,
                "tokens_per_s": statistics.median(speeds),
                "cells": len(speeds),
                "drift": (max(speeds) - min(speeds)) / statistics.median(speeds),
            }
        )
    matrix = [r for r in cells if r["role"] == "matrix"]
    target = spec.target_loss
    if target is None and matrix:
        target = max(r["val_loss_final"] for r in matrix)
    for r in cells:
        r["target_loss"] = target
        r["time_to_target_s"] = (
            interpolate_time_to_target(r["curve"], target) if target is not None else None
        )
    model = {"parameters": rows[0].get("parameters") if rows else None}
    # within a cell, how well its segments pin the ceiling down (the machine moving included)
    spreads = [_standard_error(r["ceiling_segments_tokens_per_s"]) for r in cells]
    noise = [x for x in spreads if x is not None]
    return {
        "version": RESULTS_VERSION,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": spec.quick,
        "machine": _machine(),
        "model": model,
        "settings": {
            **{
                k: v
                for k, v in dataclasses.asdict(spec).items()
                if k not in ("train_overrides", "out", "quick")
            },
            **spec.train_settings(),
        },
        "noise": statistics.median(noise) if noise else None,
        "noise_max": max(noise) if noise else None,
        "target_loss": target,
        "ceilings": ceilings,
        "cells": cells,
        "real_links": {
            "skipped": real_skipped,
            "latency_applied": latency_applied,
        },
        "overhead": overhead,
        "goals": _goals(cells, overhead),
    }


def _standard_error(segments: Sequence[float]) -> float | None:
    """The relative standard error of the mean of a cell's ceiling segments (None: fewer than
    two)."""
    if len(segments) < 2:
        return None
    return statistics.stdev(segments) / len(segments) ** 0.5 / statistics.fmean(segments)


def _machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def _goals(cells: list[dict[str, Any]], overhead: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The bench's performance goals, each ``met`` True/False (or None: not measured); a goal
    measured as a cell's ratio to its ceiling also has its ``noise``, the ratio times the
    ceiling's relative standard error (None: fewer than two segments)."""

    def find(algo: str) -> dict[str, Any] | None:
        for r in cells:
            if (
                r["role"] == "matrix"
                and r["algo"] == algo
                and r["workers"] == 2
                and r["link"] == "100mbit"
            ):
                return r
        return None

    def noise(cell: dict[str, Any] | None) -> float | None:
        # the cell's ratio to its ceiling is known to about its ceiling's standard error
        if cell is None:
            return None
        relative = _standard_error(cell["ceiling_segments_tokens_per_s"])
        return None if relative is None else relative * cell["ratio_to_ceiling"]

    goals = []
    co2 = find("co2")
    goals.append(
        {
            "goal": "CO2 on emulated 100mbit, 2 workers: >= 95% of the ceiling's tokens/s",
            "value": None if co2 is None else co2["ratio_to_ceiling"],
            "noise": noise(co2),
            "limit": 0.95,
            "format": ".1%",
            "met": None if co2 is None else co2["ratio_to_ceiling"] >= 0.95,
            "kind": "min",
        }
    )
    ddp = find("ddp")
    goals.append(
        {
            "goal": "DDP on emulated 100mbit, 2 workers: communication-bound (well below the "
            "ceiling; < 50%)",
            "value": None if ddp is None else ddp["ratio_to_ceiling"],
            "noise": noise(ddp),
            "limit": 0.5,
            "format": ".1%",
            "met": None if ddp is None else ddp["ratio_to_ceiling"] < 0.5,
            "kind": "max",
        }
    )
    hook = list((overhead or {}).get("algorithms", []))
    worst_hook = max((a["hook_fraction"] for a in hook), default=None)
    goals.append(
        {
            "goal": "inner-step overhead of the hook <= 2% of a bare step (worst algorithm)",
            "value": worst_hook,
            "limit": 0.02,
            "format": ".3%",
            "met": None if worst_hook is None else worst_hook <= 0.02,
            "kind": "max",
        }
    )
    worst_outer = max((a["outer_over_inner"] for a in hook), default=None)
    goals.append(
        {
            "goal": "outer-step compute <= one inner step (worst algorithm)",
            "value": worst_outer,
            "limit": 1.0,
            "format": ".2f",
            "met": None if worst_outer is None else worst_outer <= 1.0,
            "kind": "max",
        }
    )
    return goals


def codec_goal(codec: dict[str, Any] | None) -> dict[str, Any]:
    """The codec row's goal: at its size and layout (10 M parameters, ``gpt``),
    the worst ratio to a clone of the goal's codecs that the row measured, at most its limit
    (8); ``None`` (not measured) when the row has none of them at that size. ``codec``: the
    :func:`lowcomm.bench.codec.measure_codecs` result, or ``None``."""
    goal = CODEC_GOAL
    measured = [
        r
        for r in (codec or {}).get("rows", [])
        if r["codec"] in goal["codecs"]
        and r["layout"] == goal["layout"]
        and r["size_m"] == goal["size_m"]
    ]
    names = sorted({r["codec"] for r in measured}, key=goal["codecs"].index) or goal["codecs"]
    worst = max((r["ratio"] for r in measured), default=None)
    return {
        "goal": f"codec encode + decode + error feedback at {goal['size_m']:g} M parameters "
        f"<= {goal['limit']:g}x a clone ({', '.join(names)}; worst)",
        "value": worst,
        "limit": goal["limit"],
        "format": ".1f",
        "met": None if worst is None else worst <= goal["limit"],
        "kind": "max",
    }


def assemble_codec_results(codec: dict[str, Any]) -> dict[str, Any]:
    """The ``results.json`` of a ``lowcomm bench --codec-only`` run: the codec row
    (:func:`lowcomm.bench.codec.measure_codecs`), the machine and the row's goal. The caller
    adds ``command`` and ``elapsed_s``."""
    return {
        "version": RESULTS_VERSION,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(),
        "codec": codec,
        "goals": [codec_goal(codec)],
    }
