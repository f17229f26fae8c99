"""DiLoCo's and SlowMo's references: every H steps the outer step on the anchor with the mean
pseudo-gradient Δ̄, then θ ← A."""

from __future__ import annotations

import torch

from lowcomm.testing.references.world import Reference, World

__all__ = ["DiLoCoReference", "SlowMoReference"]


class DiLoCoReference(Reference):
    """The outer optimizer (Nesterov SGD, or delayed Nesterov) stepped with ``A.grad = Δ̄``."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.outer = world.outer_sgd(world.anchor)

    def step(self, phase: int) -> None:
        w = self.world
        if phase % w.h:
            return
        avg = w.pseudo_mean(list(range(len(w.anchor))))[0]
        for a, d in zip(w.anchor, avg):
            a.grad = d
        self.outer.param_groups[0]["lr"] = w.outer_lr()
        self.outer.step()
        for a in w.anchor:
            a.grad = None
        w.set_all(w.anchor)
        w.record()


class SlowMoReference(Reference):
    """Heavy ball on Δ̄/γ with lr α·γ (γ the inner lr now)."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.momentum: list[torch.Tensor] | None = None

    def step(self, phase: int) -> None:
        w = self.world
        if phase % w.h:
            return
        avg = w.pseudo_mean(list(range(len(w.anchor))))[0]
        gamma = w.inners[0].param_groups[0]["lr"]
        g = [d / gamma for d in avg]
        if self.momentum is None:
            self.momentum = [gi.clone() for gi in g]
        else:
            for m, gi in zip(self.momentum, g):
                m.mul_(w.hyper["outer_momentum"]).add_(gi)
        for a, m in zip(w.anchor, self.momentum):
            a.add_(m, alpha=-(w.hyper["outer_lr"] * gamma))
        w.set_all(w.anchor)
        w.record()
