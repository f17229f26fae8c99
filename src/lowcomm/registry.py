"""The one registry of algorithm names: every ``--algo`` value of ``lowcomm train``, what runs it
and how it communicates. The CLI, the job's configuration, ``lowcomm bench``, ``lowcomm
simulate``, the tests and the benchmarks read it; no other module lists algorithms.

An entry is an outer algorithm of :mod:`lowcomm.outer` under its class's own ``name`` (``co2``),
a variant of one with keywords fixed (``co2-eager``: CO2 with ``eager=True``), one of the two
baselines that are no outer algorithm: ``ddp`` (synchronous DistributedDataParallel, every step)
and ``none`` (no synchronisation at all: the throughput ceiling), or ``demo``, the per-step
optimizer :class:`lowcomm.optim.DeMo` that replaces DDP's gradient all-reduce.

Example::

    from lowcomm.registry import REGISTRY
    entry = REGISTRY["co2-eager"]
    entry.cls, dict(entry.fixed)          # (CO2, {'eager': True})
    [e.name for e in REGISTRY.values() if e.schedule is BLOCKING]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lowcomm.hparams import Hyperparameters
from lowcomm.optim.demo import DeMoConfig
from lowcomm.outer import (
    CO2,
    CoCoDC,
    DiLoCo,
    LocalSGD,
    NoLoCo,
    SlowMo,
    SparseLoCo,
    StreamingDiLoCo,
)
from lowcomm.schedules import (
    BLOCKING,
    EVERY_STEP,
    EVERY_STEP_GATHER,
    NEVER,
    SCHEDULES,
    Schedule,
)

if TYPE_CHECKING:
    from lowcomm.outer.engine import OuterAlgorithm

__all__ = [
    "ALGORITHMS",
    "BASELINES",
    "ELASTIC",
    "REGISTRY",
    "SCHEDULES",
    "AlgorithmEntry",
    "algorithm_help",
    "algorithm_titles",
    "names",
    "outer_names",
]


@dataclass(frozen=True)
class AlgorithmEntry:
    """One ``--algo`` value."""

    name: str
    """The name users type (``--algo NAME``; its class is ``ALGORITHMS[cls.name]``)."""
    summary: str
    """One line for help texts and tables."""
    cls: type[OuterAlgorithm] | None = None
    """The class that runs it; ``None`` for the baselines ``ddp`` and ``none``."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Keywords this name fixes on ``cls`` (``co2-eager``: ``{"eager": True}``)."""
    schedule: Schedule = BLOCKING
    """How it communicates (:mod:`lowcomm.schedules`)."""
    compressible: bool = False
    """Whether ``--compression`` applies to it."""
    elastic: bool = False
    """Whether ``lowcomm train --fault-tolerance`` runs it: its class runs under torchft
    (``cls.elastic``) and the entry does not say otherwise."""
    options: type[Hyperparameters] | None = None
    """The hyperparameters of an entry that is no outer algorithm (``demo``)."""

    def __post_init__(self) -> None:
        assert self.schedule in SCHEDULES, self.schedule
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))

    @property
    def is_outer(self) -> bool:
        """Whether a lowcomm outer algorithm runs it (not a baseline, not DeMo)."""
        return self.cls is not None

    @property
    def config(self) -> type[Hyperparameters] | None:
        """Its hyperparameters' dataclass: the outer algorithm's ``Config``, or ``options``."""
        return self.cls.Config if self.cls is not None else self.options


def _outer(
    cls: type[OuterAlgorithm],
    summary: str,
    suffix: str = "",
    *,
    elastic: bool = True,
    **fixed: Any,
) -> AlgorithmEntry:
    return AlgorithmEntry(
        name=f"{cls.name}-{suffix}" if suffix else cls.name,
        summary=summary,
        cls=cls,
        fixed=fixed,
        schedule=cls.schedule,
        compressible=any(f.name == "compression" for f in dataclasses.fields(cls.Config)),
        elastic=cls.elastic and elastic,
    )


_ENTRIES = (
    _outer(CO2, "CO2: one-round-stale outer updates, fully overlapped"),
    _outer(
        CO2,
        "CO2 with eager updates (own fresh delta, others' stale)",
        "eager",
        elastic=False,  # (the job runs CO2 elastic without them)
        eager=True,
    ),
    _outer(DiLoCo, "DiLoCo: Nesterov outer SGD on averaged pseudo-gradients"),
    _outer(StreamingDiLoCo, "Streaming DiLoCo: fragments synced in turn, overlapped"),
    _outer(CoCoDC, "CoCoDC: Streaming DiLoCo with delay compensation"),
    _outer(LocalSGD, "LocalSGD: parameter averaging"),
    _outer(SlowMo, "SlowMo: heavy-ball outer SGD with 1/lr scaling"),
    _outer(NoLoCo, "NoLoCo: outer steps towards a random group's mean, no all-reduce"),
    _outer(SparseLoCo, "SparseLoCo: sparse 2-bit syncs, error feedback as the outer momentum"),
    AlgorithmEntry(
        name="ddp",
        summary="DistributedDataParallel: gradient all-reduce every step (baseline)",
        schedule=EVERY_STEP,
        compressible=True,
    ),
    AlgorithmEntry(
        name="demo",
        summary="DeMo: per-step sign descent on the all-gathered top-k DCT of local momenta",
        schedule=EVERY_STEP_GATHER,
        options=DeMoConfig,
    ),
    AlgorithmEntry(
        name="none", summary="no synchronisation: the throughput ceiling", schedule=NEVER
    ),
)

REGISTRY: Mapping[str, AlgorithmEntry] = MappingProxyType({e.name: e for e in _ENTRIES})
"""Every ``--algo`` value, in the order help texts list them."""

ALGORITHMS: Mapping[str, type[OuterAlgorithm]] = MappingProxyType(
    dict(sorted({e.cls.name: e.cls for e in _ENTRIES if e.cls is not None}.items()))
)
"""The library's algorithm classes by their names (``lowcomm.ALGORITHMS``), from the entries."""

ELASTIC = tuple(e.name for e in _ENTRIES if e.elastic)
"""The entries ``lowcomm train --fault-tolerance`` runs."""

BASELINES = tuple(e.name for e in _ENTRIES if not e.is_outer)
"""The entries that are no outer algorithm (``ddp``, ``demo``, ``none``): no rounds, no
anchor."""


def names() -> tuple[str, ...]:
    """Every registered name, in registry order."""
    return tuple(REGISTRY)


def outer_names() -> tuple[str, ...]:
    """The names an outer algorithm runs (every name but the baselines)."""
    return tuple(n for n, e in REGISTRY.items() if e.is_outer)


def algorithm_titles() -> str:
    """The algorithms lowcomm implements, by their papers' names, for help texts: the part of
    each summary before its colon (variants and the baselines ``ddp`` and ``none`` left out)."""
    titles = [
        e.summary.split(":")[0]
        for e in REGISTRY.values()
        if not e.fixed and ":" in e.summary and e.name not in ("ddp", "none")
    ]
    return ", ".join(titles)


def algorithm_help() -> str:
    """Every ``--algo`` value with its one-line summary, for ``--algo``'s help."""
    return "; ".join(f"{e.name} - {e.summary}" for e in REGISTRY.values())
