"""DiLoCo and SlowMo: an outer optimizer stepped on averaged pseudo-gradients every H steps.

DiLoCo: Douillard et al., 2023 (https://arxiv.org/abs/2311.08105). SlowMo: Wang et al., ICLR
2020 (https://arxiv.org/abs/1910.00643). On the engine: one fragment, no overlap. Every H inner
steps Δ̄ ← mean(A − θᵢ), ``A.grad = Δ̄``, one outer optimizer step on A, θᵢ ← A (blocking; the
inner optimizer's state is never touched).

Example (then ``algo.step()`` after every inner step, ``algo.finish()`` at the end)::

    algo = lowcomm.DiLoCo(model, inner, sync_every=50)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch

from lowcomm.hparams import HyperparameterError, check_bool, check_positive_int, hyper
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.fragment import OptimizerState, OuterOptimizerFactory, OuterState
from lowcomm.outer.hparams import (
    CompressionConfig,
    OuterConfig,
    ShardableConfig,
    outer_lr,
    outer_lr_schedule,
    outer_momentum,
)

__all__ = ["DiLoCo", "DiLoCoConfig", "OuterSGDConfig", "SlowMo", "SlowMoConfig"]


def _check_factory(key: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise HyperparameterError(
            key,
            "must be a callable params -> torch.optim.Optimizer, e.g. "
            "lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)",
        )


@dataclass(frozen=True, kw_only=True)
class OuterSGDConfig(CompressionConfig):
    """The outer optimizer of DiLoCo and the fragment methods: SGD, or any optimizer."""

    outer_lr: float = outer_lr(0.7)
    outer_lr_schedule: str = outer_lr_schedule()
    outer_momentum: float = outer_momentum(0.9)
    nesterov: bool = hyper(True, doc="Nesterov outer momentum", check=check_bool)
    nesterov_every: int = hyper(
        1,
        doc="delayed Nesterov (Liu et al. 2024): the momentum takes the mean of the last N "
        "pseudo-gradients every N outer steps, each applied at once with outer_lr/N between "
        "(lowcomm.optim.DelayedNesterov); 1: Nesterov SGD",
        symbol="N",
        check=check_positive_int(4),
    )
    outer_optimizer: OuterOptimizerFactory | None = hyper(
        None,
        doc="a factory params -> torch.optim.Optimizer over the anchor tensors; overrides "
        "outer_lr, outer_momentum and nesterov",
        check=_check_factory,
        job=False,
    )

    def check(self) -> None:
        super().check()
        if self.nesterov and self.outer_momentum == 0:
            raise HyperparameterError(
                "nesterov",
                "needs outer_momentum > 0; set outer_momentum (e.g. 0.9) or nesterov=False",
                shown="True",
            )
        if self.nesterov_every > 1 and not self.nesterov:
            raise HyperparameterError(
                "nesterov_every",
                "delays Nesterov momentum: needs nesterov=True and outer_momentum > 0",
                shown=str(self.nesterov_every),
            )
        if self.nesterov_every > 1 and self.outer_optimizer is not None:
            raise HyperparameterError(
                "nesterov_every",
                "is for the built-in outer optimizer; with outer_optimizer given, build "
                "lowcomm.optim.DelayedNesterov in it",
                shown=str(self.nesterov_every),
            )

    def outer_factory(self) -> OuterOptimizerFactory:
        """``outer_optimizer``, or SGD with ``outer_lr``, ``outer_momentum``, ``nesterov`` (with
        ``nesterov_every`` > 1: :class:`~lowcomm.optim.DelayedNesterov`)."""
        lr, momentum = float(self.outer_lr), float(self.outer_momentum)
        if self.outer_optimizer is not None:
            return self.outer_optimizer
        if self.nesterov_every > 1:
            from lowcomm.optim.delayed_nesterov import DelayedNesterov

            return partial(DelayedNesterov, lr=lr, momentum=momentum, delay=self.nesterov_every)
        # foreach: one operation over every anchor tensor on the CPU too (torch's default there
        # is a loop over them); the same arithmetic, bit for bit
        return partial(
            torch.optim.SGD, lr=lr, momentum=momentum, nesterov=self.nesterov, foreach=True
        )


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig(OuterSGDConfig, ShardableConfig):
    """DiLoCo's hyperparameters."""


class DiLoCo(OuterAlgorithm):
    """DiLoCo: the outer optimizer (default Nesterov SGD, lr 0.7, momentum 0.9) stepped on the
    anchor with the averaged pseudo-gradient; with ``shard_outer_state`` it must be
    elementwise (it steps this rank's chunks)."""

    name = "diloco"
    Config: ClassVar[type[OuterConfig]] = DiLoCoConfig
    config: OuterSGDConfig

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        factory = self.config.outer_factory()
        return OptimizerState(factory, anchor, lr_factor=self.outer_lr_factor)

    @property
    def outer(self) -> torch.optim.Optimizer:
        """The outer optimizer (sharded: over this rank's anchor chunks)."""
        state = self.fragment.outer
        assert isinstance(state, OptimizerState)
        return state.optimizer


@dataclass(frozen=True, kw_only=True)
class SlowMoConfig(ShardableConfig):
    """SlowMo's hyperparameters."""

    outer_lr: float = outer_lr(1.0, "slow learning rate")
    outer_momentum: float = outer_momentum(0.5, "slow momentum")


class SlowMo(DiLoCo):
    """SlowMo as a DiLoCo preset: heavy-ball outer SGD with the 1/γ scaling.

    With γ the inner optimizer's current learning rate (``param_groups[0]["lr"]``), every round:
    m ← β·m + Δ̄/γ; A ← A − α·γ·m — i.e. DiLoCo with ``SGD(lr=α·γ, momentum=β)`` stepped on Δ̄/γ.
    """

    name = "slowmo"
    Config: ClassVar[type[OuterConfig]] = SlowMoConfig
    config: SlowMoConfig  # type: ignore[assignment]

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        slow_lr, momentum = float(self.config.outer_lr), float(self.config.outer_momentum)
        sgd = partial(torch.optim.SGD, lr=slow_lr, momentum=momentum, nesterov=False, foreach=True)

        def scale(avg_delta: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
            gamma = float(self.inner.param_groups[0]["lr"])
            if gamma <= 0:
                raise ValueError(
                    f"SlowMo divides by the inner learning rate, which is {gamma}; use a "
                    "positive lr"
                )
            torch._foreach_div_(list(avg_delta), gamma)
            for group in optimizer.param_groups:
                group["lr"] = slow_lr * gamma

        return OptimizerState(sgd, anchor, scale=scale)
