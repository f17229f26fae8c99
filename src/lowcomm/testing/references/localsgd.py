"""LocalSGD's reference: every H steps θ ← the workers' mean θ."""

from __future__ import annotations

from lowcomm.testing.references.world import Reference

__all__ = ["LocalSGDReference"]


class LocalSGDReference(Reference):
    def step(self, phase: int) -> None:
        w = self.world
        if phase % w.h == 0:
            w.set_all(w.mean_theta())
            w.record()

    def finish(self) -> None:
        # the steps of a partial last round are averaged once more
        w = self.world
        if w.steps > w.warmup and (w.steps - w.warmup) % w.h:
            w.set_all(w.mean_theta())
