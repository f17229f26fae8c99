"""The tiny ``lowcomm train`` job the CLI, fault, resume and reliability checks run, and running
it in this process.

Example::

    from lowcomm.testing.jobs import TINY_JOB_ALGO_ARGS, run_train_job, tiny_job_args

    summary = run_train_job("runs/t", "--algo", "co2", *tiny_job_args(steps=6))
    summary["val_loss_final"] < summary["val_loss_initial"]
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

from lowcomm.registry import REGISTRY
from lowcomm.schedules import FRAGMENTS

__all__ = [
    "FRAGMENT_ARGS",
    "TINY_JOB",
    "TINY_JOB_ALGO_ARGS",
    "TINY_JOB_ARGS",
    "TINY_JOB_STEPS",
    "TrainJob",
    "read_summary",
    "run_train_job",
    "tiny_job_args",
]

TINY_JOB_STEPS = 12

TINY_JOB: dict[str, int | float | bool] = {
    "steps": TINY_JOB_STEPS,
    "sync_every": 4,
    "eval_every": 4,
    "eval_batches": 1,
    "batch_size": 2,
    "block_size": 16,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "warmup": 2,
    "workers": 2,
    "log_every": 2,
    "dropout": 0.1,
    "quiet": True,
}
"""The tiny job's settings, by ``TrainConfig`` field: 12 steps, rounds of 4 (boundaries 4, 8,
12), 2 workers, a GPT of 2 layers, width 32, context 16, batch 2; dropout so that the global
RNG state matters to an exact resume."""


def tiny_job_args(**changes: int | float | bool | None) -> list[str]:
    """The ``lowcomm train`` flags of :data:`TINY_JOB` with ``changes``: a value replaces the
    setting, ``None`` leaves its flag out (the CLI's default applies), a bool turns a switch
    (``quiet``) on or off.

    Example::

        tiny_job_args(steps=6, quiet=None)  # ['--steps', '6', '--sync-every', '4', ...]
    """
    unknown = sorted(set(changes) - set(TINY_JOB))
    if unknown:
        raise ValueError(f"tiny_job_args: no tiny-job setting {unknown[0]!r}; add it to TINY_JOB")
    argv: list[str] = []
    for key, value in {**TINY_JOB, **changes}.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


TINY_JOB_ARGS: list[str] = tiny_job_args()
"""The flags of :data:`TINY_JOB` (``--steps 12 --sync-every 4 ... --quiet``)."""

FRAGMENT_ARGS: list[str] = ["--num-fragments", "2", "--overlap", "1"]
"""The tiny job's fragments: 2 (a sync point every 2 steps), each all-reduce launched 1 step
early (at odd steps)."""

TINY_JOB_ALGO_ARGS: dict[str, list[str]] = {
    name: list(FRAGMENT_ARGS) if entry.schedule is FRAGMENTS else []
    for name, entry in REGISTRY.items()
    if entry.schedule.syncs  # ``none`` never synchronises: nothing to fault or resume
}
"""Per ``--algo`` value of :mod:`lowcomm.registry` that synchronises (every one but
``none``): the flags added to :data:`TINY_JOB_ARGS`, :data:`FRAGMENT_ARGS` for the fragment
methods."""


def read_summary(out: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``summary.json`` of the run folder ``out``."""
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary: dict[str, Any] = json.load(f)
    return summary


def run_train_job(out: str | os.PathLike[str], *argv: str) -> dict[str, Any]:
    """Run ``lowcomm train ARGV --out OUT`` in this process (:func:`lowcomm.train.cli.
    run_command`, which starts the workers) and return the run's ``summary.json``.

    Raises what the command raises (``ValueError`` for a bad flag or setting, ``WorkerFailed``,
    ``TrainingDiverged``), and ``AssertionError`` naming a non-zero exit code.
    """
    from lowcomm.train.cli import run_command  # the training stack: only when a job runs

    code = run_command([*argv, "--out", str(out)])
    if code != 0:
        raise AssertionError(f"lowcomm train {' '.join(argv)} --out {out} exited with {code}")
    return read_summary(out)


class TrainJob(Protocol):
    """What the ``train_job`` fixture of lowcomm's tests gives: :func:`run_train_job` with
    ``out`` a keyword, a fresh folder of the test's own when it is left out."""

    def __call__(self, *argv: str, out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Run ``lowcomm train ARGV`` in ``out`` and return its summary."""
        ...
