"""Failure records of a ``lowcomm train`` job, and the one rule that names its root cause.

A worker that fails takes its peers down with it: their collectives lose a partner and fail
too, with a lost connection or a timeout. Whoever reports a failed job (the local launcher, a
restarted worker group, the launcher of workers in network namespaces) must therefore name the
first failure, not its knock-on effects. Every worker that raises writes a record
(:func:`record_failure`: ``failure-rank<r>-attempt<a>.json`` with its error, traceback, time,
attempt, and whether it is a lost peer, :func:`is_peer_loss`); a worker killed by a signal or
``os._exit`` leaves none. :func:`root_cause` reads them with one rule:

1. the earliest recorded error that is not a lost peer (ties: the lowest rank);
2. else (every record is a lost peer, or there is none) the first failed worker that left no
   record of its own: the one its peers lost;
3. else the earliest record;
4. else nothing is known.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lowcomm.guard import first_line, is_peer_loss

__all__ = [
    "attempt",
    "describe_attempt",
    "error_line",
    "is_bad_input",
    "is_peer_loss",
    "read_failures",
    "record_failure",
    "root_cause",
    "save_traceback",
]


def attempt() -> int:
    """Which attempt of the worker group this is: 0, or the number of restarts so far (torch
    elastic's ``TORCHELASTIC_RESTART_COUNT``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def error_line(error: BaseException) -> str:
    """``"Type: first line of the message"``: how a worker's failure is reported; an output that
    could not be written (an ``OSError`` naming its file) says which and how to fix it."""
    if isinstance(error, OSError) and error.filename and error.errno is not None:
        from lowcomm.runfiles import describe_os_error

        return describe_os_error(error, option="--out")
    first = first_line(error)
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def is_bad_input(error: BaseException) -> bool:
    """Whether ``error`` refuses something the worker was given rather than reporting a crash:
    library code raises ``ValueError`` for a user's mistake and the fix (a damaged or unsafe
    checkpoint file, a setting only a worker can check, ranks started with different settings),
    and ``assert`` or other errors for its own."""
    return isinstance(error, ValueError)


def record_failure(folder: str, rank: int, error: BaseException) -> None:
    """Record ``error`` (being handled: its traceback is the current one) as rank ``rank``'s
    failure in this attempt, in ``folder``. Best effort: a launcher that finds no record falls
    back to what it saw of the process."""
    record = {
        "rank": rank,
        "time": time.time(),
        "attempt": attempt(),
        "error": error_line(error),
        "peer_lost": is_peer_loss(error),
        "errno": error.errno if isinstance(error, OSError) and error.filename else None,
        "bad_input": is_bad_input(error),
        "traceback": traceback.format_exc(),
    }
    path = os.path.join(folder, f"failure-rank{rank}-attempt{attempt()}.json")
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:
        pass


def read_failures(folder: str | None, *, attempt: int | None = None) -> list[dict[str, Any]]:
    """The records :func:`record_failure` wrote in ``folder`` (those of one attempt of the
    worker group, or all); none when there is no such folder."""
    if folder is None or not os.path.isdir(folder):
        return []
    records = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("failure-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            if attempt is None or int(record.get("attempt", 0)) == attempt:
                records.append(record)
    return records


def root_cause(
    records: Sequence[Mapping[str, Any]], failed: Iterable[int] = ()
) -> tuple[int, Mapping[str, Any] | None] | None:
    """``(rank, its record or None)`` of the failure that caused the others, by the rule of the
    module docstring.

    Args:
        records: the failure records of one attempt (:func:`read_failures`).
        failed: the ranks the caller saw fail, the most likely cause first (for instance the
            first to exit); only those without a record are considered, after every record
            turned out to be a lost peer.

    Returns:
        ``None`` when there is neither a record nor a failed rank.
    """

    def earliest(candidates: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
        return min(candidates, key=lambda r: (float(r["time"]), int(r["rank"])))

    primary = [r for r in records if not r.get("peer_lost")]
    if primary:
        first = earliest(primary)
        return int(first["rank"]), first
    recorded = {int(r["rank"]) for r in records}
    silent = next((rank for rank in failed if rank not in recorded), None)
    if silent is not None:
        return silent, None
    if records:
        first = earliest(records)
        return int(first["rank"]), first
    return None


def describe_attempt(folder: str | None, number: int) -> str:
    """What the failure records of attempt ``number`` in ``folder`` say, in a few words (for a
    restarted worker group, which knows nothing else of the failure)."""
    cause = root_cause(read_failures(folder, attempt=number))
    if cause is None:
        return "a worker failed"
    rank, record = cause
    assert record is not None  # no failed ranks were given
    if record.get("peer_lost"):
        return "a worker died without an error record (its peers lost the connection)"
    return f"worker rank {rank} failed: {record['error']}"


def save_traceback(text: str | None, out: str | None, rank: int) -> str | None:
    """Keep a failed worker's traceback as ``<out>/error-rank<r>.txt``; its path, or ``None``."""
    if not text or out is None:
        return None
    path = os.path.join(out, f"error-rank{rank}.txt")
    try:
        os.makedirs(out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        return None
    return path
