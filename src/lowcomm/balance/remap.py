"""Zeppelin's remapping layer: linear layers on equal tokens, attention on equal ``s²`` work.

Chen et al. 2025 ("Zeppelin: Balancing Variable-length Workloads in Data Parallel Large Model
Training") balance the two parts of a transformer layer separately. The linear layers (QKV, the
output projection, the MLP, the norms) cost the same per token, so they run on a **token
layout**: the step's documents, back to back, cut into ``R`` contiguous runs of equal tokens
(one per rank, whatever the documents). Attention costs ``s²`` per document and needs a whole
document on one rank, so it runs on an **attention layout**: whole documents assigned to ranks
so that ``Σ s²`` is balanced (:func:`attention_owners`, LPT on ``s²``). Between the two, an
all-to-all (``all_to_all_single``) sends every token's queries, keys and values from the rank
that holds it in the token layout to the one that holds its document in the attention layout,
and the attention output back; backward runs the same exchanges in reverse (the collective is
differentiable: its backward sends the gradients back the way the rows came).

:class:`Remap` is the exchange plan for one step, the same on every rank (it depends only on the
step's document lengths and owners, which every rank has from the planner's all-gather);
:func:`remapped_loss` is lowcomm's GPT forward with its attention cores remapped: the sum of the
token losses of this rank's token-layout tokens. Summed over ranks (and the gradients
all-reduced) it is exactly the plain model's loss over all the documents, and its gradients
(tested in fp64 on 2 and 4 gloo ranks). Where remapping pays is a property of the link, like
splitting: the exchange carries ``3·h`` activations per token forward (and ``h`` back), twice
that in backward, per layer, so it belongs inside a node, never across a slow link.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowcomm.balance.cost import CostModel
from lowcomm.balance.planner import Piece, Plan
from lowcomm.models.gpt import GPT, Block

__all__ = [
    "Remap",
    "all_to_all",
    "attention_owners",
    "exchange_bytes",
    "remap_pays",
    "remap_plan",
    "remapped_loss",
    "token_bounds",
]


def token_bounds(total: int, world: int) -> list[tuple[int, int]]:
    """The token layout: ``[start, end)`` of each rank's run of the step's ``total`` tokens,
    equal to within one token (the first ``total mod world`` ranks one more)."""
    base, extra = divmod(total, world)
    out, start = [], 0
    for r in range(world):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out


def attention_owners(lengths: Sequence[int], world: int) -> list[int]:
    """The attention layout: the rank that runs each document's attention, by LPT on ``s²``
    (longest first, to the least loaded rank; ties to the lower rank, so every rank computes
    the same owners)."""
    loads = [0.0] * world
    owners = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = min(range(world), key=lambda k: (loads[k], k))
        owners[i] = r
        loads[r] += float(lengths[i]) ** 2
    return owners


@dataclass(frozen=True)
class Remap:
    """The exchanges of one step between the token layout and the attention layout.

    ``lengths`` are the step's documents in their global order (back to back: the token
    stream), ``owners`` the rank that runs each one's attention. Built on every rank from the
    same inputs; :meth:`to_attention` and :meth:`to_tokens` are this rank's halves of the
    all-to-all exchanges."""

    lengths: tuple[int, ...]
    owners: tuple[int, ...]
    world: int
    rank: int

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.owners):
            raise ValueError("Remap: one owner per document")
        if any(n <= 0 for n in self.lengths):
            raise ValueError("Remap: every document needs at least one token")
        if any(not 0 <= o < self.world for o in self.owners):
            raise ValueError(f"Remap: owners must be ranks of a world of {self.world}")

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def _starts(self) -> list[int]:
        out, pos = [], 0
        for n in self.lengths:
            out.append(pos)
            pos += n
        return out

    def attention_tokens(self, rank: int) -> list[int]:
        """Global token indices ``rank`` holds in the attention layout: its documents whole,
        in document order."""
        starts = self._starts()
        out: list[int] = []
        for i, (s, n) in enumerate(zip(starts, self.lengths, strict=True)):
            if self.owners[i] == rank:
                out.extend(range(s, s + n))
        return out

    def attention_lengths(self, rank: int | None = None) -> list[int]:
        """Lengths of the documents ``rank`` (default: this one) attends over, in order."""
        r = self.rank if rank is None else rank
        return [n for n, o in zip(self.lengths, self.owners, strict=True) if o == r]

    def moved_tokens(self, rank: int) -> int:
        """Tokens ``rank`` sends or receives in one exchange (the larger of the two): those of
        its run whose document another rank attends over, or those of its documents another
        rank's run holds."""
        bounds = token_bounds(self.total, self.world)
        start, end = bounds[rank]
        sent = received = 0
        pos = 0
        for n, owner in zip(self.lengths, self.owners, strict=True):
            inside = max(0, min(end, pos + n) - max(start, pos))
            if owner != rank:
                sent += inside
            elif owner == rank:
                received += n - inside
            pos += n
        return max(sent, received)

    def bounds(self) -> tuple[int, int]:
        """This rank's run ``[start, end)`` of the token stream."""
        return token_bounds(self.total, self.world)[self.rank]

    def positions(self) -> torch.Tensor:
        """Each of this rank's token-layout tokens' position in its document."""
        pos = torch.cat([torch.arange(n) for n in self.lengths])
        start, end = token_bounds(self.total, self.world)[self.rank]
        return pos[start:end]

    @functools.cached_property
    def _exchange(self) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """(indices into this rank's token run to send, grouped by destination rank; where
        each sent row goes back; how many go to each rank; how many come from each rank).
        Both layouts keep the tokens in their global order (the token runs are contiguous, a
        rank's documents are taken in order), so what arrives, source after source, is
        already in attention-layout order. Computed once per step."""
        owner_of = torch.repeat_interleave(
            torch.tensor(self.owners, dtype=torch.long), torch.tensor(self.lengths)
        )
        bounds = token_bounds(self.total, self.world)
        start, end = bounds[self.rank]
        mine = owner_of[start:end]
        send_index = torch.argsort(mine, stable=True)
        place = torch.empty_like(send_index)
        place[send_index] = torch.arange(len(send_index))
        send_counts = torch.bincount(mine, minlength=self.world).tolist()
        recv_counts = [int((owner_of[a:b] == self.rank).sum()) for a, b in bounds]
        return send_index, place, send_counts, recv_counts

    @functools.cached_property
    def _on_devices(self) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    def _indices_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``_exchange``'s two index tensors on ``device``, copied there once: every layer
        exchanges twice a step, and each copy from the host would stall a GPU's stream."""
        if device not in self._on_devices:
            send_index, place, _, _ = self._exchange
            self._on_devices[device] = (send_index.to(device), place.to(device))
        return self._on_devices[device]

    def to_attention(self, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """This rank's token-layout rows of ``x`` (tokens first) -> its attention-layout rows
        (differentiable)."""
        _, _, send_counts, recv_counts = self._exchange
        sent = x[self._indices_on(x.device)[0]]
        return all_to_all(sent, recv_counts, send_counts, group)

    def to_tokens(self, y: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The inverse of :meth:`to_attention`: attention-layout rows -> token-layout rows."""
        _, _, send_counts, recv_counts = self._exchange
        got = all_to_all(y, send_counts, recv_counts, group)
        return got[self._indices_on(y.device)[1]]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``all_to_all_single`` of ``x``'s rows (``in_splits`` to each rank, ``out_splits`` from
    each), differentiable."""
    out = _AllToAll.apply(x, out_splits, in_splits, group)
    assert isinstance(out, torch.Tensor)
    return out


def remap_plan(
    lengths: Sequence[int], world: int, rank: int, cost: CostModel | None
) -> tuple[Plan, Remap]:
    """The ``remap`` assignment of one step's documents: the exchange plan and, for the
    records, a :class:`~lowcomm.balance.planner.Plan` whose assignment is the attention layout
    (each rank's whole documents) and whose loads are the cost model's time per rank: its run
    of tokens' linear work (``c0 + a * tokens``) plus its documents' attention
    (``d + b * s**2`` each)."""
    lengths = [int(n) for n in lengths]
    owners = attention_owners(lengths, world)
    remap = Remap(tuple(lengths), tuple(owners), world, rank)
    bounds = token_bounds(sum(lengths), world)
    runs = [[i for i, o in enumerate(owners) if o == r] for r in range(world)]
    if cost is None:
        loads = [float(b - a) for a, b in bounds]
    else:
        loads = [
            cost.c0 + cost.a * (b - a) + sum(cost.d + cost.b * lengths[i] ** 2 for i in runs[r])
            for r, (a, b) in enumerate(bounds)
        ]
    whole = [cost.doc(n) if cost is not None else float(n) for n in lengths]
    lower = max(max(whole, default=0.0), sum(whole) / world)
    out = Plan(
        assignment=[[Piece(i) for i in run] for run in runs],
        loads=loads,
        tokens=[b - a for a, b in bounds],
        lower_bound=lower,
        strategy="remap",
        method="remap",
    )
    return out, remap


def remap_pays(
    remapped: Plan, base: Plan, remap: Remap, exchange_s_per_token: float | None
) -> bool:
    """Whether the ``remap`` step beats the cost-balanced plan of the same documents: its
    slowest rank's compute plus the exchanges (``exchange_s_per_token`` times the tokens the
    busiest rank sends or receives; None: not measured, remap) against the cost plan's
    makespan. Every rank decides alike (the same plans, the same measured rate)."""
    if exchange_s_per_token is None:
        return True
    moved = max(remap.moved_tokens(r) for r in range(remap.world))
    return max(remapped.loads) + exchange_s_per_token * moved < base.makespan


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]
) -> torch.Tensor:
    """Causal attention per document: ``q``, ``k``, ``v`` are ``(tokens, heads, head size)``."""
    parts, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        out = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True
        )
        parts.append(out.transpose(0, 1))
        start += n
    if not parts:
        return q.new_zeros((0, *q.shape[1:]))
    return torch.cat(parts)


def remapped_loss(
    gpt: GPT,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    remap: Remap,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sum of the token losses of this rank's token-layout tokens (``tokens`` and ``targets``:
    the 1-D slice ``token_bounds(...)[rank]`` of the step's token stream), with every layer's
    attention core on the attention layout (module docstring). ``gpt`` is a
    :class:`~lowcomm.models.gpt.GPT` without dropout; its forward is followed operation for
    operation: embeddings, then per block ``x + proj(attn(ln_1 x))`` and ``x + mlp(ln_2 x)``,
    the final norm and the tied head."""
    config = gpt.config
    if config.dropout:
        raise ValueError("remapped_loss runs a GPT without dropout (its masks are per token)")
    heads, width = config.n_head, config.n_embd
    size = width // heads
    pos = remap.positions().to(tokens.device)
    x = gpt.wte(tokens) + gpt.wpe(pos)
    lengths = remap.attention_lengths()
    for block in gpt.blocks:
        assert isinstance(block, Block)
        attn = block.attn
        qkv = attn.c_attn(block.ln_1(x))  # (tokens, 3 * width), token layout
        moved = remap.to_attention(qkv, group)
        q, k, v = moved.split(width, dim=1)
        y = _attention(
            q.view(-1, heads, size), k.view(-1, heads, size), v.view(-1, heads, size), lengths
        )
        back = remap.to_tokens(y.reshape(-1, width), group)
        x = x + attn.resid_dropout(attn.c_proj(back))
        x = x + block.mlp(block.ln_2(x))
    logits = gpt.lm_head(gpt.ln_f(x))
    if logits.shape[0] == 0:
        return logits.sum()
    return F.cross_entropy(logits, targets, reduction="sum")


def exchange_bytes(tokens: int, width: int, layers: int, element: int = 4) -> int:
    """Bytes one rank sends in one step's remapping at most (every token leaves): forward the
    queries, keys and values (``3·h``) and the output back (``h``), backward the same again."""
    return 2 * 4 * width * tokens * layers * element if tokens else 0
