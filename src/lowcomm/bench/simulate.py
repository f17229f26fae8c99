"""``lowcomm simulate``: project throughput and scaling of data-parallel training to many workers.

A closed-form model of one training round, per algorithm, evaluated for N = 8 … 1024 workers. It
answers "how fast would this run on N workers over this link?" without running anything, and is
checked against two kinds of measurement: the CO2 paper's reported throughput (``--preset
co2-paper``) and ``lowcomm bench`` cells on this machine (``--calibrate results.json``).

**Communication (α-β, Hockney).** A ring all-reduce of ``S`` bytes over ``n`` workers sends
``2 (n - 1)`` messages of ``S / n`` bytes in sequence, so on a link of bandwidth β (bits/s) and
per-message latency α (s) it takes

    T_ring(S, n) = 2 (n - 1) α + 2 (n - 1) / n · 8 S / β          (0 when n = 1)

(:func:`ring_allreduce_time`). Nodes of ``G`` GPUs with a fast link inside and one slow NIC per
node are modelled hierarchically (:func:`hierarchical_allreduce_time`): reduce-scatter inside the
node, then ``G`` concurrent inter-node rings, one per ``S / G`` shard, that share the node's NIC
(so the NIC carries the whole ``2 (m - 1) / m · S`` of an ``m``-node ring), then all-gather inside
the node. lowcomm's own link emulation (:mod:`lowcomm.link`) charges a collective
``α + 2 (n - 1) / n · 8 S / β`` (latency once, first in first out), which
:func:`emulated_allreduce_time` reproduces for calibration against ``lowcomm bench``.

**Compute.** ``t_c`` is the time of one inner step (forward, backward, inner optimizer) on one
worker, measured or given; it does not change with N (weak scaling: every worker keeps its batch).
The payload is the parameter count × bytes per element (4 for fp32, lowcomm's buckets; 2 for
bf16), or a measured payload.

**Overlap rules** (per worker; H = ``sync_every``; T = all-reduce time of the whole payload;
``t_o`` = one outer update):

* ``none``: no communication, step = t_c (the ceiling).
* ``ddp`` (synchronous AdamW/SGD): all-reduce of the gradients every step. DDP launches bucket
  all-reduces during backward, so at most the backward share ``b`` of ``t_c`` can hide them:
  step = t_c + max(0, T − b·t_c). ``b = 2/3`` by default (backward ≈ twice forward); ``b = 0``
  is no overlap, which is what lowcomm's emulated DDP shows when the model fits in one or two
  buckets (the link delay then starts after backward has finished).
* ``localsgd``, ``slowmo``, ``diloco``: blocking all-reduce every H steps:
  round = H·t_c + T + t_o.
* ``co2``, ``co2-eager``: the all-reduce launched at the end of round r is waited for at the end
  of round r + 1, so it overlaps H steps and the outer update: round = max(H·t_c + t_o, T).
  Communication is exposed only when T > H·t_c + t_o, and then exactly by the excess (the link is
  the bottleneck; first in, first out).
* ``streaming`` (Streaming DiLoCo) and ``cocodc``: P fragments of S / P bytes, one synced every
  H / P steps; each all-reduce (time T_f) is launched ``overlap`` (τ) steps before its sync point,
  so each sync point exposes max(0, T_f − τ·t_c). The link carries one fragment at a time, so a
  round is never shorter than P·T_f: round = max(H·t_c + P·max(0, T_f − τ·t_c) + t_o, P·T_f).
  CoCoDC's adaptive fragment choice adds a blocking all-reduce of P float64 scores at each sync
  point (a latency-bound collective).

Throughput is N × tokens per worker step / step time. *Scaling efficiency* at N is
throughput(N) / (N / N₀ · throughput(N₀)) against the smallest N₀ projected. The CO2 paper's
*scalability ratio* is the same quantity against its first multi-node point, 16 GPUs (two nodes):
throughput(128) / (8 · throughput(16)); see :func:`co2_paper_scenario`.

What the model leaves out: stragglers and jitter, congestion beyond one NIC per node, compute
slowed by communication kernels, data loading, and any overhead that grows with N other than the
all-reduce. It is a projection, and every report says so.

Paper: Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation
Overlap", ICLR 2024, https://arxiv.org/abs/2401.16265.

Example::

    net = Network(bandwidth_bps=80e9, latency_s=50e-6, gpus_per_node=8, intra_bandwidth_bps=2.4e12)
    work = Workload(parameters=7_000_000_000, tokens_per_step=4096, step_time_s=1.78,
                    bytes_per_param=2)
    rows = project(work, net, [Algorithm(name="ddp"), Algorithm(name="co2", sync_every=48)])
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "ALGORITHMS",
    "DEFAULT_WORKERS",
    "PRESETS",
    "Algorithm",
    "CalibrationRow",
    "Network",
    "PaperComparison",
    "PaperFigure",
    "Projection",
    "Scenario",
    "SimulateReport",
    "StepTime",
    "Workload",
    "add_subcommand",
    "calibrate",
    "co2_paper_scenario",
    "compare_with_paper",
    "emulated_allreduce_time",
    "format_markdown",
    "hierarchical_allreduce_time",
    "load_results",
    "preset",
    "project",
    "ring_allreduce_time",
    "run_simulate",
    "scenario_from_results",
    "solve_compute_time",
    "step_time",
]

logger = logging.getLogger(__name__)

ALGORITHMS = (
    "none",
    "ddp",
    "localsgd",
    "slowmo",
    "diloco",
    "co2",
    "co2-eager",
    "streaming",
    "cocodc",
)
"""Algorithms the model knows (the names of ``lowcomm train --algo``)."""

DEFAULT_WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)

_BLOCKING = ("localsgd", "slowmo", "diloco")
_OVERLAPPED = ("co2", "co2-eager")
_FRAGMENTED = ("streaming", "cocodc")
_SCORE_BYTES = 8  # CoCoDC all-reduces one float64 priority score per fragment

CostModel = Literal["ring", "emulated"]


# --- communication ----------------------------------------------------------------------------


def _check_collective(payload_bytes: float, n: int, bandwidth_bps: float, latency_s: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"workers must be an integer >= 1, got {n!r}")
    if not payload_bytes >= 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes!r}")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth must be > 0 bits/s, got {bandwidth_bps!r}")
    if not (latency_s >= 0 and math.isfinite(latency_s)):
        raise ValueError(f"latency must be a finite number >= 0 s, got {latency_s!r}")


def ring_allreduce_time(
    payload_bytes: float, n: int, bandwidth_bps: float, latency_s: float
) -> float:
    """Time of a ring all-reduce of ``payload_bytes`` over ``n`` workers (α-β model).

    ``2 (n - 1) α + 2 (n - 1) / n · 8 S / β``: a reduce-scatter and an all-gather of ``n - 1``
    steps each, every step one message of ``S / n`` bytes; 0 for ``n = 1``.

    Args:
        payload_bytes: S, bytes each worker contributes.
        n: workers in the ring.
        bandwidth_bps: β, link bandwidth in bits/s per worker, each direction.
        latency_s: α, latency per message in seconds.
    """
    _check_collective(payload_bytes, n, bandwidth_bps, latency_s)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * 8.0 * payload_bytes / bandwidth_bps


def emulated_allreduce_time(
    payload_bytes: float, n: int, bandwidth_bps: float, latency_s: float
) -> float:
    """What lowcomm's :class:`~lowcomm.link.EmulatedLink` charges: α + 2 (n - 1) / n · 8 S / β.

    The emulation books the ring's wire bytes on one FIFO link and adds the latency once
    (propagation overlaps the next transfer), so a set of buckets launched together costs the
    same as one bucket of their total size. 0 for ``n = 1``.
    """
    _check_collective(payload_bytes, n, bandwidth_bps, latency_s)
    if n == 1:
        return 0.0
    return latency_s + 2 * (n - 1) / n * 8.0 * payload_bytes / bandwidth_bps


def hierarchical_allreduce_time(
    payload_bytes: float,
    n: int,
    *,
    gpus_per_node: int,
    bandwidth_bps: float,
    latency_s: float,
    intra_bandwidth_bps: float | None,
    intra_latency_s: float = 0.0,
) -> float:
    """All-reduce over nodes of ``gpus_per_node`` GPUs: fast link inside, one slow NIC per node.

    Within one node (``n <= G``) this is a ring on the fast link. Across ``m = n / G`` nodes:
    reduce-scatter inside each node (``(G - 1) α_i + (G - 1) / G · 8 S / β_i``), then G concurrent
    inter-node rings on ``S / G`` bytes each, which share the node's NIC: together
    ``T_ring(S, m)`` on (β, α); then all-gather inside the node (as the reduce-scatter).
    ``intra_bandwidth_bps=None`` makes the fast link free.

    Args:
        payload_bytes: S, bytes per GPU.
        n: GPUs in all; a multiple of ``gpus_per_node`` when above it.
        gpus_per_node: G.
        bandwidth_bps: β, the inter-node bandwidth per node (its NIC), bits/s.
        latency_s: α, inter-node latency per message.
        intra_bandwidth_bps: β_i, bandwidth of the fast link per GPU, bits/s.
        intra_latency_s: α_i, latency per message on the fast link.
    """
    _check_collective(payload_bytes, n, bandwidth_bps, latency_s)
    g = gpus_per_node
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"gpus_per_node must be an integer >= 1, got {g!r}")
    intra_bw = math.inf if intra_bandwidth_bps is None else intra_bandwidth_bps
    if n <= g:
        return ring_allreduce_time(payload_bytes, n, intra_bw, intra_latency_s)
    if n % g:
        raise ValueError(
            f"workers ({n}) must be a multiple of gpus_per_node ({g}) above one node; "
            f"e.g. {g * math.ceil(n / g)}"
        )
    _check_collective(payload_bytes, g, intra_bw, intra_latency_s)
    inside = 2 * ((g - 1) * intra_latency_s + (g - 1) / g * 8.0 * payload_bytes / intra_bw)
    return inside + ring_allreduce_time(payload_bytes, n // g, bandwidth_bps, latency_s)


@dataclass(kw_only=True, frozen=True)
class Network:
    """The links between workers."""

    bandwidth_bps: float
    """β: bandwidth of the slow link in bits/s; per node (its NIC) when gpus_per_node > 1."""
    latency_s: float = 0.0
    """α: latency per message on the slow link, in seconds."""
    gpus_per_node: int = 1
    """G: workers per node; 1 puts every worker on the slow link (a flat ring)."""
    intra_bandwidth_bps: float | None = None
    """β_i: bandwidth of the fast link inside a node, per GPU, bits/s (None: free)."""
    intra_latency_s: float = 0.0
    """α_i: latency per message on the fast link."""
    cost: CostModel = "ring"
    """"ring": the α-β ring; "emulated": what lowcomm's link emulation charges (flat only)."""

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:
            raise ValueError(
                f"bandwidth must be > 0 bits/s, got {self.bandwidth_bps!r}; e.g. 80e9 (80 Gbit/s)"
            )
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency must be a finite number >= 0 s, got {self.latency_s!r}")
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {g!r}")
        if self.intra_bandwidth_bps is not None and not self.intra_bandwidth_bps > 0:
            raise ValueError(
                f"intra_bandwidth must be > 0 bits/s, got {self.intra_bandwidth_bps!r}"
            )
        if not (self.intra_latency_s >= 0 and math.isfinite(self.intra_latency_s)):
            raise ValueError(
                f"intra_latency must be a finite number >= 0 s, got {self.intra_latency_s!r}"
            )
        if self.cost not in ("ring", "emulated"):
            raise ValueError(f"cost must be 'ring' or 'emulated', got {self.cost!r}")
        if self.cost == "emulated" and g != 1:
            raise ValueError("the emulated link is flat: use gpus_per_node=1 with cost='emulated'")

    def allreduce_time(self, payload_bytes: float, n: int) -> float:
        """Seconds for one mean all-reduce of ``payload_bytes`` per worker over ``n`` workers."""
        if self.cost == "emulated":
            return emulated_allreduce_time(payload_bytes, n, self.bandwidth_bps, self.latency_s)
        if self.gpus_per_node == 1:
            return ring_allreduce_time(payload_bytes, n, self.bandwidth_bps, self.latency_s)
        return hierarchical_allreduce_time(
            payload_bytes,
            n,
            gpus_per_node=self.gpus_per_node,
            bandwidth_bps=self.bandwidth_bps,
            latency_s=self.latency_s,
            intra_bandwidth_bps=self.intra_bandwidth_bps,
            intra_latency_s=self.intra_latency_s,
        )

    def nodes(self, n: int) -> int:
        return max(1, math.ceil(n / self.gpus_per_node))


# --- workload and algorithms ------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class Workload:
    """What one worker computes and sends."""

    parameters: float
    """Model parameters (all are synchronised)."""
    tokens_per_step: float
    """Tokens (or samples) one worker processes per inner step."""
    step_time_s: float
    """t_c: compute time of one inner step on one worker (forward, backward, inner optimizer)."""
    bytes_per_param: float = 4.0
    """Bytes per synchronised element: 4 for fp32 (lowcomm's buckets), 2 for bf16/fp16."""
    payload_bytes: float | None = None
    """Bytes per worker per full synchronisation; None: parameters × bytes_per_param."""
    backward_fraction: float = 2.0 / 3.0
    """b: share of t_c during which DDP's gradient all-reduce can overlap backward (0: none)."""
    outer_time_s: float = 0.0
    """t_o: compute time of one outer update (all fragments together)."""

    def __post_init__(self) -> None:
        for key in ("parameters", "tokens_per_step", "bytes_per_param"):
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
        if not (self.step_time_s >= 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"step_time must be a finite number >= 0 s, got {self.step_time_s!r}")
        if self.payload_bytes is not None and not self.payload_bytes >= 0:
            raise ValueError(f"payload_bytes must be >= 0, got {self.payload_bytes!r}")
        if not 0.0 <= self.backward_fraction <= 1.0:
            raise ValueError(f"backward_fraction must be in [0, 1], got {self.backward_fraction!r}")
        if not (self.outer_time_s >= 0 and math.isfinite(self.outer_time_s)):
            raise ValueError(
                f"outer_time must be a finite number >= 0 s, got {self.outer_time_s!r}"
            )

    @property
    def payload(self) -> float:
        """Bytes per worker in one full synchronisation."""
        if self.payload_bytes is not None:
            return self.payload_bytes
        return self.parameters * self.bytes_per_param


@dataclass(kw_only=True, frozen=True)
class Algorithm:
    """One algorithm and its schedule."""

    name: str
    """One of :data:`ALGORITHMS`."""
    sync_every: int = 1
    """H: inner steps per round (the CO2 paper's τ); ignored by ddp and none."""
    num_fragments: int = 1
    """P: streaming/cocodc fragments; H must be a multiple of P."""
    overlap: int = 0
    """τ: streaming/cocodc inner steps a fragment's all-reduce runs before it is applied."""
    adaptive: bool = True
    """cocodc: fragments chosen by an all-reduced priority score (a blocking collective)."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.name!r}")
        for key, low in (("sync_every", 1), ("num_fragments", 1), ("overlap", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        if self.name in _FRAGMENTED:
            if self.sync_every % self.num_fragments:
                raise ValueError(
                    f"sync_every ({self.sync_every}) must be a multiple of num_fragments "
                    f"({self.num_fragments}) for {self.name}"
                )
            if self.overlap >= self.sync_every:
                raise ValueError(
                    f"overlap ({self.overlap}) must be < sync_every ({self.sync_every}) for "
                    f"{self.name}"
                )

    @property
    def label(self) -> str:
        """Short name for tables and plots, e.g. ``co2 H=48``."""
        if self.name in ("none", "ddp"):
            return self.name
        text = f"{self.name} H={self.sync_every}"
        if self.name in _FRAGMENTED:
            text += f" P={self.num_fragments} overlap={self.overlap}"
        return text


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


def step_time(algorithm: Algorithm, workload: Workload, network: Network, n: int) -> StepTime:
    """Time per inner step of ``algorithm`` on ``n`` workers; see the module docstring's rules."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"workers must be an integer >= 1, got {n!r}")
    t = workload.step_time_s
    name = algorithm.name
    if name == "none" or n == 1:
        return StepTime(t, t, 0.0, 0.0, 0.0)
    payload = workload.payload
    if name == "ddp":
        comm = network.allreduce_time(payload, n)
        exposed = max(0.0, comm - workload.backward_fraction * t)
        return StepTime(t + exposed, t, comm, exposed, 0.0)
    h = algorithm.sync_every
    outer = workload.outer_time_s
    if name in _BLOCKING:
        comm = network.allreduce_time(payload, n)
        return StepTime(t + (comm + outer) / h, t, comm / h, comm / h, outer / h)
    if name in _OVERLAPPED:
        comm = network.allreduce_time(payload, n)
        window = h * t + outer
        exposed = max(0.0, comm - window)
        # link-bound: each all-reduce also queues behind the previous one for the excess
        return StepTime((window + exposed) / h, t, comm / h, exposed / h, outer / h, exposed / h)
    assert name in _FRAGMENTED, name
    p = algorithm.num_fragments
    frag = network.allreduce_time(payload / p, n)
    score = 0.0
    if name == "cocodc" and algorithm.adaptive:
        score = network.allreduce_time(_SCORE_BYTES * p, n)
    per_point = max(0.0, frag - algorithm.overlap * t) + score
    compute_bound = h * t + p * per_point + outer
    link_bound = p * (frag + score)
    round_s = max(compute_bound, link_bound)
    exposed = round_s - h * t - outer
    queued = max(0.0, link_bound - compute_bound)
    return StepTime(round_s / h, t, p * (frag + score) / h, exposed / h, outer / h, queued / h)


def solve_compute_time(
    target_step_s: float, algorithm: Algorithm, workload: Workload, network: Network, n: int
) -> float:
    """The compute time t_c at which ``algorithm`` on ``n`` workers takes ``target_step_s``.

    Bisection on t_c; the step time is non-decreasing in t_c for ddp, the blocking algorithms and
    CO2, which is what it is used for (turning a measured throughput into a compute time).
    """

    def f(t: float) -> float:
        return step_time(algorithm, replace(workload, step_time_s=t), network, n).step_s

    if not (target_step_s > 0 and math.isfinite(target_step_s)):
        raise ValueError(f"target step time must be a finite number > 0, got {target_step_s!r}")
    lo, hi = 0.0, target_step_s
    if f(lo) > target_step_s:
        raise ValueError(
            f"no compute time gives {target_step_s:.6g} s per step for {algorithm.label} on {n} "
            f"workers: communication alone exposes {f(lo):.6g} s"
        )
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if f(mid) < target_step_s:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * target_step_s:
            break
    return 0.5 * (lo + hi)


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
                    sync_every=1 if algo.name == "ddp" else algo.sync_every,
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


# --- scenarios and the CO2 paper preset -------------------------------------------------------


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


CO2_PAPER_URL = "https://arxiv.org/abs/2401.16265"
_A100_NVLINK_BPS = 300e9 * 8  # NVLink 3 through NVSwitch: 300 GB/s per GPU each way
_A100_NVLINK_LATENCY_S = 5e-6
_TCP_80G = (80e9, 50e-6)  # lowcomm.link.PROFILES["tcp-80g"]


def co2_paper_scenario(
    *,
    parameters: float = 7.0e9,
    tokens_per_step: float = 4096,
    bytes_per_param: float = 2.0,
    backward_fraction: float = 2.0 / 3.0,
    network: Network | None = None,
    sync_every: Sequence[int] = (12, 48),
) -> Scenario:
    """The CO2 paper's scalability setting, calibrated on its one single-node figure.

    Setting (Sun et al. 2024, Section 4.3): TransNormer-LLM 7B, A100 nodes of 8 GPUs (NVSwitch
    inside), 80 Gbit/s TCP/IP between nodes, AdamW (synchronous data parallel) against CO2 with
    τ = 12 and 48, 8 to 128 GPUs. Reported throughput is in words/s for the whole cluster.

    Calibration point (the only one): AdamW on 8 GPUs (one node, no slow link) runs at
    18,444 words/s; the compute time per step t_c is solved so that our DDP model gives exactly
    that. Every other figure is a projection.

    Assumptions the paper does not pin down: tokens per GPU per inner step (``tokens_per_step``;
    it sets t_c, and so the ratio of communication to compute), the parameter count (7e9, the
    nominal size), bf16 payloads for both the gradient and the CO2 all-reduce, one 80 Gbit/s NIC
    per node, NVLink at 300 GB/s per GPU, and DDP hiding communication behind the backward
    two thirds of a step.
    """
    net = network or Network(
        bandwidth_bps=_TCP_80G[0],
        latency_s=_TCP_80G[1],
        gpus_per_node=8,
        intra_bandwidth_bps=_A100_NVLINK_BPS,
        intra_latency_s=_A100_NVLINK_LATENCY_S,
    )
    ddp = Algorithm(name="ddp")
    base = Workload(
        parameters=parameters,
        tokens_per_step=tokens_per_step,
        step_time_s=1.0,
        bytes_per_param=bytes_per_param,
        backward_fraction=backward_fraction,
    )
    adamw_8 = 18_444.0
    target = 8 * tokens_per_step / adamw_8
    t_c = solve_compute_time(target, ddp, base, net, 8)
    workload = replace(base, step_time_s=t_c)
    algos = (ddp, *(Algorithm(name="co2", sync_every=h) for h in sync_every))
    ratio_note = "throughput(128) / (8 × throughput(16)): against two nodes, not one"
    figures = (
        PaperFigure(algo="ddp", workers=8, metric="tokens_per_s", value=adamw_8,
                    note="AdamW; the calibration point"),
        PaperFigure(algo="ddp", workers=16, metric="tokens_per_s", value=3_488.0,
                    note="AdamW; the 8 -> 16 GPU drop, as a review of the paper quotes it"),
        PaperFigure(algo="ddp", workers=128, metric="tokens_per_s", value=22_810.0,
                    note="AdamW"),
        PaperFigure(algo="ddp", workers=128, metric="scalability_ratio", value=0.82,
                    note=ratio_note),
        PaperFigure(algo="co2 H=48", workers=128, metric="tokens_per_s", value=304_736.0,
                    note="CO2 τ=48"),
        PaperFigure(algo="co2 H=48", workers=128, metric="scalability_ratio", value=1.06,
                    note=ratio_note),
        PaperFigure(algo="co2 H=48", workers=16, metric="tokens_per_s",
                    value=304_736.0 / (8 * 1.06), reported=False,
                    note="not reported: implied by 304,736 and the ratio 1.06"),
        PaperFigure(algo="co2 H=12", workers=128, metric="scalability_ratio", value=0.86,
                    note=ratio_note),
    )  # fmt: skip
    paper = tuple(f for f in figures if f.algo in {a.label for a in algos})
    notes = (
        "Projection, not a measurement: an α-β ring model with the overlap rules of each "
        "algorithm (lowcomm.bench.simulate).",
        "Calibration point (the only one): AdamW on 8 GPUs = 18,444 words/s, which gives "
        f"t_c = {t_c:.4g} s of compute per step at {tokens_per_step:g} tokens per GPU per step.",
        f"Assumed: {parameters:.3g} parameters (TransNormer-LLM 7B, nominal), "
        f"{bytes_per_param:g} bytes per synchronised element, {tokens_per_step:g} tokens per "
        "GPU per step (not given by the paper); DDP hides communication behind "
        f"{backward_fraction:.3g} of a step.",
        f"Network: {net.gpus_per_node} GPUs per node, {_rate(net.intra_bandwidth_bps)} per GPU "
        f"inside a node, {_rate(net.bandwidth_bps)} per node between nodes, latency "
        f"{net.latency_s * 1e6:g} us; hierarchical all-reduce.",
        "Scalability ratio as the paper defines it: per-GPU throughput at N over per-GPU "
        "throughput at 16 GPUs (two nodes); 22,810 / (8 × 3,488) = 0.82.",
        "Words/s are counted as tokens/s.",
    )
    return Scenario(
        name="co2-paper",
        workload=workload,
        network=net,
        algorithms=algos,
        workers=DEFAULT_WORKERS,
        scalability_base=16,
        unit="words",
        notes=notes,
        paper=paper,
        sources=(CO2_PAPER_URL,),
    )


PRESETS: dict[str, Callable[..., Scenario]] = {"co2-paper": co2_paper_scenario}
"""Named scenarios for ``--preset``."""


def preset(name: str, **overrides: Any) -> Scenario:
    """The scenario named ``name`` (see :data:`PRESETS`), with keyword overrides."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name](**overrides)


@dataclass(frozen=True)
class PaperComparison:
    """A paper figure beside our projection."""

    algo: str
    workers: int
    metric: str
    paper: float
    ours: float | None
    ratio: float | None
    """ours / paper."""
    note: str


def compare_with_paper(
    rows: Sequence[Projection], figures: Sequence[PaperFigure]
) -> list[PaperComparison]:
    """Each paper figure beside the projected value of the same algorithm, N and metric."""
    index = {(r.algo, r.workers): r for r in rows}
    out = []
    for f in figures:
        row = index.get((f.algo, f.workers))
        ours = None if row is None else getattr(row, f.metric)
        ratio = None if ours is None or f.value == 0 else ours / f.value
        out.append(PaperComparison(f.algo, f.workers, f.metric, f.value, ours, ratio, f.note))
    return out


def _paper_implications(scenario: Scenario, rows: Sequence[Projection]) -> list[str]:
    """What the paper's AdamW figures say about its communication, beside ours (co2-paper)."""
    figs: dict[tuple[str, int, str], float] = {
        (f.algo, f.workers, f.metric): f.value for f in scenario.paper
    }
    need = [("ddp", n, "tokens_per_s") for n in (8, 16, 128)]
    if not all(k in figs for k in need):
        return []
    thr8, thr16, thr128 = (figs[k] for k in need)
    # step time in units of the 8-GPU step (≈ compute): N / throughput(N) over 8 / throughput(8)
    r16, r128 = (16 / thr16) / (8 / thr8), (128 / thr128) / (8 / thr8)
    ours = {r.workers: r for r in rows if r.algo == "ddp"}
    net = scenario.network
    lines = [
        f"The paper's AdamW step on 16 GPUs takes {r16:.2f}× its 8-GPU step and on 128 GPUs "
        f"{r128:.2f}×: about {r16 - 1:.1f} and {r128 - 1:.1f} compute-steps of exposed "
        "communication, whatever the batch size."
    ]
    if 8 in ours and 16 in ours and 128 in ours:
        o16 = ours[16].step_time_s / ours[8].step_time_s
        o128 = ours[128].step_time_s / ours[8].step_time_s
        lines.append(f"Our model: {o16:.2f}× and {o128:.2f}×.")
    m16, m128 = net.nodes(16), net.nodes(128)
    if m16 > 1:
        growth = ((m128 - 1) / m128) / ((m16 - 1) / m16)
        lines.append(
            f"From {m16} to {m128} nodes the paper's exposed communication grows "
            f"{(r128 - 1) / (r16 - 1):.2f}×; a ring all-reduce's bandwidth term grows "
            f"{growth:.2f}× (2(m-1)/m), and its exposed part more, since the overlap is fixed."
        )
    ddp = next((a for a in scenario.algorithms if a.name == "ddp"), None)
    if ddp is None or net.cost != "ring":
        return lines
    bw = _implied_bandwidth(scenario, ddp, 16, thr16)
    if bw is None:
        return lines
    slow = replace(net, bandwidth_bps=bw)
    again = project(scenario.workload, slow, scenario.algorithms, (16, 128), scalability_base=16)
    at = {(r.algo, r.workers): r for r in again}
    text = (
        f"An inter-node bandwidth of {_rate(bw)} per node (instead of {_rate(net.bandwidth_bps)}) "
        "reproduces the paper's AdamW on 16 GPUs under our other assumptions; then AdamW on 128 "
        f"GPUs runs at {at[('ddp', 128)].tokens_per_s:,.0f} words/s (paper {thr128:,.0f}), so no "
        "single ring bandwidth fits both AdamW figures"
    )
    ratios = {f.algo: f.value for f in scenario.paper if f.metric == "scalability_ratio"}
    co2 = [
        f"{a.label} {at[(a.label, 128)].scalability_ratio:.2f}"
        + (f" (paper {ratios[a.label]:.2f})" if a.label in ratios else "")
        for a in scenario.algorithms
        if a.name in _OVERLAPPED
    ]
    if co2:
        text += "; CO2's scalability ratio at that bandwidth: " + ", ".join(co2)
    lines.append(text + ".")
    return lines


def _implied_bandwidth(scenario: Scenario, algo: Algorithm, n: int, target: float) -> float | None:
    """The inter-node bandwidth at which ``algo`` on ``n`` workers gives ``target`` throughput."""

    def thr(bw: float) -> float:
        net = replace(scenario.network, bandwidth_bps=bw)
        return (
            n
            * scenario.workload.tokens_per_step
            / step_time(algo, scenario.workload, net, n).step_s
        )

    lo, hi = math.log(1e3), math.log(1e15)
    if not thr(math.exp(lo)) <= target <= thr(math.exp(hi)):
        return None
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if thr(math.exp(mid)) < target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


# --- calibration against `lowcomm bench` ------------------------------------------------------


@dataclass(frozen=True)
class CalibrationRow:
    """A ``lowcomm bench`` cell beside the model's prediction for it."""

    algo: str
    workers: int
    link: str | None
    sync_every: int
    num_fragments: int | None
    overlap: int | None
    compute_s: float
    """t_c: the step time of the no-sync cell with the same worker count."""
    payload_bytes: float
    """Bytes per worker per full synchronisation used for the prediction."""
    measured_step_s: float
    predicted_step_s: float
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    ratio: float
    """predicted / measured throughput."""
    measured_hidden_fraction: float | None
    predicted_hidden_fraction: float | None
    note: str


def load_results(path: str) -> dict[str, Any]:
    """Read a ``lowcomm bench`` results file; ValueError naming the file when it cannot be used."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise ValueError(
            f"results file {path!r} cannot be read ({e.strerror or e}); pass the results.json "
            "written by lowcomm bench"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"results file {path!r} is not JSON ({e.msg} at line {e.lineno}); pass the "
            "results.json written by lowcomm bench"
        ) from None
    _check_results(data, path)
    return data


def _check_results(data: Any, source: str) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise ValueError(
            f"results file {source!r} has no 'cells' list; pass the results.json written by "
            "lowcomm bench"
        )
    for i, cell in enumerate(data["cells"]):
        if not isinstance(cell, dict):
            raise ValueError(f"results file {source!r}: cell {i} is not an object")
        for key in ("algo", "workers", "tokens_per_s", "step_time_s"):
            if key not in cell or cell[key] is None:
                raise ValueError(
                    f"results file {source!r}: cell {i} has no {key!r}; re-run lowcomm bench"
                )
        n = cell["workers"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"results file {source!r}: cell {i} has workers={n!r}; it must be an integer >= 1"
            )
        for key in ("tokens_per_s", "step_time_s"):
            v = cell[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(
                    f"results file {source!r}: cell {i} has {key}={v!r}; it must be a number > 0"
                )


def _opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _cell_algorithm(cell: Mapping[str, Any], settings: Mapping[str, Any]) -> Algorithm:
    name = str(cell["algo"])
    if name not in ALGORITHMS:
        raise ValueError(
            f"results cell algo {name!r} is not one the model knows ({', '.join(ALGORITHMS)})"
        )
    if name in ("none", "ddp"):
        return Algorithm(name=name)
    h = _opt_int(cell.get("sync_every")) or _opt_int(settings.get("sync_every")) or 1
    if name in _FRAGMENTED:
        p = _opt_int(cell.get("num_fragments")) or 1
        tau = _opt_int(cell.get("overlap")) or 0
        return Algorithm(name=name, sync_every=h, num_fragments=p, overlap=tau)
    return Algorithm(name=name, sync_every=h)


def _known_algorithm(cell: Mapping[str, Any], settings: Mapping[str, Any]) -> Algorithm | None:
    try:
        return _cell_algorithm(cell, settings)
    except ValueError as e:
        logger.warning("results cell skipped: %s", e)
        return None


def _period(algo: Algorithm) -> int:
    return 1 if algo.name == "ddp" else algo.sync_every


def _cell_network(cell: Mapping[str, Any]) -> Network | None:
    bw = cell.get("link_bandwidth_bps")
    if not isinstance(bw, int | float) or isinstance(bw, bool) or not bw > 0:
        return None
    lat = cell.get("link_latency_s")
    lat = float(lat) if isinstance(lat, int | float) and not isinstance(lat, bool) else 0.0
    return Network(bandwidth_bps=float(bw), latency_s=lat, cost="emulated")


_FREE = Network(bandwidth_bps=math.inf, latency_s=0.0, cost="emulated")


def calibrate(results: Mapping[str, Any], *, source: str = "results") -> list[CalibrationRow]:
    """Predict every synchronising cell of a ``lowcomm bench`` results file and compare.

    For each cell: t_c is the step time of the no-sync ceiling measured in the cell's own
    processes (``ceiling_tokens_per_s``), else of the ``none`` cell with the same worker count;
    the payload is the measured payload per worker step × the sync period (else parameters ×
    4); the link is the cell's emulated link, charged as
    :func:`emulated_allreduce_time`; DDP gets no overlap with backward (lowcomm's emulated DDP
    charges each bucket from its launch, and a model of one or two buckets launches its last
    when backward has finished). The predicted throughput is the ceiling's measured throughput ×
    t_c / predicted step time, so it is in the results file's own units. A cell without a link
    is predicted with free communication (noted); one without a ceiling, or with an algorithm
    the model does not know, is skipped with a warning.
    """
    _check_results(results, source)
    settings = results.get("settings") or {}
    model = results.get("model") or {}
    params = model.get("parameters") if isinstance(model, dict) else None
    cells = results["cells"]
    ceilings = {c["workers"]: c for c in cells if c["algo"] == "none"}
    rows: list[CalibrationRow] = []
    for cell in cells:
        if cell["algo"] == "none":
            continue
        algo = _known_algorithm(cell, settings)
        if algo is None:
            continue
        n = int(cell["workers"])
        notes: list[str] = []
        ceiling = ceilings.get(n)
        if isinstance(cell.get("ceiling_tokens_per_s"), int | float):
            # the ceiling measured inside the cell's own processes (lowcomm bench)
            ceiling_thr = float(cell["ceiling_tokens_per_s"])
            t_c = float(cell["tokens_per_s"]) * float(cell["step_time_s"]) / ceiling_thr
        elif ceiling is not None:
            t_c = float(ceiling["step_time_s"])
            ceiling_thr = float(ceiling["tokens_per_s"])
            notes.append("t_c from the none cell")
        else:
            logger.warning(
                "cell %s on %d workers has no no-sync ceiling cell: skipped", algo.label, n
            )
            continue
        per_step = cell.get("payload_bytes_per_worker_step")
        if isinstance(per_step, int | float) and not isinstance(per_step, bool) and per_step > 0:
            payload = float(per_step) * _period(algo)
        elif isinstance(params, int | float) and params > 0:
            payload = float(params) * 4.0
            notes.append("payload = parameters × 4")
        else:
            raise ValueError(
                f"results file {source!r}: cell {algo.label} on {n} workers has no "
                "payload_bytes_per_worker_step and the file no model.parameters"
            )
        network = _cell_network(cell)
        if network is None:
            network = _FREE
            notes.append("no emulated link: communication taken as free")
        workload = Workload(
            parameters=float(params) if isinstance(params, int | float) and params > 0 else 1.0,
            tokens_per_step=1.0,
            step_time_s=t_c,
            payload_bytes=payload,
            backward_fraction=0.0,
        )
        st = step_time(algo, workload, network, n)
        predicted = ceiling_thr * t_c / st.step_s
        measured = float(cell["tokens_per_s"])
        hidden = cell.get("hidden_fraction")
        rows.append(
            CalibrationRow(
                algo=algo.label,
                workers=n,
                link=cell.get("link"),
                sync_every=_period(algo),
                num_fragments=algo.num_fragments if algo.name in _FRAGMENTED else None,
                overlap=algo.overlap if algo.name in _FRAGMENTED else None,
                compute_s=t_c,
                payload_bytes=payload,
                measured_step_s=float(cell["step_time_s"]),
                predicted_step_s=st.step_s,
                measured_tokens_per_s=measured,
                predicted_tokens_per_s=predicted,
                ratio=predicted / measured,
                measured_hidden_fraction=float(hidden) if isinstance(hidden, int | float) else None,
                predicted_hidden_fraction=st.hidden_fraction,
                note="; ".join(notes),
            )
        )
    return rows


def scenario_from_results(results: Mapping[str, Any], *, source: str = "results") -> Scenario:
    """A scenario for this machine: the bench's model, compute time and emulated link.

    t_c and tokens per worker step come from the no-sync ceiling with the fewest workers: the
    ``none`` cell, else the median of the ceilings measured inside the cells (tokens/s are totals
    over workers); the link is the slowest emulated link of the cells; the algorithms are those
    of the cells. Workers are assumed to keep their own compute as N grows (on this machine they
    share its cores).
    """
    _check_results(results, source)
    cells = results["cells"]
    nones = sorted((c for c in cells if c["algo"] == "none"), key=lambda c: c["workers"])
    with_ceiling = sorted(
        (c for c in cells if isinstance(c.get("ceiling_tokens_per_s"), int | float)),
        key=lambda c: c["workers"],
    )
    if nones:
        ceiling = nones[0]
        t_c = float(ceiling["step_time_s"])
        tokens = float(ceiling["tokens_per_s"]) * t_c / int(ceiling["workers"])
    elif with_ceiling:
        fewest = with_ceiling[0]["workers"]
        same = [c for c in with_ceiling if c["workers"] == fewest]
        ceiling = {"workers": fewest}
        per_step = float(same[0]["tokens_per_s"]) * float(same[0]["step_time_s"])
        ceiling_thr = statistics.median(float(c["ceiling_tokens_per_s"]) for c in same)
        t_c = per_step / ceiling_thr
        tokens = per_step / int(fewest)
    else:
        raise ValueError(
            f"results file {source!r} has no no-sync ceiling (a 'none' cell or cells with "
            "ceiling_tokens_per_s) to take the compute time from; re-run lowcomm bench, or pass "
            "--step-time"
        )
    model = results.get("model") or {}
    params = model.get("parameters") if isinstance(model, dict) else None
    if not isinstance(params, int | float) or isinstance(params, bool) or not params > 0:
        raise ValueError(f"results file {source!r} has no model.parameters; re-run lowcomm bench")
    # the slowest emulated link of the bench: where the algorithms differ most
    networks = [net for c in cells if (net := _cell_network(c)) is not None]
    network = min(networks, key=lambda net: net.bandwidth_bps) if networks else None
    if network is None:
        raise ValueError(
            f"results file {source!r} has no cell with an emulated link; pass --bandwidth"
        )
    settings = results.get("settings") or {}
    algos: list[Algorithm] = []
    for c in cells:
        a = None if c["algo"] == "none" else _known_algorithm(c, settings)
        if a is not None and a not in algos:
            algos.append(a)
    if not algos:
        algos = [Algorithm(name="ddp")]
    return Scenario(
        name="this-machine",
        workload=Workload(
            parameters=float(params),
            tokens_per_step=tokens,
            step_time_s=t_c,
            bytes_per_param=4.0,
            backward_fraction=0.0,
        ),
        network=network,
        algorithms=tuple(algos),
        notes=(
            "Projection, not a measurement: the bench's model and measured compute time on this "
            "machine, every worker assumed to have its own compute, the emulated link's cost "
            "(latency once per collective + ring wire bytes / bandwidth).",
            f"t_c = {t_c:.4g} s per step ({tokens:g} tokens per worker step) from the no-sync cell "
            f"on {ceiling['workers']} workers; {params:g} parameters, fp32 payloads; DDP without "
            "overlap, as lowcomm's emulated DDP.",
        ),
        sources=(source,),
    )


# --- report -----------------------------------------------------------------------------------


@dataclass
class SimulateReport:
    """What :func:`run_simulate` computed and wrote."""

    scenario: Scenario
    projections: list[Projection]
    paper: list[PaperComparison] = field(default_factory=list)
    implications: list[str] = field(default_factory=list)
    calibration: list[CalibrationRow] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "version": 1,
            "kind": "projection (lowcomm simulate), not a measurement",
            "scenario": {
                "name": s.name,
                "unit": s.unit,
                "workload": {**asdict(s.workload), "payload": s.workload.payload},
                "network": asdict(s.network),
                "algorithms": [{**asdict(a), "label": a.label} for a in s.algorithms],
                "workers": list(s.workers),
                "scalability_base": s.scalability_base,
                "notes": list(s.notes),
                "sources": list(s.sources),
            },
            "projections": [asdict(r) for r in self.projections],
            "paper": [asdict(r) for r in self.paper],
            "paper_implications": list(self.implications),
            "calibration": [asdict(r) for r in self.calibration],
        }


def _rate(bps: float | None) -> str:
    if bps is None or math.isinf(bps):
        return "free"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def format_projection_table(report: SimulateReport) -> str:
    s = report.scenario
    base = s.scalability_base
    header = [
        "algorithm", "N", "nodes", "step (s)", "compute (s)", "comm/step (s)",
        "exposed/step (s)", "hidden", f"{s.unit}/s", f"{s.unit}/s per worker",
        "scaling eff.",
    ]  # fmt: skip
    if base is not None:
        header.append(f"scal. ratio vs N={base}")
    rows = []
    for r in report.projections:
        row = [
            r.algo, str(r.workers), str(r.nodes), _num(r.step_time_s, 4), _num(r.compute_s, 4),
            _num(r.comm_per_step_s, 4), _num(r.exposed_per_step_s, 4),
            "-" if r.hidden_fraction is None else f"{r.hidden_fraction:.2f}",
            _num(r.tokens_per_s), _num(r.tokens_per_s_per_worker, 4),
            f"{r.scaling_efficiency:.3f}",
        ]  # fmt: skip
        if base is not None:
            row.append("-" if r.scalability_ratio is None else f"{r.scalability_ratio:.3f}")
        rows.append(row)
    return _table(header, rows)


def format_paper_table(report: SimulateReport) -> str:
    unit = report.scenario.unit
    names = {"tokens_per_s": f"{unit}/s", "scalability_ratio": "scalability ratio"}
    rows = []
    for c in report.paper:
        ratio_metric = c.metric == "scalability_ratio"

        def fmt(x: float, ratio_metric: bool = ratio_metric) -> str:
            return f"{x:.2f}" if ratio_metric else _num(x)

        rows.append(
            [
                c.algo,
                str(c.workers),
                names.get(c.metric, c.metric),
                fmt(c.paper),
                "-" if c.ours is None else fmt(c.ours),
                "-" if c.ratio is None else f"{c.ratio:.3f}",
                c.note,
            ]
        )
    return _table(["setting", "N", "metric", "paper", "ours", "ours/paper", "note"], rows)


def format_calibration_table(report: SimulateReport) -> str:
    rows = []
    for c in report.calibration:
        hidden = f"{_num(c.measured_hidden_fraction, 2)} / {_num(c.predicted_hidden_fraction, 2)}"
        rows.append(
            [
                c.algo, str(c.workers), c.link or "-", _num(c.compute_s, 4),
                _num(c.measured_step_s, 4), _num(c.predicted_step_s, 4),
                _num(c.measured_tokens_per_s), _num(c.predicted_tokens_per_s),
                f"{c.ratio:.3f}", hidden, c.note,
            ]
        )  # fmt: skip
    header = [
        "cell", "N", "link", "t_c (s)", "step measured (s)", "step predicted (s)",
        "tokens/s measured", "tokens/s predicted", "predicted/measured",
        "hidden measured / predicted", "note",
    ]  # fmt: skip
    return _table(header, rows)


def format_markdown(report: SimulateReport) -> str:
    """The report as Markdown: assumptions, projection, paper comparison, calibration."""
    s = report.scenario
    parts = [f"# lowcomm simulate: {s.name} (projection)", ""]
    parts += [f"- {n}" for n in s.notes]
    if s.sources:
        parts.append(f"- Sources: {', '.join(s.sources)}")
    parts += ["", "## Projection", "", format_projection_table(report), ""]
    if report.paper:
        parts += ["## Paper vs ours", "", format_paper_table(report), ""]
    if report.implications:
        parts += ["### What the paper's figures imply", ""]
        parts += [f"- {line}" for line in report.implications]
        parts.append("")
    if report.calibration:
        parts += [
            "## Calibration on this machine",
            "",
            "Predicted (model, emulated link cost, measured compute time) against measured "
            "(lowcomm bench) per cell.",
            "",
            format_calibration_table(report),
            "",
        ]
    return "\n".join(parts)


def _plot(report: SimulateReport, path: str) -> None:
    # A bare Figure renders with Agg and leaves pyplot's global backend alone.
    from matplotlib.figure import Figure

    s = report.scenario
    fig = Figure(figsize=(12, 4.8))
    ax1, ax2 = fig.subplots(1, 2)
    styles = ("-", "--", ":", "-.")
    colors: dict[str, Any] = {}
    for i, label in enumerate(dict.fromkeys(r.algo for r in report.projections)):
        rows = [r for r in report.projections if r.algo == label]
        ns = [r.workers for r in rows]
        style = styles[i % len(styles)]
        (line,) = ax1.plot(ns, [r.tokens_per_s for r in rows], style, marker="o", ms=3, label=label)
        colors[label] = line.get_color()
        ax2.plot(
            ns, [r.scaling_efficiency for r in rows], style, marker="o", ms=3, color=colors[label]
        )
    seen: set[bool] = set()
    for f in s.paper:
        if f.metric != "tokens_per_s":
            continue
        name = "paper (reported)" if f.reported else "paper (implied)"
        ax1.scatter(
            [f.workers], [f.value], marker="x" if f.reported else "+", s=70,
            color=colors.get(f.algo, "black"), label=None if f.reported in seen else name,
            zorder=5,
        )  # fmt: skip
        seen.add(f.reported)
    n0 = min(r.workers for r in report.projections)
    for ax, ylabel, title in (
        (ax1, f"{s.unit}/s (all workers)", "throughput (projected)"),
        (ax2, f"scaling efficiency vs N={n0}", "scaling efficiency (projected)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers N")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.set_ylim(0, 1.05)
    fig.suptitle(f"lowcomm simulate: {s.name} (projection, not a measurement)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_simulate(
    scenario: Scenario,
    *,
    out: str,
    results: Mapping[str, Any] | None = None,
    results_source: str = "results",
) -> SimulateReport:
    """Project ``scenario``, compare with its paper figures and a bench results file, and write
    ``simulate.json``, ``simulate.md`` and ``simulate.png`` to ``out``."""
    rows = project(
        scenario.workload,
        scenario.network,
        scenario.algorithms,
        scenario.workers,
        scalability_base=scenario.scalability_base,
    )
    report = SimulateReport(scenario=scenario, projections=rows)
    if scenario.paper:
        report.paper = compare_with_paper(rows, scenario.paper)
        report.implications = _paper_implications(scenario, rows)
    if results is not None:
        report.calibration = calibrate(results, source=results_source)
    os.makedirs(out, exist_ok=True)
    paths = {
        "json": os.path.join(out, "simulate.json"),
        "markdown": os.path.join(out, "simulate.md"),
        "plot": os.path.join(out, "simulate.png"),
    }
    report.paths = paths
    with open(paths["json"], "w", encoding="utf-8") as fh:
        json.dump(report.as_dict(), fh, indent=2, allow_nan=False)
        fh.write("\n")
    with open(paths["markdown"], "w", encoding="utf-8") as fh:
        fh.write(format_markdown(report))
    _plot(report, paths["plot"])
    logger.debug("lowcomm simulate: wrote %s", ", ".join(paths.values()))
    return report


# --- command line -----------------------------------------------------------------------------


def _parse_link(text: str, flag: str) -> tuple[float, float | None]:
    """``tcp-80g`` (a profile), ``80gbit``, ``80gbit:50us`` or bits/s as a number ->
    (bandwidth, latency or None)."""
    from lowcomm.link import EmulatedLink

    spec = text.strip().lower()
    try:
        bw = float(spec)
    except ValueError:
        pass
    else:
        if not bw > 0 or not math.isfinite(bw):
            raise ValueError(f"{flag} must be > 0 bits/s, got {text!r}; e.g. 80gbit or tcp-80g")
        return bw, None
    try:
        if ":" in spec or spec in _profiles():
            link = EmulatedLink.parse(spec)
            return link.bandwidth_bps, link.latency_s
        return EmulatedLink.parse(f"{spec}:0s").bandwidth_bps, None
    except ValueError:
        raise ValueError(
            f"{flag} {text!r} is not a link profile ({', '.join(_profiles())}), a rate such as "
            "80gbit or 100mbit, or RATE:LATENCY such as 80gbit:50us"
        ) from None


def _profiles() -> tuple[str, ...]:
    from lowcomm.link import PROFILES

    return tuple(PROFILES)


def _parse_time(text: str, flag: str) -> float:
    spec = text.strip().lower()
    try:
        value = float(spec)
    except ValueError:
        from lowcomm.link import EmulatedLink

        try:
            value = EmulatedLink.parse(f"1gbit:{spec}").latency_s
        except ValueError:
            raise ValueError(
                f"{flag} must be seconds (0.00005) or a time such as 50us, 10ms, 1s; got {text!r}"
            ) from None
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{flag} must be >= 0 s, got {text!r}")
    return value


def _parse_positive(text: Any, flag: str, *, integer: bool = False) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)) or (integer and value != int(value)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{flag} must be {kind} > 0, got {text!r}")
    return value


def _parse_int_list(text: str, flag: str, *, low: int = 1) -> tuple[int, ...]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(
                f"{flag} must be integers >= {low} separated by commas (e.g. 8,16,32), got {item!r}"
            ) from None
        if value < low:
            raise ValueError(f"{flag} must be integers >= {low}, got {value}")
        out.append(value)
    if not out:
        raise ValueError(f"{flag} needs at least one value, e.g. 8,16,32")
    return tuple(out)


def _parse_algos(text: str) -> tuple[str, ...]:
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    for name in names:
        if name not in ALGORITHMS:
            raise ValueError(f"--algos: {name!r} is not one of {', '.join(ALGORITHMS)}")
    if not names:
        raise ValueError(f"--algos needs at least one of {', '.join(ALGORITHMS)}")
    return tuple(dict.fromkeys(names))


def _build_algorithms(
    names: Sequence[str], sync_every: Sequence[int], num_fragments: int, overlap: int
) -> tuple[Algorithm, ...]:
    algos: list[Algorithm] = []
    for name in names:
        if name in ("none", "ddp"):
            algos.append(Algorithm(name=name))
            continue
        for h in sync_every:
            if name in _FRAGMENTED:
                algos.append(
                    Algorithm(name=name, sync_every=h, num_fragments=num_fragments, overlap=overlap)
                )
            else:
                algos.append(Algorithm(name=name, sync_every=h))
    return tuple(dict.fromkeys(algos))


def _scenario_from_args(
    args: argparse.Namespace,
) -> tuple[Scenario, Mapping[str, Any] | None, str]:
    given = vars(args)
    results = None
    source = "results"
    if "calibrate" in given:
        source = str(args.calibrate)
        results = load_results(source)

    net_kwargs: dict[str, Any] = {}
    if "bandwidth" in given:
        bw, lat = _parse_link(args.bandwidth, "--bandwidth")
        net_kwargs["bandwidth_bps"] = bw
        if lat is not None:
            net_kwargs["latency_s"] = lat
    if "latency" in given:
        net_kwargs["latency_s"] = _parse_time(args.latency, "--latency")
    if "gpus_per_node" in given:
        net_kwargs["gpus_per_node"] = int(
            _parse_positive(args.gpus_per_node, "--gpus-per-node", integer=True)
        )
    if "intra_bandwidth" in given:
        ibw, ilat = _parse_link(args.intra_bandwidth, "--intra-bandwidth")
        net_kwargs["intra_bandwidth_bps"] = ibw
        if ilat is not None:
            net_kwargs["intra_latency_s"] = ilat
    if "intra_latency" in given:
        net_kwargs["intra_latency_s"] = _parse_time(args.intra_latency, "--intra-latency")

    work_kwargs: dict[str, Any] = {}
    for key, flag, integer in (
        ("params", "--params", False),
        ("tokens_per_step", "--tokens-per-step", False),
        ("bytes_per_param", "--bytes-per-param", False),
    ):
        if key in given:
            work_kwargs[key] = _parse_positive(given[key], flag, integer=integer)
    if "step_time" in given:
        work_kwargs["step_time_s"] = _parse_time(args.step_time, "--step-time")
        if not work_kwargs["step_time_s"] > 0:
            raise ValueError(f"--step-time must be > 0 s, got {args.step_time!r}")
    if "backward_fraction" in given:
        try:
            b = float(args.backward_fraction)
        except ValueError:
            b = math.nan
        if not 0 <= b <= 1:
            raise ValueError(f"--backward-fraction must be in [0, 1], got {args.backward_fraction}")
        work_kwargs["backward_fraction"] = b
    if "outer_time" in given:
        work_kwargs["outer_time_s"] = _parse_time(args.outer_time, "--outer-time")

    sync_every = _parse_int_list(args.sync_every, "--sync-every") if "sync_every" in given else None
    preset_name = given.get("preset")
    if preset_name is not None:
        if preset_name not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset_name!r}")
        overrides: dict[str, Any] = {}
        if "params" in work_kwargs:
            overrides["parameters"] = work_kwargs.pop("params")
        for key in ("tokens_per_step", "bytes_per_param", "backward_fraction"):
            if key in work_kwargs:
                overrides[key] = work_kwargs.pop(key)
        if sync_every is not None:
            overrides["sync_every"] = sync_every
        if net_kwargs:
            base_net = preset(preset_name).network
            overrides["network"] = replace(base_net, **net_kwargs)
            net_kwargs = {}
        scenario = preset(preset_name, **overrides)
        if "step_time_s" in work_kwargs:
            logger.warning(
                "--step-time replaces the preset's calibrated compute time: the calibration "
                "point no longer holds"
            )
    elif results is not None:
        scenario = scenario_from_results(results, source=source)
    else:
        missing = [f for f, k in (("--params", "params"), ("--step-time", "step_time_s"),
                                  ("--bandwidth", "bandwidth_bps"))
                   if k not in work_kwargs and k not in net_kwargs]  # fmt: skip
        if missing:
            raise ValueError(
                f"give {', '.join(missing)} (or --preset co2-paper, or --calibrate "
                "RESULTS_JSON for this machine)"
            )
        scenario = Scenario(
            name="custom",
            workload=Workload(
                parameters=work_kwargs.pop("params"),
                tokens_per_step=work_kwargs.pop("tokens_per_step", 1.0),
                step_time_s=work_kwargs.pop("step_time_s"),
            ),
            network=Network(**net_kwargs),
            algorithms=_build_algorithms(("ddp", "diloco", "co2"), sync_every or (12,), 1, 0),
            notes=("Projection, not a measurement: an α-β ring model with the overlap rules of "
                   "each algorithm (lowcomm.bench.simulate).",),
        )  # fmt: skip
        net_kwargs = {}

    if "params" in work_kwargs:
        work_kwargs["parameters"] = work_kwargs.pop("params")
    if work_kwargs:
        scenario = replace(scenario, workload=replace(scenario.workload, **work_kwargs))
    if net_kwargs:
        scenario = replace(scenario, network=replace(scenario.network, **net_kwargs))

    if (
        "algos" in given
        or "num_fragments" in given
        or "overlap" in given
        or (sync_every is not None and preset_name is None)
    ):
        names = (
            _parse_algos(args.algos)
            if "algos" in given
            else tuple(dict.fromkeys(a.name for a in scenario.algorithms))
        )
        outer = [a.sync_every for a in scenario.algorithms if a.name not in ("ddp", "none")]
        h_list = sync_every or tuple(dict.fromkeys(outer)) or (12,)
        p = int(_parse_positive(given.get("num_fragments", 1), "--num-fragments", integer=True))
        tau = _parse_int_list(str(given.get("overlap", 0)), "--overlap", low=0)[0]
        scenario = replace(scenario, algorithms=_build_algorithms(names, h_list, p, tau))
    if "workers" in given:
        scenario = replace(scenario, workers=_parse_int_list(args.workers, "--workers"))
    if "scalability_base" in given:
        base = int(_parse_positive(args.scalability_base, "--scalability-base", integer=True))
        scenario = replace(scenario, scalability_base=base)
    g = scenario.network.gpus_per_node
    for n in scenario.workers:
        if g > 1 and n > g and n % g:
            raise ValueError(
                f"--workers {n} is not a multiple of --gpus-per-node {g}; use multiples of {g}"
            )
    return scenario, results, source


def _run_simulate(args: argparse.Namespace, prog: str) -> int:
    """Run ``lowcomm simulate``: print the tables and the paths written; 0 on success."""
    scenario, results, source = _scenario_from_args(args)
    out = getattr(args, "out", None) or os.path.join("runs", "simulate")
    report = run_simulate(scenario, out=out, results=results, results_source=source)
    print(format_markdown(report))
    print(f"{prog}: wrote {report.paths['json']}, {report.paths['markdown']}, "
          f"{report.paths['plot']} (projection, not a measurement)")  # fmt: skip
    return 0


_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--preset", "{" + ",".join(PRESETS) + "}",
     "a named scenario: co2-paper (TransNormer-LLM 7B on A100 nodes of 8, 80 Gbit/s TCP between "
     "nodes, AdamW against CO2 tau=12 and 48, beside the paper's figures)"),
    ("--calibrate", "RESULTS_JSON",
     "a lowcomm bench results.json: predict each cell and compare with the measurement "
     "(without --preset, also project this machine's setup)"),
    ("--params", "N", "model parameters, e.g. 7e9"),
    ("--tokens-per-step", "N", "tokens per worker per inner step (default 1: throughput in steps)"),
    ("--step-time", "TIME", "compute time of one inner step on one worker, e.g. 0.25 or 250ms"),
    ("--bandwidth", "LINK",
     "slow link: a profile (rdma-800g, tcp-80g, 1gbit, 100mbit, 10mbit; sets the latency too), "
     "a rate such as 80gbit, or RATE:LATENCY; per node when --gpus-per-node > 1"),
    ("--latency", "TIME", "latency per message on the slow link, e.g. 50us (overrides a profile)"),
    ("--gpus-per-node", "G",
     "workers per node, sharing one slow NIC, with a fast link inside (default 1: a flat ring)"),
    ("--intra-bandwidth", "LINK", "fast link inside a node, per GPU, e.g. 2400gbit (default free)"),
    ("--intra-latency", "TIME", "latency per message on the fast link, e.g. 5us"),
    ("--algos", "A,B", f"algorithms: {', '.join(ALGORITHMS)} (default ddp,diloco,co2)"),
    ("--sync-every", "H[,H]",
     "inner steps per round (the CO2 paper's tau); several values give a line each (default 12)"),
    ("--num-fragments", "P", "streaming/cocodc fragments (default 1)"),
    ("--overlap", "STEPS",
     "streaming/cocodc inner steps a fragment's all-reduce may run (default 0)"),
    ("--bytes-per-param", "B", "bytes per synchronised element: 4 fp32 (default), 2 bf16"),
    ("--backward-fraction", "B",
     "share of a step DDP can hide its all-reduce behind (default 0.667; 0: none)"),
    ("--outer-time", "TIME", "compute time of one outer update (default 0)"),
    ("--workers", "N[,N]", "worker counts (default 8,16,32,64,128,256,512,1024)"),
    ("--scalability-base", "N",
     "worker count the scalability ratio is taken against (co2-paper: 16)"),
    ("--out", "DIR", "output folder (default runs/simulate)"),
)  # fmt: skip


def add_subcommand(subparsers: Any) -> None:
    """Register ``simulate`` on an argparse subparsers object.

    The parsed namespace holds only the flags given (``argparse.SUPPRESS``) and ``_run``: call
    ``args._run(args, prog)``; it raises ``ValueError`` with a one-line message on bad input.
    """
    p = subparsers.add_parser(
        "simulate",
        help="project throughput and scaling efficiency to 8 ... 1024 workers (a model)",
        description=(
            "Project the throughput and scaling efficiency of ddp, diloco, co2, streaming and "
            "the other algorithms to many workers with an alpha-beta ring all-reduce model and "
            "each algorithm's overlap rules, and write simulate.json, simulate.md and "
            "simulate.png. --preset co2-paper puts the projection beside the CO2 paper's "
            "reported figures; --calibrate compares predicted with measured lowcomm bench "
            "cells. Without either, give --params, --step-time and --bandwidth. "
            "Figures are projections, not measurements."
        ),
        argument_default=argparse.SUPPRESS,
    )
    for flag, metavar, text in _FLAGS:
        p.add_argument(flag, dest=flag[2:].replace("-", "_"), metavar=metavar, help=text)
    p.set_defaults(_run=_run_simulate)
