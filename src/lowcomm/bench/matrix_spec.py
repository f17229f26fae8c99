"""What the benchmark matrix runs (:mod:`lowcomm.bench.matrix`): :class:`BenchSpec`, its
settings and their checks, and its :class:`Cell` jobs with the ``TrainConfig`` of each."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from lowcomm.bench.variants import algo_fields
from lowcomm.link import EmulatedLink
from lowcomm.registry import BASELINES, REGISTRY, outer_names

__all__ = ["QUICK_TARGET_S", "BenchSpec", "Cell"]

QUICK_TARGET_S = 300.0
"""``--quick`` is sized to finish within this many seconds on 2 cores."""

_MATRIX_LEAVES_OUT = ("slowmo",)
"""Algorithms the full matrix does not run by default: SlowMo is a DiLoCo preset (the same
blocking schedule and payload), so its throughput is DiLoCo's."""


def _matrix_algos() -> list[str]:
    """The full matrix: every synchronising baseline, then every outer algorithm in registry
    order, less :data:`_MATRIX_LEAVES_OUT` (the ceiling is measured inside every cell)."""
    baselines = [n for n in BASELINES if REGISTRY[n].schedule.syncs]
    return [*baselines, *(n for n in outer_names() if n not in _MATRIX_LEAVES_OUT)]


def _cell_algos() -> list[str]:
    """Every ``--algo`` value a cell can run: all but the no-sync ceiling (it is in every cell)."""
    return [n for n, e in REGISTRY.items() if e.schedule.syncs]


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
        ceiling_steps: no-sync steps timed in every cell (in segments interleaved with training).
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
        settings = {k: cfg.value(k) for k in keys}
        settings["data"] = cfg.data or "embedded corpus"
        settings.update(self.train_overrides)
        return settings
