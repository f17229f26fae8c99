"""Deterministic assignment of documents to ranks: every rank runs :func:`plan` on the same
all-gathered lengths and gets the same plan, so nothing else is broadcast.

Strategies (``STRATEGIES``), all under a per-rank token cap:

- ``sequential``: the documents in the order given, cut into runs of about equal tokens (each
  document goes to the rank its middle token falls in): what a rank would train on had it kept
  the documents it read;
- ``random``: the same after a seeded shuffle;
- ``length``: the same after sorting by length, longest first (group-by-length: similar
  lengths together, as trainers do to reduce padding);
- ``tokens``: LPT on token counts (equal tokens per rank);
- ``cost``: LPT (or Karmarkar–Karp, ``method="kk"``) on :meth:`CostModel.doc`; with a
  :class:`SplitPolicy`, a document whose cost alone exceeds the fair share ``sum(c)/R`` is split
  over ``k`` ranks when the link between them makes it pay (:func:`split_pays`), inside one
  node when only the node's own network does.

LPT (longest processing time first) gives each document, most costly first, to the least-loaded
rank with room under the cap; its makespan is within ``4/3 - 1/(3R)`` of the optimum.
Karmarkar–Karp's largest differencing method merges partial R-way partitions, pairing the
heaviest part of one with the lightest of the other; when its result breaks the token cap the
plan falls back to LPT (``Plan.method`` says which ran).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lowcomm.balance.cost import CostModel

__all__ = [
    "METHODS",
    "STRATEGIES",
    "LinkTier",
    "Piece",
    "Plan",
    "SplitDecision",
    "SplitPolicy",
    "min_split_length",
    "plan",
    "spread_over_steps",
    "split_pays",
]

logger = logging.getLogger(__name__)

STRATEGIES = ("random", "sequential", "length", "tokens", "cost")
"""Values of ``strategy`` (``lowcomm train --balance``)."""

METHODS = ("lpt", "kk")
"""Values of ``method``: how the ``cost`` and ``tokens`` strategies partition."""


@dataclass(frozen=True)
class Piece:
    """A document, or this rank's part of a split one, given to a rank."""

    doc: int
    """Index of the document in the planned list."""
    ranks: tuple[int, ...] = ()
    """For a split document, the ranks sharing it in ring order (empty: the whole document)."""
    index: int = 0
    """For a split document, this rank's position in ``ranks``."""

    @property
    def split(self) -> bool:
        return bool(self.ranks)


@dataclass(frozen=True)
class LinkTier:
    """The link a split's keys and values would cross: bandwidth in bits/s (``inf``: not a
    constraint) and latency per message."""

    bandwidth_bps: float = math.inf
    latency_s: float = 0.0
    name: str = "local"


@dataclass(frozen=True)
class SplitPolicy:
    """When documents may be split across ranks.

    ``node_size`` ranks form a node (ranks node-major); inside a node keys and values cross
    ``intra``, between nodes ``inter``. ``kv_bytes_per_token`` is what one token's keys and
    values take over all layers (``2 * n_embd * n_layer * element size``); ``layers`` counts the
    sequential exchanges."""

    kv_bytes_per_token: float
    layers: int
    node_size: int | None = None
    """Ranks per node (``None``: all ranks are one node)."""
    intra: LinkTier = LinkTier()
    inter: LinkTier = LinkTier(name="inter-node")
    max_k: int | None = None
    """Most ranks one document is split over (default: a node's, or every rank)."""


@dataclass(frozen=True)
class SplitDecision:
    """What the planner decided for a document whose cost exceeds the fair share."""

    doc: int
    length: int
    k: int
    """Ranks it is split over (1: not split)."""
    tier: str
    """The link tier the split crosses, or why it was not split."""
    saving_s: float
    comm_s: float
    refused: str | None = None
    """A wider split refused first (the slow link it would have crossed), if any."""


@dataclass
class Plan:
    """One plan unit's assignment (a step, or a round of an outer algorithm)."""

    assignment: list[list[Piece]]
    """Per rank: its pieces (split pieces first, in document order, then whole documents)."""
    loads: list[float]
    """Per rank: planned cost (seconds under the cost model, or tokens without one)."""
    tokens: list[int]
    """Per rank: tokens."""
    lower_bound: float
    """``max(max c_i, sum c / R)`` over the unsplit documents."""
    strategy: str
    method: str
    splits: list[SplitDecision] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.loads)

    @property
    def ratio(self) -> float:
        """Makespan over the lower bound (1 is perfect; below 1 only by splitting)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0


def _kv_exchange(k: int, policy: SplitPolicy, link: LinkTier) -> tuple[float, float]:
    """(seconds per token, fixed seconds) of a split's ring exchanges on ``link``: per layer,
    each rank sends its keys and values k-1 times forward, and keys, values and their
    gradients k-1 times plus the gradients once backward, in 2k-1 sequential messages."""
    wire = policy.kv_bytes_per_token * (6 * (k - 1) + 2) / k * 8  # bits per document token
    beta = 0.0 if math.isinf(link.bandwidth_bps) else wire / link.bandwidth_bps
    gamma = policy.layers * (2 * k - 1) * link.latency_s
    return beta, gamma


def min_split_length(k: int, cost: CostModel, policy: SplitPolicy, link: LinkTier) -> float:
    """The shortest document worth splitting over ``k`` ranks on ``link``: where the compute the
    busiest rank saves, ``(a*s + b*s**2)(k-1)/k``, equals the exchange time ``beta*s + gamma``.
    With ``b = 6*h*L/F`` (the attention FLOP rate ``F``) and ``beta`` proportional to
    ``bytes/B``, this is the closed form ``s ~ F * bytes * (k-1) / B`` of Zeppelin's
    local / intra-node / inter-node classification."""
    if k < 2:
        return math.inf
    beta, gamma = _kv_exchange(k, policy, link)
    f = (k - 1) / k
    qa, qb, qc = cost.b * f, cost.a * f - beta, -gamma
    if qa == 0:
        return -qc / qb if qb > 0 else math.inf
    disc = qb * qb - 4 * qa * qc
    return (-qb + math.sqrt(disc)) / (2 * qa)


def split_pays(
    length: int, k: int, cost: CostModel, policy: SplitPolicy, link: LinkTier
) -> tuple[bool, float, float]:
    """Whether splitting a ``length``-token document over ``k`` ranks on ``link`` saves time:
    ``(pays, compute saved on the busiest rank, exchange time)``."""
    saving = cost.doc(length) - cost.split_piece(length, k)
    beta, gamma = _kv_exchange(k, policy, link)
    comm = beta * length + gamma
    return length >= 2 * k and saving > comm, saving, comm


def _check(lengths: Sequence[int], world: int, token_cap: int | None) -> None:
    if world < 1:
        raise ValueError(f"plan: world={world} must be >= 1.")
    if any(int(n) <= 0 for n in lengths):
        raise ValueError("plan: every document needs at least one token.")
    if token_cap is not None and lengths:
        need = math.ceil(sum(lengths) / world) + max(lengths)
        if token_cap < need:
            raise ValueError(
                f"token cap {token_cap} is too small for {len(lengths)} documents of "
                f"{sum(lengths)} tokens on {world} ranks: raise it to at least {need} (the "
                "per-rank share plus the longest document), or draw fewer tokens per step."
            )


def _contiguous(order: Sequence[int], lengths: Sequence[int], world: int) -> list[list[int]]:
    """Cut ``order`` into ``world`` runs of about equal tokens: each document goes to the rank
    its middle token falls in."""
    total = sum(lengths[i] for i in order)
    runs: list[list[int]] = [[] for _ in range(world)]
    before = 0
    for i in order:
        mid = before + lengths[i] / 2
        runs[min(world - 1, int(mid * world // total))].append(i)
        before += lengths[i]
    return runs


def _lpt(
    items: Sequence[int],
    weight: Sequence[float],
    lengths: Sequence[int],
    loads: list[float],
    tokens: list[int],
    cap: int | None,
) -> list[list[int]]:
    world = len(loads)
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(items, key=lambda j: (-weight[j], j)):
        room = [r for r in range(world) if cap is None or tokens[r] + lengths[i] <= cap]
        if not room:  # unreachable with a cap that passed _check
            raise ValueError(f"plan: no rank has room for document {i} under the token cap.")
        r = min(room, key=lambda q: (loads[q], q))
        out[r].append(i)
        loads[r] += weight[i]
        tokens[r] += lengths[i]
    return out


def _kk(items: Sequence[int], weight: Sequence[float], preload: Sequence[float]) -> list[list[int]]:
    """Karmarkar–Karp's largest differencing method for R-way partitions, starting from
    ``preload`` (the rank loads already placed). Returns the items per rank."""
    world = len(preload)
    counter = itertools.count()
    # a partition: list of (sum, rank or -1, items), heaviest first
    Part = list[tuple[float, int, list[int]]]

    def push(heap: list[tuple[float, int, Part]], part: Part) -> None:
        part.sort(key=lambda p: (-p[0], p[1], p[2]))
        heapq.heappush(heap, (-(part[0][0] - part[-1][0]), next(counter), part))

    heap: list[tuple[float, int, Part]] = []
    if any(preload):
        push(heap, [(preload[r], r, []) for r in range(world)])
    for i in items:
        push(heap, [(weight[i], -1, [i])] + [(0.0, -1, []) for _ in range(world - 1)])
    if not heap:
        return [[] for _ in range(world)]
    while len(heap) > 1:
        _, _, x = heapq.heappop(heap)
        _, _, y = heapq.heappop(heap)
        merged: Part = []
        for (sx, rx, ix), (sy, ry, iy) in zip(x, reversed(y), strict=True):
            merged.append((sx + sy, max(rx, ry), ix + iy))
        push(heap, merged)
    final = heap[0][2]
    out: list[list[int]] = [[] for _ in range(world)]
    free = iter(sorted(set(range(world)) - {r for _, r, _ in final if r >= 0}))
    for _, r, part_items in final:
        out[r if r >= 0 else next(free)] = sorted(part_items)
    return out


def plan(
    lengths: Sequence[int],
    world: int,
    *,
    strategy: str = "cost",
    cost: CostModel | None = None,
    method: str = "lpt",
    token_cap: int | None = None,
    seed: int = 0,
    split: SplitPolicy | None = None,
) -> Plan:
    """Assign documents of ``lengths`` to ``world`` ranks (see the module docstring).

    ``cost`` is needed by the ``cost`` strategy and for the loads reported (without it, loads
    are tokens). ``seed`` drives the ``random`` strategy's shuffle. ``split`` enables splitting
    (``cost`` strategy only).

    Raises:
        ValueError: an unknown strategy or method, a token cap below the per-rank share plus
            the longest document, ``cost`` missing for the ``cost`` strategy, or ``split`` with
            another strategy.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}.")
    if strategy == "cost" and cost is None:
        raise ValueError("the cost strategy needs a cost model (cost=CostModel(...)).")
    if split is not None and strategy != "cost":
        raise ValueError(f"splitting documents needs the cost strategy, not {strategy!r}.")
    lengths = [int(n) for n in lengths]
    _check(lengths, world, token_cap)
    costs = [cost.doc(s) if cost is not None else float(s) for s in lengths]
    lower = max(max(costs, default=0.0), sum(costs) / world)
    runs, used = _unsplit(lengths, costs, world, strategy, method, token_cap, seed)
    pieces = [[Piece(i) for i in run] for run in runs]
    base = Plan(
        assignment=pieces,
        loads=[sum(costs[i] for i in run) for run in runs],
        tokens=[sum(lengths[i] for i in run) for run in runs],
        lower_bound=lower,
        strategy=strategy,
        method=used,
    )
    if split is None or world == 1 or not lengths:
        return base
    assert cost is not None
    decisions, groups = _split_decisions(lengths, costs, world, cost, split)
    if groups:
        joint = _joint_lpt(lengths, costs, groups, world, cost, split, token_cap)
        if joint is not None and joint.makespan < base.makespan:
            joint.lower_bound, joint.strategy, joint.splits = lower, strategy, decisions
            return joint
        no_gain = "not split: the plan is no shorter with it"
        decisions = [dataclasses.replace(d, k=1, tier=no_gain) if d.k > 1 else d for d in decisions]
    base.splits = decisions
    return base


def _unsplit(
    lengths: list[int],
    costs: list[float],
    world: int,
    strategy: str,
    method: str,
    token_cap: int | None,
    seed: int,
) -> tuple[list[list[int]], str]:
    """Documents per rank, whole, and the method that placed them."""
    n = len(lengths)
    if strategy in ("sequential", "random", "length"):
        order = list(range(n))
        if strategy == "random":
            gen = torch.Generator().manual_seed(seed)
            order = torch.randperm(n, generator=gen).tolist()
        elif strategy == "length":
            order.sort(key=lambda i: (-lengths[i], i))
        return (_contiguous(order, lengths, world) if n else [[] for _ in range(world)]), (
            "contiguous"
        )
    weight = costs if strategy == "cost" else [float(s) for s in lengths]
    if method == "kk":
        runs = _kk(range(n), weight, [0.0] * world)
        over = [sum(lengths[i] for i in r) for r in runs]
        if token_cap is None or max(over, default=0) <= token_cap:
            return runs, "kk"
        logger.info(
            "Karmarkar-Karp's plan puts %d tokens on one rank, over the cap of %d: "
            "placed by LPT instead (Plan.method 'lpt')",
            max(over),
            token_cap,
        )
    return _lpt(range(n), weight, lengths, [0.0] * world, [0] * world, token_cap), "lpt"


def _split_decisions(
    lengths: list[int], costs: list[float], world: int, cost: CostModel, policy: SplitPolicy
) -> tuple[list[SplitDecision], list[tuple[int, int, bool]]]:
    """For each document costing more than the fair share ``sum(c)/R``: over how many ranks to
    split it, ``k = ceil(c / fair)`` (at most a node's inside one, at most ``max_k``), on the
    widest tier where it pays. Returns the decisions and the splits ``(doc, k, in one node)``."""
    fair = sum(costs) / world
    node = policy.node_size or world
    several_nodes = node < world
    limit = min(world, policy.max_k or world)
    decisions, groups = [], []
    for i in sorted(range(len(lengths)), key=lambda j: (-costs[j], j)):
        if costs[i] <= fair:
            continue
        want = min(limit, math.ceil(costs[i] / fair), lengths[i] // 2)
        options: list[tuple[int, LinkTier, bool]] = []
        if want > node and several_nodes:
            options.append((want, policy.inter, False))
        if min(want, node) >= 2:
            options.append((min(want, node), policy.intra, several_nodes))
        reason, saving, comm = "not split: fewer than 2 tokens per chunk", 0.0, 0.0
        chosen, refused = None, None
        for k, link, in_node in options:
            pays, saving, comm = split_pays(lengths[i], k, cost, policy, link)
            if pays:
                chosen = (k, link, in_node)
                break
            reason = f"not split: the {link.name} link costs more than it saves"
            refused = refused or f"k={k} over the {link.name} link"
        if chosen is None:
            decisions.append(SplitDecision(i, lengths[i], 1, reason, saving, comm, refused))
            continue
        k, link, in_node = chosen
        decisions.append(SplitDecision(i, lengths[i], k, link.name, saving, comm, refused))
        groups.append((i, k, in_node))
    return decisions, groups


def _joint_lpt(
    lengths: list[int],
    costs: list[float],
    groups: list[tuple[int, int, bool]],
    world: int,
    cost: CostModel,
    policy: SplitPolicy,
    cap: int | None,
) -> Plan | None:
    """LPT over whole documents and split ones together, most costly per rank first: a split
    document over ``k`` ranks goes to the ``k`` least-loaded ones with room (inside the node
    whose ``k`` least-loaded end lowest, when it must stay in a node). ``None`` when a split
    finds no room under the cap."""
    split_of = {doc: (k, in_node) for doc, k, in_node in groups}
    node = policy.node_size or world
    nodes = [list(range(s, min(s + node, world))) for s in range(0, world, node)]
    loads, tokens = [0.0] * world, [0] * world
    pieces: list[list[Piece]] = [[] for _ in range(world)]

    def per_rank(i: int) -> float:
        k = split_of.get(i, (1, False))[0]
        return cost.split_piece(lengths[i], k) if k > 1 else costs[i]

    for i in sorted(range(len(lengths)), key=lambda j: (-per_rank(j), j)):
        k, in_node = split_of.get(i, (1, False))
        share = math.ceil(lengths[i] / k)
        room = [r for r in range(world) if cap is None or tokens[r] + share <= cap]
        if k == 1:
            if not room:
                return None
            chosen = [min(room, key=lambda r: (loads[r], r))]
        else:
            pools = [[r for r in g if r in room] for g in nodes] if in_node else [room]
            options = [sorted(p, key=lambda r: (loads[r], r))[:k] for p in pools if len(p) >= k]
            if not options:
                return None
            chosen = min(options, key=lambda g: (max(loads[r] for r in g), g[0]))
        ring = tuple(sorted(chosen))
        for index, r in enumerate(ring):
            pieces[r].append(Piece(i, ring, index) if k > 1 else Piece(i))
            loads[r] += per_rank(i)
            tokens[r] += share
    for p in pieces:
        p.sort(key=lambda q: (not q.split, q.doc))
    return Plan(
        assignment=pieces,
        loads=loads,
        tokens=tokens,
        lower_bound=0.0,
        strategy="cost",
        method="lpt",
    )


def spread_over_steps(
    pieces: Sequence[Piece], lengths: Sequence[int], steps: int, cost: CostModel | None
) -> list[list[Piece]]:
    """A rank's pieces of a round spread over its ``steps`` inner steps: split pieces in the
    first step (every rank sharing a split meets it there), whole documents by LPT on cost."""
    out: list[list[Piece]] = [[] for _ in range(steps)]
    load = [0.0] * steps
    for p in pieces:
        if p.split:
            out[0].append(p)
            load[0] += cost.doc(lengths[p.doc]) if cost is not None else lengths[p.doc]
    whole = [p for p in pieces if not p.split]
    for p in sorted(whole, key=lambda q: (-lengths[q.doc], q.doc)):
        w = cost.doc(lengths[p.doc]) if cost is not None else float(lengths[p.doc])
        t = min(range(steps), key=lambda j: (load[j], j))
        out[t].append(p)
        load[t] += w
    return out
