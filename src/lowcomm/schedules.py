"""How an algorithm communicates: its schedule, one object per kind, which the cost model, the
link tuner, the planner and the simulator ask instead of comparing names.

=====================  ===================================================================
schedule               what goes over the link
=====================  ===================================================================
``BLOCKING``           a blocking all-reduce every H steps (LocalSGD, DiLoCo, SlowMo)
``ONE_ROUND_STALE``    the sync of round t applied at the end of round t + 1 (CO2), or τ
                       steps after its launch; optionally P staggered fragments
``SPARSE_GATHER``      every H steps an all-gather of every worker's sparse, 2-bit
                       pseudo-gradient, blocking (τ = 0) or applied τ ≤ H steps after its
                       launch (SparseLoCo)
``FRAGMENTS``          P fragments synced in turn, each τ < H steps in flight (Streaming
                       DiLoCo, CoCoDC)
``GOSSIP``             every H steps an exchange within small random groups (NoLoCo)
``EVERY_STEP``         a blocking all-reduce of the gradients every step (DDP)
``EVERY_STEP_GATHER``  an all-gather of every rank's few compressed momentum coefficients
                       every step (DeMo)
``NEVER``              nothing (the no-sync ceiling)
=====================  ===================================================================

A schedule knows which settings of the cost model's algorithm apply to it (:attr:`Schedule.
keywords`), checks them, names them (:meth:`Schedule.label`), and prices one inner step
(:meth:`Schedule.step_time`: the overlap rules of :mod:`lowcomm.tune.cost`'s docstring). An
outer algorithm's class names its schedule (``OuterAlgorithm.schedule``); the registry's
entries carry it. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

__all__ = [
    "BLOCKING",
    "EVERY_STEP",
    "EVERY_STEP_GATHER",
    "FRAGMENTS",
    "GOSSIP",
    "NEVER",
    "ONE_ROUND_STALE",
    "SCHEDULES",
    "SPARSE_GATHER",
    "Cadence",
    "LinkModel",
    "Schedule",
    "StepTime",
    "Work",
    "sparse_bytes_per_element",
]

_SCORE_BYTES = 8  # CoCoDC all-reduces one float64 priority score per fragment


class LinkModel(Protocol):
    """What a schedule asks of a network: the time of its collectives over ``n`` workers
    (:class:`lowcomm.tune.cost.Network`; ``lowcomm plan`` passes the data-parallel group of a
    layout)."""

    def allreduce_time(self, payload_bytes: float, n: int) -> float: ...

    def allgather_time(self, payload_bytes: float, n: int) -> float: ...

    def exchange_time(self, payload_bytes: float, group: int) -> float: ...


class Work(Protocol):
    """What a schedule asks of a workload (:class:`lowcomm.tune.cost.Workload`)."""

    @property
    def step_time_s(self) -> float: ...

    @property
    def outer_time_s(self) -> float: ...

    @property
    def backward_fraction(self) -> float: ...

    @property
    def parameters(self) -> float: ...

    @property
    def payload(self) -> float: ...


class Cadence(Protocol):
    """What a schedule asks of an algorithm's settings (:class:`lowcomm.tune.cost.Algorithm`)."""

    @property
    def name(self) -> str: ...

    @property
    def sync_every(self) -> int: ...

    @property
    def num_fragments(self) -> int: ...

    @property
    def overlap(self) -> int: ...

    @property
    def group_size(self) -> int: ...

    @property
    def topk(self) -> int: ...

    @property
    def chunk(self) -> int: ...

    @property
    def density(self) -> float: ...

    @property
    def bits(self) -> int: ...

    @property
    def scores_fragments(self) -> bool: ...

    def largest_group(self, n: int) -> int: ...


@dataclass(frozen=True)
class StepTime:
    """Per-worker time of one inner step, averaged over a round."""

    step_s: float
    """Wall time per inner step."""
    compute_s: float
    """t_c."""
    comm_s: float
    """All-reduce time per inner step (all of a round's collectives, divided by H)."""
    exposed_s: float
    """Communication not hidden behind compute, per inner step."""
    outer_s: float
    """Outer-update compute per inner step."""
    queued_s: float = 0.0
    """Time collectives wait for the link behind earlier ones, per inner step (link-bound)."""

    @property
    def hidden_fraction(self) -> float | None:
        """1 − blocked / in flight, as lowcomm's counters define it (in flight from launch to
        completion, queueing included); None without communication."""
        in_flight = self.comm_s + self.queued_s
        if in_flight <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.exposed_s / in_flight))


class Schedule:
    """One way of communicating (see the module docstring); its instances are the constants
    of this module."""

    name: ClassVar[str]
    keywords: ClassVar[tuple[str, ...]] = ("sync_every",)
    """The cost model's algorithm settings that apply (``sync_every``, ``num_fragments``,
    ``overlap``, ``group_size``, ``topk``, ``chunk``)."""
    syncs: ClassVar[bool] = True
    """Whether anything goes over the link."""
    rounds_all_reduce: ClassVar[bool] = False
    """Whether each round's sync is an all-reduce of the whole model's pseudo-gradients (or P
    fragments of it): what the link tuner chooses settings for, the planner prices and the
    job's preflight estimates."""
    needs_fixed_group: ClassVar[bool] = False
    """Whether its syncs need a fixed group of ranks (not torchft's changing quorum)."""

    def __repr__(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name

    def period(self, sync_every: int) -> int | None:
        """Inner steps per synchronisation (``None``: never)."""
        return sync_every

    def check(self, a: Cadence) -> None:
        """Refuse settings this schedule cannot run (``ValueError``)."""

    def label(self, a: Cadence) -> str:
        """A short name for tables and plots (``co2 H=48``)."""
        return f"{a.name} H={a.sync_every}"

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        """Time per inner step of ``a`` on ``n`` workers (n > 1; one worker sends nothing)."""
        raise NotImplementedError


def _fragments_step(a: Cadence, work: Work, network: LinkModel, n: int, overlap: int) -> StepTime:
    """The ``fragments`` rule, each fragment ``overlap`` steps in flight."""
    t, h, outer = work.step_time_s, a.sync_every, work.outer_time_s
    p = a.num_fragments
    frag = network.allreduce_time(work.payload / p, n)
    score = network.allreduce_time(_SCORE_BYTES * p, n) if a.scores_fragments else 0.0
    per_point = max(0.0, frag - overlap * t) + score
    compute_bound = h * t + p * per_point + outer
    link_bound = p * (frag + score)
    round_s = max(compute_bound, link_bound)
    exposed = round_s - h * t - outer
    queued = max(0.0, link_bound - compute_bound)
    return StepTime(round_s / h, t, p * (frag + score) / h, exposed / h, outer / h, queued / h)


def _in_flight_step(work: Work, h: int, comm: float, tau: int) -> StepTime:
    """One sync per round of ``comm`` seconds launched τ steps before the round ends and
    applied at its end (τ = H: at the end of the next round)."""
    t, outer = work.step_time_s, work.outer_time_s
    if tau < h:
        # one fragment of the fragments rule (lowcomm train's CO2)
        exposed = max(0.0, comm - tau * t)
        round_s = max(h * t + exposed + outer, comm)
        queued = max(0.0, comm - (h * t + exposed + outer))
        return StepTime(
            round_s / h, t, comm / h, (round_s - h * t - outer) / h, outer / h, queued / h
        )
    window = h * t + outer
    exposed = max(0.0, comm - window)
    # link-bound: each sync also queues behind the previous one for the excess
    return StepTime((window + exposed) / h, t, comm / h, exposed / h, outer / h, exposed / h)


def sparse_bytes_per_element(density: float, chunk: int, bits: int) -> float:
    """Wire bytes per element of SparseLoCo's codec (:mod:`lowcomm.compress.sparse`) over
    whole s × s tiles (s = ``chunk``): k = round(density·s²) kept of s², each a ⌈log₂ s²⌉-bit
    index and a ``bits``-bit value (each tensor's 4·(1 + 2^bits) bytes of codebook left out)."""
    area = chunk * chunk
    k = min(area, max(1, round(density * area)))
    return k * (max(1, math.ceil(math.log2(area))) + bits) / 8 / area


def _staggered(a: Cadence) -> None:
    if a.sync_every % a.num_fragments:
        raise ValueError(
            f"sync_every ({a.sync_every}) must be a multiple of num_fragments "
            f"({a.num_fragments}) for {a.name}"
        )


def _overlap_below_h(a: Cadence) -> None:
    if a.overlap >= a.sync_every:
        raise ValueError(
            f"overlap ({a.overlap}) must be < sync_every ({a.sync_every}) for {a.name}"
        )


class _Never(Schedule):
    name = "never"
    keywords = ()
    syncs = False

    def period(self, sync_every: int) -> int | None:
        return None

    def label(self, a: Cadence) -> str:
        return a.name

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        t = work.step_time_s
        return StepTime(t, t, 0.0, 0.0, 0.0)


class _EveryStep(Schedule):
    name = "every-step"
    keywords = ()

    def period(self, sync_every: int) -> int | None:
        return 1

    def label(self, a: Cadence) -> str:
        return a.name

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        t = work.step_time_s
        comm = network.allreduce_time(work.payload, n)
        exposed = max(0.0, comm - work.backward_fraction * t)
        return StepTime(t + exposed, t, comm, exposed, 0.0)


class _EveryStepGather(Schedule):
    name = "every-step-gather"
    keywords = ("overlap", "topk", "chunk")

    def period(self, sync_every: int) -> int | None:
        return 1

    def label(self, a: Cadence) -> str:
        return f"{a.name} k={a.topk} s={a.chunk}" + (" overlap" if a.overlap else "")

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        t = work.step_time_s
        sent = work.parameters * min(1.0, a.topk / a.chunk**2) * 8.0
        comm = network.allgather_time(sent, n)
        exposed = max(0.0, comm - t) if a.overlap else comm
        return StepTime(t + exposed, t, comm, exposed, 0.0)


class _Blocking(Schedule):
    name = "blocking"
    rounds_all_reduce = True

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        t, h, outer = work.step_time_s, a.sync_every, work.outer_time_s
        comm = network.allreduce_time(work.payload, n)
        return StepTime(t + (comm + outer) / h, t, comm / h, comm / h, outer / h)


class _OneRoundStale(Schedule):
    name = "one-round-stale"
    keywords: ClassVar[tuple[str, ...]] = ("sync_every", "num_fragments", "overlap")
    rounds_all_reduce = True

    def check(self, a: Cadence) -> None:
        _staggered(a)

    def label(self, a: Cadence) -> str:
        text = super().label(a)
        if a.num_fragments > 1:
            text += f" P={a.num_fragments}"
        if 0 < a.overlap < a.sync_every:
            text += f" overlap={a.overlap}"
        return text

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        h = a.sync_every
        if a.num_fragments > 1:
            # staggered fragments: the fragments rule, τ = H where overlap is 0
            return _fragments_step(a, work, network, n, a.overlap or h)
        comm = network.allreduce_time(work.payload, n)
        return _in_flight_step(work, h, comm, a.overlap or h)


class _SparseGather(Schedule):
    """Every H steps an all-gather of every worker's sparse payload
    (:func:`sparse_bytes_per_element` of the parameters), blocking at τ = ``overlap`` = 0,
    else launched τ ≤ H steps before it is applied."""

    name = "sparse-gather"
    keywords = ("sync_every", "overlap", "density", "chunk", "bits")

    def check(self, a: Cadence) -> None:
        if a.overlap > a.sync_every:
            raise ValueError(
                f"overlap ({a.overlap}) must be <= sync_every ({a.sync_every}) for {a.name}"
            )

    def label(self, a: Cadence) -> str:
        text = f"{super().label(a)} d={a.density:.3g}"
        return text + (f" overlap={a.overlap}" if a.overlap else "")

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        t, h, outer = work.step_time_s, a.sync_every, work.outer_time_s
        sent = work.parameters * sparse_bytes_per_element(a.density, a.chunk, a.bits)
        comm = network.allgather_time(sent, n)
        if a.overlap == 0:
            return StepTime(t + (comm + outer) / h, t, comm / h, comm / h, outer / h)
        return _in_flight_step(work, h, comm, a.overlap)


class _Fragments(Schedule):
    name = "fragments"
    keywords: ClassVar[tuple[str, ...]] = ("sync_every", "num_fragments", "overlap")
    rounds_all_reduce = True

    def check(self, a: Cadence) -> None:
        _overlap_below_h(a)
        _staggered(a)

    def label(self, a: Cadence) -> str:
        return f"{super().label(a)} P={a.num_fragments} overlap={a.overlap}"

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        return _fragments_step(a, work, network, n, a.overlap)


class _Gossip(Schedule):
    name = "gossip"
    keywords = ("sync_every", "group_size", "overlap")
    needs_fixed_group = True

    def check(self, a: Cadence) -> None:
        _overlap_below_h(a)

    def label(self, a: Cadence) -> str:
        text = f"{super().label(a)} n={a.group_size}"
        return text + (f" overlap={a.overlap}" if a.overlap else "")

    def step_time(self, a: Cadence, work: Work, network: LinkModel, n: int) -> StepTime:
        t, h, outer = work.step_time_s, a.sync_every, work.outer_time_s
        ex = network.exchange_time(work.payload, a.largest_group(n))
        per_sync = max(0.0, ex - a.overlap * t)
        round_s = max(h * t + per_sync + outer, ex)
        queued = max(0.0, ex - (h * t + per_sync + outer))
        return StepTime(
            round_s / h, t, ex / h, (round_s - h * t - outer) / h, outer / h, queued / h
        )


BLOCKING: Schedule = _Blocking()
ONE_ROUND_STALE: Schedule = _OneRoundStale()
SPARSE_GATHER: Schedule = _SparseGather()
FRAGMENTS: Schedule = _Fragments()
GOSSIP: Schedule = _Gossip()
EVERY_STEP: Schedule = _EveryStep()
EVERY_STEP_GATHER: Schedule = _EveryStepGather()
NEVER: Schedule = _Never()

SCHEDULES: tuple[Schedule, ...] = (
    BLOCKING,
    ONE_ROUND_STALE,
    SPARSE_GATHER,
    FRAGMENTS,
    GOSSIP,
    EVERY_STEP,
    EVERY_STEP_GATHER,
    NEVER,
)
"""Every schedule (see the module docstring)."""
