"""Causal attention over a document split across ranks: the zig-zag layout and a ring exchange.

A document of ``s`` tokens split over ``k`` ranks is cut into ``2k`` chunks of nearly equal size
(the first ``s mod 2k`` one token longer); rank ``i`` of the split holds chunks ``i`` and
``2k-1-i``, so every rank holds one early and one late chunk and does the same causal attention
work. Each rank computes its queries, keys and values for its own tokens; :class:`RingAttention`
then passes every rank's keys and values around the ring (``k-1`` exchanges, each overlapped with
the attention over the block in hand) and merges the partial results with their log-sum-exp, so
the output equals full causal attention over the whole document. The backward pass sends the
blocks around once more with their key and value gradients, which arrive back at their owner
after ``k`` hops.

Blocks are compared chunk by chunk: a query chunk sees an earlier key chunk fully, its own
causally, and a later one not at all.

Example (inside each of the ``k`` ranks of the split; ``group`` a process group of all ranks)::

    ring = RingAttention(group, ranks=(0, 1), index=rank, sizes=zigzag_sizes(s, 2))
    idx = zigzag_take(doc_tokens, ring.sizes, ring.index)
    packed = Packed(lengths=[len(idx)], positions=zigzag_positions(ring.sizes, ring.index),
                    split=ring)
    _, loss = model(idx[None], targets[None], packed=packed, reduction="sum")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RingAttention", "zigzag_positions", "zigzag_sizes", "zigzag_take"]


def zigzag_sizes(length: int, k: int) -> tuple[int, ...]:
    """Sizes of the ``2k`` chunks of a ``length``-token document (the first ``length mod 2k``
    are one token longer).

    Raises:
        ValueError: ``k < 1`` or the document has fewer than ``2k`` tokens.
    """
    if k < 1:
        raise ValueError(f"A document is split over k >= 1 ranks, got k={k}.")
    if length < 2 * k:
        raise ValueError(
            f"A document of {length} tokens cannot be split over {k} ranks: the zig-zag layout "
            f"needs at least 2k = {2 * k} tokens."
        )
    base, extra = divmod(length, 2 * k)
    return tuple(base + (1 if j < extra else 0) for j in range(2 * k))


def _chunks_of(index: int, k: int) -> tuple[int, int]:
    return index, 2 * k - 1 - index


def _bounds(sizes: Sequence[int], chunk: int) -> tuple[int, int]:
    start = sum(sizes[:chunk])
    return start, start + sizes[chunk]


def zigzag_positions(sizes: Sequence[int], index: int) -> torch.Tensor:
    """Positions in the document of the tokens rank ``index`` of the split holds, in order."""
    k = len(sizes) // 2
    return torch.cat([torch.arange(*_bounds(sizes, c)) for c in _chunks_of(index, k)])


def zigzag_take(tokens: torch.Tensor, sizes: Sequence[int], index: int) -> torch.Tensor:
    """Rank ``index``'s tokens of ``tokens`` (the whole document, 1-D), in order."""
    k = len(sizes) // 2
    return torch.cat([tokens[slice(*_bounds(sizes, c))] for c in _chunks_of(index, k)])


class RingAttention:
    """Causal attention for rank ``ranks[index]``'s part of a document split over ``ranks``
    (global ranks, in ring order), exchanging keys and values over ``group`` (a process group
    holding all of them; its point-to-point messages must not interleave with another split's,
    so every rank processes its splits in the same order). Callable as
    :class:`lowcomm.models.gpt.SplitAttention`."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        ranks: Sequence[int],
        index: int,
        sizes: Sequence[int],
    ) -> None:
        if len(sizes) != 2 * len(ranks):
            raise ValueError(
                f"{len(ranks)} ranks need 2k = {2 * len(ranks)} chunk sizes, got {len(sizes)}."
            )
        if not 0 <= index < len(ranks):
            raise ValueError(f"index {index} is not a position in ranks {list(ranks)}.")
        self.group = group
        self.ranks = tuple(int(r) for r in ranks)
        self.index = index
        self.sizes = tuple(int(n) for n in sizes)
        self.bytes_sent = 0
        """Bytes this rank has sent for this split (keys and values, and their gradients)."""

    @property
    def k(self) -> int:
        return len(self.ranks)

    def local_size(self, index: int) -> int:
        a, b = _chunks_of(index, self.k)
        return self.sizes[a] + self.sizes[b]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _RingFunction.apply(q, k, v, self)
        return out

    # --- the exchange -------------------------------------------------------------------------

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
        """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous one
        (asynchronously: wait on the returned works)."""
        k = self.k
        nxt, prev = self.ranks[(self.index + 1) % k], self.ranks[(self.index - 1) % k]
        self.bytes_sent += send.numel() * send.element_size()
        ops = [
            dist.P2POp(dist.isend, send, nxt, group=self.group),
            dist.P2POp(dist.irecv, recv, prev, group=self.group),
        ]
        return list(dist.batch_isend_irecv(ops))


def _relation(q_chunk: int, kv_chunk: int) -> str | None:
    if kv_chunk < q_chunk:
        return "full"
    if kv_chunk == q_chunk:
        return "causal"
    return None


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, relation: str) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if relation == "causal":
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _flash_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, relation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one key block and the log-sum-exp of its scores (CPU: torch's
    flash kernel; elsewhere: the scores in memory)."""
    if _flash_cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, relation == "causal", scale=scale
        )
        return out, lse.to(q.dtype)
    s = _scores(q, k, scale, relation)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    relation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv, given the *final* output and log-sum-exp of the rows."""
    if _flash_cpu(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out.contiguous(),
            lse.contiguous(),
            0.0,
            relation == "causal",
            scale=scale,
        )
        return dq, dk, dv
    p = torch.exp(_scores(q, k, scale, relation) - lse[..., None])
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v.transpose(-2, -1))
    ds = p * (dp - (dout * out).sum(dim=-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _pairs(ring: RingAttention, owner: int) -> list[tuple[slice, slice, str]]:
    """(query rows, key rows, relation) of every block pair between this rank's queries and
    ``owner``'s keys that attends at all."""
    k = ring.k
    mine, theirs = _chunks_of(ring.index, k), _chunks_of(owner, k)
    q_offsets = (0, ring.sizes[mine[0]])
    kv_offsets = (0, ring.sizes[theirs[0]])
    pairs = []
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(theirs):
            rel = _relation(qc, kc)
            if rel is not None:
                qs = slice(q_offsets[qi], q_offsets[qi] + ring.sizes[qc])
                ks = slice(kv_offsets[ki], kv_offsets[ki] + ring.sizes[kc])
                pairs.append((qs, ks, rel))
    return pairs


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingAttention
    ) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        held = torch.stack([k, v]).contiguous()
        n = ring.k
        for step in range(n):
            owner = (ring.index - step) % n
            works: list[Any] = []
            if step < n - 1:  # the next block travels while this one is attended to
                nxt = torch.empty(
                    (2, *k.shape[:-2], ring.local_size((owner - 1) % n), k.shape[-1]),
                    dtype=k.dtype,
                    device=k.device,
                )
                works = ring.exchange(held, nxt)
            for qs, ks, rel in _pairs(ring, owner):
                block_out, block_lse = _block_forward(
                    q[..., qs, :], held[0][..., ks, :], held[1][..., ks, :], scale, rel
                )
                new_lse = torch.logaddexp(lse[..., qs], block_lse)
                out[..., qs, :] = (
                    out[..., qs, :] * torch.exp(lse[..., qs] - new_lse)[..., None]
                    + block_out * torch.exp(block_lse - new_lse)[..., None]
                )
                lse[..., qs] = new_lse
            for w in works:
                w.wait()
            if works:
                held = nxt
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        ring: RingAttention = ctx.ring
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        scale = 1.0 / math.sqrt(q.shape[-1])
        dq = torch.zeros_like(q)
        # the block in hand: its keys, values and the gradients gathered for them so far
        held = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)]).contiguous()
        n = ring.k
        for step in range(n):
            owner = (ring.index - step) % n
            kb, vb, dk, dv = held[0], held[1], held[2], held[3]
            for qs, ks, rel in _pairs(ring, owner):
                dq_b, dk_b, dv_b = _block_backward(
                    grad_out[..., qs, :],
                    q[..., qs, :],
                    kb[..., ks, :],
                    vb[..., ks, :],
                    out[..., qs, :],
                    lse[..., qs],
                    scale,
                    rel,
                )
                dq[..., qs, :] += dq_b
                dk[..., ks, :] += dk_b
                dv[..., ks, :] += dv_b
            if n == 1:
                break
            prev_owner = (owner - 1) % n
            if step < n - 1:  # pass the block on with its gradients
                nxt = torch.empty(
                    (4, *k.shape[:-2], ring.local_size(prev_owner), k.shape[-1]),
                    dtype=k.dtype,
                    device=k.device,
                )
                for w in ring.exchange(held, nxt):
                    w.wait()
                held = nxt
            else:  # the block in hand is the next rank's: its gradients go home
                grads = held[2:].contiguous()
                mine = torch.empty_like(torch.stack([k, v]))
                for w in ring.exchange(grads, mine):
                    w.wait()
                held = torch.stack([k, v, mine[0], mine[1]])
        return dq, held[2], held[3], None
