"""Streaming DiLoCo: DiLoCo over P fragments, one synced at a time, with overlapped all-reduces.

Paper: Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", 2025 (https://arxiv.org/abs/2501.18512). The schedule is torchft's
``DiLoCo(model_fragments, sync_every, fragment_sync_delay, fragment_update_alpha)``:

* sync points every H/P inner steps; the k-th (k = 1, 2, …) syncs fragment (k − 1) mod P;
* fragment p's pseudo-gradient Δ_p = A_p − θ_p is taken and its all-reduce launched ``overlap``
  (τ) inner steps before its sync point;
* at the sync point: Â_p = OuterOpt_p(A_p, Δ̄_p); θ_p ← (1 − mix)·Â_p + mix·θ_p; A_p ← Â_p.

torchft keeps at most one fragment in flight (τ < H/P). Here τ may be anything below H: with
τ ≥ H/P the next fragment's all-reduce is launched while earlier ones are still running, which
hides more of a slow link at the price of staler pseudo-gradients. The first sync points, whose
launch would then fall before the first step, are skipped.

Paper symbols → arguments: H ``sync_every``, P ``num_fragments``, τ ``overlap``, α ``mix``
(the paper's mixing factor), outer α/β ``outer_lr``/``outer_momentum``.

Example (then ``algo.step()`` after every inner step, ``algo.finish()`` at the end)::

    algo = lowcomm.StreamingDiLoCo(model, inner, sync_every=48, num_fragments=4, overlap=2)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm.outer.diloco import OuterSGDConfig
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.fragment import OptimizerState, OuterState
from lowcomm.outer.hparams import (
    HyperparameterError,
    OuterConfig,
    ShardableConfig,
    check_number,
    check_positive_int,
    hyper,
)

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
    overlap: int = hyper(
        0,
        doc="inner steps a fragment's all-reduce runs before it is applied (below sync_every)",
        symbol="τ",
        check=check_number("must be an integer >= 0, got {value!r}", 0, integer=True),
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


def _find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` with the most children: the transformer blocks of usual models."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    return best


def split_by_blocks(model: nn.Module, num_fragments: int) -> list[list[torch.Tensor]]:
    """Automatic fragments, strided by transformer block as in the Streaming DiLoCo paper.

    Block j of the model's largest ``nn.ModuleList`` goes to fragment j mod P (blocks are
    interleaved across fragments). Every other trainable parameter (embeddings, final norm,
    head) goes, in ``named_parameters()`` order, to the fragment with the fewest elements so
    far (ties: the lowest index), which keeps the fragments' sizes — and so the bursts on the
    link — close to each other. Deterministic: every rank computes the same split.
    """
    blocks = _find_blocks(model)
    if blocks is None or len(blocks) < num_fragments:
        found = 0 if blocks is None else len(blocks)
        raise ValueError(
            f"automatic fragments need at least num_fragments={num_fragments} transformer "
            f"blocks in an nn.ModuleList, found {found}; pass fragments=[module, ...] instead"
        )
    groups: list[list[torch.Tensor]] = [[] for _ in range(num_fragments)]
    in_blocks: set[int] = set()
    for j, block in enumerate(blocks):
        for p in block.parameters():
            if p.requires_grad and id(p) not in in_blocks:
                groups[j % num_fragments].append(p)
                in_blocks.add(id(p))
    sizes = [sum(p.numel() for p in g) for g in groups]
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in in_blocks or id(p) in seen:
            continue
        seen.add(id(p))
        i = min(range(num_fragments), key=lambda f: (sizes[f], f))
        groups[i].append(p)
        sizes[i] += p.numel()
    return groups


class StreamingDiLoCo(OuterAlgorithm):
    """Streaming DiLoCo: P fragments synced in turn, each all-reduce overlapped with τ steps
    (see the module docstring); one outer optimizer per fragment, as :class:`~lowcomm.DiLoCo`.
    Automatic fragments (``num_fragments``) need the model as an ``nn.Module``
    (:func:`split_by_blocks`). ``finish()`` applies every all-reduce still in flight and then
    resets every fragment to its anchor, so all ranks agree; local progress since a fragment's
    last sync is dropped."""

    name = "streaming"
    Config: ClassVar[type[OuterConfig]] = StreamingConfig
    config: FragmentsConfig
    schedule = "fragments"
    # Fragments are synced at their own sync points, not at round boundaries; the docstring
    # says what finish() drops.
    _discards_partial_round = False
    _flat_state = False

    @classmethod
    def _complete(cls, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        fragments = hyperparameters.get("fragments")
        if fragments is not None:
            given = hyperparameters.get("num_fragments")
            if given is not None and given != len(fragments):
                raise HyperparameterError(
                    "num_fragments",
                    f"but {len(fragments)} fragments were given; pass one of the two",
                    shown=str(given),
                )
            hyperparameters = {**hyperparameters, "num_fragments": len(fragments)}
        elif hyperparameters.get("num_fragments") is None:
            hyperparameters = {k: v for k, v in hyperparameters.items() if k != "num_fragments"}
        return hyperparameters

    def _overlap(self) -> int:
        return int(self.config.overlap)

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        return OptimizerState(self.config.outer_factory(), anchor)

    def _fragment_groups(
        self, model_or_params: nn.Module | list[torch.Tensor]
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
        mine = {id(q) for q in self.params}
        seen: set[int] = set()
        for i, g in enumerate(groups):
            if not g:
                raise ValueError(f"fragment {i} has no trainable parameters")
            for q in g:
                if id(q) in seen:
                    raise ValueError(f"a parameter appears in two fragments (again in {i})")
                if id(q) not in mine:
                    raise ValueError(f"fragment {i} holds a parameter that is not in the model")
                seen.add(id(q))
        if len(seen) != len(mine):
            raise ValueError(
                f"{len(mine) - len(seen)} trainable parameter(s) are in no fragment and would "
                "never be synchronised; give every parameter to a fragment"
            )
        return groups

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
