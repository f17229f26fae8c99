"""lowcomm's metrics for loggers: scalars under ``lowcomm/`` whose x-axis is the outer step.

A :class:`MetricsLogger` watches a *source*, anything with an ``outer_step`` counter and a
``metrics()`` method: an outer algorithm (:meth:`lowcomm.outer.engine.OuterAlgorithm.metrics`),
:class:`lowcomm.DeMo`, or :class:`EveryStep` for synchronous training (DDP), whose every step
is a sync. Called after every inner step, it writes once per outer step (or every ``every``
outer steps): to TensorBoard (``torch.utils.tensorboard.SummaryWriter``; extra
``lowcomm[tensorboard]``) with ``global_step`` = the outer step, and/or one JSON object per
line. The scalars:

* ``lowcomm/loss``: the mean of the training losses passed to :meth:`MetricsLogger.step` since
  the last write (this rank's);
* ``lowcomm/val_loss``: each :meth:`MetricsLogger.eval`, at the outer step it was taken at;
* ``lowcomm/pseudo_grad_norm`` (outer algorithms), ``lowcomm/bytes_sent``,
  ``lowcomm/bytes_received``, ``lowcomm/blocked_s``, ``lowcomm/hidden_fraction`` (once
  something was sent), ``lowcomm/skipped_updates`` (outer algorithms), and
  ``lowcomm/inner_step``, which maps the outer axis back to the inner one.

Example::

    algo = lowcomm.CO2(model, inner, sync_every=12)
    log = MetricsLogger(algo, tensorboard="runs/co2-tb")   # rank 0 only, typically
    for batch in loader:
        loss = loss_fn(model, batch); loss.backward()
        inner.step(); inner.zero_grad(); algo.step()
        log.step(loss)                                      # writes when a sync was applied
    log.eval(validation_loss())
    log.close()
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

import torch

from lowcomm.comm import CommStats

__all__ = ["SCALARS", "EveryStep", "MetricsLogger", "MetricsSource", "merged_metrics"]

SCALARS = (
    "loss",
    "pseudo_grad_norm",
    "bytes_sent",
    "bytes_received",
    "blocked_s",
    "hidden_fraction",
    "skipped_updates",
    "inner_step",
)
"""What each write holds, under ``lowcomm/`` (those a source reports; ``val_loss`` is written
by :meth:`MetricsLogger.eval`)."""


class MetricsSource(Protocol):
    """What :class:`MetricsLogger` reads."""

    @property
    def outer_step(self) -> int: ...

    def metrics(self) -> dict[str, float | int | None]: ...


class EveryStep:
    """The source for synchronous training (DDP, or no synchronisation), whose every inner step
    is a sync: call :meth:`step` after each; ``stats`` are its communication counters (a DDP
    meter's)."""

    def __init__(self, stats: CommStats | None = None) -> None:
        self.stats = stats if stats is not None else CommStats()
        self.outer_step = 0

    def step(self) -> None:
        self.outer_step += 1

    def metrics(self) -> dict[str, float | int | None]:
        return {
            "outer_step": self.outer_step,
            "inner_step": self.outer_step,
            **self.stats.metrics(),
        }


def merged_metrics(source: MetricsSource) -> dict[str, float]:
    """``source``'s metrics as ``lowcomm/<name>`` floats, the ones that are set (for merging
    into another trainer's logs: Hugging Face, Lightning)."""
    return {
        f"lowcomm/{k}": float(v)
        for k, v in source.metrics().items()
        if v is not None and (k in SCALARS or k == "outer_step")
    }


class MetricsLogger:
    """Writes ``source``'s scalars (module docstring) to TensorBoard at ``tensorboard`` (a
    folder) and/or to the JSONL file ``jsonl``, or to an existing ``writer`` (a
    ``SummaryWriter``, e.g. the one a trainer already has). ``every``: write every that many
    outer steps. ``purge_step`` (TensorBoard): a resumed run's first outer step; what an
    earlier, stopped run wrote from it on is hidden. ``jsonl_append``: add to an existing file.
    """

    def __init__(
        self,
        source: MetricsSource,
        *,
        tensorboard: str | None = None,
        jsonl: str | None = None,
        writer: Any = None,
        every: int = 1,
        purge_step: int | None = None,
        jsonl_append: bool = False,
    ) -> None:
        if tensorboard is None and jsonl is None and writer is None:
            raise ValueError(
                "MetricsLogger needs somewhere to write: tensorboard=FOLDER, jsonl=PATH or "
                "writer=SummaryWriter(...)"
            )
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.source = source
        self.every = every
        self._owns_writer = writer is None and tensorboard is not None
        self.writer = writer if writer is not None else _summary_writer(tensorboard, purge_step)
        self._jsonl = None
        if jsonl is not None:
            self._jsonl = open(jsonl, "a" if jsonl_append else "w", encoding="utf-8")  # noqa: SIM115
        self._last = int(source.outer_step)
        self._loss_sum: torch.Tensor | float = 0.0
        self._losses = 0

    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """Call after every inner step (after ``algo.step()``) with its training loss; writes
        if an outer step was completed (``every``) since the last write. Returns whether it
        wrote. The loss stays on the device until then."""
        if loss is not None:
            self._loss_sum = self._loss_sum + (
                loss.detach().float() if isinstance(loss, torch.Tensor) else float(loss)
            )
            self._losses += 1
        outer = int(self.source.outer_step)
        if outer - self._last < self.every:
            return False
        self._last = outer
        values = self.source.metrics()
        if self._losses:
            values["loss"] = float(self._loss_sum) / self._losses
        self._loss_sum, self._losses = 0.0, 0
        self._write(outer, {k: values.get(k) for k in SCALARS}, values)
        return True

    def eval(self, val_loss: float) -> None:
        """Write a validation loss at the current outer step."""
        outer = int(self.source.outer_step)
        self._write(outer, {"val_loss": float(val_loss)}, {"val_loss": float(val_loss)})

    def _write(self, outer: int, scalars: dict[str, Any], record: dict[str, Any]) -> None:
        if self.writer is not None:
            for key, value in scalars.items():
                if value is not None and math.isfinite(float(value)):
                    self.writer.add_scalar(f"lowcomm/{key}", float(value), global_step=outer)
            self.writer.flush()
        if self._jsonl is not None:
            safe = {
                k: v if not isinstance(v, float) or math.isfinite(v) else None
                for k, v in record.items()
            }
            self._jsonl.write(json.dumps({"outer_step": outer, **safe}) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._owns_writer and self.writer is not None:
            self.writer.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def _summary_writer(folder: str | None, purge_step: int | None) -> Any:
    if folder is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "writing TensorBoard event files needs the tensorboard package: "
            "pip install 'lowcomm[tensorboard]'"
        ) from None
    return SummaryWriter(folder, purge_step=purge_step)
