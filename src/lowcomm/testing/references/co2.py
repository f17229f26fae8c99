"""CO2's reference: the sync of a round applied one round later (or τ steps after its launch),
the Gap-Aware penalty, outer momentum and clipping on the anchor; with eager updates every
worker steps its own anchor with its fresh Δ/N and the others' stale part; with fragments (or
the delay-corrected merge) one outer state per fragment, synced in turn."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowcomm.outer.functional import GAP_EPS, GAP_STAT_DECAY, GAP_STAT_NEW
from lowcomm.testing.ref_compression import rank_order_mean
from lowcomm.testing.references.world import Reference, World

__all__ = ["CO2Reference"]


@dataclass
class _State:
    m: list[torch.Tensor]
    c: list[torch.Tensor]
    u: list[torch.Tensor]
    pending: list[torch.Tensor] | None = None
    updates: int = 0

    @classmethod
    def over(cls, anchor: list[torch.Tensor]) -> _State:
        def zeros() -> list[torch.Tensor]:
            return [torch.zeros_like(a) for a in anchor]

        return cls(m=zeros(), c=zeros(), u=zeros())


def _part(d: torch.Tensor, n: int, weight: float | None) -> torch.Tensor:
    """An eager update's own share of ``d``: d/N, or ``weight``·d."""
    return d / n if weight is None else d * float(weight)


class CO2Reference(Reference):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        anchor, hyper = world.anchor, world.hyper
        self.state = _State.over(anchor)
        self.tau = world.h if hyper.get("overlap") is None else hyper["overlap"]
        # with fragments (or the delay-corrected merge, θ ← A + (θ − θ_s)): one outer state per
        # fragment, synced in turn as Streaming DiLoCo
        self.merge_progress = hyper.get("merge") == "delay_corrected"
        self.fragmented = len(world.frags) > 1 or self.merge_progress
        self.frag_states = [_State.over([anchor[j] for j in idx]) for idx in world.frags]
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.snapshots: dict[int, list[list[torch.Tensor]]] = {}
        # eager updates: every worker's own anchor and state, and its own last contribution
        self.eager_a = [[a.clone() for a in anchor] for _ in range(world.n)]
        self.eager_st = [_State.over(anchor) for _ in range(world.n)]
        self.eager_own: list[list[torch.Tensor]] = []

    def warm_anchors(self) -> list[list[torch.Tensor]]:
        return self.eager_a

    def apply(self, avg: list[torch.Tensor], anchor: list[torch.Tensor], co2: _State) -> None:
        """The outer step on ``anchor`` with ``avg``: penalty, momentum, clip, Nesterov."""
        w = self.world
        hyper = w.hyper
        first = co2.updates == 0
        beta, gp = hyper["outer_momentum"], hyper["gap_penalty"]
        scaled = []
        for d, m, c, u in zip(avg, co2.m, co2.c, co2.u):
            if gp == "gap_aware":
                if first:
                    c.copy_(d.abs())
                else:
                    c.mul_(GAP_STAT_DECAY).add_(d.abs(), alpha=GAP_STAT_NEW)
                lam = 1.0 / ((d + u).abs() / (c + GAP_EPS)).clamp(min=1.0)
                scaled.append(lam * d)
            elif gp == "none":
                scaled.append(d.clone())
            else:
                scaled.append(d / float(gp))
            m.mul_(beta).add_(scaled[-1])
        clip = hyper["clip"]
        if clip is not None and hyper["clip_mode"] == "value":
            for m in co2.m:
                m.clamp_(-clip, clip)
        elif clip is not None:
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(m) for m in co2.m])
            )
            scale = torch.clamp(clip / (total + 1e-6), max=1.0)
            for m in co2.m:
                m.mul_(scale)
        for a, m, s, u in zip(anchor, co2.m, scaled, co2.u):
            step = torch.add(s, m, alpha=beta) if hyper["nesterov"] else m
            old = a.clone()
            a.add_(step, alpha=-w.outer_lr())
            u.copy_(a - old)
        co2.updates += 1

    def step(self, phase: int) -> None:
        if self.fragmented:
            self._fragments_step(phase)
            return
        w = self.world
        everything = list(range(len(w.anchor)))
        if self.tau < w.h and (phase + self.tau) % w.h == 0:
            self.state.pending = w.pseudo_mean(everything)[0]  # launched τ steps early
        if phase % w.h:
            return
        if w.hyper["eager"]:
            self._eager_round()
        elif self.tau < w.h:
            assert self.state.pending is not None
            self.apply(self.state.pending, w.anchor, self.state)
            self.state.pending = None
            w.set_all(w.anchor)
        else:
            launched = w.pseudo_mean(everything)[0]
            if self.state.pending is not None:
                self.apply(self.state.pending, w.anchor, self.state)
            self.state.pending = launched
            w.set_all(w.anchor)
        w.record()

    def _eager_round(self) -> None:
        """Every worker has its own anchor: Δᵢ/N fresh + (Δ̄ − Δᵢ_prev/N) stale."""
        w = self.world
        weight = w.hyper["own_weight"]
        launched, own = w.pseudo_mean(list(range(len(w.anchor))), anchors=self.eager_a)
        for i in range(w.n):
            e = [_part(d, w.n, weight) for d in own[i]]
            if self.state.pending is not None:
                e = [
                    x + (p - _part(q, w.n, weight))
                    for x, p, q in zip(e, self.state.pending, self.eager_own[i])
                ]
            self.apply(e, self.eager_a[i], self.eager_st[i])
            for p, a in zip(w.thetas[i], self.eager_a[i]):
                p.copy_(a)
        self.eager_own[:] = own
        self.state.pending = launched

    def _fragments_step(self, phase: int) -> None:
        w = self.world
        tau = self.tau
        # with the merge at τ = H, the sync point applies before it launches
        apply_first = self.merge_progress and tau >= w.h
        if apply_first:
            self._sync_point(phase)
        if (phase + tau) % w.interval == 0:
            k = (phase + tau) // w.interval
            f = (k - 1) % len(w.frags)
            if self.merge_progress:
                self.snapshots[f] = w.snapshot(w.frags[f])
            self.pending[k] = (f, w.pseudo_mean(w.frags[f], f)[0])
        if not apply_first:
            self._sync_point(phase)
        if phase % w.h == 0:
            w.record()

    def _sync_point(self, phase: int) -> None:
        """With fragments, at inner step ``phase``: the sync point's outer step and merge."""
        w = self.world
        if phase % w.interval:
            return
        k = phase // w.interval
        f = (k - 1) % len(w.frags)
        if k in self.pending:
            launched_f, avg = self.pending.pop(k)
            assert launched_f == f
            self.apply(avg, [w.anchor[j] for j in w.frags[f]], self.frag_states[f])
        elif self.merge_progress:
            return  # nothing launched: nothing to merge, θ stays
        # θ_f ← A_f (unlaunched sync points: A_f unchanged), or θ ← A + (θ − θ_s)
        w.to_anchor(w.frags[f], self.snapshots[f] if self.merge_progress else None)

    def finish(self) -> None:
        w = self.world
        anchor = w.anchor
        if w.hyper["eager"]:
            weight = w.hyper["own_weight"]
            if self.state.pending is not None:
                for i in range(w.n):
                    e = [
                        p - _part(q, w.n, weight)
                        for p, q in zip(self.state.pending, self.eager_own[i])
                    ]
                    self.apply(e, self.eager_a[i], self.eager_st[i])
                mean = [rank_order_mean([wa[j] for wa in self.eager_a]) for j in range(len(anchor))]
                for wa in self.eager_a:
                    for x, v in zip(wa, mean):
                        x.copy_(v)
            anchor = self.eager_a[0]
        elif self.state.pending is not None:
            self.apply(self.state.pending, w.anchor, self.state)
        for k in sorted(self.pending):
            launched_f, avg = self.pending.pop(k)
            self.apply(avg, [anchor[j] for j in w.frags[launched_f]], self.frag_states[launched_f])
        w.set_all(anchor)
