"""Fault injection for the tests and benchmarks of failure handling (not a user setting).

:data:`FAULT_ENV` names one rank, one step and how that rank fails there; the training loop asks
:func:`fault_point` once and calls :func:`inject_fault` at that step, right after
``algo.step()``. Only the first attempt of a worker group injects, so a restarted group runs
clean and the tests can check that it recovers.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
from torch import nn

from lowcomm.train.failures import attempt as group_attempt

__all__ = ["FAULT_ENV", "FAULT_MODES", "fault_point", "inject_fault"]

logger = logging.getLogger(__name__)

FAULT_ENV = "LOWCOMM_FAULT_INJECT"
"""For tests only: ``"RANK:STEP[:MODE]"`` makes that rank fail right after ``algo.step()`` of
that step, in the first attempt of the worker group only (``TORCHELASTIC_RESTART_COUNT`` 0):
MODE ``kill`` (default: SIGKILL itself), ``exit`` (``os._exit(3)``), ``hang`` (stop without
exiting, until the others time out), ``raise`` (a ``RuntimeError``) or ``nan`` (set one value
of its first parameter to NaN and go on: a diverging worker). Not a user setting."""

FAULT_MODES = ("kill", "exit", "hang", "raise", "nan")
"""The MODEs of :data:`FAULT_ENV`."""


def fault_point(rank: int, *, attempt: int | None = None) -> tuple[int, str] | None:
    """``(step, mode)`` of the fault :data:`FAULT_ENV` asks this rank to inject, if any
    (``attempt``: which start this is, else the worker group's; an elastic replica passes its
    index as ``rank`` and its own restarts)."""
    spec = os.environ.get(FAULT_ENV)
    started = group_attempt() if attempt is None else attempt
    if not spec or started > 0:
        return None
    parts = spec.split(":")
    try:
        fault_rank, step = int(parts[0]), int(parts[1])
        mode = parts[2] if len(parts) > 2 else "kill"
    except (IndexError, ValueError):
        mode = ""
    if mode not in FAULT_MODES or len(parts) > 3:
        raise ValueError(
            f"{FAULT_ENV}={spec!r} must be RANK:STEP[:MODE], MODE one of {FAULT_MODES}"
        )
    return (step, mode) if fault_rank == rank else None


def inject_fault(mode: str, rank: int, step: int, timeout_s: float, *, model: nn.Module) -> None:
    """Fail as ``mode`` says (:data:`FAULT_ENV`); ``timeout_s`` is the collective timeout a
    hanging rank outlasts."""
    logger.warning("%s: rank %d injects a fault (%s) at step %d", FAULT_ENV, rank, mode, step)
    if mode == "nan":  # a worker that diverges: one NaN in its first parameter
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
        return
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":
        os._exit(3)
    elif mode == "hang":
        time.sleep(10 * timeout_s)  # the peers time out long before; the launcher stops us
    raise RuntimeError(f"fault injected by {FAULT_ENV} at step {step}")
