"""What every algorithm's reference shares (:mod:`lowcomm.testing.references`): the N workers
of one scenario, their models and inner optimizers, the anchor, the pseudo-gradient mean
(compressed when the scenario asks), the synchronous warm start and the record of every
round."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any

import torch

from lowcomm.optim.delayed_nesterov import DelayedNesterov
from lowcomm.outer.warm import WARM_STREAM
from lowcomm.registry import ALGORITHMS
from lowcomm.testing.ref_compression import RefCompression, rank_order_mean
from lowcomm.testing.toy import make_inner, toy_backward, toy_model, trainable_params

__all__ = ["ALGO_DEFAULTS", "Reference", "ReferenceRun", "World"]

ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    name: {f.name: f.default for f in dataclasses.fields(cls.Config) if f.default is not MISSING}
    for name, cls in ALGORITHMS.items()
}
"""Each algorithm's default hyperparameters, from its dataclass (a scenario's ``hyper``
overrides them)."""


@dataclass
class ReferenceRun:
    """Every worker's parameters after every round (``rounds[t][worker][param]``) and after
    ``finish()`` (``final[worker][param]``)."""

    rounds: list[list[list[torch.Tensor]]] = field(default_factory=list)
    final: list[list[torch.Tensor]] = field(default_factory=list)


class World:
    """The workers of ``scenario`` (see :mod:`lowcomm.testing.reference`) and the operations
    every reference uses."""

    def __init__(self, scenario: dict[str, Any]) -> None:
        self.algo: str = scenario["algo"]
        self.n: int = scenario["workers"]
        self.h: int = scenario["sync_every"]
        self.steps: int = scenario["steps"]
        self.seed: int = scenario.get("seed", 0)
        self.hyper: dict[str, Any] = {**ALGO_DEFAULTS[self.algo], **scenario.get("hyper", {})}
        self.models = [toy_model(self.seed) for _ in range(self.n)]
        inner = scenario.get("inner", "sgd")
        self.inners = [make_inner(inner, m.parameters()) for m in self.models]
        self.thetas = [trainable_params(m) for m in self.models]
        self.anchor = [p.detach().clone().float() for p in self.thetas[0]]
        self.frags: list[list[int]] = scenario.get("fragments", [list(range(len(self.anchor)))])
        self.interval = self.h // len(self.frags)
        self.warmup: int = self.hyper["sync_warmup"]
        self.out = ReferenceRun()
        self._spec = self.hyper.get("compression")
        self._compressors: dict[int, RefCompression] = {}
        warm_spec = self.hyper.get("sync_warmup_compression")
        self._warm_compressors = [
            RefCompression(
                warm_spec, [self.anchor[j].shape for j in idx], self.n, stream=WARM_STREAM + f
            )
            for f, idx in enumerate(self.frags)
            if warm_spec is not None
        ]

    def outer_lr(self) -> float:
        """α, times γ/γ₀ when the outer lr follows the inner schedule."""
        if self.hyper.get("outer_lr_schedule", "constant") == "constant":
            return float(self.hyper["outer_lr"])
        group = self.inners[0].param_groups[0]
        return float(self.hyper["outer_lr"]) * (group["lr"] / group.get("initial_lr", group["lr"]))

    def outer_sgd(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """DiLoCo's outer optimizer: Nesterov SGD, or delayed Nesterov (``nesterov_every``)."""
        hyper = self.hyper
        kw = {"lr": hyper["outer_lr"], "momentum": hyper["outer_momentum"]}
        if hyper.get("nesterov_every", 1) > 1:
            return DelayedNesterov(params, delay=hyper["nesterov_every"], **kw)
        return torch.optim.SGD(params, nesterov=hyper["nesterov"], **kw)

    def pseudo_mean(
        self, idx: list[int], key: int = 0, anchors: list[list[torch.Tensor]] | None = None
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Mean over workers of Δ = A − θ for parameters ``idx`` (compressed when asked), and
        each worker's contribution to it."""
        per = [
            [(anchors[w] if anchors else self.anchor)[j] - th[j].float() for j in idx]
            for w, th in enumerate(self.thetas)
        ]
        if self._spec is None:
            return [rank_order_mean([p[pos] for p in per]) for pos in range(len(idx))], per
        if key not in self._compressors:
            shapes = [self.anchor[j].shape for j in idx]
            self._compressors[key] = RefCompression(self._spec, shapes, self.n, stream=key)
        return self._compressors[key].mean(per)

    def mean_theta(self) -> list[torch.Tensor]:
        """Every parameter's mean over the workers (summed in rank order)."""
        return [
            rank_order_mean([th[j].float() for th in self.thetas]) for j in range(len(self.anchor))
        ]

    def set_all(self, values: list[torch.Tensor]) -> None:
        """Every worker's θ ← ``values``."""
        with torch.no_grad():
            for th in self.thetas:
                for p, v in zip(th, values):
                    p.copy_(v)

    def snapshot(self, indices: Sequence[int]) -> list[list[torch.Tensor]]:
        """θ_s: every worker's parameters ``indices`` now (fp32 copies)."""
        return [[th[j].detach().float().clone() for j in indices] for th in self.thetas]

    def to_anchor(
        self, indices: Sequence[int], snapshot: list[list[torch.Tensor]] | None = None
    ) -> None:
        """A sync point's merge on parameters ``indices``: θ ← A, or with the progress since
        the launch kept (``snapshot`` θ_s, from :meth:`snapshot`) θ ← A + (θ − θ_s)."""
        with torch.no_grad():
            for i, th in enumerate(self.thetas):
                for pos, j in enumerate(indices):
                    if snapshot is None:
                        th[j].copy_(self.anchor[j])
                    else:
                        th[j].copy_(self.anchor[j] - (snapshot[i][pos] - th[j].float()))

    def record(self) -> None:
        """A round ended: every worker's parameters now."""
        self.out.rounds.append([[p.detach().clone() for p in th] for th in self.thetas])

    def warm_step(self, step: int, anchors: list[list[torch.Tensor]]) -> None:
        """Inner step ``step`` of the warm start: DDP's step, every worker with the mean
        gradient (exact, or per fragment every worker's decoded g + e with
        ``sync_warmup_compression``); the anchor and ``anchors`` follow θ."""
        for w in range(self.n):
            toy_backward(self.models[w], w, step, self.seed)
        with torch.no_grad():
            grads = [[_grad(p) for p in th] for th in self.thetas]
            if not self._warm_compressors:
                means = [rank_order_mean([g[j] for g in grads]) for j in range(len(self.anchor))]
            else:
                means = [torch.empty(0)] * len(self.anchor)
                for comp, idx in zip(self._warm_compressors, self.frags):
                    got, _ = comp.mean([[g[j] for j in idx] for g in grads])
                    for j, m in zip(idx, got):
                        means[j] = m
            for w in range(self.n):
                for param, mean_g in zip(self.thetas[w], means):
                    param.grad = mean_g.clone()
                self.inners[w].step()
                self.inners[w].zero_grad()
            for values in [self.anchor, *anchors]:
                for dst, src in zip(values, self.thetas[0]):
                    dst.copy_(src)
        if step % self.h == 0:
            self.record()


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad.float()


class Reference:
    """One algorithm's reference over a :class:`World` (the subclasses, one per algorithm)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def warm_anchors(self) -> list[list[torch.Tensor]]:
        """Per-worker anchors of its own, which follow θ through the warm start like the
        anchor."""
        return []

    def step(self, phase: int) -> None:
        """After every worker's inner step ``phase`` of the schedule (counted from the end of
        the warm start; no gradients are taken)."""
        raise NotImplementedError

    def finish(self) -> None:
        """``finish()``: apply what is in flight; afterwards every worker's θ is final."""
        self.world.set_all(self.world.anchor)
