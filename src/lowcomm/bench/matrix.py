"""The benchmark matrix: algorithms × link profiles × worker counts, one ``lowcomm train`` job per
cell, every cell on the same data, steps and seed.

A cell is a real multi-process training job (:func:`lowcomm.train.launcher.launch`), so what it
measures is what a user of ``lowcomm train`` gets: tokens per second of training time
(evaluations excluded), the communication counters of every worker, and the validation curve.

Besides the matrix, a run measures:

* **the ceiling**, in every cell: the same worker processes time ``ceiling_steps`` inner steps
  with no synchronisation at all on a private copy of the model, in segments of 2 steps
  interleaved with training, where no sync is in flight (``lowcomm train --ceiling-steps``).
  Each cell is divided by its own ceiling, so a machine whose speed drifts between cells or
  within one (a shared machine) moves both alike; the standard error of the ceiling's mean over
  its segments is reported as the noise of the ratios;
* **emulator validation** (optional; Linux, root, iproute2): cells run on a *real* link shaped with
  ``tc`` (:mod:`lowcomm.bench.netshape`) beside the same cell on the emulated link of the same
  bandwidth and latency. Where netem is missing the real link has no added latency, so its
  emulated twin gets latency 0 too.

The cells' rows become ``results.json`` in :mod:`lowcomm.bench.results` (ceilings, noise, time to
target, goals) and Markdown and plots in :mod:`lowcomm.bench.report`.

Example::

    spec = BenchSpec.quick(out="runs/bench")
    results = run_bench(spec)       # writes runs/bench/results.json (see write_results)
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from lowcomm.bench.matrix_spec import QUICK_TARGET_S, BenchSpec, Cell
from lowcomm.bench.results import assemble_results
from lowcomm.link import EmulatedLink

__all__ = [
    "QUICK_TARGET_S",
    "BenchSpec",
    "Cell",
    "run_bench",
]

logger = logging.getLogger(__name__)


def _read_curve(cell_out: str) -> list[list[float]]:
    points = []
    with open(os.path.join(cell_out, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "eval" and record.get("val_loss") is not None:
                points.append([record["tokens"], record["train_s"], record["val_loss"]])
    return points


def _link_numbers(link: str | None, latency_override: float | None = None) -> dict[str, Any]:
    if link is None:
        return {"link_bandwidth_bps": None, "link_latency_s": None}
    parsed = EmulatedLink.parse(link)
    latency = parsed.latency_s if latency_override is None else latency_override
    return {"link_bandwidth_bps": parsed.bandwidth_bps, "link_latency_s": latency}


def _row(cell: Cell, cfg: Any, summary: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    mean = summary["comm_mean"]
    steps = int(summary["steps"])
    return {
        "id": cell.id,
        "role": cell.role,
        "algo": cell.algo,
        "workers": int(summary["workers"]),
        "link": cell.link,
        "shaping": cell.shaping,
        **_link_numbers(cell.link),
        "steps": steps,
        "parameters": summary["parameters"],
        "sync_every": summary.get("sync_every"),
        "num_fragments": cfg.value("num_fragments"),
        "overlap": cfg.value("overlap"),
        "tokens": int(summary["tokens"]),
        "tokens_per_step": int(summary["tokens"]) // steps,
        "tokens_per_s": summary["tokens_per_s"],
        "train_time_s": summary["train_time_s"],
        "wall_time_s": summary["wall_time_s"],
        "step_time_s": summary["train_time_s"] / steps,
        "payload_bytes_per_worker_step": mean["payload_bytes_per_step"],
        "wire_bytes_per_worker_step": mean["wire_bytes_per_step"],
        "blocked_s_per_worker": mean["blocked_s"],
        # the worker that waited most (a straggler's wait shows on the others)
        "blocked_s_most": max(
            (w["blocked_s"] for w in summary["comm_per_worker"]), default=mean["blocked_s"]
        ),
        "hidden_fraction": mean["hidden_fraction"],
        "val_loss_initial": summary["val_loss_initial"],
        "val_loss_final": summary["val_loss_final"],
        "curve": _read_curve(cfg.out),
        "ceiling_tokens_per_s": summary["ceiling"]["tokens_per_s"],
        "ceiling_segments_tokens_per_s": summary["ceiling"]["segments_tokens_per_s"],
        "ratio_to_ceiling": summary["ceiling"]["ratio"],
        **extra,
    }


def _run_cell(spec: BenchSpec, cell: Cell, net_factory: Callable[..., Any] | None) -> dict:
    from lowcomm.train.launcher import launch

    cfg = spec.train_config(cell, spec.out)
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if cell.shaping == "real":
        from lowcomm.bench.netshape import ShapedNetwork, launch_shaped

        parsed = EmulatedLink.parse(str(cell.link))
        factory = net_factory or ShapedNetwork
        with factory(cell.workers, parsed.bandwidth_bps, parsed.latency_s) as net:
            summary = launch_shaped(cfg, net)
            extra["real_link"] = net.describe()
            extra["latency_applied"] = bool(net.latency_applied)
    else:
        launched = launch(cfg)
        assert launched is not None
        summary = launched
    extra["command_s"] = time.perf_counter() - t0
    row = _row(cell, cfg, summary, extra)
    if cell.shaping == "real" and not row["latency_applied"]:
        row["link_latency_s"] = 0.0
    return row


def _validation_cells(spec: BenchSpec, latency_applied: bool) -> list[Cell]:
    cells = []
    for w in spec.workers:
        for link in spec.real_links:
            parsed = EmulatedLink.parse(link)
            # The twin must see the link the real cell sees: no netem, no added latency.
            twin = link if latency_applied else f"{_rate_text(parsed.bandwidth_bps)}:0ms"
            # …and both choose their settings for that link (the real job sees no --link)
            tune = None if "tune_link" in spec.train_overrides else twin
            for algo in spec.real_algos:
                cells.append(Cell(algo, w, link, "real", "validation", tune))
                cells.append(Cell(algo, w, twin, "emulated", "validation", tune))
    return cells


def _rate_text(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale and float(bps / scale).is_integer():
            return f"{int(bps / scale)}{unit}"
    return f"{bps:g}bit"


def run_bench(
    spec: BenchSpec,
    *,
    command: str | None = None,
    progress: Callable[[str], None] | None = None,
    net_factory: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Run every cell of ``spec`` and the overhead micro-benchmark; write ``results.json``,
    ``results.md`` and the plots to ``spec.out``; return the results.

    Args:
        spec: what to run (checked with :meth:`BenchSpec.validate`).
        command: the command line to print in the report.
        progress: called with a one-line note as each cell starts and ends (the CLI prints it).
        net_factory: ``ShapedNetwork`` replacement for the real-link cells (tests).

    Raises:
        ValueError: a bad setting.
        lowcomm.train.launcher.WorkerFailed: a cell's worker failed.
    """
    from lowcomm.bench.report import write_report

    spec.validate()
    note = progress or (lambda text: logger.info("%s", text))
    os.makedirs(spec.out, exist_ok=True)
    t_start = time.perf_counter()

    real_skipped: str | None = None
    latency_applied = False
    if spec.real_links and spec.real_algos:
        if net_factory is None:
            from lowcomm.bench.netshape import netem_available, unavailable_reason

            real_skipped = unavailable_reason()
            latency_applied = real_skipped is None and netem_available()
        if real_skipped is not None:
            note(f"real-link validation skipped: {real_skipped}")
    else:
        real_skipped = "not requested"

    cells = spec.cells()
    if real_skipped is None:
        cells += _validation_cells(spec, latency_applied)

    overhead = None
    if spec.overhead:
        from lowcomm.bench.overhead import measure_overhead

        note(f"overhead micro-benchmark: {', '.join(spec.overhead_algos)}")
        overhead = measure_overhead(
            spec.overhead_algos,
            rounds=spec.overhead_rounds,
            sync_every=spec.sync_every,
            seed=spec.seed,
            train_overrides=spec.train_overrides,
            # a worker's share of the cores, as in the matrix's first worker count
            threads=max(1, (os.cpu_count() or 1) // spec.workers[0]),
        )

    memory = None
    if spec.memory:
        from lowcomm.bench.memory import measure_memory

        note(f"memory report: N = {', '.join(map(str, spec.memory_workers))}")
        memory = measure_memory(spec.memory_workers, train_overrides=spec.train_overrides)

    rows = []
    for i, cell in enumerate(cells, 1):
        label = f"[{i}/{len(cells)}] {cell.algo} x{cell.workers} {cell.link or '(no link)'}"
        if cell.role == "validation":
            label += f" ({cell.shaping})"
        row = _run_cell(spec, cell, net_factory)
        rows.append(row)
        note(
            f"{label}: {row['tokens_per_s']:,.0f} tok/s ({row['ratio_to_ceiling']:.1%} of its "
            f"ceiling), val {row['val_loss_final']:.3f}, {row['command_s']:.0f} s"
        )

    results = assemble_results(spec, rows, overhead, real_skipped, latency_applied)
    results["memory"] = memory
    results["command"] = command
    results["elapsed_s"] = time.perf_counter() - t_start
    write_report(results, spec.out)
    return results
