"""DiLoCo and SlowMo: an outer optimizer stepped on averaged pseudo-gradients every H steps.

DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023 (https://arxiv.org/abs/2311.08105). SlowMo: Wang et al., "SlowMo: Improving
Communication-Efficient Distributed SGD with Slow Momentum", ICLR 2020
(https://arxiv.org/abs/1910.00643).

Every H inner steps: Δ̄ ← mean over workers of (A − θᵢ); ``A.grad = Δ̄``; one step of the outer
optimizer on the anchor A; θᵢ ← A. Blocking. The inner optimizer's state is never touched.

Example::

    algo = lowcomm.DiLoCo(model, inner, sync_every=50)   # Nesterov SGD, lr 0.7, momentum 0.9
    for x, y in loader:
        loss_fn(model(x), y).backward()
        inner.step(); inner.zero_grad()
        algo.step()
    algo.finish()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lowcomm.comm import DEFAULT_BUCKET_CAP_MB, Communicator, FlatBuckets
from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.feedback import Compressor
from lowcomm.guard import optimizer_state_tensors
from lowcomm.outer.base import (
    Compression,
    OuterAlgorithm,
    _check_bool,
    _check_momentum,
    _check_positive_float,
    optimizer_settings,
)
from lowcomm.outer.fragment import Fragment, OuterOptimizerFactory
from lowcomm.outer.sharded import ShardedFragment, check_sharding

__all__ = ["DiLoCo", "SlowMo"]


class DiLoCo(OuterAlgorithm):
    """DiLoCo: outer optimizer on the anchor, stepped with the averaged pseudo-gradient.

    Args:
        model_or_params: an ``nn.Module`` or an iterable of parameters.
        inner_optimizer: the optimizer whose ``step()`` drives the rounds (AdamW in the paper).
        sync_every: H, inner steps per round.
        outer_lr: α, the outer learning rate (default 0.7).
        outer_momentum: β, the outer momentum (default 0.9).
        nesterov: Nesterov momentum for the outer SGD (default True).
        outer_optimizer: a factory ``params -> torch.optim.Optimizer`` building the outer
            optimizer over the anchor tensors; overrides ``outer_lr``/``outer_momentum``/
            ``nesterov``.
        process_group: the group to average over; ``None`` is WORLD.
        bucket_cap_mb: size cap of one flat fp32 bucket (one collective each).
        compression: compress the pseudo-gradients, with error feedback on each rank: a codec
            of :mod:`lowcomm.compress` or a spec such as ``"int4"``, ``"topk:0.01"``,
            ``"powersgd:4"``, ``"lgreco:powersgd"`` (default ``None``: exact fp32 all-reduce).
        shard_outer_state: keep 1/N of the anchor and of the outer optimizer's state on each
            rank (reduce-scatter, update the owned chunk, all-gather: see
            :mod:`lowcomm.outer.sharded`); the outer optimizer must be elementwise.
        nan_policy, check_consistency: the guards every algorithm has (see
            :class:`~lowcomm.outer.base.OuterAlgorithm`).
    """

    name = "diloco"
    compressible = True
    _default_nesterov = True

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_optimizer: OuterOptimizerFactory | None = None,
        process_group: dist.ProcessGroup | Communicator | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        compression: Compression = None,
        shard_outer_state: bool = False,
        nan_policy: str = "skip",
        check_consistency: bool = True,
    ) -> None:
        self.validate(
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            outer_optimizer=outer_optimizer,
            bucket_cap_mb=bucket_cap_mb,
            compression=compression,
            shard_outer_state=shard_outer_state,
        )
        super().__init__(
            model_or_params,
            inner_optimizer,
            sync_every=sync_every,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            nan_policy=nan_policy,
            check_consistency=check_consistency,
        )
        if outer_optimizer is None:
            outer_optimizer = _sgd_factory(float(outer_lr), float(outer_momentum), bool(nesterov))
        self.compression = parse_compression(compression)
        self.shard_outer_state = bool(shard_outer_state)
        self.fragment: Fragment | ShardedFragment
        if self.shard_outer_state:
            # blocking: the gathered anchor may reuse the snapshot's buffer
            self.fragment = ShardedFragment(
                self.params,
                self.comm,
                bucket_cap_mb=self.bucket_cap_mb,
                factory=outer_optimizer,
                scale=self._scale_outer_grads,
                gather_into_snapshot=True,
            )
        else:
            self.fragment = Fragment(
                self.params,
                outer_optimizer,
                bucket_cap_mb=self.bucket_cap_mb,
                compression=self.compression,
                rank=self.comm.rank,
            )

    @property
    def anchor(self) -> FlatBuckets:
        """A: the global parameters, bit-identical on every rank (sharded: the last gathered
        full anchor; this rank's own chunk is ``fragment.shard``)."""
        return self.fragment.anchor

    @property
    def outer(self) -> torch.optim.Optimizer:
        """The outer optimizer (sharded: over this rank's anchor chunks)."""
        assert self.fragment.outer is not None
        return self.fragment.outer

    @classmethod
    def validate(cls, **kwargs: Any) -> None:
        super().validate(**kwargs)
        validate_outer_sgd(kwargs, default_nesterov=cls._default_nesterov)

    def _scale_outer_grads(self, avg_delta: list[torch.Tensor]) -> None:
        """Hook for presets that rescale Δ̄ before the outer step (SlowMo). Default: none."""

    def _end_round(self) -> None:
        what = f"round {self.rounds + 1}"
        frag = self.fragment
        if isinstance(frag, ShardedFragment):
            with record_function(f"{self._profile_tag}::sync"):
                frag.launch(self._check_own, lambda: self._skip(what))
                frag.wait()  # reduce-scatter, update of this rank's chunk, all-gather
        else:
            with record_function(f"{self._profile_tag}::sync"):
                frag.launch(self.comm, self._check_own)
            with record_function(f"{self._profile_tag}::outer"):
                frag.outer_step(self._scale_outer_grads, lambda avg: self._guard(avg, what))
        # skipped or not, every rank continues from the anchor
        self.anchor.copy_to(self.params)

    def _finish(self) -> None:
        # Rounds are blocking; only a partial round's local progress remains, and it is dropped.
        self.anchor.copy_to(self.params)

    def _compressors(self) -> list[Compressor]:
        return [] if self.fragment.compressor is None else [self.fragment.compressor]

    def _settings(self) -> dict[str, Any]:
        return {
            **super()._settings(),
            "compression": None if self.compression is None else self.compression.spec,
            "shard_outer_state": self.shard_outer_state,
            **optimizer_settings("outer optimizer", self.outer),
        }

    def _state_tensors(self) -> list[torch.Tensor]:
        frag = self.fragment
        if isinstance(frag, ShardedFragment):
            return frag.state_tensors()
        return [
            *super()._state_tensors(),
            *frag.anchor.buffers,
            *optimizer_state_tensors(frag.outer),
        ]

    def _buffer_tensors(self) -> list[torch.Tensor]:
        frag = self.fragment
        if isinstance(frag, ShardedFragment):
            return frag.buffer_tensors()
        return list(frag.delta.buffers)

    def _extra_state(self) -> dict[str, Any]:
        return self.fragment.state_dict()

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        check_sharding(state, self.shard_outer_state, type(self).__name__)
        self.fragment.load_state_dict(state, self.comm, self._load_tensors)


def validate_outer_sgd(kwargs: dict[str, Any], *, default_nesterov: bool) -> None:
    """Checks of the outer-optimizer keywords shared by DiLoCo, SlowMo and Streaming DiLoCo."""
    if "outer_lr" in kwargs:
        _check_positive_float("outer_lr", kwargs["outer_lr"], 0.7)
    if "outer_momentum" in kwargs:
        _check_momentum("outer_momentum", kwargs["outer_momentum"])
    nesterov = kwargs.get("nesterov", default_nesterov)
    _check_bool("nesterov", nesterov)
    if nesterov and kwargs.get("outer_momentum", 1) == 0:
        raise ValueError(
            "nesterov=True needs outer_momentum > 0; set outer_momentum (e.g. 0.9) or "
            "nesterov=False"
        )
    factory = kwargs.get("outer_optimizer")
    if factory is not None and not callable(factory):
        raise ValueError(
            "outer_optimizer must be a callable params -> torch.optim.Optimizer, e.g. "
            "lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
        )


def _sgd_factory(lr: float, momentum: float, nesterov: bool) -> OuterOptimizerFactory:
    def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)

    return factory


class SlowMo(DiLoCo):
    """SlowMo as a DiLoCo preset: heavy-ball outer SGD with the 1/γ scaling.

    With γ the inner optimizer's current learning rate (``param_groups[0]["lr"]``), every round:
    m ← β·m + Δ̄/γ; A ← A − α·γ·m — i.e. DiLoCo with ``SGD(lr=α·γ, momentum=β)`` stepped on Δ̄/γ.

    Args:
        outer_lr: α, the slow learning rate (default 1.0).
        outer_momentum: β, the slow momentum (default 0.5).
        Other arguments as :class:`DiLoCo`.
    """

    name = "slowmo"
    _default_nesterov = False

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.5,
        process_group: dist.ProcessGroup | Communicator | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        compression: Compression = None,
        shard_outer_state: bool = False,
        nan_policy: str = "skip",
        check_consistency: bool = True,
    ) -> None:
        super().__init__(
            model_or_params,
            inner_optimizer,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=False,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            compression=compression,
            shard_outer_state=shard_outer_state,
            nan_policy=nan_policy,
            check_consistency=check_consistency,
        )
        self.slow_lr = float(outer_lr)

    def _scale_outer_grads(self, avg_delta: list[torch.Tensor]) -> None:
        gamma = float(self.inner.param_groups[0]["lr"])
        if gamma <= 0:
            raise ValueError(
                f"SlowMo divides by the inner learning rate, which is {gamma}; use a positive lr"
            )
        torch._foreach_div_(list(avg_delta), gamma)
        for group in self.outer.param_groups:
            group["lr"] = self.slow_lr * gamma
