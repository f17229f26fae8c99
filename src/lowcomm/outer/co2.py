"""CO2: local updates with an outer all-reduce that overlaps a whole round of compute.

Paper: Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation
Overlap", ICLR 2024 (https://arxiv.org/abs/2401.16265). Staleness gap penalty in Gap-Aware form:
Barkai et al., "Gap-Aware Mitigation of Gradient Staleness", ICLR 2020
(https://arxiv.org/abs/1909.10802).

Round t ends after H inner steps:

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

Paper symbols → arguments: H ``sync_every`` (the paper's τ), α ``outer_lr``, β
``outer_momentum``, φ ``clip``, Λ ``gap_penalty``.

Example::

    algo = lowcomm.CO2(model, inner, sync_every=12)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        inner.step(); inner.zero_grad()
        algo.step()
    algo.finish()
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lowcomm.comm import DEFAULT_BUCKET_CAP_MB, Communicator, Handle
from lowcomm.compress.codecs import PowerSGD, parse_compression
from lowcomm.compress.feedback import Compressor
from lowcomm.compress.lgreco import LGreCo
from lowcomm.outer.base import (
    Compression,
    OuterAlgorithm,
    _check_bool,
    _check_momentum,
    _check_positive_float,
    clone_views,
)
from lowcomm.outer.fragment import load_compression
from lowcomm.outer.functional import co2_outer_update_, pseudo_gradient_
from lowcomm.outer.sharded import ShardedFragment, ShardedRound, check_sharding

__all__ = ["CO2"]

CLIP_MODES = ("value", "norm")


class CO2(OuterAlgorithm):
    """CO2: one-round-stale, fully overlapped outer updates with staleness gap penalty and
    outer momentum clipping.

    Args:
        model_or_params: an ``nn.Module`` or an iterable of parameters.
        inner_optimizer: the optimizer whose ``step()`` drives the rounds.
        sync_every: H, inner steps per round (the paper's τ; default 12).
        outer_lr: α, the outer learning rate (default 1.0).
        outer_momentum: β, the outer momentum (default 0.5).
        nesterov: A ← A − α(Λ⊙Δ̄ + β·m) instead of A ← A − α·m (default False).
        clip: φ, the outer momentum clipping threshold; ``None`` disables clipping (default 1.0).
        clip_mode: ``"value"`` clamps m elementwise to [−φ, φ]; ``"norm"`` scales m to global
            L2 norm ≤ φ.
        gap_penalty: Λ: ``"gap_aware"`` (default; Λ = 1 / max(1, |g| / (c + ε)), g the gap
            between the anchor and the stale average model, c a running mean of |Δ̄|),
            ``"none"`` (Λ = 1), or a float λ ≥ 1 (Λ = 1/λ, a constant divisor).
        eager: eager updates (see the module docstring; default False).
        process_group: the group to reduce over; ``None`` is WORLD.
        bucket_cap_mb: size cap of one flat fp32 bucket (one collective each).
        compression: compress the pseudo-gradients, with error feedback on each rank (a codec
            or a spec such as ``"int4"``, ``"topk:0.01"``, ``"powersgd:4"``,
            ``"lgreco:powersgd"``; see :mod:`lowcomm.compress`). Still one round stale and
            overlapped: the compressed collective is launched at the end of round t and
            decoded at the end of round t + 1; PowerSGD's second all-reduce goes out H/2 inner
            steps after the first. Eager updates use this rank's decoded contribution as Δᵢ
            and need a single-phase codec (not PowerSGD).
        shard_outer_state: keep 1/N of the anchor, momentum, gap statistic and last update on
            each rank (:mod:`lowcomm.outer.sharded`): the parameters are reduce-scattered at
            the end of round t, the owner's update and the anchor's all-gather go out H/2
            steps later, and θ takes the anchor at the end of round t + 1 — still fully
            overlapped. Not with ``eager``, ``compression`` or ``clip_mode="norm"``.
        nan_policy, check_consistency: the guards every algorithm has (see
            :class:`~lowcomm.outer.base.OuterAlgorithm`).
    """

    name = "co2"
    schedule = "one-round-stale"
    compressible = True

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int = 12,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.5,
        nesterov: bool = False,
        clip: float | None = 1.0,
        clip_mode: str = "value",
        gap_penalty: str | float = "gap_aware",
        eager: bool = False,
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
            clip=clip,
            clip_mode=clip_mode,
            gap_penalty=gap_penalty,
            eager=eager,
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
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.clip = None if clip is None else float(clip)
        self.clip_mode = clip_mode
        self.gap_penalty: str | float = (
            gap_penalty if isinstance(gap_penalty, str) else float(gap_penalty)
        )
        self.outer_updates = 0
        """Outer updates applied so far (the first one seeds the gap statistic)."""
        self.shard_outer_state = bool(shard_outer_state)
        self.sharded: ShardedFragment | None = None
        self._round: ShardedRound | None = None  # sharded: the sync launched last round
        if self.shard_outer_state:
            # anchor, momentum, gap statistic and last update: this rank's chunks only
            self.sharded = ShardedFragment(
                self.params,
                self.comm,
                bucket_cap_mb=self.bucket_cap_mb,
                update=self._sharded_update,
                reference=self._round_start_anchor,
            )
            self._anchor_moved = False  # whether A has moved since the round now reduced began
            self.anchor = self.sharded.anchor  # the last gathered full anchor
            self._chunk_state = [
                [torch.zeros_like(c) for c in self.sharded.shard] for _ in range(3)
            ]
        else:
            self.anchor = self._new_buckets()
            self.anchor.copy_from(self.params)
            self.momentum = self.anchor.like()
            self.gap_stat = self.anchor.like()
            self.last_update = self.anchor.like()
        # Two send buffers: the one in flight is never touched while the other is filled.
        self._send = [] if self.sharded else [self.anchor.like(), self.anchor.like()]
        self._send_next = 0
        self._pending: tuple[Handle, int] | None = None  # (handle, index into _send)
        self.eager = bool(eager)
        # Eager: this rank's own Δᵢ of each send buffer, kept before the all-reduce sums it.
        self._own = [self.anchor.like(), self.anchor.like()] if self.eager else []
        self.compression = parse_compression(compression)
        self.compressor = (
            None
            if self.compression is None
            else Compressor(
                self.compression,
                self.anchor.shapes,
                rank=self.comm.rank,
                device=self.anchor.device,
            )
        )

    @classmethod
    def validate(cls, **kwargs: Any) -> None:
        super().validate(**kwargs)
        if "outer_lr" in kwargs:
            _check_positive_float("outer_lr", kwargs["outer_lr"], 1.0)
        if "outer_momentum" in kwargs:
            _check_momentum("outer_momentum", kwargs["outer_momentum"])
        if "nesterov" in kwargs:
            _check_bool("nesterov", kwargs["nesterov"])
        if "eager" in kwargs:
            _check_bool("eager", kwargs["eager"])
        if kwargs.get("clip") is not None:
            _check_positive_float("clip", kwargs["clip"], 1.0)
        if "clip_mode" in kwargs and kwargs["clip_mode"] not in CLIP_MODES:
            raise ValueError(f"clip_mode must be 'value' or 'norm', got {kwargs['clip_mode']!r}")
        if kwargs.get("shard_outer_state") and kwargs.get("eager"):
            raise ValueError(
                "eager=True cannot be combined with shard_outer_state=True: eager updates need "
                "this rank's own full pseudo-gradient, which a sharded sync never forms"
            )
        if kwargs.get("shard_outer_state") and kwargs.get("clip_mode") == "norm":
            raise ValueError(
                "clip_mode='norm' cannot be combined with shard_outer_state=True (the norm "
                "would span every rank's chunk); use clip_mode='value'"
            )
        if kwargs.get("eager") and kwargs.get("compression") is not None:
            setting = parse_compression(kwargs["compression"])
            if isinstance(setting, PowerSGD) or (
                isinstance(setting, LGreCo) and setting.family == "powersgd"
            ):
                raise ValueError(
                    f"eager=True needs this rank's decoded contribution at launch, which "
                    f"{setting.spec!r} only has after its second all-reduce; use eager=False or "
                    "a single-phase codec such as 'int8' or 'topk:0.01'"
                )
        if "gap_penalty" in kwargs:
            gp = kwargs["gap_penalty"]
            if isinstance(gp, str):
                if gp not in ("gap_aware", "none"):
                    raise ValueError(
                        f"gap_penalty must be 'gap_aware', 'none' or a number >= 1, got {gp!r}"
                    )
            elif (
                isinstance(gp, bool)
                or not isinstance(gp, numbers.Real)
                or not math.isfinite(gp)
                or gp < 1
            ):
                raise ValueError(
                    f"gap_penalty as a constant divisor λ must be a finite number >= 1 "
                    f"(Λ = 1/λ ∈ (0, 1]), got {gp!r}; or use 'gap_aware' / 'none'"
                )

    @property
    def in_flight(self) -> bool:
        """Whether an all-reduce launched by an earlier round has not been applied yet."""
        return self._pending is not None or self._round is not None

    def _sharded_update(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None:
        """The outer update on this rank's chunks (sharded; the same rule, elementwise)."""
        self._apply(anchor, *self._chunk_state, avg_delta)
        self._anchor_moved = True

    def _round_start_anchor(self, anchor: list[torch.Tensor]) -> list[torch.Tensor]:
        """The chunks of the anchor the round being applied started from: A − u, with u the
        last update, unless that update was skipped (then A itself)."""
        if not self._anchor_moved:
            return anchor
        return list(torch._foreach_sub(anchor, self._chunk_state[2]))

    def _sharded_skip(self, what: str) -> None:
        self._anchor_moved = False
        self._skip(what)

    def _end_round_sharded(self, frag: ShardedFragment) -> None:
        stale = self._round
        if stale is not None:
            stale.advance()  # (H = 1) its reduce-scatter reads the snapshot about to be refilled
        what = f"round {self.rounds + 1}"
        with record_function(f"{self._profile_tag}::launch"):
            self._round = frag.launch(self._check_own, lambda: self._sharded_skip(what))
            # the owner's update and the all-gather go out halfway through the next round
            self._schedule_advance(self._round, self.sync_every)
        if stale is not None:
            with record_function(f"{self._profile_tag}::wait"):
                stale.wait()
        self.anchor.copy_to(self.params)

    def _outer_update(self, avg_delta: list[torch.Tensor]) -> None:
        self._apply(
            self.anchor.views,
            self.momentum.views,
            self.gap_stat.views,
            self.last_update.views,
            avg_delta,
        )

    def _apply(self, *tensors: list[torch.Tensor]) -> None:
        """One :func:`co2_outer_update_` on (anchor, momentum, gap statistic, last update,
        Δ̄) with this algorithm's hyperparameters."""
        with record_function(f"{self._profile_tag}::outer"):
            co2_outer_update_(
                *tensors,
                lr=self.outer_lr,
                beta=self.outer_momentum,
                nesterov=self.nesterov,
                clip=self.clip,
                clip_mode=self.clip_mode,
                gap_penalty=self.gap_penalty,
                first=self.outer_updates == 0,
            )
        self.outer_updates += 1

    def _wait_pending(self) -> tuple[list[torch.Tensor], int] | None:
        """Wait for the all-reduce launched last round: its Δ̄ (views) and buffer index."""
        if self._pending is None:
            return None
        handle, idx = self._pending
        self._pending = None
        with record_function(f"{self._profile_tag}::wait"):
            handle.wait()
        return self._send[idx].views, idx

    def _eager_delta(
        self, fresh: int | None, stale: tuple[list[torch.Tensor], int] | None
    ) -> list[torch.Tensor]:
        """Δᵢᵗ/N (own, fresh) + (Δ̄ᵗ⁻¹ − Δᵢᵗ⁻¹/N) (others', stale); a missing part counts 0."""
        n = float(self.world_size)
        if fresh is not None:
            out = list(torch._foreach_div(self._own[fresh].views, n))
        else:
            out = [torch.zeros_like(v) for v in self.anchor.views]
        if stale is not None:
            avg, idx = stale
            others = torch._foreach_sub(avg, torch._foreach_div(self._own[idx].views, n))
            torch._foreach_add_(out, others)
        return out

    def _end_round(self) -> None:
        if self.sharded is not None:
            self._end_round_sharded(self.sharded)
            return
        idx = self._send_next
        send = self._send[idx]
        self._send_next ^= 1
        with record_function(f"{self._profile_tag}::launch"):
            pseudo_gradient_(send.views, self.anchor.views, self.params)
            own_ok = self._check_own(send.views)
            if self.compressor is not None:
                # eager: this rank's decoded contribution is what the others will receive
                own = self._own[idx] if self.eager else None
                handle = self.comm.compressed_mean_async(send, self.compressor, own=own)
                self._schedule_advance(handle, self.sync_every)
            else:
                if self.eager:
                    torch._foreach_copy_(self._own[idx].views, send.views)
                handle = self.comm.all_reduce_mean_async(send.buffers)
        stale = self._wait_pending()
        self._pending = (handle, idx)
        if stale is None or self._guard(stale[0], f"round {self.rounds}"):
            if self.eager:
                # a non-finite own Δᵢ is left out here; next round every rank skips its average
                self._outer_update(self._eager_delta(idx if own_ok else None, stale))
            elif stale is not None:
                self._outer_update(stale[0])
        self.anchor.copy_to(self.params)

    def _finish(self) -> None:
        if self.sharded is not None:
            if self._round is not None:
                self._round.wait()
                self._round = self.sharded.pending = None
            self.anchor.copy_to(self.params)
            return
        stale = self._wait_pending()
        if stale is not None:
            if self._guard(stale[0], f"round {self.rounds}"):
                self._outer_update(self._eager_delta(None, stale) if self.eager else stale[0])
            if self.eager:
                # Eager anchors differ a little across ranks (each applied its own fresh Δᵢ
                # through the nonlinear momentum, clip and penalty): agree on their mean.
                self.comm.all_reduce_mean(self.anchor.buffers)
        self.anchor.copy_to(self.params)

    def _compressors(self) -> list[Compressor]:
        return [] if self.compressor is None else [self.compressor]

    def _drain(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
        if self._round is not None:
            self._round.wait()

    def _state_tensors(self) -> list[torch.Tensor]:
        if self.sharded is not None:
            return [*self.sharded.state_tensors(), *(t for ts in self._chunk_state for t in ts)]
        state = [self.anchor, self.momentum, self.gap_stat, self.last_update]
        return [*super()._state_tensors(), *(b for fb in state for b in fb.buffers)]

    def _buffer_tensors(self) -> list[torch.Tensor]:
        if self.sharded is not None:
            return self.sharded.buffer_tensors()
        return [b for fb in (*self._send, *self._own) for b in fb.buffers]

    def _settings(self) -> dict[str, Any]:
        return {
            **super()._settings(),
            "shard_outer_state": self.shard_outer_state,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
            "clip": self.clip,
            "clip_mode": self.clip_mode,
            "gap_penalty": self.gap_penalty,
            "eager": self.eager,
            "compression": None if self.compression is None else self.compression.spec,
        }

    def _extra_state(self) -> dict[str, Any]:
        if self.sharded is not None:
            momentum, gap_stat, last_update = self._chunk_state
            return {
                "eager": False,
                **self.sharded.state_dict(),  # completes the sync in flight, if any
                "momentum": [t.clone() for t in momentum],
                "gap_stat": [t.clone() for t in gap_stat],
                "last_update": [t.clone() for t in last_update],
                "outer_updates": self.outer_updates,
                "anchor_moved": self._anchor_moved,
            }
        pending = own = None
        if self._pending is not None:
            # Completing (not applying) the all-reduce lets us store its result exactly.
            handle, idx = self._pending
            handle.wait()
            pending = clone_views(self._send[idx])
            own = clone_views(self._own[idx]) if self.eager else None
        state: dict[str, Any] = {
            "eager": self.eager,
            "anchor": clone_views(self.anchor),
            "momentum": clone_views(self.momentum),
            "gap_stat": clone_views(self.gap_stat),
            "last_update": clone_views(self.last_update),
            "outer_updates": self.outer_updates,
            "pending_avg_delta": pending,
            "pending_own_delta": own,
        }
        if self.compressor is not None:
            state["compression"] = self.compressor.state_dict()
        return state

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if bool(state.get("eager", False)) != self.eager:
            raise ValueError(
                f"state_dict was saved with eager={state.get('eager')!r} but this CO2 has "
                f"eager={self.eager!r}; resume with the same settings"
            )
        check_sharding(state, self.sharded is not None, "CO2")
        if self.sharded is not None:
            for key, chunks in zip(("momentum", "gap_stat", "last_update"), self._chunk_state):
                src = state.get(key)
                if src is None or [t.shape for t in src] != [t.shape for t in chunks]:
                    raise ValueError(f"sharded CO2 state_dict[{key!r}] does not fit this model")
            self.sharded.load_state_dict(state)
            for key, chunks in zip(("momentum", "gap_stat", "last_update"), self._chunk_state):
                torch._foreach_copy_(chunks, [t.to(c.device) for t, c in zip(state[key], chunks)])
            self.outer_updates = int(state.get("outer_updates", 0))
            self._anchor_moved = bool(state.get("anchor_moved", False))
            self._round = self.sharded.pending
            return
        self._load_tensors(state, "anchor", self.anchor.views)
        self._load_tensors(state, "momentum", self.momentum.views)
        self._load_tensors(state, "gap_stat", self.gap_stat.views)
        self._load_tensors(state, "last_update", self.last_update.views)
        self.outer_updates = int(state.get("outer_updates", 0))
        load_compression(self.compressor, state)
        self._pending = None
        if state.get("pending_avg_delta") is not None:
            idx = self._send_next
            self._send_next ^= 1
            self._load_tensors(state, "pending_avg_delta", self._send[idx].views)
            if self.eager:
                self._load_tensors(state, "pending_own_delta", self._own[idx].views)
            self._pending = (self.comm.completed(self._send[idx].buffers), idx)
