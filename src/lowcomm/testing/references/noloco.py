"""NoLoCo's reference: every worker's own φ and δ; every H steps (launched τ earlier) the mean
θ of its random group, δ ← μ·δ + α·(mean_G θ − φ), φ ← φ + δ, θ ← φ."""

from __future__ import annotations

import torch

from lowcomm.outer.functional import noloco_groups
from lowcomm.testing.ref_compression import rank_order_mean
from lowcomm.testing.references.world import Reference, World

__all__ = ["NoLoCoReference"]


class NoLoCoReference(Reference):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.phi = [[a.clone() for a in world.anchor] for _ in range(world.n)]
        self.delta = [[torch.zeros_like(a) for a in world.anchor] for _ in self.phi]
        self.pending: list[list[torch.Tensor]] | None = None
        self.applied = 0

    def warm_anchors(self) -> list[list[torch.Tensor]]:
        return self.phi

    def launch(self, step: int) -> list[list[torch.Tensor]]:
        """Each worker's group mean of θ (summed in rank order, then divided)."""
        w = self.world
        groups = noloco_groups(w.n, w.hyper["group_size"], step, w.hyper["group_seed"])
        of = {i: g for g in groups for i in g}
        return [
            [rank_order_mean([w.thetas[j][p].float() for j in of[i]]) for p in range(len(w.anchor))]
            for i in range(w.n)
        ]

    def apply(self, means: list[list[torch.Tensor]]) -> None:
        w = self.world
        mu, alpha = w.hyper["outer_momentum"], w.hyper["outer_lr"]
        for i in range(w.n):
            for a, m, mean, p in zip(self.phi[i], self.delta[i], means[i], w.thetas[i]):
                m.mul_(mu).add_(mean - a, alpha=alpha)
                a.add_(m)
                p.copy_(a)
        self.applied += 1

    def step(self, phase: int) -> None:
        w = self.world
        tau = w.hyper["overlap"]
        if (phase + tau) % w.h == 0:
            self.pending = self.launch(phase + tau)
        if phase % w.h == 0 and self.pending is not None:
            self.apply(self.pending)
            self.pending = None
            w.record()

    def finish(self) -> None:
        w = self.world
        if self.pending is not None:
            self.apply(self.pending)
        # finish(): the ranks agree on the mean of their φ (once any sync was applied)
        per_worker = self.phi
        if self.applied:
            mean = [rank_order_mean([wa[j] for wa in self.phi]) for j in range(len(w.anchor))]
            per_worker = [mean] * w.n
        for th, values in zip(w.thetas, per_worker):
            for p, v in zip(th, values):
                p.copy_(v)
