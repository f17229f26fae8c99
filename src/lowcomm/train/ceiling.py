"""The no-sync ceiling of ``lowcomm train`` (``--ceiling-steps``): the throughput the same
worker processes reach without any synchronisation, measured inside the job."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.data import get_batch, make_generator
from lowcomm.device import synchronize, to_device
from lowcomm.train.config import TrainConfig
from lowcomm.train.model import inner_optimizer

__all__ = ["SEGMENT_STEPS", "Ceiling", "segment_plan"]


SEGMENT_STEPS = 2
"""Inner steps per segment of the ceiling (a short job gets at least one segment before
training and one after)."""


def segment_plan(ceiling_steps: int, steps: int, start: int = 0) -> tuple[list[int], list[int]]:
    """The ceiling's segments: their sizes (``ceiling_steps`` in segments of about
    :data:`SEGMENT_STEPS`, at least two where there are two steps) and, for every segment
    between the first (before training) and the last (after it), the step after which it is
    due, spread evenly over the steps this run trains (after ``start``, a resumed run's
    checkpoint, up to ``steps``)."""
    if ceiling_steps <= 0:
        return [], []
    n = min(ceiling_steps, max(2, -(-ceiling_steps // SEGMENT_STEPS)))
    sizes = [ceiling_steps // n + (1 if i < ceiling_steps % n else 0) for i in range(n)]
    span = max(0, steps - start)
    due = [start + round(i * span / (n - 1)) for i in range(1, n - 1)]
    return sizes, due


class Ceiling:
    """The no-sync ceiling measured inside the job: the same worker processes time inner steps
    on a private copy of the model and inner optimizer with no synchronisation at all, in
    segments of a few steps interleaved with training — the first before it, the last after
    it, the others spread over the run, each at the first step from its due step on after which
    no collective is in flight (where none comes, after training) — so that the ceiling sees
    the machine as the training saw it, its speed drifting or not.

    The first and the last segment start and end on every rank together (a barrier on each
    side). The others run on each rank when it reaches the step, without a barrier: a barrier
    would line the ranks up, and the rank ahead would wait there for the others — a wait the
    training, whose syncs absorb a lead within their slack (or let it shrink again), would not
    all have paid. So each rank's training clock leaves out exactly its own segments, and the
    ranks stay as far apart as the training left them. A job without synchronisation runs at
    its slowest rank's pace, so the ceiling is the slowest rank's (:meth:`summary`), as the
    training's time is (the job's clock stops when the last rank has done its steps).

    Each rank draws batches from its own generator and keeps the training's random state: the
    training's data order, model and dropout draws are untouched.
    """

    def __init__(
        self, gpt: nn.Module, cfg: TrainConfig, corpus: Any, rank: int, device: torch.device
    ) -> None:
        self.model = copy.deepcopy(gpt)
        self.optimizer = inner_optimizer(self.model, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr
        self.cfg = cfg
        self.corpus = corpus
        self.device = device
        self.gen = make_generator(cfg.seed + 1_000_003, rank)
        self.segments: list[tuple[int, float]] = []  # (steps, seconds) on this rank
        self._sizes: list[int] = []  # the segments still to run (planned by before())
        self._due: list[int] = []  # the steps after which the middle ones are due
        with self._own_random_state():
            self._step()  # untimed: optimizer state and allocator warm-up

    def _own_random_state(self) -> Any:
        """The training's global random state, restored afterwards (dropout draws from it)."""
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        return torch.random.fork_rng(devices=cuda)

    def before(self, start: int = 0) -> None:
        """The first segment, before training (which starts after step ``start``: a resumed
        run spreads the others over the steps it has left)."""
        self._sizes, self._due = segment_plan(self.cfg.ceiling_steps, self.cfg.steps, start)
        if self._sizes:
            self.run(self._sizes.pop(0))

    def during(self, step: int, idle: bool) -> float:
        """After ``step`` of training (``idle``: no collective in flight): the next segment if
        it is due, on this rank alone (no barrier: see the class docstring); returns its seconds,
        to leave out of this rank's training time (0.0: none ran)."""
        if not (idle and self._due and step >= self._due[0]):
            return 0.0
        self._due.pop(0)
        return self.run(self._sizes.pop(0), aligned=False)

    def after(self) -> None:
        """After training: the segments still to run (those never due at an idle step, and the
        last)."""
        while self._sizes:
            self.run(self._sizes.pop(0))

    def _step(self) -> None:
        x, y = get_batch(self.corpus.train, self.cfg.batch_size, self.cfg.block_size, self.gen)
        bf16 = self.cfg.precision == "bf16"  # the job's arithmetic, for a fair ceiling
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = self.model(to_device(x, self.device), to_device(y, self.device))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int, *, aligned: bool = True) -> float:
        """A segment of ``steps`` steps. ``aligned``: on every rank together, a barrier on each
        side; returns its seconds from the first barrier to the end of the second. Else on this
        rank alone; returns its own seconds. Either way :attr:`segments` gets this rank's time
        for its steps."""
        if steps <= 0:
            return 0.0
        synchronize(self.device)  # the device's earlier work (the training's) is not timed
        if aligned:
            dist.barrier()
        t0 = time.perf_counter()
        with self._own_random_state():
            for _ in range(steps):
                self._step()
        synchronize(self.device)
        self.segments.append((steps, time.perf_counter() - t0))
        if aligned:
            dist.barrier()
        return time.perf_counter() - t0

    def summary(
        self, tokens_per_step: int, everyone: Sequence[Sequence[tuple[int, float]]] | None = None
    ) -> dict[str, Any]:
        """The ceiling in tokens/s (all workers' tokens, like the job's own figure): the slowest
        rank's, overall from each rank's total time and per segment from its slowest rank.
        ``everyone``: every rank's :attr:`segments` (gathered; default: this rank's alone)."""
        ranks = [list(s) for s in everyone] if everyone else [self.segments]
        if any([n for n, _ in r] != [n for n, _ in self.segments] for r in ranks):
            raise ValueError("every rank must have timed the same ceiling segments")
        steps = sum(n for n, _ in self.segments)
        seconds = max(sum(s for _, s in r) for r in ranks)
        slowest = [max(r[j][1] for r in ranks) for j in range(len(self.segments))]
        return {
            "steps": steps,
            "tokens_per_s": steps * tokens_per_step / seconds,
            "segments_tokens_per_s": [
                n * tokens_per_step / s for (n, _), s in zip(self.segments, slowest)
            ],
        }
