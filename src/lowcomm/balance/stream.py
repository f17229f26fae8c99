"""This rank's documents, step by step: draw, all-gather the lengths, plan, pack.

Every plan unit (one step, or a whole round of ``steps_per_unit`` inner steps for an outer
algorithm, which only waits for the others once a round) each rank draws its own token budget
(:class:`~lowcomm.balance.documents.DocumentSampler`), all-gathers the ``(doc, start,
length)`` of its pieces, and runs :func:`~lowcomm.balance.planner.plan` on the gathered list:
the same inputs on every rank, so the same plan, with no broadcast. The gather of the next unit
is started when a unit begins and waited for when it ends, so it travels while the steps
compute. A rank's share of a round is spread over the round's steps by cost
(:func:`~lowcomm.balance.planner.spread_over_steps`).

A step's pieces are packed into micro-batches of at most ``cap`` tokens (first-fit decreasing),
each a :class:`~lowcomm.models.gpt.Packed` input; a split document's part is a micro-batch of
its own with a :class:`~lowcomm.balance.ring.RingAttention`. The loss of a micro-batch is its
token sum divided by ``tokens_per_step`` (the mean tokens per rank per step), i.e. the token
sum times the world size over the global token count, so the averaged gradient is the same
whichever rank holds which document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.balance.cost import CostModel
from lowcomm.balance.documents import MIN_DOC_TOKENS, DocumentCorpus, DocumentSampler
from lowcomm.balance.planner import (
    STRATEGIES,
    Piece,
    Plan,
    SplitPolicy,
    plan,
    spread_over_steps,
)
from lowcomm.balance.remap import Remap, remap_pays, remap_plan
from lowcomm.balance.ring import RingAttention, zigzag_positions, zigzag_sizes, zigzag_take
from lowcomm.device import collective_device
from lowcomm.models.gpt import Packed

__all__ = [
    "ASSIGNMENTS",
    "DocumentStream",
    "MicroBatch",
    "RemapWork",
    "StepWork",
    "parse_assignments",
]


@dataclass
class MicroBatch:
    """One forward and backward: ``model(x, y, packed=packed, reduction="sum")``."""

    x: torch.Tensor
    y: torch.Tensor
    packed: Packed
    lengths: list[int]
    """Document lengths (for a split piece, the whole document's)."""
    split_k: int = 1


@dataclass
class StepWork:
    """This rank's work for one inner step."""

    micro_batches: list[MicroBatch]
    tokens: int
    """Tokens (predictions) this rank trains on in the step."""
    predicted_s: float
    """The cost model's compute time for them."""
    unit: int
    """The plan unit (step or round) the step belongs to."""
    assignment: str
    """The unit's assignment (an entry of :data:`ASSIGNMENTS`)."""
    plan: Plan
    """The unit's plan (the same on every rank)."""
    first_of_unit: bool = False
    remap: RemapWork | None = None
    """With ``remap``: this rank's run of the step's tokens and the exchange plan (then
    ``micro_batches`` is empty)."""


@dataclass
class RemapWork:
    """One step of the ``remap`` assignment (:mod:`lowcomm.balance.remap`): this rank's run of
    the step's token stream, its targets, and the exchanges of every layer's attention."""

    x: torch.Tensor
    y: torch.Tensor
    remap: Remap


ASSIGNMENTS = (*STRATEGIES, "cost+split", "remap")
"""What a plan unit's documents are assigned by: a planner strategy, ``cost+split``
(cost-balanced, splitting documents by the ``split`` policy), or ``remap`` (Zeppelin's
remapping: the linear layers on equal runs of tokens, attention on whole documents balanced by
s², :mod:`lowcomm.balance.remap`; one step per unit, one node)."""


def parse_assignments(spec: str | Sequence[str]) -> list[str]:
    """``"random,cost"`` or ``["random", "cost"]`` -> the checked list.

    Raises:
        ValueError: an empty list or an entry not in :data:`ASSIGNMENTS`.
    """
    items = [a.strip() for a in spec.split(",")] if isinstance(spec, str) else list(spec)
    bad = [a for a in items if a not in ASSIGNMENTS]
    if not items or bad:
        raise ValueError(
            f"assignment {bad[0] if bad else spec!r} is not one of {', '.join(ASSIGNMENTS)} "
            "(or a comma-separated list of them, taken in turn per plan unit)"
        )
    return items


class DocumentStream:
    """Per-rank iterator of :class:`StepWork` (see the module docstring).

    ``strategy`` is an entry of :data:`ASSIGNMENTS` or a list of them, taken in turn per plan
    unit (to compare assignments side by side in one run: the averaged gradient does not
    depend on the assignment, so neither does training); with ``paired`` every assignment of a
    turn gets the same documents (each drawn unit is then trained once per assignment: for
    measurements, comparing assignments on identical work). ``split`` is the policy of
    ``cost+split``. ``group`` carries the length gathers (default WORLD); ``ring_group`` the
    split documents' key/value exchanges, a group of every rank that carries nothing else
    (required with ``cost+split``)."""

    def __init__(
        self,
        corpus: DocumentCorpus,
        *,
        cap: int,
        tokens_per_step: int,
        steps_per_unit: int = 1,
        seed: int = 0,
        strategy: str | Sequence[str] = "cost",
        paired: bool = False,
        method: str = "lpt",
        token_cap: int | None = None,
        cost: CostModel | None = None,
        split: SplitPolicy | None = None,
        group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        exchange_s_per_token: float | None = None,
    ) -> None:
        self.assignments = parse_assignments(strategy)
        self.exchange_s_per_token = exchange_s_per_token
        """``remap``: the measured seconds per token its exchanges take in a step (every
        layer, forward and backward); None: not measured, every step remapped."""
        self.paired = paired
        if "cost+split" in self.assignments and (split is None or ring_group is None):
            raise ValueError(
                "cost+split needs split (a SplitPolicy) and ring_group (a group of every rank)."
            )
        self.corpus = corpus
        self.cap = cap
        self.tokens_per_step = tokens_per_step
        self.steps_per_unit = steps_per_unit
        self.seed = seed
        self.method, self.token_cap = method, token_cap
        self.cost, self.split = cost, split
        self.group, self.ring_group = group, ring_group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sampler = DocumentSampler(corpus, cap, seed=seed, rank=self.rank)
        unit_tokens = tokens_per_step * steps_per_unit
        self.capacity = unit_tokens // min(MIN_DOC_TOKENS, cap) + 2
        self.unit = -1
        self._steps: list[list[Piece]] = []
        self._pieces: list[tuple[int, int, int]] = []
        self._plan: Plan | None = None
        self._remap: Remap | None = None
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._start_gather()

    # --- units --------------------------------------------------------------------------------

    def _start_gather(self) -> None:
        mine = self.sampler.draw(self.tokens_per_step * self.steps_per_unit)
        local = torch.full((self.capacity, 3), -1, dtype=torch.int64)
        local[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        device = collective_device(self.group)  # NCCL gathers GPU tensors only
        local = local.to(device)
        out = torch.empty((self.world * self.capacity, 3), dtype=torch.int64, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, local, group=self.group, async_op=True)
        self._pending = (out, work)

    def _finish_gather(self) -> list[tuple[int, int, int]]:
        assert self._pending is not None
        out, work = self._pending
        if work is not None:
            work.wait()
        self._pending = None
        rows = out[out[:, 0] >= 0].tolist()
        return [(int(d), int(s), int(n)) for d, s, n in rows]

    def _unit_seed(self, unit: int) -> int:
        digest = hashlib.blake2b(f"lowcomm-balance:{self.seed}:{unit}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") >> 1

    def _begin_unit(self, pieces: list[tuple[int, int, int]] | None = None) -> None:
        self.unit += 1
        if pieces is None and self.paired and self.unit % len(self.assignments):
            pieces = self._pieces  # the same documents for the next assignment
        if pieces is None:
            self._pieces = self._finish_gather()
            self._start_gather()  # the next unit's lengths travel during this one
        else:  # restored
            self._pieces = pieces
        lengths = [n for _, _, n in self._pieces]
        cap = None
        if self.token_cap is not None:
            cap = self.token_cap * self.steps_per_unit
        self.assignment = self.assignments[self.unit % len(self.assignments)]
        splitting = self.assignment == "cost+split"
        self._remap = None
        if self.assignment == "remap":
            if self.steps_per_unit != 1:
                raise ValueError("remap plans one step per unit (DDP), not a round")
            remapped, remap = remap_plan(lengths, self.world, self.rank, self.cost)
            base = None  # the cost plan, needed only to weigh a measured exchange against
            if self.exchange_s_per_token is not None:
                base = plan(
                    lengths,
                    self.world,
                    strategy="cost" if self.cost is not None else "tokens",
                    cost=self.cost,
                    method=self.method,
                    token_cap=cap,
                    seed=self._unit_seed(self.unit),
                )
            if base is None or remap_pays(remapped, base, remap, self.exchange_s_per_token):
                self._plan, self._remap = remapped, remap
                self._steps = [[]]
                self._step_in_unit = 0
                return
            # the exchange costs more than the balance gains: the cost plan, whole documents
            self._plan = base
            self._steps = [base.assignment[self.rank]]
            self._step_in_unit = 0
            return
        self._plan = plan(
            lengths,
            self.world,
            strategy="cost" if splitting else self.assignment,
            cost=self.cost,
            method=self.method,
            token_cap=cap,
            seed=self._unit_seed(self.unit),
            split=self.split if splitting else None,
        )
        mine = self._plan.assignment[self.rank]
        if self.steps_per_unit == 1:
            self._steps = [mine]
        else:
            self._steps = spread_over_steps(mine, lengths, self.steps_per_unit, self.cost)
        self._step_in_unit = 0

    def next_step(self) -> StepWork:
        """This rank's micro-batches for the next inner step."""
        first = False
        if not self._steps or self._step_in_unit >= self.steps_per_unit:
            self._begin_unit()
            first = True
        pieces = self._steps[self._step_in_unit]
        self._step_in_unit += 1
        assert self._plan is not None
        if self._remap is not None:
            return self._remap_step(first)
        mbs = self._micro_batches(pieces)
        tokens = sum(int(mb.x.shape[1]) for mb in mbs)
        return StepWork(
            micro_batches=mbs,
            tokens=tokens,
            predicted_s=self._predict(mbs),
            unit=self.unit,
            assignment=self.assignment,
            plan=self._plan,
            first_of_unit=first,
        )

    def _remap_step(self, first: bool) -> StepWork:
        """The ``remap`` step: the whole token stream of the unit's pieces, in their gathered
        order; this rank's run of it."""
        assert self._remap is not None and self._plan is not None
        parts = [self.sampler.piece(d, s, n) for d, s, n in self._pieces]
        xs = torch.cat([px for px, _ in parts])
        ys = torch.cat([py for _, py in parts])
        start, end = self._remap.bounds()
        return StepWork(
            micro_batches=[],
            tokens=end - start,
            predicted_s=self._plan.loads[self.rank],
            unit=self.unit,
            assignment=self.assignment,
            plan=self._plan,
            first_of_unit=first,
            remap=RemapWork(
                x=xs[start:end].to(self.device), y=ys[start:end].to(self.device), remap=self._remap
            ),
        )

    def _predict(self, mbs: list[MicroBatch]) -> float:
        if self.cost is None:
            return float("nan")
        total = 0.0
        for mb in mbs:
            if mb.split_k > 1:
                total += self.cost.c0 + self.cost.split_piece(mb.lengths[0], mb.split_k)
            else:
                total += self.cost.batch(mb.lengths)
        return total

    def _micro_batches(self, pieces: list[Piece]) -> list[MicroBatch]:
        out: list[MicroBatch] = []
        for p in sorted((p for p in pieces if p.split), key=lambda q: q.doc):
            doc, start, length = self._pieces[p.doc]
            x, y = self.sampler.piece(doc, start, length)
            sizes = zigzag_sizes(length, len(p.ranks))
            ring = RingAttention(self.ring_group, ranks=p.ranks, index=p.index, sizes=sizes)
            mx, my = zigzag_take(x, sizes, p.index), zigzag_take(y, sizes, p.index)
            packed = Packed(
                lengths=[len(mx)], positions=zigzag_positions(sizes, p.index), split=ring
            )
            out.append(self._mb([mx], [my], packed, [length], len(p.ranks)))
        # whole documents: first-fit decreasing into micro-batches of at most cap tokens
        bins: list[list[int]] = []
        room: list[int] = []
        whole = sorted(
            (p.doc for p in pieces if not p.split), key=lambda d: (-self._pieces[d][2], d)
        )
        for d in whole:
            n = self._pieces[d][2]
            for b in range(len(bins)):
                if room[b] >= n:
                    bins[b].append(d)
                    room[b] -= n
                    break
            else:
                bins.append([d])
                room.append(self.cap - n)
        for docs in bins:
            parts = [self.sampler.piece(*self._pieces[d]) for d in docs]
            lens = [len(px) for px, _ in parts]
            out.append(
                self._mb([px for px, _ in parts], [py for _, py in parts], Packed(lens), lens, 1)
            )
        return out

    def _mb(
        self,
        xs: list[torch.Tensor],
        ys: list[torch.Tensor],
        packed: Packed,
        lengths: list[int],
        k: int,
    ) -> MicroBatch:
        x = torch.cat(xs)[None].to(self.device)
        y = torch.cat(ys)[None].to(self.device)
        return MicroBatch(x=x, y=y, packed=packed, lengths=lengths, split_k=k)

    # --- the loss -----------------------------------------------------------------------------

    def loss_scale(self) -> float:
        """What a micro-batch's token sum is multiplied by: 1 / mean tokens per rank per step."""
        return 1.0 / self.tokens_per_step

    # --- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the unit in progress, the next unit's
        gathered lengths and the sampler's generator."""
        out = None
        if self._pending is not None:
            out, work = self._pending
            if work is not None:
                work.wait()
                self._pending = (out, None)
        return {
            "unit": self.unit,
            "pieces": list(self._pieces),
            "step_in_unit": getattr(self, "_step_in_unit", 0),
            "next": out.clone() if out is not None else None,
            "generator": self.sampler.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].wait()  # the gather every rank started on construction
        self.sampler.generator.set_state(state["generator"])
        self.unit = int(state["unit"]) - 1
        if self.unit >= 0:  # re-plan the unit in progress from its gathered lengths
            self._begin_unit([(int(d), int(s), int(n)) for d, s, n in state["pieces"]])
            self._step_in_unit = int(state["step_in_unit"])
        else:
            self.unit = -1
        self._pending = (state["next"], None)
