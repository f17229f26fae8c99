"""What ``lowcomm bench --convergence`` runs (:mod:`lowcomm.bench.convergence`):
:class:`ConvergenceSpec`, its settings and their checks, and the ``TrainConfig`` of each of its
loss and timing jobs."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from lowcomm.bench.variants import algo_fields
from lowcomm.link import EmulatedLink
from lowcomm.registry import REGISTRY

__all__ = ["ConvergenceSpec", "label_for"]


def _default_algos() -> list[str]:
    """DDP first (the reference), then every other entry that synchronises."""
    return ["ddp", *(n for n, e in REGISTRY.items() if n != "ddp" and e.schedule.syncs)]


@dataclass
class ConvergenceSpec:
    """What the harness runs. Every training setting not named here is the ``lowcomm train``
    job's default (or ``train_overrides``).

    Attributes:
        algos: ``--algo`` values, each optionally with ``+CODEC`` and ``/KEY=VALUE`` job
            settings (the first ``ddp`` is the reference every gap and target is taken from).
        workers: worker counts.
        seeds: seeds per cell (model initialisation and data order).
        steps: inner steps per worker of the 1× job (``None``: the job's default).
        lengths: multiples of ``steps`` to run (``[1, 4]``: the default job and one 4× longer).
        links: link profiles the step time is measured on.
        timing_steps: steps of each timing job (rounded up to whole rounds).
        eval_every: steps between evaluations (``None``: the job's default).
        eval_batches: batches per evaluation (``None``: the job's default).
        train_overrides: other ``TrainConfig`` fields for every job (model size, data...).
        out: output folder.
        reuse: keep the jobs of an earlier run in ``out`` whose settings match (an interrupted
            run continues); otherwise every job runs again.
    """

    algos: list[str] = field(default_factory=_default_algos)
    workers: list[int] = field(default_factory=lambda: [2, 4])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    steps: int | None = None
    lengths: list[int] = field(default_factory=lambda: [1])
    links: list[str] = field(default_factory=lambda: ["1mbit", "10mbit", "100mbit", "1gbit"])
    timing_steps: int = 48
    eval_every: int | None = None
    eval_batches: int | None = None
    train_overrides: dict[str, Any] = field(default_factory=dict)
    out: str = os.path.join("runs", "convergence")
    reuse: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting and its fix; build one job of each
        algorithm so that a bad job setting fails now, not an hour in."""
        if not self.algos:
            raise ValueError("algos: give at least one algorithm, e.g. ddp,co2")
        choices = [n for n, e in REGISTRY.items() if e.schedule.syncs]
        for algo in self.algos:
            base = algo_fields(algo)["algo"]
            if base not in choices:
                raise ValueError(
                    f"algos: unknown algorithm {base!r} in {algo!r}; choose from "
                    f"{', '.join(choices)}"
                )
        if len(set(self.algos)) != len(self.algos):
            raise ValueError(f"algos: {self.algos} names an algorithm twice")
        for key in ("workers", "seeds", "lengths"):
            values = getattr(self, key)
            low = 0 if key == "seeds" else 1
            if not values or any(not isinstance(v, int) or v < low for v in values):
                raise ValueError(f"{key}: need integers >= {low}, got {values!r}")
        for link in self.links:
            EmulatedLink.parse(link)
        for key in ("steps", "eval_every", "eval_batches", "timing_steps"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{key}: must be an integer >= 1, got {value!r}")
        for algo in self.algos:
            for length in self.lengths:
                self.train_config(algo, self.workers[0], self.seeds[0], length)

    def tuned_per_link(self, algo: str) -> bool:
        """Whether the entry ``algo`` is the job as ``lowcomm train`` runs it on each link: no
        ``tune_link`` given, and its algorithm one the job tunes to its link
        (:func:`lowcomm.tune.evidence.evidence_for`). Such an entry is one cell per link, its
        settings chosen for that link (:func:`label`); ``ALGO/tune_link=off`` is the untuned
        job on every link."""
        from lowcomm.tune.evidence import evidence_for

        fields = algo_fields(algo)
        entry = REGISTRY[fields["algo"]]
        tunable = entry.is_outer and not entry.fixed and evidence_for(fields["algo"]) is not None
        return "tune_link" not in fields and tunable and bool(self.links)

    def train_config(
        self,
        algo: str,
        workers: int,
        seed: int,
        length: int = 1,
        link: str | None = None,
        *,
        tuned_for: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Any:
        """The ``TrainConfig`` of one job: a loss job (``link`` None) or a timing job.

        ``tuned_for``: a link the entry is tuned for (:meth:`tuned_per_link`). Its first loss
        job chooses the settings for that link (``tune_link`` that link, as the job would on
        it); every other job of the cell runs with those ``settings`` as given. An entry that
        names its link (``ALGO/tune_link=10mbit``) likewise: ``settings`` (its first loss job's
        choice) are given to its other jobs as they are, with ``tune_link`` off."""
        from lowcomm.train.config import config_from_dict

        values: dict[str, Any] = {**self.train_overrides, **algo_fields(algo)}
        values.update(workers=workers, seed=seed, overwrite=True, quiet=True)
        label = algo if tuned_for is None else label_for(algo, tuned_for)
        # an entry is one set of settings on every link: its loss jobs (no link) and timing
        # jobs (each link) run the same ones. Settings from the link where the entry names the
        # link to choose for (ALGO/tune_link=10mbit), for both; an entry tuned per link takes
        # its first loss job's choice for that link in every other job of its cell
        values.setdefault("tune_link", "off")
        if settings is not None:
            # the first loss job's choice, given as it is (a timing job, short and on another
            # link, would choose again for its own length and machine, and time other settings)
            values.update(settings, tune_link="off")
        elif tuned_for is not None:
            values["tune_link"] = tuned_for
        base = config_from_dict(values, source=f"--algos {algo!r}")
        steps = (self.steps or base.steps) * length
        if link is None:
            name = f"loss-{_slug(label)}-w{workers}-x{length}-s{seed}"
            values.update(steps=steps, link=None)
            if self.eval_every is not None:
                values["eval_every"] = self.eval_every
        else:
            h = base.sync_every if REGISTRY[base.algo].is_outer else 1
            timing = h * math.ceil(self.timing_steps / h)
            name = f"time-{_slug(label)}-w{workers}-{_slug(link)}"
            values.update(steps=timing, link=link, eval_every=timing)
            loss_jobs = (
                self.train_config(algo, workers, seed, n, tuned_for=tuned_for, settings=settings)
                for n in self.lengths
            )
            if any(job.sync_warmup_steps() for job in loss_jobs):
                # a warm start of the same length first: its steps are timed apart
                values.update(steps=2 * timing, sync_warmup=timing)
            elif REGISTRY[base.algo].is_outer:
                values["sync_warmup"] = 0  # not the job's default for these few steps
            if tuned_for is not None and settings is not None:
                _predicting(values, base)
        if self.eval_batches is not None:
            values["eval_batches"] = self.eval_batches
        values.update(name=name, out=os.path.join(self.out, "jobs", name))
        return config_from_dict(values, source="convergence").with_paths()


def _predicting(values: dict[str, Any], base: Any) -> None:
    """A tuned cell's timing job predicts its own steps: the tuner runs at its start-up on the
    job's link with every setting it tunes given (``values``, else ``base``'s resolved value),
    so it keeps them all and records its predicted step times from the compute it measures
    in that job, beside the steps the job then takes."""
    from lowcomm.train.outer_keys import OUTER_KEYS
    from lowcomm.train.tuning import TUNED_KEYS

    values["tune_link"] = "auto"
    kwargs = base.algorithm_kwargs()
    for key in TUNED_KEYS:
        if key in values or key not in OUTER_KEYS[base.algo]:
            continue
        if key.endswith("compression") and kwargs.get(key) is None:
            values[key] = "none"  # fp32, given
        elif key == "num_fragments" and kwargs.get(key) is None:
            values[key] = 1  # the whole model at once
        elif key in kwargs:
            values[key] = kwargs[key]


def label_for(algo: str, link: str) -> str:
    """The cell of entry ``algo`` tuned for ``link``: ``co2@10mbit``."""
    return f"{algo}@{link}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "-", text).strip("-")
