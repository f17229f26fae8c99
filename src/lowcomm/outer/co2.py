"""CO2: local updates with an outer all-reduce that overlaps a whole round of compute.

Paper: Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation
Overlap", ICLR 2024 (https://arxiv.org/abs/2401.16265). Staleness gap penalty in Gap-Aware form:
Barkai et al., "Gap-Aware Mitigation of Gradient Staleness", ICLR 2020
(https://arxiv.org/abs/1909.10802).

On the outer engine: one fragment, overlap τ = H. Round t ends after H inner steps:

1. Dᵢᵗ ← A_t − θᵢ into a send buffer; launch its all-reduce asynchronously. Do not wait.
2. If a previous round is in flight: wait for it → Δ̄ᵗ⁻¹ (it had a whole round to finish) and
   take one outer step (:func:`~lowcomm.outer.functional.co2_outer_update_`): gap penalty Λ,
   momentum m ← β·m + Λ ⊙ Δ̄ᵗ⁻¹, clipping to φ, A_{t+1} = A_t − α·m. At t = 0: A_1 = A_0.
3. θᵢ ← A_{t+1}.

``finish()`` waits for the last all-reduce, applies it, and leaves θ = A on every rank.

Eager updates (``eager=True``; Kale et al., "Eager Updates For Overlapped Communication and
Computation in DiLoCo", 2025, https://arxiv.org/abs/2502.12996): step 2 uses
Δᵢᵗ/N + (Δ̄ᵗ⁻¹ − Δᵢᵗ⁻¹/N) — this rank's own fresh delta and the others' stale part — instead of
Δ̄ᵗ⁻¹ (a missing part counts as 0, so round 0 already applies Δᵢ⁰/N). Anchors then differ a
little across ranks; ``finish()`` replaces them by their mean so that all ranks agree.

Example (then ``algo.step()`` after every inner step, ``algo.finish()`` at the end)::

    algo = lowcomm.CO2(model, inner, sync_every=12)

Paper symbols → arguments: H ``sync_every`` (the paper's τ), α ``outer_lr``, β
``outer_momentum``, φ ``clip``, Λ ``gap_penalty``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.compress.codecs import PowerSGD, parse_compression
from lowcomm.compress.lgreco import LGreCo
from lowcomm.outer.engine import AnyFragment, OuterAlgorithm
from lowcomm.outer.fragment import OuterState, Sync, load_tensors
from lowcomm.outer.functional import co2_outer_update_
from lowcomm.outer.hparams import (
    HyperparameterError,
    OuterConfig,
    ShardableConfig,
    check_bool,
    check_optional,
    check_positive_float,
    check_positive_int,
    hyper,
    outer_lr,
    outer_momentum,
)

__all__ = ["CLIP_MODES", "CO2", "CO2Config", "CO2State"]

CLIP_MODES = ("value", "norm")


def _check_clip_mode(key: str, value: Any) -> None:
    if value not in CLIP_MODES:
        raise HyperparameterError(key, f"must be 'value' or 'norm', got {value!r}")


def _check_gap_penalty(key: str, value: Any) -> None:
    if isinstance(value, str):
        if value not in ("gap_aware", "none"):
            raise HyperparameterError(
                key, f"must be 'gap_aware', 'none' or a number >= 1, got {value!r}"
            )
    elif (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 1
    ):
        raise HyperparameterError(
            key,
            f"as a constant divisor λ must be a finite number >= 1 (Λ = 1/λ ∈ (0, 1]), got "
            f"{value!r}; or use 'gap_aware' / 'none'",
        )


@dataclass(frozen=True, kw_only=True)
class CO2Config(ShardableConfig):
    """CO2's hyperparameters."""

    sync_every: int = hyper(
        12, doc="inner steps per round (the paper's τ)", symbol="H", check=check_positive_int(12)
    )
    outer_lr: float = outer_lr(1.0)
    outer_momentum: float = outer_momentum(0.5)
    nesterov: bool = hyper(
        False,
        doc="Nesterov outer momentum (CO2: A ← A − α(Λ⊙Δ̄ + β·m) instead of A ← A − α·m)",
        check=check_bool,
    )
    clip: float | None = hyper(
        1.0,
        doc='outer momentum clipping threshold (None, in a job "none": no clipping)',
        symbol="φ",
        job_type="float | str | None",
        check=check_optional(check_positive_float(1.0)),
    )
    clip_mode: str = hyper(
        "value",
        doc="value (clamp m elementwise to [-φ, φ]) or norm (scale m to L2 norm <= φ)",
        check=_check_clip_mode,
    )
    gap_penalty: str | float = hyper(
        "gap_aware",
        doc="staleness penalty: gap_aware, none, or a constant divisor λ >= 1",
        symbol="Λ",
        check=_check_gap_penalty,
    )
    eager: bool = hyper(
        False, doc="eager updates: own fresh Δ, others' stale part", check=check_bool
    )

    def check(self) -> None:
        super().check()
        if self.shard_outer_state and self.eager:
            raise HyperparameterError(
                "eager",
                "cannot be combined with shard_outer_state=True: eager updates need this "
                "rank's own full pseudo-gradient, which a sharded sync never forms",
                shown="True",
            )
        if self.shard_outer_state and self.clip_mode == "norm":
            raise HyperparameterError(
                "clip_mode",
                "cannot be combined with shard_outer_state=True (the norm would span every "
                "rank's chunk); use clip_mode='value'",
                shown="'norm'",
            )
        if self.eager and self.compression is not None:
            setting = parse_compression(self.compression)
            if isinstance(setting, PowerSGD) or (
                isinstance(setting, LGreCo) and setting.family == "powersgd"
            ):
                raise HyperparameterError(
                    "eager",
                    f"needs this rank's decoded contribution at launch, which {setting.spec!r} "
                    "only has after its second all-reduce; use eager=False or a single-phase "
                    "codec such as 'int8' or 'topk:0.01'",
                    shown="True",
                )


class CO2State:
    """CO2's outer state over the anchor tensors: momentum m, gap statistic c, last update u,
    and the number of updates applied (the first seeds c)."""

    def __init__(self, config: CO2Config, anchor: list[torch.Tensor]) -> None:
        self.config = config
        self.momentum = [torch.zeros_like(a) for a in anchor]
        self.gap_stat = [torch.zeros_like(a) for a in anchor]
        self.last_update = [torch.zeros_like(a) for a in anchor]
        self.updates = 0

    def step(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None:
        c = self.config
        co2_outer_update_(
            anchor,
            self.momentum,
            self.gap_stat,
            self.last_update,
            avg_delta,
            lr=float(c.outer_lr),
            beta=float(c.outer_momentum),
            nesterov=c.nesterov,
            clip=None if c.clip is None else float(c.clip),
            clip_mode=c.clip_mode,
            gap_penalty=c.gap_penalty if isinstance(c.gap_penalty, str) else float(c.gap_penalty),
            first=self.updates == 0,
        )
        self.updates += 1

    def tensors(self) -> list[torch.Tensor]:
        return [*self.momentum, *self.gap_stat, *self.last_update]

    def settings(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": [t.clone() for t in self.momentum],
            "gap_stat": [t.clone() for t in self.gap_stat],
            "last_update": [t.clone() for t in self.last_update],
            "outer_updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_tensors(state, "momentum", self.momentum)
        load_tensors(state, "gap_stat", self.gap_stat)
        load_tensors(state, "last_update", self.last_update)
        self.updates = int(state.get("outer_updates", 0))


class CO2(OuterAlgorithm):
    """CO2: one-round-stale, fully overlapped outer updates with staleness gap penalty and
    outer momentum clipping (see the module docstring).

    With ``compression`` the compressed collective is still launched at the end of round t
    and decoded at the end of round t + 1 (PowerSGD's second all-reduce H/2 steps after the
    first); eager updates then use this rank's decoded contribution as Δᵢ and need a
    single-phase codec. With ``shard_outer_state`` the parameters are reduce-scattered at the
    end of round t, the owner's update and the anchor's all-gather go out H/2 steps later, and
    θ takes the anchor at the end of round t + 1 (not with ``eager`` or ``clip_mode="norm"``).
    """

    name = "co2"
    Config: ClassVar[type[OuterConfig]] = CO2Config
    config: CO2Config
    schedule = "one-round-stale"
    _apply_unlaunched = True

    def _overlap(self) -> int:
        return self.sync_every

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        return CO2State(self.config, anchor)

    def _keeps_own(self) -> bool:
        return self.config.eager

    @property
    def outer_updates(self) -> int:
        """Outer updates applied so far (the first one seeds the gap statistic)."""
        return self._state().updates

    def _state(self) -> CO2State:
        state = self.fragment.outer
        assert isinstance(state, CO2State)
        return state

    def _outer_input(
        self, frag: AnyFragment, sync: Sync | None, avg: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        if not self.config.eager:
            return avg
        # Δᵢᵗ/N (own, fresh: launched at this step) + (Δ̄ᵗ⁻¹ − Δᵢᵗ⁻¹/N) (others', stale); a
        # missing part counts 0, and so does a non-finite own Δᵢ (every rank skips its average)
        assert hasattr(frag, "own")
        n = float(self.world_size)
        fresh = frag.pending[-1] if frag.pending else None
        if fresh is not None and fresh.step == self.local_step and fresh.own_ok:
            out = list(torch._foreach_div(frag.own(fresh), n))
        else:
            out = [torch.zeros_like(v) for v in frag.anchor.views]
        if sync is not None and avg is not None:
            others = torch._foreach_sub(avg, torch._foreach_div(frag.own(sync), n))
            torch._foreach_add_(out, others)
        return out

    def _after_finish(self, drained: bool) -> None:
        if self.config.eager and drained:
            # Eager anchors differ a little across ranks (each applied its own fresh Δᵢ
            # through the nonlinear momentum, clip and penalty): agree on their mean.
            self.comm.all_reduce_mean(self.anchor.buffers)

    def _extra_state(self) -> dict[str, Any]:
        return {"eager": self.config.eager}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if bool(state.get("eager", False)) != self.config.eager:
            raise ValueError(
                f"state_dict was saved with eager={state.get('eager')!r} but this CO2 has "
                f"eager={self.config.eager!r}; resume with the same settings"
            )
