"""Dynamic local steps: rounds that end together on workers of unequal speed.

With ``local_steps="dynamic"`` the schedule of an outer algorithm keeps its H *positions* per
round on every rank (launches, applies and round boundaries stay where they are), but rank j
takes an inner step at only H_j of them and passes over the rest at no cost, so that a worker
half as fast takes about half the steps and every rank reaches the round's sync at about the
same time. The fastest rank takes all H. This is the dynamic local updates of Asynchronous
Local-SGD (Liu et al. 2024, https://arxiv.org/abs/2401.09135) and the sample-weighted average
of hivemind's ``Optimizer``, inside the synchronous engine and its overlap.

* **Where a rank steps**: at position p (1 … H) of a round in which it takes h steps, iff
  ⌊p·h/H⌋ > ⌊(p − 1)·h/H⌋ — spread evenly over the round, the last position always a step (so
  a sync launched τ positions before the end still has inner steps to overlap on every rank).
* **Speeds**: each rank measures the wall time of its own inner steps (from the end of one
  ``step()`` call to the start of the next at a position it stepped at: its forward, backward
  and optimizer step, none of the engine's waits); on a GPU the clock waits for the device
  first (:func:`lowcomm.device.device_clock`), or it would time the kernels' launch. With the
  sync whose apply falls on a round boundary every rank sends its mean over the steps since
  the last such sync — one SUM all-reduce of N float64 values, launched just before the sync's
  own collective and waited on at its apply — and every rank sets the next round's
  H_j = min(H, max(1, round(H·t_min/t_j))) from the same numbers. Rounds before the first
  measurement take H steps everywhere.
* **Weights**: rank j's pseudo-gradient (LocalSGD: its parameters) is multiplied by
  N·n_j / Σ n before the mean, n_j being the inner steps rank j took since the same fragment's
  previous launch (every rank computes every n_j from the plans): the average is weighted by
  the tokens each rank contributed when every rank's batch holds as many tokens. With equal
  speeds every factor is exactly 1 and nothing changes, bit for bit.

* **The warm start** (``sync_warmup``: gradients averaged every step) follows the same plans:
  at a position a rank passes over it contributes no gradient (its factor is 0, the others'
  N/m for the m ranks that stepped), takes the optimizer step with the mean like every rank
  (the engine calls it; the models stay identical), and the step times are exchanged with a
  blocking all-reduce at each of the warm start's round boundaries, excluding the time spent
  waiting for the means.

Rounds are counted over the whole job, warm start included (K is a multiple of H).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lowcomm.comm import Communicator
from lowcomm.device import collective_device, device_clock

__all__ = ["Pace", "plan_steps", "steps_through", "trim_plan"]


def steps_through(p: int, h: int, sync_every: int) -> int:
    """Inner steps a rank taking ``h`` of a round's ``sync_every`` positions has taken at
    positions 1 … ``p``."""
    return p * h // sync_every


def trim_plan(plan: list[int], remaining: int) -> list[int]:
    """``plan`` cut to ``remaining`` steps in all (the last round of a job with a length in
    tokens): each rank's share in proportion, the leftover steps to the largest remainders
    (the lowest rank first among equals); unchanged when it fits."""
    total = sum(plan)
    if total <= remaining:
        return list(plan)
    remaining = max(0, remaining)
    cut = [n * remaining // total for n in plan]
    order = sorted(range(len(plan)), key=lambda j: (-(plan[j] * remaining % total), j))
    for j in order[: remaining - sum(cut)]:
        cut[j] += 1
    return cut


def plan_steps(times: list[float], sync_every: int) -> list[int]:
    """Each rank's steps in the next round from its measured seconds per inner step (0: not
    measured, taken as the fastest): the fastest rank takes ``sync_every``, rank j
    round(H·t_min/t_j), at least 1."""
    measured = [t for t in times if t > 0]
    if not measured:
        return [sync_every] * len(times)
    fastest = min(measured)
    return [
        sync_every if t <= 0 else min(sync_every, max(1, round(sync_every * fastest / t)))
        for t in times
    ]


class Pace:
    """The dynamic-local-steps bookkeeping of one engine (see the module docstring): the plans
    (every rank's steps per round), the steps every rank took since each fragment's launch,
    this rank's step timing and the measurements in flight."""

    def __init__(
        self,
        comm: Communicator,
        sync_every: int,
        num_fragments: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        self.comm = comm
        self.world = comm.world_size
        self.rank = comm.rank
        self.sync_every = sync_every
        self.plans: dict[int, list[int]] = {}
        """Round (1-based, over the whole job) → every rank's steps in it; rounds not listed
        take H everywhere."""
        self.taken = [0] * self.world
        """Inner steps each rank took."""
        self._at_launch = [[0] * self.world for _ in range(num_fragments)]
        self.compute_s = 0.0
        """This rank's seconds of inner steps since its last measurement was sent."""
        self.timed = 0
        self.waited = 0.0
        """Seconds this rank waited for the warm start's means since the last position (not
        its compute)."""
        self.clock: Callable[[], float] = device_clock(device)
        """What step times are read from (a test may replace it): ``time.perf_counter``,
        after waiting for ``device``'s queued work on a GPU (``device`` ``None``: the current
        CUDA device's, when CUDA is in use)."""
        self._t_end: float | None = None
        self._measuring: dict[int, tuple[Any, torch.Tensor] | list[float]] = {}
        self.last_times: list[float] = [0.0] * self.world
        """Every rank's seconds per inner step as last measured (0: not yet)."""
        self.budget: int | None = None
        """Inner steps all ranks together take in the job, if it is known: the last round's
        plan is cut to what is left of it (:meth:`OuterAlgorithm.set_total_steps`)."""

    # -- the plan -----------------------------------------------------------------------------

    def plan(self, rnd: int) -> list[int]:
        return self.plans.get(rnd, [self.sync_every] * self.world)

    def _position(self, q: int) -> tuple[int, int]:
        rnd = (q - 1) // self.sync_every + 1
        return rnd, q - (rnd - 1) * self.sync_every

    def steps_at(self, q: int) -> list[bool]:
        """Whether each rank takes an inner step at position ``q`` (1-based, of the job)."""
        rnd, p = self._position(q)
        h = self.sync_every
        return [steps_through(p, n, h) > steps_through(p - 1, n, h) for n in self.plan(rnd)]

    def steps_here(self, q: int) -> bool:
        """Whether this rank takes an inner step at position ``q``."""
        return self.steps_at(q)[self.rank]

    def warm_factor(self, q: int) -> float:
        """This rank's factor for its gradient in the warm start's mean at position ``q``:
        N/m if it stepped (m ranks did), else 0 (exactly 1.0 when every rank stepped)."""
        at = self.steps_at(q)
        return (self.world * int(at[self.rank])) / max(1, sum(at))

    # -- every position -----------------------------------------------------------------------

    def begin(self, stepped: bool) -> None:
        """At the start of ``step()``: the inner step just taken (if this rank took one) is
        timed from the end of the last ``step()``."""
        if stepped and self._t_end is not None:
            self.compute_s += self.clock() - self._t_end - self.waited
            self.timed += 1
        self.waited = 0.0

    def end(self) -> None:
        """At the end of ``step()``."""
        self._t_end = self.clock()

    def position(self, q: int, inner: torch.optim.Optimizer, warmup: int) -> None:
        """At the start of ``step()`` for position ``q``: time this rank's inner step (if it
        took one), count every rank's; inside the warm start (its first ``warmup`` positions)
        a rank that passed the position takes the ``inner`` optimizer's step with the others'
        mean (its pre-hook averages), like DDP's ranks."""
        here = self.steps_here(q)
        self.begin(here)
        if q <= warmup and not here:
            inner.step()
            inner.zero_grad(set_to_none=True)
            self.waited = 0.0  # (waited inside step(): not in the next step's time)
        self.advance(q)

    def advance(self, q: int) -> None:
        """Every rank's steps at position ``q`` are counted."""
        for j, stepped in enumerate(self.steps_at(q)):
            self.taken[j] += int(stepped)

    def work_through(self, q: int) -> int:
        """Inner steps all ranks together will have taken once position ``q`` (the next, not
        yet counted) is done."""
        return sum(self.taken) + sum(self.steps_at(q))

    def schedule_starts(self) -> None:
        """The warm start ended: every fragment's first pseudo-gradient counts the steps from
        here."""
        self._at_launch = [list(self.taken) for _ in self._at_launch]

    # -- a launch and its apply ---------------------------------------------------------------

    def weight(self, fragment: int) -> float:
        """This rank's factor for the fragment launched now: N·n_j / Σ n over the steps since
        the fragment's previous launch (exactly 1.0 when every rank took as many)."""
        since = [a - b for a, b in zip(self.taken, self._at_launch[fragment])]
        self._at_launch[fragment] = list(self.taken)
        total = sum(since)
        if total == 0:
            return 1.0
        return (self.world * since[self.rank]) / total

    def _send(self) -> tuple[Any, torch.Tensor]:
        # where the group's collectives take their tensors (NCCL: the GPU)
        times = torch.zeros(self.world, dtype=torch.float64, device=collective_device(self.comm))
        times[self.rank] = self.compute_s / self.timed if self.timed else 0.0
        self.compute_s, self.timed = 0.0, 0
        return self.comm.all_reduce_sum_async(times), times

    def measure(self, k: int) -> None:
        """Send this rank's seconds per inner step with sync point ``k``."""
        self._measuring[k] = self._send()

    def measure_now(self, q: int) -> None:
        """At the warm start's round boundary ``q``: exchange the step times (blocking) and
        plan the next round."""
        work, times = self._send()
        work.wait()
        self._plan_after(q, [float(t) for t in times.tolist()])

    def _times(self, k: int) -> list[float] | None:
        got = self._measuring.pop(k, None)
        if got is None or isinstance(got, list):
            return got
        work, times = got
        work.wait()
        return [float(t) for t in times.tolist()]

    def applied(self, k: int, q: int) -> None:
        """Sync point ``k`` was applied at position ``q``: with its measurement, plan the next
        round."""
        times = self._times(k)
        if times is not None:
            self._plan_after(q, times)

    def _plan_after(self, q: int, times: list[float]) -> None:
        self.last_times = times
        rnd = self._position(q)[0] + (1 if q % self.sync_every == 0 else 0)
        self.plans = {r: p for r, p in self.plans.items() if r >= rnd - 2}
        plan = plan_steps(times, self.sync_every)
        if self.budget is not None:
            plan = trim_plan(plan, self.budget - sum(self.taken))
        self.plans[rnd] = plan

    # -- records and state --------------------------------------------------------------------

    def report(self, q: int) -> dict[str, Any]:
        """Every rank's steps in the current round and in total, and its last measured time."""
        rnd = self._position(max(1, q))[0]
        return {
            "steps_per_round": self.plan(rnd),
            "inner_steps": list(self.taken),
            "step_s": list(self.last_times),
        }

    def state_dict(self) -> dict[str, Any]:
        measuring = {k: self._times(k) for k in sorted(self._measuring)}
        self._measuring = dict(measuring)  # type: ignore[arg-type]
        return {
            "plans": [[r, list(p)] for r, p in sorted(self.plans.items())],
            "taken": list(self.taken),
            "at_launch": [list(a) for a in self._at_launch],
            "compute_s": self.compute_s,
            "timed": self.timed,
            "measuring": [[k, t] for k, t in measuring.items()],
            "last_times": list(self.last_times),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        taken = [int(n) for n in state["taken"]]
        if len(taken) != self.world or len(state["at_launch"]) != len(self._at_launch):
            raise ValueError(
                f"the dynamic local steps' state is for {len(taken)} ranks and "
                f"{len(state['at_launch'])} fragments, not {self.world} and "
                f"{len(self._at_launch)}; resume with the same world size and fragments"
            )
        self.plans = {int(r): [int(n) for n in p] for r, p in state["plans"]}
        self.taken = taken
        self._at_launch = [[int(n) for n in a] for a in state["at_launch"]]
        self.compute_s, self.timed = float(state["compute_s"]), int(state["timed"])
        self._measuring = {int(k): [float(x) for x in t] for k, t in state["measuring"]}
        self.last_times = [float(t) for t in state["last_times"]]
        self._t_end = None
