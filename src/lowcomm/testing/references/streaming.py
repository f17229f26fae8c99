"""Streaming DiLoCo's and CoCoDC's references: P fragments synced in turn, each all-reduce τ
steps in flight, the outer optimizer per fragment; Streaming merges θ ← (1 − mix)·A + mix·θ,
CoCoDC compensates the delay and chooses the fragment by priority."""

from __future__ import annotations

import math

import torch

from lowcomm.testing.ref_compression import rank_order_mean
from lowcomm.testing.references.world import Reference, World

__all__ = ["CoCoDCReference", "StreamingReference"]


class StreamingReference(Reference):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.outer = [world.outer_sgd([world.anchor[j] for j in idx]) for idx in world.frags]
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
        # per-worker snapshots θ_s of each fragment at its launch
        self.snapshots: dict[int, list[list[torch.Tensor]]] = {}

    def choose(self, k: int) -> int:
        """The fragment sync point ``k`` launches: in turn."""
        return (k - 1) % len(self.world.frags)

    def step(self, phase: int) -> None:
        w = self.world
        tau = w.hyper["overlap"]
        # at τ = H (CoCoDC) the fragment's sync lands before it launches again
        due = phase % w.interval == 0 and phase - tau >= 1
        if due and tau >= w.h:
            self.sync(phase // w.interval)
        if (phase + tau) % w.interval == 0:
            k = (phase + tau) // w.interval
            f = self.choose(k)
            self.snapshots[f] = [
                [th[j].detach().float().clone() for j in w.frags[f]] for th in w.thetas
            ]
            self.pending[k] = (f, w.pseudo_mean(w.frags[f], f)[0])
        if due and tau < w.h:
            self.sync(phase // w.interval)
        if phase % w.h == 0:
            w.record()

    def sync(self, k: int) -> None:
        """Apply sync point ``k``: the fragment's outer step, then the merge."""
        w = self.world
        f, avg = self.pending.pop(k)
        idx = w.frags[f]
        for j, d in zip(idx, avg):
            w.anchor[j].grad = d
        self.outer[f].param_groups[0]["lr"] = w.outer_lr()
        self.outer[f].step()
        for j in idx:
            w.anchor[j].grad = None
        for worker in range(w.n):
            for pos, j in enumerate(idx):
                self.merge(f, worker, pos, j)

    def merge(self, f: int, worker: int, pos: int, j: int) -> None:
        """θ ← (1 − mix)·A + mix·θ, for parameter ``j`` (``pos`` in fragment ``f``)."""
        w = self.world
        theta = w.thetas[worker][j]
        local = theta.detach().clone()
        theta.copy_(w.anchor[j])
        theta.lerp_(local, float(w.hyper["mix"]))

    def finish(self) -> None:
        for k in sorted(self.pending):
            self.sync(k)
        super().finish()


class CoCoDCReference(StreamingReference):
    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.last_launch = [0] * len(world.frags)

    def choose(self, k: int) -> int:
        """The free fragment that starved longest (past ``max_wait``), else in turn
        (``adaptive`` off), else the highest mean priority: RMS of its Δ times its wait."""
        w = self.world
        frags, hyper = w.frags, w.hyper
        busy = {f for f, _ in self.pending.values()}
        free = [f for f in range(len(frags)) if f not in busy]
        waits = {f: k - self.last_launch[f] for f in free}
        starving = [f for f in free if waits[f] >= hyper["max_wait"] * len(frags)]
        if starving:
            f = max(starving, key=lambda f: (waits[f], -f))
        elif not hyper["adaptive"]:
            rr = (k - 1) % len(frags)
            f = min(free, key=lambda f: (f - rr) % len(frags))
        else:
            per_worker = []
            for th in w.thetas:
                sc = torch.zeros(len(frags), dtype=torch.float64)
                for g in free:
                    norms = [
                        torch.linalg.vector_norm(w.anchor[j] - th[j].float()) for j in frags[g]
                    ]
                    rms = torch.linalg.vector_norm(torch.stack(norms))
                    numel = sum(w.anchor[j].numel() for j in frags[g])
                    sc[g] = float(rms) / math.sqrt(numel) * waits[g]
                per_worker.append(sc)
            scores = rank_order_mean(per_worker)
            f = max(free, key=lambda g: (float(scores[g]), -g))
        self.last_launch[f] = k
        return f

    def merge(self, f: int, worker: int, pos: int, j: int) -> None:
        """θ ← A − g − λ·g⊙g⊙(A − θ_s), g = θ_s − θ (delay compensation)."""
        w = self.world
        snap = self.snapshots[f][worker][pos]
        g = snap - w.thetas[worker][j].float()
        new = w.anchor[j] - g
        lambda0 = w.hyper["lambda0"]
        if lambda0 != 0.0:
            hh = g * g * (w.anchor[j] - snap)
            if torch.linalg.vector_norm(hh) > 0:
                lam = lambda0 * torch.linalg.vector_norm(g) / torch.linalg.vector_norm(hh)
                new = new - lam * hh
        w.thetas[worker][j].copy_(new)
