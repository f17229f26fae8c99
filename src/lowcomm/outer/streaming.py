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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.hparams import HyperparameterError, check_number, check_positive_int, hyper
from lowcomm.outer.diloco import DiLoCo, OuterSGDConfig
from lowcomm.outer.hparams import OuterConfig, ShardableConfig, overlap
from lowcomm.params import check_partition, split_by_blocks

__all__ = ["FragmentsConfig", "StreamingConfig", "StreamingDiLoCo", "split_by_blocks"]


@dataclass(frozen=True, kw_only=True)
class FragmentsConfig(OuterSGDConfig):
    """P fragments synced in turn, each overlapped by τ steps (Streaming DiLoCo, CoCoDC)."""

    num_fragments: int = hyper(
        1,
        doc="fragments, transformer blocks strided across them; sync_every must be a multiple",
        symbol="P",
        check=check_positive_int(4),
    )
    fragments: Sequence[Any] | None = hyper(
        None,
        doc="explicit fragments: modules or parameter lists holding every parameter once",
        job=False,
    )
    overlap: int = overlap(
        "inner steps a fragment's all-reduce runs before it is applied (below sync_every)"
    )

    def check(self) -> None:
        super().check()
        h, p, tau = self.sync_every, self.num_fragments, self.overlap
        if h % p:
            raise HyperparameterError(
                "sync_every",
                f"must be a multiple of num_fragments={p} (a sync point every H/P steps); e.g. "
                f"sync_every={p * max(1, round(h / p))}",
                shown=str(h),
            )
        if tau >= h:
            raise HyperparameterError(
                "overlap",
                f"must be < sync_every={h}: a fragment's all-reduce must land before the same "
                "fragment is launched again",
                shown=str(tau),
            )


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
    schedule = "fragments"
    _discards_partial_round = False
    _flat_state = False

    @classmethod
    def _complete(cls, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        fragments, given = (
            hyperparameters.get("fragments"),
            hyperparameters.pop("num_fragments", None),
        )
        if fragments is not None and given is not None and given != len(fragments):
            problem = f"but {len(fragments)} fragments were given; pass one of the two"
            raise HyperparameterError("num_fragments", problem, shown=str(given))
        if fragments is not None or given is not None:
            hyperparameters["num_fragments"] = given if fragments is None else len(fragments)
        return hyperparameters

    def _fragment_groups(
        self, model_or_params: nn.Module | Iterable[torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        fragments = self.config.fragments
        if fragments is None:
            p = self.config.num_fragments
            if p == 1:
                return [self.params]
            if not isinstance(model_or_params, nn.Module):
                raise ValueError(
                    "automatic fragments (num_fragments > 1) need the model as an nn.Module; "
                    "pass the module, or fragments=[...]"
                )
            groups = split_by_blocks(model_or_params, p)
        else:
            groups = [
                [q for q in (f.parameters() if isinstance(f, nn.Module) else f) if q.requires_grad]
                for f in fragments
            ]
        return check_partition(groups, self.params)

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
