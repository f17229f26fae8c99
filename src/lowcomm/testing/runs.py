"""Compare two ``lowcomm train`` run folders bit for bit: what an exact resume or restart must
reproduce.

A run that was faulted and then resumed (or restarted) from a checkpoint must end exactly as an
uninterrupted run of the same job: every rank's full state at the last step (model, inner
optimizer, algorithm state with its anchors and in-flight results, RNG states), rank 0's final
model and algorithm state (``checkpoint.pt``), the metrics' numbers and the summary's. The tests
assert it (:func:`assert_same_run`); ``benchmarks/reliability.py`` reports the differences
(:func:`compare_runs`).

Example::

    from lowcomm.testing.runs import compare_runs

    result = compare_runs("runs/reference", "runs/resumed")
    result.identical, result.describe()  # (True, 'identical: 0 of 651 tensors differ')
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from lowcomm.testing.jobs import read_summary
from lowcomm.train.checkpoint import CHECKPOINTS

__all__ = [
    "MEASUREMENTS",
    "RunComparison",
    "assert_identical",
    "assert_same_run",
    "compare_runs",
    "compare_states",
    "final_state",
    "metric_numbers",
    "rank_state",
    "read_records",
]

Path = str | os.PathLike[str]

MEASUREMENTS = ("comm_stats", "progress", "intra_node_stats")
"""The entries of a rank's checkpoint that are measurements, not state (wall-clock, blocked and
in-flight times): left out of every comparison."""

SUMMARY_KEYS = ("val_loss_initial", "val_loss_final", "tokens")
"""The summary's numbers a resume must not change (and ``comm_mean.payload_bytes``: the
communication counters continue across it)."""


@dataclass
class RunComparison:
    """The differences found between two states or runs, by where they are
    (``rank1.algorithm.anchor``, ``final.model.wte.weight``, ``metrics[3]``)."""

    tensors: int = 0
    """Tensors compared."""
    differing_tensors: list[str] = field(default_factory=list)
    """Tensors whose dtype, shape or any bit differ."""
    differing_values: list[str] = field(default_factory=list)
    """Other differences: values, keys (``(keys)``), lengths (``(length)``), metrics, summary."""
    problem: str | None = None
    """What could not be compared (a file missing or unreadable), else ``None``."""

    @property
    def identical(self) -> bool:
        return self.problem is None and not self.differing_tensors and not self.differing_values

    def describe(self, limit: int = 5) -> str:
        """One line: ``identical: 0 of N tensors differ``, or what differs (the first
        ``limit`` of each kind)."""
        if self.problem is not None:
            return f"not compared: {self.problem}"
        line = f"{len(self.differing_tensors)} of {self.tensors} tensors differ"
        if self.identical:
            return f"identical: {line}"
        if self.differing_tensors:
            line += f" ({_first(self.differing_tensors, limit)})"
        if self.differing_values:
            n = len(self.differing_values)
            line += f"; {n} other difference{'' if n == 1 else 's'}: "
            line += _first(self.differing_values, limit)
        return line


def _first(items: list[str], limit: int) -> str:
    return ", ".join(items[:limit]) + (" ..." if len(items) > limit else "")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def compare_states(
    a: Any, b: Any, where: str = "", into: RunComparison | None = None
) -> RunComparison:
    """Walk nested checkpoint contents (dicts, lists, tuples, tensors, plain values) side by
    side and record every difference in ``into`` (a new :class:`RunComparison` if ``None``),
    which is returned. A tensor is equal when its dtype, shape and every bit are; other values
    by ``==``, NaN equal to NaN."""
    result = RunComparison() if into is None else into
    if isinstance(a, torch.Tensor):
        result.tensors += 1
        same = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
        if not same:
            result.differing_tensors.append(where)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            result.differing_values.append(f"{where} (keys)")
            return result
        for key in a:
            compare_states(a[key], b[key], f"{where}.{key}", result)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            result.differing_values.append(f"{where} (length)")
            return result
        for i, (x, y) in enumerate(zip(a, b)):
            compare_states(x, y, f"{where}[{i}]", result)
    elif not (a == b or (a != a and b != b)):
        result.differing_values.append(where)
    return result


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Raise ``AssertionError`` naming every difference unless ``a`` and ``b`` are bitwise
    equal (:func:`compare_states`)."""
    result = compare_states(a, b, where)
    if not result.identical:
        raise AssertionError(f"{where or 'states'}: {result.describe()}")


def rank_state(run: Path, step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s checkpoint of step ``step`` in the run folder ``run``, without its
    :data:`MEASUREMENTS`."""
    path = os.path.join(run, CHECKPOINTS, f"step-{step:06d}", f"rank-{rank}.pt")
    state: dict[str, Any] = torch.load(path, weights_only=True)
    for key in MEASUREMENTS:
        state.pop(key, None)
    return state


def final_state(run: Path) -> dict[str, Any]:
    """The run's ``checkpoint.pt``: rank 0's model, optimizer and algorithm state at the end."""
    state: dict[str, Any] = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=True)
    return state


def read_records(run: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl``, one dict per record."""
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def metric_numbers(run: Path) -> list[tuple[Any, ...]]:
    """What a resume must not change in the metrics: the loss records' values, the validation
    losses, the rounds and the payload."""
    numbers: list[tuple[Any, ...]] = []
    for r in read_records(run):
        if r["kind"] == "step":
            numbers.append(("step", r["step"], r["steps"], r["loss"], r["lr"], r["tokens"]))
        elif r["kind"] == "eval":
            numbers.append(("eval", r["step"], r["val_loss"], r["rounds"], r["payload_bytes"]))
    return numbers


def compare_runs(reference: Path, run: Path) -> RunComparison:
    """``run`` against ``reference`` (same job): every rank's state at the reference's last step,
    rank 0's final model and algorithm state, the metrics' numbers (:func:`metric_numbers`) and
    the summary's losses, tokens and payload. A file missing or unreadable is the result's
    ``problem``."""
    result = RunComparison()
    try:
        summaries = [read_summary(reference), read_summary(run)]
        steps = summaries[0]["steps"]
        for rank in range(summaries[0]["workers"]):
            a, b = rank_state(reference, steps, rank), rank_state(run, steps, rank)
            compare_states(a, b, f"rank{rank}", result)
        final_ref, final = final_state(reference), final_state(run)
        for key in ("model", "algorithm"):
            compare_states(final_ref[key], final[key], f"final.{key}", result)
        ref_numbers, numbers = metric_numbers(reference), metric_numbers(run)
        if len(ref_numbers) != len(numbers):
            result.differing_values.append("metrics (record count)")
        result.differing_values += [
            f"metrics[{i}]" for i, (x, y) in enumerate(zip(ref_numbers, numbers)) if x != y
        ]
        for key in SUMMARY_KEYS:
            if summaries[0][key] != summaries[1][key]:
                result.differing_values.append(f"summary.{key}")
        if summaries[0]["comm_mean"]["payload_bytes"] != summaries[1]["comm_mean"]["payload_bytes"]:
            result.differing_values.append("summary.comm_mean.payload_bytes")
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        result.problem = f"{type(e).__name__}: {e}"
    return result


def assert_same_run(reference: Path, run: Path, *, resumed_at: list[int]) -> None:
    """Raise ``AssertionError`` unless ``run`` ended exactly as ``reference``
    (:func:`compare_runs`), counted every step in exactly one loss record, and resumed at the
    steps ``resumed_at`` (its metrics' resume records and its summary say so)."""
    result = compare_runs(reference, run)
    if not result.identical:
        raise AssertionError(f"{run} did not end as {reference}: {result.describe()}")
    records = read_records(run)
    steps = sum(r["steps"] for r in records if r["kind"] == "step")
    if steps != read_summary(reference)["steps"]:
        raise AssertionError(f"{run}: the loss records count {steps} steps")
    resumes = [r["step"] for r in records if r["kind"] == "resume"]
    if resumes != resumed_at:
        raise AssertionError(f"{run}: resume records at {resumes}, expected {resumed_at}")
    summary_resumed = read_summary(run)["resumed_at"]
    if summary_resumed != resumed_at:
        raise AssertionError(f"{run}: summary resumed_at {summary_resumed}, not {resumed_at}")
