"""The benchmark matrix: algorithms × link profiles × worker counts, one ``lowcomm train`` job per
cell, every cell on the same data, steps and seed.

A cell is a real multi-process training job (:func:`lowcomm.train.launcher.launch`), so what it
measures is what a user of ``lowcomm train`` gets: tokens per second of training time
(evaluations excluded), the communication counters of every worker, and the validation curve.

Besides the matrix, a run measures:

* **the ceiling**, in every cell: the same worker processes time ``ceiling_steps`` inner steps
  with no synchronisation at all on a private copy of the model, half right before training and
  half right after (``lowcomm train --ceiling-steps``). Each cell is divided by its own ceiling,
  so a machine whose speed drifts between cells (a shared machine) moves both alike; the
  difference between the two halves is reported as the noise of the ratios;
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
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lowcomm.bench.results import assemble_results
from lowcomm.bench.variants import algo_fields
from lowcomm.link import EmulatedLink
from lowcomm.registry import BASELINES, REGISTRY, outer_names

__all__ = [
    "QUICK_TARGET_S",
    "BenchSpec",
    "Cell",
    "run_bench",
]

logger = logging.getLogger(__name__)

QUICK_TARGET_S = 300.0
"""``--quick`` is sized to finish within this many seconds on 2 cores."""

_MATRIX_LEAVES_OUT = ("slowmo",)
"""Algorithms the full matrix does not run by default: SlowMo is a DiLoCo preset (the same
blocking schedule and payload), so its throughput is DiLoCo's."""


def _matrix_algos() -> list[str]:
    """The full matrix: every synchronising baseline, then every outer algorithm in registry
    order, less :data:`_MATRIX_LEAVES_OUT` (the ceiling is measured inside every cell)."""
    baselines = [n for n in BASELINES if REGISTRY[n].schedule != "never"]
    return [*baselines, *(n for n in outer_names() if n not in _MATRIX_LEAVES_OUT)]


def _cell_algos() -> list[str]:
    """Every ``--algo`` value a cell can run: all but the no-sync ceiling (it is in every cell)."""
    return [n for n, e in REGISTRY.items() if e.schedule != "never"]


@dataclass(frozen=True)
class Cell:
    """One training job of the benchmark.

    Attributes:
        algo: a ``lowcomm train --algo`` value.
        workers: worker processes.
        link: link profile or ``RATE:LATENCY``.
        shaping: ``"emulated"`` or ``"real"`` (tc-shaped namespaces).
        role: ``"matrix"`` or ``"validation"`` (the emulator-validation pairs).
        tune_link: the link the job chooses its settings for (``--tune-link``); ``None``: its
            own (an emulated cell's link; a real cell's, which the job cannot see, is given
            here so that it chooses as its emulated twin does).
    """

    algo: str
    workers: int
    link: str
    shaping: str = "emulated"
    role: str = "matrix"
    tune_link: str | None = None

    @property
    def id(self) -> str:
        link = str(self.link).replace(":", "-")
        suffix = f"-{self.shaping}" if self.role == "validation" else ""
        algo = re.sub(r"[^A-Za-z0-9_.+=-]", "-", self.algo)
        return f"{algo}-{link}-w{self.workers}{suffix}"


@dataclass
class BenchSpec:
    """What to run. Every cell gets the same ``steps``, ``sync_every``, ``seed`` and model.

    Attributes:
        algos: ``lowcomm train --algo`` values for the matrix (not ``none``: the ceiling is
            measured inside every cell), each optionally with ``+COMPRESSION`` (``co2+int4``,
            ``ddp+powersgd:4``: ``lowcomm train --compression``).
        links: link profiles or ``RATE:LATENCY`` values.
        workers: worker counts.
        steps: inner steps per worker in every cell.
        sync_every: H for the algorithms with rounds.
        seed: model initialisation and data order.
        eval_every: inner steps between validation evaluations.
        eval_batches: batches per evaluation.
        ceiling_steps: no-sync steps timed in every cell (half before training, half after).
        target_loss: validation loss for the time-to-target column; ``None``: the highest final
            validation loss of the matrix cells, which every cell reaches.
        real_links: links to run on real tc-shaped namespaces as well (emulator validation).
        real_algos: algorithms for the validation pairs.
        overhead: run the hook-overhead micro-benchmark.
        overhead_algos: algorithms it measures.
        overhead_rounds: rounds of ``sync_every`` steps it times per algorithm.
        memory: run the memory report (:mod:`lowcomm.bench.memory`).
        memory_workers: the group sizes it measures.
        train_overrides: other ``TrainConfig`` fields for every cell (model size, batch...).
        out: output folder.
        quick: this is the ``--quick`` preset (reported).
    """

    algos: list[str] = field(default_factory=_matrix_algos)
    links: list[str] = field(default_factory=lambda: ["tcp-80g", "1gbit", "100mbit", "10mbit"])
    workers: list[int] = field(default_factory=lambda: [2])
    steps: int = 240
    sync_every: int = 12
    seed: int = 0
    eval_every: int = 24
    eval_batches: int = 8
    ceiling_steps: int = 24
    target_loss: float | None = None
    real_links: list[str] = field(default_factory=lambda: ["100mbit"])
    real_algos: list[str] = field(default_factory=lambda: ["ddp", "co2"])
    overhead: bool = True
    overhead_algos: list[str] = field(
        default_factory=lambda: ["co2", "diloco", "streaming", "cocodc"]
    )
    overhead_rounds: int = 8
    memory: bool = True
    memory_workers: list[int] = field(default_factory=lambda: [2, 4])
    train_overrides: dict[str, Any] = field(default_factory=dict)
    out: str = os.path.join("runs", "bench")
    quick: bool = False

    @classmethod
    def quick_preset(cls, **changes: Any) -> BenchSpec:
        """The ``--quick`` matrix: DDP, CO2 and DiLoCo on 1gbit and 100mbit with 2 workers, 96
        steps (8 rounds), emulator validation of DDP and CO2 on 100mbit; under 5 minutes on 2
        cores."""
        base: dict[str, Any] = {
            "algos": ["ddp", "co2", "diloco"],
            "links": ["1gbit", "100mbit"],
            "workers": [2],
            "steps": 96,
            "eval_every": 24,
            "eval_batches": 4,
            "ceiling_steps": 16,
            "overhead_algos": ["co2", "diloco", "streaming"],
            "overhead_rounds": 4,
            "quick": True,
        }
        base.update(changes)
        return cls(**base)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting and its fix."""
        choices = _cell_algos()
        for key in ("algos", "real_algos", "overhead_algos"):
            for algo in getattr(self, key):
                fields = algo_fields(algo)
                if fields["algo"] not in choices:
                    raise ValueError(
                        f"{key}: unknown algorithm {fields['algo']!r}; choose from "
                        f"{', '.join(choices)} (the no-sync ceiling is measured inside every "
                        "cell), optionally with +COMPRESSION such as co2+int4 and /KEY=VALUE "
                        "settings such as co2/overlap=12/sync_warmup=0"
                    )
                if "compression" in fields and not fields["compression"]:
                    raise ValueError(
                        f"{key}: {algo!r} names no compression after '+'; e.g. co2+int4"
                    )
        for algo in self.overhead_algos:
            if "/" in algo:
                raise ValueError(
                    f"overhead_algos: {algo!r}: the overhead micro-benchmark takes no /KEY=VALUE "
                    "settings; name the algorithm (and +COMPRESSION) only"
                )
            if not REGISTRY[algo.partition("+")[0]].is_outer:
                raise ValueError(
                    f"overhead_algos: {algo!r} has no lowcomm hook to measure; choose lowcomm "
                    "algorithms such as co2 or diloco"
                )
        if not self.algos:
            raise ValueError("algos: give at least one algorithm, e.g. co2")
        if not self.links:
            raise ValueError("links: give at least one link profile, e.g. 100mbit")
        for link in [*self.links, *self.real_links]:
            EmulatedLink.parse(link)  # raises a ValueError naming the spelling
        if self.memory and (not self.memory_workers or any(w < 2 for w in self.memory_workers)):
            raise ValueError(
                f"memory_workers: need group sizes >= 2 to shard over, got {self.memory_workers}"
            )
        if not self.workers or any(w < 1 for w in self.workers):
            raise ValueError(f"workers: need worker counts >= 1, got {self.workers}")
        for key in (
            "steps",
            "sync_every",
            "eval_every",
            "eval_batches",
            "overhead_rounds",
            "ceiling_steps",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: must be an integer >= 1, got {value!r}")
        if self.steps % self.sync_every:
            raise ValueError(
                f"steps ({self.steps}) must be a multiple of sync_every ({self.sync_every}) so "
                "that every cell ends on a round boundary"
            )
        if self.ceiling_steps < 2:
            raise ValueError(
                f"ceiling_steps: must be >= 2 (half are timed before training, half after), "
                f"got {self.ceiling_steps}"
            )
        if self.target_loss is not None and not self.target_loss > 0:
            raise ValueError(f"target_loss: must be > 0, got {self.target_loss!r}")
        # Every cell must be a valid training job: check one of each algorithm now.
        for algo in {*self.algos, *self.real_algos}:
            self.train_config(Cell(algo, self.workers[0], self.links[0]), self.out)

    def cells(self) -> list[Cell]:
        """The matrix jobs in the order they run (the validation pairs follow them)."""
        cells = []
        for w in self.workers:
            for link in self.links:
                cells += [Cell(a, w, link) for a in self.algos]
        return cells

    def train_config(self, cell: Cell, out: str) -> Any:
        """The ``TrainConfig`` of ``cell`` (resolved paths, output under ``out/cells``)."""
        from lowcomm.train.config import config_from_dict

        values: dict[str, Any] = {
            **self.train_overrides,
            **algo_fields(cell.algo),
            "workers": cell.workers,
            "steps": self.steps,
            "sync_every": self.sync_every,
            "seed": self.seed,
            "eval_every": self.eval_every,
            "eval_batches": self.eval_batches,
            "ceiling_steps": self.ceiling_steps,
            "link": cell.link if cell.shaping == "emulated" else None,
            **({"tune_link": cell.tune_link} if cell.tune_link is not None else {}),
            "name": cell.id,
            "out": os.path.join(out, "cells", cell.id),
            "overwrite": True,
            "quiet": True,
        }
        return config_from_dict(values, source="bench").with_paths()

    def train_settings(self) -> dict[str, Any]:
        """The training settings every cell shares (model size, batch, learning rate, data), for
        the report: those of a co2 cell, with ``train_overrides`` on top."""
        cfg = self.train_config(Cell("co2", self.workers[0], self.links[0]), self.out)
        keys = ("batch_size", "block_size", "n_layer", "n_head", "n_embd", "lr", "bucket_cap_mb")
        settings = {k: getattr(cfg, k) for k in keys}
        settings["data"] = cfg.data or "embedded corpus"
        settings.update(self.train_overrides)
        return settings


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
        "num_fragments": cfg.num_fragments,
        "overlap": cfg.overlap,
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
