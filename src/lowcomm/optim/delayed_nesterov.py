"""Delayed Nesterov: an outer optimizer whose momentum moves only every N steps.

Paper: Liu et al., "Asynchronous Local-SGD Training for Language Modeling", 2024
(https://arxiv.org/abs/2401.09135), Algorithm "Delayed Nesterov" with its momentum-activation
constant c = 0. Stale pseudo-gradients fed one by one through Nesterov momentum compound in a
stale direction; delayed Nesterov applies each one at once with lr/N but folds them into the
momentum only every N steps, as their mean:

* every step: Σ ← Σ + g; p ← p − lr·g/N;
* every N-th step, in addition: m ← β·m + Σ/N; p ← p − lr·β·m; Σ ← 0.

Over N steps the direct part moves p by lr times the mean of the N pseudo-gradients, and the
momentum part by one Nesterov step on that mean: with N = 1 it is ``torch.optim.SGD(lr,
momentum=β, nesterov=True)`` bit for bit (a test pins both forms). To keep the per-step rate of
a plain Nesterov outer step, scale lr by N (as the paper's HALoS follow-up does).

Example::

    outer = lambda params: DelayedNesterov(params, lr=0.7 * 4, momentum=0.9, delay=4)
    algo = lowcomm.DiLoCo(model, inner, sync_every=12, outer_optimizer=outer)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DelayedNesterov"]


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov momentum (see the module docstring): ``delay`` N, ``momentum`` β."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        delay: int = 1,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not (isinstance(delay, int) and not isinstance(delay, bool) and delay >= 1):
            raise ValueError(f"delay must be an integer >= 1, got {delay!r}; e.g. 4")
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, n = float(group["lr"]), float(group["momentum"]), int(group["delay"])
            # the tensors at each step count (one, unless some went without a gradient),
            # stepped together: a fixed number of _foreach operations whatever their number
            by_step: dict[int, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["grad_sum"] = torch.zeros_like(p)
                by_step.setdefault(int(state["step"]), []).append(p)
            for step, params in by_step.items():
                grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
                ms = [self.state[p]["momentum_buffer"] for p in params]
                totals = [self.state[p]["grad_sum"] for p in params]
                torch._foreach_add_(totals, grads)
                direct = grads if n == 1 else torch._foreach_div(grads, n)
                if (step + 1) % n == 0:
                    torch._foreach_mul_(ms, beta)
                    torch._foreach_add_(ms, totals, alpha=1.0 / n)
                    torch._foreach_zero_(totals)
                    # one add of (g/N + β·m), as torch's Nesterov SGD adds (g + β·m)
                    torch._foreach_add_(
                        params, torch._foreach_add(direct, ms, alpha=beta), alpha=-lr
                    )
                else:
                    torch._foreach_add_(params, direct, alpha=-lr)
                for p in params:
                    self.state[p]["step"] += 1
        return loss
