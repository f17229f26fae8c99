"""Streaming DiLoCo: DiLoCo over P fragments, one synced at a time, with overlapped all-reduces.

Paper: Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", 2025 (https://arxiv.org/abs/2501.18512). The schedule is torchft's
``DiLoCo(model_fragments, sync_every, fragment_sync_delay, fragment_update_alpha)``: a sync point
every H/P inner steps, the k-th (k = 1, 2, …) syncs fragment (k − 1) mod P, whose
Δ_p = A_p − θ_p was taken and all-reduced τ steps earlier; there Â_p = OuterOpt_p(A_p, Δ̄_p)
and θ_p ← (1 − mix)·Â_p + mix·θ_p. torchft keeps one fragment in flight (τ < H/P); here any
τ < H works (τ ≥ H/P hides more of a slow link with staler pseudo-gradients; the first sync
points, whose launch would fall before step 1, are skipped).

Paper symbols → arguments: H ``sync_every``, P ``num_fragments``, τ ``overlap``, α ``mix``.

Example::

    algo = lowcomm.StreamingDiLoCo(model, inner, sync_every=48, num_fragments=4, overlap=2)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.hparams import HyperparameterError, check_number, hyper
from lowcomm.outer.diloco import DiLoCo, OuterSGDConfig
from lowcomm.outer.hparams import (
    OuterConfig,
    ShardableConfig,
    check_fragments,
    fragments,
    num_fragments,
    overlap,
)
from lowcomm.params import split_by_blocks
from lowcomm.schedules import FRAGMENTS

__all__ = ["FragmentsConfig", "StreamingConfig", "StreamingDiLoCo", "split_by_blocks"]


@dataclass(frozen=True, kw_only=True)
class FragmentsConfig(OuterSGDConfig):
    """P fragments synced in turn, each overlapped by τ steps (Streaming DiLoCo, CoCoDC)."""

    num_fragments: int = num_fragments()
    fragments: Sequence[Any] | None = fragments()
    overlap: int = overlap(
        "inner steps a fragment's all-reduce runs before it is applied (below sync_every)"
    )

    full_overlap: ClassVar[bool] = False
    """Whether τ = H is allowed: the merge keeps the progress since the launch (CoCoDC), so a
    fragment's sync may be applied at the step the same fragment launches again."""

    def check(self) -> None:
        super().check()
        h, tau = self.sync_every, self.overlap
        check_fragments(h, self.num_fragments)
        if tau > h or (tau == h and not self.full_overlap):
            if self.full_overlap:
                why = f"must be <= sync_every={h} (tau = sync_every: full overlap)"
            else:
                why = (
                    f"must be < sync_every={h}: a fragment's all-reduce must land before the "
                    "same fragment is launched again (cocodc takes overlap=sync_every: its merge "
                    "keeps the progress made while a fragment is in flight)"
                )
            raise HyperparameterError("overlap", why, shown=str(tau))


@dataclass(frozen=True, kw_only=True)
class StreamingConfig(FragmentsConfig, ShardableConfig):
    """Streaming DiLoCo's hyperparameters."""

    mix: float = hyper(
        0.0,
        doc="mixing factor at a sync point: θ ← (1 − mix)·A + mix·θ",
        symbol="α",
        check=check_number(
            "must be in [0, 1], got {value!r}; 0 keeps the global model", 0, 1, open_high=False
        ),
    )


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (see the module docstring): one outer optimizer per fragment, as
    :class:`~lowcomm.DiLoCo`; automatic fragments need an ``nn.Module``. ``finish()`` applies
    what is in flight and resets every fragment to its anchor (local progress since a
    fragment's last sync is dropped)."""

    name = "streaming"
    Config: ClassVar[type[OuterConfig]] = StreamingConfig
    config: FragmentsConfig
    schedule = FRAGMENTS
    _discards_partial_round = False
    _flat_state = False

    def _merge(self, f: int) -> None:
        """θ_p ← (1 − mix)·Â_p + mix·θ_p (Â_p is now the fragment's anchor)."""
        frag = self.fragments[f]
        mix = float(getattr(self.config, "mix", 0.0))
        if mix == 0.0:
            frag.anchor.copy_to(frag.params)
            return
        local = [p.detach().clone() for p in frag.params]
        frag.anchor.copy_to(frag.params)
        torch._foreach_lerp_([p.detach() for p in frag.params], local, mix)
