"""SparseLoCo's reference, from the paper's equations: every worker's accumulator
e ← β·e + Δ, the top-k of every tile of e quantised to a 4-level (or 16-level) codebook, e less
what was sent, the outer step A ← A − α·Δ̄ with Δ̄ each element's mean over the workers that sent
it (its sum over n^γ, n those workers, with ``sender_power`` γ); at τ > 0 the sync applied τ
steps after its launch (at τ = H one round later), then θ ← A, or θ ← A + (θ − θ_s) with the
delay-corrected merge; with early rounds a sync every H₀ steps for the first W. Written tensor
by tensor and tile by tile, apart from :mod:`lowcomm.compress.sparse`."""

from __future__ import annotations

import math

import torch

from lowcomm.testing.ref_compression import rank_order_mean
from lowcomm.testing.references.world import Reference, World

__all__ = ["SparseLoCoReference"]


def _side(n: int, target: int) -> int:
    """The largest divisor of ``n`` not above ``target``."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


class SparseLoCoReference(Reference):
    aggregation = "senders"
    """Δ̄ of an element: the mean over the workers that sent it (``"senders"``, the paper's);
    ``"sum"`` and ``"mean-over-all"`` (over every worker) are there to be told apart from it."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        hyper = world.hyper
        self.beta = float(hyper["error_decay"])
        self.density = float(hyper["density"])
        self.chunk = int(hyper["chunk"])
        self.bits = int(hyper["bits"])
        self.power = float(hyper["sender_power"])
        self.tau = int(hyper["overlap"])
        self.keep = hyper["merge"] == "delay_corrected"
        self.early_every = int(hyper["early_every"])
        self.early_steps = int(hyper["early_steps"])
        self.errors = [[torch.zeros_like(a) for a in world.anchor] for _ in range(world.n)]
        self.pending: dict[int, list[torch.Tensor]] = {}  # sync point -> Δ̄ launched for it
        self.snapshot: list[list[torch.Tensor]] | None = None  # θ_s of every worker

    def _grid(self, shape: torch.Size) -> tuple[int, int, int, int, int]:
        """rows, cols, tile height, tile width and k of a tensor of ``shape``."""
        n = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 1
        cols = n // rows
        h, w = _side(rows, self.chunk), _side(cols, self.chunk)
        return rows, cols, h, w, min(h * w, max(1, round(self.density * h * w)))

    def _compressed(self, shape: torch.Size) -> bool:
        """Whether the tensor's sparse bytes are fewer than its fp32 bytes."""
        rows, cols, h, w, k = self._grid(shape)
        kept = (rows // h) * (cols // w) * k
        index_bits = max(1, math.ceil(math.log2(h * w)))
        head = 0 if self.bits == 32 else 4 * (1 + 2**self.bits)
        sparse = head + math.ceil(kept * index_bits / 8) + math.ceil(kept * self.bits / 8)
        return sparse < 4 * rows * cols

    def _quantised(self, v: torch.Tensor) -> torch.Tensor:
        """The kept values ``v`` as the receivers decode them."""
        if self.bits == 32:
            return v.clone()
        levels = 2**self.bits
        shift = (v.double().sum() / v.numel()).float()
        c = v - shift
        sigma = math.sqrt(float((c.double() ** 2).sum()) / (v.numel() - 1)) if v.numel() > 1 else 0
        step = torch.tensor(6.0 * sigma / levels, dtype=torch.float32)
        if not (math.isfinite(float(step)) and float(step) > 0):
            step = torch.tensor(1.0)
        q = torch.round(c / step + levels // 2).clamp(0, levels - 1)
        book = torch.zeros(levels)
        for b in range(levels):
            inside = c[q == b]
            if inside.numel():
                book[b] = (inside.double().sum() / inside.numel()).float()
        return book[q.long()] + shift

    def _sent(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a worker sends of its accumulator ``e``: the decoded tensor, and which elements
        it kept."""
        rows, cols, h, w, k = self._grid(e.shape)
        m = e.reshape(rows, cols)
        picks = []
        for y in range(rows // h):
            for x in range(cols // w):
                tile = m[y * h : (y + 1) * h, x * w : (x + 1) * w].reshape(-1)
                top = torch.topk(tile.abs(), k).indices.sort().values
                picks += [((y * h + i // w) * cols + x * w + i % w) for i in top.tolist()]
        where = torch.tensor(picks, dtype=torch.long)
        sent = torch.zeros(rows * cols)
        sent[where] = self._quantised(m.reshape(-1)[where])
        kept = torch.zeros(rows * cols, dtype=torch.bool)
        kept[where] = True
        return sent.view(e.shape), kept.view(e.shape)

    def mean(self) -> list[torch.Tensor]:
        """Δ̄: every worker's Δ into its accumulator, the sparse part sent and taken out, the
        mean over the workers that sent each element (fp32 tensors: over every worker)."""
        w = self.world
        out = []
        for j, a in enumerate(w.anchor):
            parts, masks = [], []
            for i in range(w.n):
                e = self.errors[i][j]
                e.copy_(self.beta * e + (a - w.thetas[i][j].float()))
                if self._compressed(a.shape):
                    sent, kept = self._sent(e)
                    e.copy_(e - sent)
                else:  # sent as it is: nothing is left
                    sent, kept = e.clone(), torch.ones(a.shape, dtype=torch.bool)
                    e.zero_()
                parts.append(sent)
                masks.append(kept)
            if not self._compressed(a.shape):
                out.append(rank_order_mean(parts))
                continue
            total, count = torch.zeros(a.shape), torch.zeros(a.shape)
            for sent, kept in zip(parts, masks):
                total[kept] = total[kept] + sent[kept]
                count[kept] = count[kept] + 1
            if self.aggregation == "sum":
                out.append(total)
            elif self.aggregation == "mean-over-all":
                out.append(total / w.n)
            else:
                out.append(total / count.clamp(min=1) ** self.power)
        return out

    def _update(self, avg: list[torch.Tensor]) -> None:
        """A ← A − α·Δ̄."""
        w = self.world
        for a, d in zip(w.anchor, avg):
            a.add_(d, alpha=-w.outer_lr())

    def step(self, phase: int) -> None:
        w = self.world
        # with the merge at τ = H a sync point applies before it launches
        apply_first = self.keep and self.tau >= w.h
        if apply_first:
            self._sync_point(phase)
        if self._syncs_at(phase + self.tau):  # the launch for the sync point at phase + τ
            if self.keep:
                self.snapshot = w.snapshot(range(len(w.anchor)))
            self.pending[phase + self.tau] = self.mean()
        if not apply_first:
            self._sync_point(phase)
        if phase % w.h == 0:
            w.record()

    def _sync_point(self, phase: int) -> None:
        """At a sync point: its sync's update, then θ ← A (reset) or θ ← A + (θ − θ_s)."""
        w = self.world
        if not self._syncs_at(phase):
            return
        launched = self.pending.pop(phase, None)
        if launched is not None:
            self._update(launched)
        elif self.keep:
            return  # nothing launched yet: nothing to merge, θ stays
        w.to_anchor(range(len(w.anchor)), self.snapshot if self.keep else None)

    def _syncs_at(self, phase: int) -> bool:
        """Whether ``phase`` (inner steps after the warm start) is a sync point: every H₀ steps
        up to W (early rounds), every H after."""
        if self.early_steps and 0 < phase <= self.early_steps:
            return phase % self.early_every == 0
        return phase % self.world.h == 0

    def finish(self) -> None:
        for k in sorted(self.pending):
            self._update(self.pending.pop(k))
        super().finish()
