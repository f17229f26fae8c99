"""CO2: local updates with an outer all-reduce that overlaps a whole round of compute.

Paper: Sun et al., ICLR 2024 (https://arxiv.org/abs/2401.16265); staleness gap penalty in
Gap-Aware form: Barkai et al., ICLR 2020 (https://arxiv.org/abs/1909.10802). On the engine: one
fragment, overlap τ = H. At the end of round t:

1. Dᵢᵗ ← A_t − θᵢ; launch its all-reduce without waiting.
2. Wait for round t − 1's (it had a whole round) → Δ̄ᵗ⁻¹; one outer step
   (:func:`~lowcomm.outer.functional.co2_outer_update_`): penalty Λ, m ← β·m + Λ ⊙ Δ̄ᵗ⁻¹,
   clip to φ, A_{t+1} = A_t − α·m. At t = 0: A_1 = A_0.
3. θᵢ ← A_{t+1}. ``finish()`` applies the last all-reduce: θ = A on every rank.

Eager updates (``eager=True``; Kale et al. 2025, https://arxiv.org/abs/2502.12996): step 2
uses Δᵢᵗ/N + (Δ̄ᵗ⁻¹ − Δᵢᵗ⁻¹/N), this rank's own fresh delta and the others' stale part (a
missing part counts 0). ``own_weight=w`` puts w·Δᵢᵗ in its place and takes w·Δᵢᵗ⁻¹ out: with
w = 1 (α = 1, β = 0) a rank sits at the last average plus all of its own latest round, the
reset to a stale anchor discarding nothing (delayed averaging, as in Zhou et al. 2020, DaSGD).
Anchors then differ across ranks; ``finish()`` takes their mean.

``overlap=τ < H`` launches each round's all-reduce τ steps before the round ends and applies
it at the end: τ steps stale instead of a round (not with eager). ``num_fragments=P > 1``
staggers the model as Streaming DiLoCo does (Douillard et al. 2025,
https://arxiv.org/abs/2501.18512): P fragments, transformer blocks strided across them, a sync
point every H/P steps syncing fragment (k − 1) mod P with the steps above, each fragment with its
own outer state. With τ = H/P the link carries a fragment per H/P steps, the same bytes per round
as one fragment a round, each fragment H/P steps stale instead of H.

``merge="delay_corrected"`` (the delay-corrected merge of LOSCAR-SGD, Maziane et al. 2026,
https://arxiv.org/abs/2605.20866) replaces step 3's reset θ ← A by θ ← A + (θ − θ_s), θ_s the
fragment's parameters when its all-reduce was launched: below full overlap the reset drops the
τ steps taken since the launch (they are in no Δ), the merge keeps them. At τ = H a sync point
then applies before it launches (the launch sends the progress since the last one, nothing is
carried twice), and a sync point with nothing launched leaves θ alone. Only the merge differs:
with α 1, β 0, no clip or penalty the mean of the ranks' θ does not move at a merge. Paper
symbols: H ``sync_every`` (the paper's τ), α ``outer_lr``, β ``outer_momentum``, φ ``clip``, Λ
``gap_penalty``.

Example::

    algo = lowcomm.CO2(model, inner, sync_every=12)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.buckets import FlatBuckets
from lowcomm.compress.codecs import PowerSGD, parse_compression
from lowcomm.hparams import (
    HyperparameterError,
    check_bool,
    check_choice,
    check_number,
    check_optional,
    check_positive_float,
    check_positive_int,
    hyper,
)
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.fragment import AnyFragment, OuterState, Sync
from lowcomm.outer.functional import co2_outer_update_
from lowcomm.outer.hparams import (
    OuterConfig,
    ShardableConfig,
    check_fragments,
    check_overlap,
    fragments,
    merge,
    num_fragments,
    outer_lr,
    outer_lr_schedule,
    outer_momentum,
)
from lowcomm.outer.merge import MERGES
from lowcomm.params import load_tensors
from lowcomm.schedules import ONE_ROUND_STALE

__all__ = ["CLIP_MODES", "CO2", "MERGES", "CO2Config", "CO2State"]

CLIP_MODES = ("value", "norm")


_check_divisor = check_number(
    "as a constant divisor λ must be a finite number >= 1 (Λ = 1/λ ∈ (0, 1]), got {value!r}; "
    "or use 'gap_aware' / 'none'",
    1,
)


def _check_gap_penalty(key: str, value: Any) -> None:
    if isinstance(value, str) and value not in ("gap_aware", "none"):
        raise HyperparameterError(
            key, f"must be 'gap_aware', 'none' or a number >= 1, got {value!r}"
        )
    if not isinstance(value, str):
        _check_divisor(key, value)


@dataclass(frozen=True, kw_only=True)
class CO2Config(ShardableConfig):
    """CO2's hyperparameters."""

    sync_every: int = hyper(
        12, doc="inner steps per round (the paper's τ)", symbol="H", check=check_positive_int(12)
    )
    outer_lr: float = outer_lr(1.0)
    outer_lr_schedule: str = outer_lr_schedule()
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
        check=check_choice(CLIP_MODES),
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
    overlap: int | None = hyper(
        None,
        doc="inner steps an all-reduce runs before it is applied: below sync_every for the "
        "fragment methods; for CO2 at most sync_every (None: sync_every, the paper's one-round "
        "staleness; fewer: τ steps stale, the all-reduce hidden behind τ steps of compute)",
        symbol="τ",
        job_type="int | None",
        check=check_optional(
            check_number("must be an integer >= 1, got {value!r}; e.g. {key}=4", 1, integer=True)
        ),
    )
    num_fragments: int = num_fragments()
    fragments: Sequence[Any] | None = fragments()
    merge: str = merge()
    own_weight: float | None = hyper(
        None,
        doc="eager: the weight w of this rank's own fresh Δᵢ, replaced by the average a round "
        "later (None: 1/N, the eager update; 1: keep all of its own progress, delayed averaging)",
        symbol="w",
        job_type="float | None",
        check=check_optional(
            check_number(
                "must be a number in (0, 1], got {value!r}; e.g. {key}=1.0",
                0,
                1,
                open_low=True,
                open_high=False,
            )
        ),
    )

    def check(self) -> None:
        super().check()
        check_overlap(self.sync_every, self.overlap, "None: sync_every")
        check_fragments(self.sync_every, self.num_fragments)
        if self.eager and self.num_fragments > 1:
            raise HyperparameterError(
                "eager",
                "cannot be combined with num_fragments > 1 (eager updates take the whole "
                "model's own delta at each sync); use num_fragments=1",
                shown="True",
            )
        if self.eager and self.overlap not in (None, self.sync_every):
            raise HyperparameterError(
                "eager",
                "needs overlap = sync_every: the eager update uses the delta launched at the "
                "same step as the average it completes",
                shown="True",
            )
        if self.eager and self.local_steps == "dynamic":
            raise HyperparameterError(
                "local_steps",
                "'dynamic' cannot be combined with eager=True (an eager update counts this "
                "rank's fresh pseudo-gradient and every other rank's stale one at 1/N each, "
                "with no weight for the steps each took); use eager=False or 'fixed'",
                shown="'dynamic'",
            )
        if self.merge == "delay_corrected" and self.eager:
            raise HyperparameterError(
                "merge",
                "'delay_corrected' cannot be combined with eager=True (eager updates keep this "
                "rank's own progress through the outer step instead); use merge='reset'",
                shown="'delay_corrected'",
            )
        if self.merge == "delay_corrected" and self.shard_outer_state:
            raise HyperparameterError(
                "merge",
                "'delay_corrected' cannot be combined with shard_outer_state=True yet; use "
                "merge='reset', or shard_outer_state=False",
                shown="'delay_corrected'",
            )
        if self.own_weight is not None and not self.eager:
            raise HyperparameterError(
                "own_weight", "needs eager=True (it weighs the eager update's own Δᵢ)"
            )
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
        setting = parse_compression(self.compression) if self.eager else None
        two_phase = isinstance(setting, PowerSGD) or getattr(setting, "family", "") == "powersgd"
        if setting is not None and two_phase:
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

    def __init__(
        self,
        config: CO2Config,
        anchor: list[torch.Tensor],
        lr_factor: Callable[[], float | None],
    ) -> None:
        self.config = config
        self.lr_factor = lr_factor
        self.momentum = [torch.zeros_like(a) for a in anchor]
        self.gap_stat = [torch.zeros_like(a) for a in anchor]
        self.last_update = [torch.zeros_like(a) for a in anchor]
        self.updates = 0

    def step(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None:
        c, factor = self.config, self.lr_factor()
        co2_outer_update_(
            anchor,
            self.momentum,
            self.gap_stat,
            self.last_update,
            avg_delta,
            lr=float(c.outer_lr) * (1.0 if factor is None else factor),
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

    def heal_free(self) -> list[str]:
        """The state_dict keys a healed replica need not receive: without the gap-aware
        penalty nothing reads the gap statistic (0) or the last update (rewritten whole by
        the next step, before anything reads it)."""
        return [] if self.config.gap_penalty == "gap_aware" else ["gap_stat", "last_update"]

    def shared_tensors(self) -> list[torch.Tensor]:
        """What every replica of a committed sync holds alike: :meth:`tensors` less those of
        :meth:`heal_free` (a healed replica keeps its own, unused ones)."""
        free = self.heal_free()
        return [t for key, ts in self._named().items() if key not in free for t in ts]

    def settings(self) -> dict[str, Any]:
        return {}

    def _named(self) -> dict[str, list[torch.Tensor]]:
        return {
            "momentum": self.momentum,
            "gap_stat": self.gap_stat,
            "last_update": self.last_update,
        }

    def state_dict(self) -> dict[str, Any]:
        state = {k: [t.clone() for t in ts] for k, ts in self._named().items()}
        return {**state, "outer_updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, into in self._named().items():
            load_tensors(state, key, into)
        self.updates = int(state.get("outer_updates", 0))


class CO2(OuterAlgorithm):
    """CO2: one-round-stale, fully overlapped outer updates with staleness gap penalty and
    outer momentum clipping (see the module docstring). Compressed or sharded, the second
    phase (PowerSGD's second all-reduce; the owner's update and all-gather) goes out H/2 steps
    after the launch; eager updates use this rank's decoded contribution as Δᵢ."""

    name = "co2"
    Config: ClassVar[type[OuterConfig]] = CO2Config
    config: CO2Config
    schedule = ONE_ROUND_STALE
    _apply_unlaunched = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._eager_out: dict[int, FlatBuckets] = {}  # eager: the outer input, per fragment

    def _overlap(self) -> int:
        return self.sync_every if self.config.overlap is None else int(self.config.overlap)

    def _keeps_progress(self) -> bool:
        return self.config.merge == "delay_corrected"

    @property
    def _flat_state(self) -> bool:  # type: ignore[override]
        return self.config.num_fragments == 1

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        return CO2State(self.config, anchor, self.outer_lr_factor)

    @property
    def outer_updates(self) -> int:
        """Outer updates applied so far (the first one seeds the gap statistic), summed over
        the fragments."""
        return sum(int(getattr(f.outer, "updates", 0)) for f in self.fragments)

    def _outer_input(
        self, frag: AnyFragment, sync: Sync | None, avg: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        if not self.config.eager:
            return avg
        # w·Δᵢᵗ (own, fresh: launched at this step) + (Δ̄ᵗ⁻¹ − w·Δᵢᵗ⁻¹) (the average replaces
        # it a round later), w = 1/N by default; a missing part counts 0, and so does a
        # non-finite own Δᵢ (every rank skips its average)
        assert hasattr(frag, "own")
        w = self.config.own_weight

        def scale(t: list[torch.Tensor]) -> list[torch.Tensor]:
            if w is None:
                return list(torch._foreach_div(t, float(self.world_size)))
            return list(torch._foreach_mul(t, float(w)))

        # this rank's fresh part, in a buffer of the fragment's layout: w·Δᵢᵗ where Δᵢᵗ was
        # finite, else 0 (decided on the device: nothing waits for the launch's verdict)
        out = self._eager_out.get(id(frag))
        if out is None:
            out = self._eager_out[id(frag)] = frag.anchor.like()
        fresh = frag.pending[-1] if frag.pending else None
        if fresh is not None and fresh.step == self.local_step and hasattr(frag, "own_buckets"):
            own = frag.own_buckets(fresh)
            ok = fresh.own_flag
            if ok is None:  # restored from a checkpoint: decided on the host
                ok = torch.tensor(fresh.own_ok, device=out.device)
            for o, b in zip(out.buffers, own.buffers):
                if w is None:
                    torch.div(b, float(self.world_size), out=o)
                else:
                    torch.mul(b, float(w), out=o)
                o.masked_fill_(ok.logical_not(), 0.0)
        else:
            torch._foreach_zero_(out.buffers)
        if sync is not None and avg is not None:
            others = torch._foreach_sub(avg, scale(frag.own(sync)))
            torch._foreach_add_(out.views, others)
        return out.views

    def _after_finish(self, drained: bool) -> None:
        if self.config.eager and drained:
            # Eager anchors differ a little across ranks (each applied its own fresh Δᵢ
            # through the nonlinear momentum, clip and penalty): agree on their mean.
            self.comm.all_reduce_mean(self.anchor.buffers)

    def _extra_state(self) -> dict[str, Any]:
        return {"eager": self.config.eager}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if state.get("eager", False) != self.config.eager:
            raise ValueError(
                f"state_dict was saved with eager={state.get('eager', False)!r} but this CO2 "
                f"has eager={self.config.eager!r}; resume with the same settings"
            )
