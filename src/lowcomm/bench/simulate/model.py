"""``lowcomm simulate``'s projection: the shared α-β cost model taken to N workers.

The cost model itself (collectives, :class:`Workload`, :class:`Network`, each algorithm's overlap
rule :func:`step_time`) lives in :mod:`lowcomm.tune.cost`, shared with ``lowcomm plan``; its
docstring has the formulas. Here: the projection to N = 8 … 1024 workers (:func:`project`) and
the scenarios with their published figures. Nothing here reads files or prints.

Throughput is N × tokens per worker step / step time. *Scaling efficiency* at N is
throughput(N) / (N / N₀ · throughput(N₀)) against the smallest N₀ projected. The CO2 paper's
*scalability ratio* is the same quantity against its first multi-node point, 16 GPUs (two nodes):
throughput(128) / (8 · throughput(16)); see :func:`~lowcomm.bench.simulate.co2_paper_scenario`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from lowcomm.tune.cost import (
    ALGORITHMS,
    Algorithm,
    CostModel,
    Network,
    StepTime,
    Workload,
    allgather_time,
    emulated_allreduce_time,
    exchange_time,
    hierarchical_allreduce_time,
    ring_allreduce_time,
    solve_compute_time,
    step_time,
)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_WORKERS",
    "Algorithm",
    "CostModel",
    "Network",
    "PaperFigure",
    "Projection",
    "Scenario",
    "StepTime",
    "Workload",
    "allgather_time",
    "emulated_allreduce_time",
    "exchange_time",
    "hierarchical_allreduce_time",
    "project",
    "ring_allreduce_time",
    "solve_compute_time",
    "step_time",
]

DEFAULT_WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)


# --- projection -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Projection:
    """One algorithm at one worker count (a row of the projection table)."""

    algo: str
    """Label, e.g. ``co2 H=48``."""
    name: str
    sync_every: int
    workers: int
    nodes: int
    step_time_s: float
    compute_s: float
    comm_per_step_s: float
    exposed_per_step_s: float
    hidden_fraction: float | None
    tokens_per_s: float
    tokens_per_s_per_worker: float
    scaling_efficiency: float
    """throughput(N) / (N / N₀ · throughput(N₀)), N₀ the smallest N projected."""
    scalability_ratio: float | None
    """The same against ``scalability_base`` workers (the CO2 paper's 16); None without it."""


def _check_workers(workers: Iterable[int]) -> tuple[int, ...]:
    out = tuple(workers)
    if not out:
        raise ValueError("workers must list at least one worker count, e.g. 8,16,32")
    for n in out:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"workers must be integers >= 1, got {n!r}")
    return tuple(sorted(set(out)))


def project(
    workload: Workload,
    network: Network,
    algorithms: Sequence[Algorithm],
    workers: Iterable[int] = DEFAULT_WORKERS,
    *,
    scalability_base: int | None = None,
) -> list[Projection]:
    """Throughput, step time, exposed communication and scaling of each algorithm at each N."""
    ns = _check_workers(workers)
    if not algorithms:
        raise ValueError("algorithms must name at least one algorithm, e.g. ddp,co2")
    rows: list[Projection] = []
    for algo in algorithms:
        times = {n: step_time(algo, workload, network, n) for n in ns}
        thr = {n: n * workload.tokens_per_step / times[n].step_s for n in ns}
        n0 = ns[0]
        for n in ns:
            st = times[n]
            ratio = None
            if scalability_base is not None and scalability_base in thr:
                ratio = thr[n] / (n / scalability_base * thr[scalability_base])
            rows.append(
                Projection(
                    algo=algo.label,
                    name=algo.name,
                    sync_every=algo.period,
                    workers=n,
                    nodes=network.nodes(n),
                    step_time_s=st.step_s,
                    compute_s=st.compute_s,
                    comm_per_step_s=st.comm_s,
                    exposed_per_step_s=st.exposed_s,
                    hidden_fraction=st.hidden_fraction,
                    tokens_per_s=thr[n],
                    tokens_per_s_per_worker=thr[n] / n,
                    scaling_efficiency=thr[n] / (n / n0 * thr[n0]),
                    scalability_ratio=ratio,
                )
            )
    return rows


# --- scenarios --------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class PaperFigure:
    """A figure a paper reports (or that follows from its figures), for the comparison table."""

    algo: str
    """Label of the matching :class:`Algorithm`."""
    workers: int
    metric: Literal["tokens_per_s", "scalability_ratio"]
    value: float
    note: str = ""
    reported: bool = True
    """False for a figure derived from reported ones (plotted differently)."""


@dataclass(kw_only=True, frozen=True)
class Scenario:
    """Everything a projection needs, with the assumptions stated."""

    name: str
    workload: Workload
    network: Network
    algorithms: tuple[Algorithm, ...]
    workers: tuple[int, ...] = DEFAULT_WORKERS
    scalability_base: int | None = None
    """Worker count the scalability ratio is taken against (None: not reported)."""
    unit: str = "tokens"
    """What ``tokens_per_step`` counts (the CO2 paper reports words, i.e. tokens)."""
    notes: tuple[str, ...] = ()
    """Assumptions and sources, printed with every report."""
    paper: tuple[PaperFigure, ...] = ()
    sources: tuple[str, ...] = ()
