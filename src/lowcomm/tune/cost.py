"""The α-β cost model shared by ``lowcomm simulate`` and ``lowcomm plan``.

The collectives' costs (ring, hierarchical and tiered all-reduce, all-gather, reduce-scatter,
point-to-point, group exchange), the workload and the network (:class:`Workload`,
:class:`Network`) and each data-parallel algorithm's overlap rule (:func:`step_time`, chosen by
the algorithm's ``schedule`` in :data:`lowcomm.registry.REGISTRY`). ``lowcomm simulate`` projects
these to N workers (:mod:`lowcomm.bench.simulate.model`); ``lowcomm plan`` prices the collectives
of a TP/PP/DP layout with them and uses :func:`step_time` for an outer algorithm across the
slowest tier (:mod:`lowcomm.plan.timing`). Nothing here reads files or prints.

**Communication (α-β, Hockney).** A ring all-reduce of ``S`` bytes over ``n`` workers sends
``2 (n - 1)`` messages of ``S / n`` bytes in sequence, so on a link of bandwidth β (bits/s) and
per-message latency α (s) it takes

    T_ring(S, n) = 2 (n - 1) α + 2 (n - 1) / n · 8 S / β          (0 when n = 1)

(:func:`ring_allreduce_time`); a reduce-scatter or an all-gather is half of it. Nodes of ``G`` GPUs
with a fast link inside and one slow NIC per node are modelled hierarchically
(:func:`hierarchical_allreduce_time`): reduce-scatter inside the node, then ``G`` concurrent
inter-node rings, one per ``S / G`` shard, that share the node's NIC (so the NIC carries the whole
``2 (m - 1) / m · S`` of an ``m``-node ring), then all-gather inside the node. lowcomm's own link
emulation (:mod:`lowcomm.link`) charges a collective ``α + 2 (n - 1) / n · 8 S / β`` (latency once,
first in first out), which :func:`emulated_allreduce_time` reproduces for calibration against
``lowcomm bench``.

**Compute.** ``t_c`` is the time of one inner step (forward, backward, inner optimizer) on one
worker, measured or given; it does not change with N (weak scaling: every worker keeps its batch).
The payload is the parameter count × bytes per element (4 for fp32, lowcomm's buckets; 2 for
bf16), or a measured payload.

**Overlap rules**, one per schedule (:mod:`lowcomm.schedules`, whose ``step_time`` applies
them; per worker; H = ``sync_every``; T = all-reduce time of the whole payload; ``t_o`` = one
outer update):

* ``never`` (``none``): no communication, step = t_c (the ceiling).
* ``every-step`` (``ddp``, synchronous AdamW/SGD): all-reduce of the gradients every step. DDP
  launches bucket all-reduces during backward, so at most the backward share ``b`` of ``t_c`` can
  hide them: step = t_c + max(0, T − b·t_c). ``b = 2/3`` by default (backward ≈ twice forward);
  ``b = 0`` is no overlap, which is what lowcomm's emulated DDP shows when the model fits in one
  or two buckets (the link delay then starts after backward has finished).
* ``blocking`` (``localsgd``, ``slowmo``, ``diloco``): blocking all-reduce every H steps:
  round = H·t_c + T + t_o.
* ``one-round-stale`` (``co2``, ``co2-eager``): the all-reduce launched at the end of round r is
  waited for at the end of round r + 1, so it overlaps H steps and the outer update:
  round = max(H·t_c + t_o, T). Communication is exposed only when T > H·t_c + t_o, and then
  exactly by the excess (the link is the bottleneck; first in, first out). With ``overlap``
  0 < τ < H (``lowcomm train``'s CO2: launched τ steps before the round ends, applied at its
  end) it is one fragment of the ``fragments`` rule: round = max(H·t_c + max(0, T − τ·t_c) +
  t_o, T); ``overlap`` 0 is the paper's τ = H. With ``num_fragments`` P > 1 (staggered
  fragments) it is the ``fragments`` rule with τ (H where ``overlap`` is 0).
* ``fragments`` (``streaming``: Streaming DiLoCo, and ``cocodc``): P fragments of S / P bytes,
  one synced every H / P steps; each all-reduce (time T_f) is launched ``overlap`` (τ) steps
  before its sync point, so each sync point exposes max(0, T_f − τ·t_c). The link carries one
  fragment at a time, so a round is never shorter than P·T_f:
  round = max(H·t_c + P·max(0, T_f − τ·t_c) + t_o, P·T_f). CoCoDC's adaptive fragment choice
  adds a blocking all-reduce of P float64 scores at each sync point (a latency-bound collective).
* ``gossip`` (``noloco``): no all-reduce; every H steps each worker exchanges its full payload
  with the other members of a random group of n (``group_size``; with N not divisible by n the
  last group has n + N mod n members, and the largest group sets the round). A member sends
  its S bytes to each of the g − 1 others at once over its own link, so the exchange takes
  T_x = α + (g − 1) · 8 S / β, independent of N (:func:`exchange_time`; with ``G`` GPUs per node
  sharing one NIC and the partners on other nodes, the NIC carries G of them:
  α + G (g − 1) · 8 S / β). Launched τ (``overlap``) steps before it is applied:
  round = max(H·t_c + max(0, T_x − τ·t_c) + t_o, T_x). The model assumes every worker has its
  own full-duplex link of bandwidth β and that the exchanges of different groups do not share
  links (no switch or core contention); the finish() all-reduce of φ is once per run and left
  out.
* ``every-step-gather`` (``demo``): every step an all-gather of each worker's top-k DCT
  coefficients, S_d = parameters · min(1, k / s²) · 8 bytes (an int32 index and an fp32 value
  per coefficient; k = ``topk`` of every s × s block, ``chunk`` s: the 2-D tensors that hold
  nearly all parameters). A ring all-gather sends (n − 1) messages of S_d and every worker
  receives (n − 1)·S_d, so T_g = (n − 1)(α + 8 S_d / β) grows with N (:func:`allgather_time`;
  lowcomm's emulation charges α + (n − 1)·8 S_d / β). Compression happens after backward, so
  nothing hides it: step = t_c + T_g; with ``overlap`` (applied one step late) it runs behind the
  next step: step = max(t_c, T_g).

**Tiers.** A cluster is a stack of tiers (devices in a node, nodes in a region, regions), each
with its own bandwidth and latency per uplink. A collective over a group with ``k_i`` members
in each unit of tier ``i`` (``k_0`` devices of a node, ``k_1`` nodes of a region, ...) is
priced as reduce-scatters down the tiers, an all-reduce at the top and all-gathers back up (as
NCCL's hierarchical algorithms run it); at tier ``i`` every device sends its shard
``S / (k_0 ⋯ k_{i-1})``, and ``share_i`` devices that communicate at once share the tier's
uplink (:func:`tiered_allreduce_time`):

    T = Σ_i 2 (k_i − 1) α_i + 2 (k_i − 1) / k_i · 8 S_i · share_i / β_i

With two tiers and ``share_1 = k_0`` this is :func:`hierarchical_allreduce_time`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from lowcomm.outer.cocodc import CoCoDC
from lowcomm.registry import REGISTRY, AlgorithmEntry, names
from lowcomm.schedules import LinkModel, Schedule, StepTime
from lowcomm.tune.collective_cost import (
    TierLevel,
    allgather_time,
    emulated_allreduce_time,
    exchange_time,
    hierarchical_allreduce_time,
    p2p_time,
    ring_allreduce_time,
    tiered_allreduce_time,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CostModel",
    "LinkModel",
    "Network",
    "StepTime",
    "TierLevel",
    "Workload",
    "allgather_time",
    "emulated_allreduce_time",
    "exchange_time",
    "hierarchical_allreduce_time",
    "p2p_time",
    "ring_allreduce_time",
    "solve_compute_time",
    "step_time",
    "tiered_allreduce_time",
]

ALGORITHMS = names()
"""Algorithms the model knows: every ``lowcomm train --algo`` value, in registry order."""

CostModel = Literal["ring", "emulated"]


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

    def allgather_time(self, payload_bytes: float, n: int) -> float:
        """Seconds for one all-gather of ``payload_bytes`` per worker over ``n`` workers (with
        nodes of several GPUs, a ring over the nodes, each node's NIC carrying its G shards)."""
        emulated = self.cost == "emulated"
        g = 1 if emulated else self.gpus_per_node
        nodes = n if g == 1 else self.nodes(n)
        return allgather_time(
            g * payload_bytes, nodes, self.bandwidth_bps, self.latency_s, emulated=emulated
        )

    def exchange_time(self, payload_bytes: float, group: int) -> float:
        """Seconds for one group exchange (NoLoCo) of ``payload_bytes`` per member among
        ``group`` members (:func:`exchange_time`; nodes of several GPUs share their NIC)."""
        sharing = 1 if self.cost == "emulated" else self.gpus_per_node
        return exchange_time(
            payload_bytes, group, self.bandwidth_bps, self.latency_s, sharing=sharing
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
    """P: streaming/cocodc fragments (and co2's staggered fragments); H must be a multiple of
    P."""
    overlap: int = 0
    """τ: streaming/cocodc inner steps a fragment's all-reduce runs before it is applied; for
    co2, 0 < τ < H launches the all-reduce τ steps before the round ends (0: the paper's τ = H)."""
    adaptive: bool = True
    """cocodc: fragments chosen by an all-reduced priority score (a blocking collective)."""
    group_size: int = 2
    """n: noloco's group size."""
    topk: int = 32
    """k: demo's coefficients sent per chunk."""
    chunk: int = 64
    """s: demo's chunk size per dimension; sparseloco's tile side."""
    density: float = 1 / 64
    """sparseloco: elements kept per tile (k = round(density·s²))."""
    bits: int = 2
    """sparseloco: bits of a kept value (2, 4; 32: fp32)."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.name!r}")
        keys = [("sync_every", 1), ("num_fragments", 1), ("overlap", 0), ("group_size", 2)]
        keys += [("topk", 1), ("chunk", 1)]
        for key, low in keys:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if self.bits not in (2, 4, 32):
            raise ValueError(f"bits must be 2, 4 or 32, got {self.bits!r}")
        self.schedule.check(self)

    @property
    def entry(self) -> AlgorithmEntry:
        """Its entry in :data:`lowcomm.registry.REGISTRY`."""
        return REGISTRY[self.name]

    @property
    def schedule(self) -> Schedule:
        """How it communicates (:mod:`lowcomm.schedules`): the overlap rule :func:`step_time`
        applies."""
        return self.entry.schedule

    @property
    def period(self) -> int:
        """Inner steps per synchronisation: 1 for a sync every step (ddp, demo), else
        ``sync_every``."""
        period = self.schedule.period(self.sync_every)
        return self.sync_every if period is None else period

    @property
    def label(self) -> str:
        """Short name for tables and plots, e.g. ``co2 H=48``."""
        return self.schedule.label(self)

    @property
    def scores_fragments(self) -> bool:
        """Whether each sync point also all-reduces a priority score per fragment: CoCoDC's
        adaptive transmission (its class and variants, unless ``adaptive`` is off or fixed
        off)."""
        entry = self.entry
        if entry.cls is None or not issubclass(entry.cls, CoCoDC):
            return False
        return bool(entry.fixed.get("adaptive", self.adaptive))

    def largest_group(self, n: int) -> int:
        """noloco: members of the largest group among ``n`` workers (the remainder of n not
        divisible by ``group_size`` joins the last group)."""
        groups = max(1, n // self.group_size)
        return n - (groups - 1) * self.group_size


def step_time(algorithm: Algorithm, workload: Workload, network: LinkModel, n: int) -> StepTime:
    """Time per inner step of ``algorithm`` on ``n`` workers; see the module docstring's rules."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"workers must be an integer >= 1, got {n!r}")
    if n == 1 or not algorithm.schedule.syncs:
        t = workload.step_time_s
        return StepTime(t, t, 0.0, 0.0, 0.0)
    return algorithm.schedule.step_time(algorithm, workload, network, n)


def solve_compute_time(
    target_step_s: float, algorithm: Algorithm, workload: Workload, network: LinkModel, n: int
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
