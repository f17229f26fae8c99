"""What a ``lowcomm train`` run leaves in its folder, and how it is written.

* ``config.json``: the resolved configuration;
* ``metrics.jsonl``: one JSON object per line:

  - ``{"kind": "step", "step", "steps", "loss", "lr", "tokens", "elapsed_s"}`` every
    ``log_every`` inner steps, before every evaluation and at the last step: ``loss`` is rank 0's
    training loss averaged over the ``steps`` inner steps that end at ``step`` (every step's loss
    is in exactly one record), ``lr`` the inner learning rate of step ``step``;
  - ``{"kind": "eval", "step", "val_loss", "tokens", "elapsed_s", "train_s", "rounds",
    <rank 0's CommStats>}`` per evaluation; ``train_s`` is the training time before it (the
    wall time since the start less every evaluation's time);
  - ``{"kind": "resume", "step", "checkpoint", "restart"}`` where a resumed or restarted run
    continued from the checkpoint of ``step``: the records after ``step`` written by the run
    that was stopped are removed first, so every step still appears in exactly one ``step``
    record and times continue from the checkpoint's;

* ``checkpoint.pt``: **rank 0's** final state (after ``algo.finish()``): its model, inner
  optimizer (with ``node_sharding="zero"`` the whole AdamW state, gathered from node 0's shards,
  in AdamW's own format) and algorithm state (``"rank": 0``), with the config, world size and
  step. It is the trained model to load; the resume points are the per-rank checkpoints under
  ``checkpoints/`` (``--checkpoint-every``, see :mod:`lowcomm.train.checkpoint`). Plain dicts,
  tensors, numbers and strings, so ``torch.load(weights_only=True)`` reads it;
* ``checkpoints/step-NNNNNN/``: resumable checkpoints of every rank (with ``--checkpoint-every``);
* ``loss.png``: training and validation loss against step;
* ``summary.json``: totals, throughput, validation loss start and end, communication counters per
  worker and their mean, ``replicas_identical`` (every rank ended with the same parameters, by
  a checksum of each rank's), and ``layout``: ``null``, or with ``nodes`` / ``node_sharding``
  the node layout (``nodes``, ``procs_per_node``, ``node_sharding``, ``across_nodes``,
  ``link_per_process``, ``cross_node_wire_bytes_per_node`` and ``intra_node``, the mean
  counters of DDP inside the nodes); with node groups the ``comm_*`` counters are those of the
  algorithm's cross-node group;
* ``error-rank<r>.txt``: the traceback of a worker that failed, if one did.

A folder holding :data:`RUN_FILES` or a ``checkpoints`` folder is a previous run: ``lowcomm train``
refuses it unless told to overwrite it (and then removes :func:`previous_run_files` and the
checkpoints first) or to resume it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import uuid
from typing import Any

import torch

__all__ = [
    "json_safe",
    "CHECKPOINT_NOTE",
    "RUN_FILES",
    "MetricsWriter",
    "atomic_write",
    "plot_losses",
    "previous_run_files",
    "read_metrics",
    "save_checkpoint",
    "write_json",
]

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoint.pt")
"""Files whose presence marks a folder as holding a run."""

CHECKPOINT_NOTE = (
    "rank 0's final state only (model, inner optimizer, algorithm), after algo.finish(); "
    "resume points with every rank's state are under checkpoints/ (--checkpoint-every)"
)
"""The ``"note"`` stored in ``checkpoint.pt``."""


def previous_run_files(folder: str) -> list[str]:
    """Paths of the files a ``lowcomm train`` run writes that exist in ``folder``: the
    :data:`RUN_FILES`, ``loss.png`` and ``error-rank*.txt``."""
    names = [*RUN_FILES, "loss.png"]
    paths = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
    return paths + sorted(glob.glob(os.path.join(glob.escape(folder), "error-rank*.txt")))


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN or inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class MetricsWriter:
    """Writes one JSON object per line to ``path`` (a new file, or appended to with ``append``,
    as a resumed run does) and flushes it, so a crashed run keeps its metrics up to the crash."""

    def __init__(self, path: str, *, append: bool = False) -> None:
        self.path = path
        mode = "a" if append else "w"
        self._f = open(path, mode, encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(json_safe(record)) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def atomic_write(path: str, write: Any) -> None:
    """Write through a temporary file in the same folder, fsync, then ``os.replace``: readers see
    the old file or the new one, never a torn one."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)  # make the rename itself durable


def fsync_dir(folder: str) -> None:
    """fsync a folder, so that renames into it survive a crash (not possible on every
    platform: then a no-op)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    data = (json.dumps(json_safe(obj), indent=2) + "\n").encode()
    atomic_write(path, lambda f: f.write(data))


def save_checkpoint(path: str, checkpoint: dict[str, Any]) -> None:
    """``torch.save`` atomically (temporary file in the same folder, fsync, ``os.replace``)."""
    atomic_write(path, lambda f: torch.save(checkpoint, f))


def plot_losses(metrics_path: str, png_path: str, *, title: str | None = None) -> None:
    """Training loss (raw and smoothed) and validation loss against step, to ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = [r["step"] for r in records if r["kind"] == "step" and r["loss"] is not None]
    losses = [r["loss"] for r in records if r["kind"] == "step" and r["loss"] is not None]
    ev = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]
    smooth: list[float] = []
    for loss in losses:
        smooth.append(loss if not smooth else 0.9 * smooth[-1] + 0.1 * loss)

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if steps:
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (rank 0)")
        ax.plot(steps, smooth, color="tab:blue", linewidth=1.5, label="train, smoothed")
    if ev:
        ax.plot(
            [s for s, _ in ev],
            [v for _, v in ev],
            color="tab:orange",
            marker="o",
            markersize=3.5,
            linewidth=1.5,
            label="validation",
        )
    if title:
        ax.set_title(title, fontsize=10)
    ax.set_xlabel("inner step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
