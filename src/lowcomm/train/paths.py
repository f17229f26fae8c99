"""Names of a run folder's checkpoint layout, shared by the configuration (which resolves a
``--resume`` path to its run folder) and :mod:`lowcomm.train.checkpoint` (which writes and reads
the checkpoints). Pure string and path functions: nothing here touches the disk."""

from __future__ import annotations

import datetime
import os
import re

from lowcomm.train.errors import ConfigError

__all__ = [
    "CHECKPOINTS",
    "LATEST",
    "STEP_FOLDER",
    "run_folder_of",
    "run_paths",
    "step_folder_name",
]

LATEST = "latest"
"""The value of ``resume`` meaning "the latest complete checkpoint under ``out``"."""

CHECKPOINTS = "checkpoints"
"""The folder under ``out`` that holds the checkpoints."""

STEP_FOLDER = re.compile(r"step-(\d+)")
"""The name of one checkpoint's folder under :data:`CHECKPOINTS` (``fullmatch``; group 1: the
step)."""


def step_folder_name(step: int) -> str:
    """``step-000120``: the folder of the checkpoint of ``step``."""
    return f"step-{step:06d}"


def run_folder_of(path: str) -> str:
    """The run folder a ``--resume`` path belongs to (lexically): ``RUN/checkpoints/step-N`` and
    ``RUN/checkpoints`` give ``RUN``; anything else is taken to be a run folder itself."""
    norm = os.path.normpath(path)
    base = os.path.basename(norm)
    parent = os.path.dirname(norm)
    if STEP_FOLDER.fullmatch(base) and os.path.basename(parent) == CHECKPOINTS:
        return os.path.dirname(parent) or "."
    if base == CHECKPOINTS:
        return parent or "."
    return norm


def run_paths(
    algo: str,
    name: str | None,
    out: str | None,
    resume: str | None,
    now: datetime.datetime | None = None,
) -> tuple[str, str]:
    """A run's ``(name, out)``: ``name`` by default ``<algo>-<YYYYmmdd-HHMMSS>`` (at ``now``),
    ``out`` by default ``runs/<name>``, or, resuming from a checkpoint path without ``out``, the
    run folder that holds it (the run it belongs to continues)."""
    if out is None and resume is not None:
        if resume == LATEST:
            raise ConfigError(
                "resume",
                "without a path needs out (--out), the folder of the run to continue; "
                "or pass the checkpoint: --resume RUN/checkpoints/step-NNNNNN",
            )
        out = run_folder_of(resume)
        if name is None:
            name = os.path.basename(os.path.normpath(out))
    if name is None:
        now = now or datetime.datetime.now()
        name = f"{algo}-{now:%Y%m%d-%H%M%S}"
    if out is None:
        out = os.path.join("runs", name)
    return name, out
