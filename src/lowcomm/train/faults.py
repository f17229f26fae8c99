"""Fault injection for the tests and benchmarks of failure handling (not a user setting).

:data:`FAULT_ENV` names one rank, one step and how that rank fails there; the training loop asks
:func:`fault_point` once and calls :func:`inject_fault` at that step, right after
``algo.step()``. Only the first attempt of a worker group injects, so a restarted group runs
clean and the tests can check that it recovers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Any

import torch
from torch import nn

from lowcomm.train.failures import attempt as group_attempt

__all__ = [
    "ELASTIC_MODES",
    "FAULT_ENV",
    "FAULT_MODES",
    "LOST_STATE_ENV",
    "die_as_donor",
    "fault_point",
    "fetch_lost_state",
    "inject_fault",
    "mark_lost",
]

logger = logging.getLogger(__name__)

FAULT_ENV = "LOWCOMM_FAULT_INJECT"
"""For tests only: ``"RANK:STEP[:MODE]"`` makes that rank fail right after ``algo.step()`` of
that step, in the first attempt of the worker group only (``TORCHELASTIC_RESTART_COUNT`` 0):
MODE ``kill`` (default: SIGKILL itself), ``exit`` (``os._exit(3)``), ``hang`` (stop without
exiting, until the others time out), ``raise`` (a ``RuntimeError``) or ``nan`` (set one value
of its first parameter to NaN and go on: a diverging worker). Two more for elastic replicas
(``--fault-tolerance``; RANK is the replica's number, and only its first start injects):
``sync`` (SIGKILL itself right after it joined the quorum of the first sync — or warm-start
step — launched at or after STEP, before its collective: a replica dying with a sync in
flight) and ``donor`` (the first time it sends its state to a healing replica, send the length
and SIGKILL itself before the state; RANK ``*``: whichever replica donates first, once per
job). Not a user setting."""

FAULT_MODES = ("kill", "exit", "hang", "raise", "nan", "sync", "donor")
"""The MODEs of :data:`FAULT_ENV`."""

ELASTIC_MODES = ("sync", "donor")
"""The MODEs an elastic replica arms itself (:meth:`lowcomm.train.elastic.ElasticReplica.arm`)
rather than the loop injecting them after a step."""


LOST_STATE_ENV = "LOWCOMM_LOST_STATE"
"""For benchmarks and tests: a folder in which a file ``attempt<N>`` lists, one a line, the ranks
whose machine was lost before attempt N of the worker group (:func:`mark_lost`), its local disk
with it. Under ``--link`` such a rank's replacement reads its checkpoint file across the link
from where the run's checkpoints are kept: before the group resumes it waits as long as the
link takes to carry the file (:func:`fetch_lost_state`), as a killed elastic replica waits for
its heal from a peer. Without the variable, or without ``--link``, a restarted worker reads its
own disk, as a process restarted on the same machine does. Not a user setting."""


def mark_lost(folder: str, rank: int, attempt: int) -> None:
    """Record in ``folder`` (:data:`LOST_STATE_ENV`) that ``rank``'s machine was lost while the
    worker group ran its attempt ``attempt``: the next attempt's ``rank`` fetches its state."""
    with open(os.path.join(folder, f"attempt{attempt + 1}"), "a", encoding="utf-8") as f:
        f.write(f"{rank}\n")


def _lost(folder: str, rank: int, attempt: int) -> bool:
    try:
        with open(os.path.join(folder, f"attempt{attempt}"), encoding="utf-8") as f:
            return str(rank) in f.read().split()
    except FileNotFoundError:
        return False


def fetch_lost_state(path: str, rank: int, link: str | None) -> None:
    """Carry the checkpoint file ``path`` of ``rank`` across ``link`` if :data:`LOST_STATE_ENV`
    says this rank's machine was lost before this attempt: wait for the link's latency and the
    file's bytes at its bandwidth, and note ``{"rank", "bytes", "link_s", "waited_s"}`` next to
    the list as ``attempt<N>.rank<r>.json``. Nothing (no wait) otherwise."""
    folder = os.environ.get(LOST_STATE_ENV)
    now = group_attempt()
    if not folder or link is None or now == 0 or not _lost(folder, rank, now):
        return
    from lowcomm.link import EmulatedLink, wait_until

    size = os.path.getsize(path)
    t0 = time.monotonic()
    done = EmulatedLink.parse(link).model().schedule(t0, size)
    wait_until(done)
    fetched = {
        "rank": rank,
        "bytes": size,
        "link_s": done - t0,
        "waited_s": time.monotonic() - t0,
    }
    logger.info(
        "rank %d's machine was lost: its checkpoint (%.1f MB) came over the %s link in %.1f s",
        rank,
        size / 1e6,
        link,
        fetched["waited_s"],
    )
    with open(os.path.join(folder, f"attempt{now}.rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(fetched, f)


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
        fault_rank = None if parts[0] == "*" else int(parts[0])
        step = int(parts[1])
        mode = parts[2] if len(parts) > 2 else "kill"
    except (IndexError, ValueError):
        mode = ""
    if mode not in FAULT_MODES or len(parts) > 3 or (fault_rank is None and mode != "donor"):
        raise ValueError(
            f"{FAULT_ENV}={spec!r} must be RANK:STEP[:MODE], MODE one of {FAULT_MODES} "
            "(RANK * with donor only)"
        )
    return (step, mode) if fault_rank in (None, rank) else None


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


def die_as_donor(transport: Any, token: str) -> None:
    """Make the first send of ``transport`` (a :class:`lowcomm.elastic.transport.TensorTransport`)
    among the processes given the same ``token`` path announce its length, then SIGKILL this
    process before the state: the healing replica's transfer fails half-way. The process that
    creates ``token`` dies; the others send as usual."""
    from lowcomm.elastic.transport import LENGTH_TAG

    send = transport.send_checkpoint

    def send_then_die(dst_ranks: list[int], step: int, state_dict: Any, timeout: Any) -> None:
        try:
            os.close(os.open(token, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another donor died already: this one sends
            return send(dst_ranks, step, state_dict, timeout)
        logger.warning("%s: this replica dies half-way through sending its state", FAULT_ENV)
        length = torch.tensor([1 << 20], dtype=torch.int64)
        for dst in dst_ranks:
            transport.pg.send([length], dst, tag=LENGTH_TAG).wait(timeout)
        os.kill(os.getpid(), signal.SIGKILL)

    transport.send_checkpoint = send_then_die
