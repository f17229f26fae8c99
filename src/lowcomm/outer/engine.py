"""The outer engine: one launch → wait → update schedule that every outer algorithm is.

A *fragment* (some parameters with their anchor A, send buffer and outer state:
:mod:`lowcomm.outer.fragment`) is **launched** at an inner step (Δ = A − θ into its buffer, the
collective started) and **applied** ``overlap`` inner steps later (wait, outer update of A,
merge into θ). With H = ``sync_every`` and P fragments there is a sync point every H/P inner
steps; the k-th (k = 1, 2, …) applies the fragment chosen when its collective was launched,
``overlap`` (τ) steps earlier. An algorithm is a choice of:

============  ===========  =======  ============================  =========================
algorithm     fragments    τ        update rule                   merge
============  ===========  =======  ============================  =========================
LocalSGD      1            0        A ← mean θ                    θ ← A
DiLoCo        1            0        outer optimizer (Nesterov)    θ ← A
SlowMo        1            0        heavy ball, Δ̄/γ, lr α·γ       θ ← A
CO2           1            H        penalty, momentum, clip       θ ← A (eager: own fresh Δ)
Streaming     P            τ < H    outer optimizer per fragment  θ ← (1 − mix)·A + mix·θ
CoCoDC        P (chosen)   τ < H    outer optimizer per fragment  delay compensation
============  ===========  =======  ============================  =========================

Subclasses set their :class:`~lowcomm.outer.hparams.OuterConfig` dataclass (``Config``), which
gives the constructor's keywords, and override the few hooks that make them what they are:
:meth:`OuterAlgorithm._outer_state` (the update rule), :meth:`~OuterAlgorithm._merge`,
:meth:`~OuterAlgorithm._choose_fragment`, :meth:`~OuterAlgorithm._outer_input`.

Two guards run in every algorithm: :mod:`lowcomm.outer.guards`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from lowcomm.comm import CommStats, Communicator, storage_nbytes
from lowcomm.compress.codecs import parse_compression
from lowcomm.guard import (
    Description,
    all_finite,
    describe_tensors,
)
from lowcomm.outer.fragment import (
    Fragment,
    OuterState,
    ShardedFragment,
    Sync,
    collect_params,
)
from lowcomm.outer.guards import Guards
from lowcomm.outer.hparams import HyperparameterError, OuterConfig, describe, signature

__all__ = ["OuterAlgorithm"]

logger = logging.getLogger(__name__)

AnyFragment = Fragment | ShardedFragment


class OuterAlgorithm(Guards):
    """The engine: see the module docstring. Not used directly.

    Every algorithm takes, besides its own hyperparameters (its ``Config``):

    Args:
        model_or_params: an ``nn.Module`` or an iterable of parameters.
        inner_optimizer: the optimizer whose ``step()`` drives the schedule.
        process_group: the group to synchronise over; ``None`` is WORLD (a subgroup runs the
            algorithm across node groups while DDP runs inside them).
        nan_policy: ``"skip"`` (default) drops an outer update whose averaged pseudo-gradient
            holds NaN or Inf, alike on every rank, and counts it in ``skipped_updates``;
            ``"raise"`` raises :class:`~lowcomm.guard.NonFiniteError` on every rank instead.
        check_consistency: compare the model and settings across ranks at the first step and
            fail on every rank naming the first difference (default True).
    """

    name: ClassVar[str] = "outer"
    Config: ClassVar[type[OuterConfig]] = OuterConfig
    """The algorithm's hyperparameters; the constructor takes its fields as keywords."""
    schedule: ClassVar[str] = "blocking"
    """How it communicates (:data:`lowcomm.registry.SCHEDULES`)."""
    _discards_partial_round: ClassVar[bool] = True
    """Whether :meth:`finish` drops the steps taken since the last round boundary (and warns)."""
    _averages_params: ClassVar[bool] = False
    """Whether syncs average θ itself instead of Δ (LocalSGD: the anchor is the average)."""
    _flat_state: ClassVar[bool] = True
    """Whether the one fragment's state sits at the top of :meth:`state_dict` (the fragment
    methods keep ``fragment_0``, ``fragment_1``, … instead)."""
    _apply_unlaunched: ClassVar[bool] = False
    """Whether a sync point whose collective would have launched before step 1 still merges
    (CO2: θ ← A₀ at the end of round 0)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = signature(cls.Config)  # type: ignore[attr-defined]
        if cls.__doc__ and "Keywords (its" not in cls.__doc__:
            cls.__doc__ = cls.__doc__.rstrip() + "\n" + describe(cls.Config)

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | Communicator | None = None,
        **hyperparameters: Any,
    ) -> None:
        self.config = self.Config(**self._complete(hyperparameters))
        if not isinstance(model_or_params, (nn.Module, torch.Tensor)):
            # iterated twice (all parameters, then fragments): a generator would run dry
            try:
                model_or_params = list(model_or_params)
            except TypeError as e:
                raise ValueError(
                    f"model_or_params must be an nn.Module or an iterable of parameters, got "
                    f"{type(model_or_params).__name__}"
                ) from e
        named = collect_params(model_or_params)  # type: ignore[arg-type]
        self.params = [p for _, p in named]
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"inner_optimizer must be a torch.optim.Optimizer, got "
                f"{type(inner_optimizer).__name__}; pass the optimizer you call .step() on"
            )
        self.inner = inner_optimizer
        self.comm = (
            process_group
            if isinstance(process_group, Communicator)
            else Communicator(process_group)
        )
        self.sync_every = int(self.config.sync_every)
        self.nan_policy = self.config.nan_policy
        self.compression = parse_compression(getattr(self.config, "compression", None))
        self.shard_outer_state = bool(getattr(self.config, "shard_outer_state", False))
        self.local_step = 0
        """Inner steps taken (calls to :meth:`step`)."""
        self.rounds = 0
        """Rounds completed (every ``sync_every`` inner steps)."""
        self.sync_points = 0
        """Syncs applied."""
        self.skipped_updates = 0
        """Outer updates skipped because their averaged pseudo-gradient held NaN or Inf."""
        self._hook: RemovableHandle | None = None
        self._warned_partial_at = -1
        self._profile_tag = f"lowcomm::{self.name}"
        self._to_advance: list[tuple[int, Sync]] = []
        self._in_flight: dict[int, int] = {}  # sync point k -> fragment index
        self.overlap = self._overlap()
        """τ: inner steps between a fragment's launch and its apply."""
        groups = self._fragment_groups(model_or_params)  # type: ignore[arg-type]
        self.fragments: list[AnyFragment] = [self._new_fragment(g, i) for i, g in enumerate(groups)]
        self.num_fragments = len(self.fragments)
        self.interval = self.sync_every // self.num_fragments
        """Inner steps between sync points: H / P."""
        # The model as built, compared across ranks at the first step (values hashed now).
        self._unchecked: Description | None = (
            describe_tensors(named) if self.config.check_consistency else None
        )

    # -- what an algorithm chooses -------------------------------------------------------------

    @classmethod
    def _complete(cls, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for ``Config`` (subclasses derive some from others)."""
        return hyperparameters

    def _overlap(self) -> int:
        """τ: inner steps between a fragment's launch and its apply."""
        return 0

    def _fragment_groups(
        self, model_or_params: nn.Module | list[torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        """The fragments' parameters (default: the whole model, one fragment)."""
        return [self.params]

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        """The update rule and its state over ``anchor`` (not called when
        ``_averages_params``: the average is the anchor)."""
        raise NotImplementedError

    def _keeps_own(self) -> bool:
        """Whether fragments keep this rank's own contribution (eager updates)."""
        return False

    def _new_fragment(self, params: list[torch.Tensor], index: int) -> AnyFragment:
        depth = 2 if self.overlap >= self.sync_every else 1
        if self.shard_outer_state:
            return ShardedFragment(
                params,
                self,
                outer=self._outer_state,
                bucket_cap_mb=self.config.bucket_cap_mb,
                gather_into_snapshot=self.overlap == 0,
                keep_reference=depth > 1,
            )
        return Fragment(
            params,
            self,
            outer=None if self._averages_params else self._outer_state,
            bucket_cap_mb=self.config.bucket_cap_mb,
            depth=depth,
            compression=self.compression,
            stream=index,
            keep_own=self._keeps_own(),
        )

    def _choose_fragment(self, k: int) -> int:
        """The fragment the k-th sync point syncs (round-robin)."""
        return (k - 1) % self.num_fragments

    def _before_launch(self, f: int) -> None:
        """Called just before fragment ``f``'s pseudo-gradient is taken."""

    def _outer_input(
        self, frag: AnyFragment, sync: Sync | None, avg: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """What the update rule is stepped with: the average (``None``: no update)."""
        return avg

    def _merge(self, f: int) -> None:
        """θ_p ← A_p after fragment ``f``'s update was applied."""
        frag = self.fragments[f]
        frag.anchor.copy_to(frag.params)

    def _after_finish(self, drained: bool) -> None:
        """Called by :meth:`finish` after applying what was in flight (``drained``: any)."""

    # -- driving -------------------------------------------------------------------------------

    @property
    def stats(self) -> CommStats:
        """Communication counters of this worker (bytes, time blocked and in flight)."""
        return self.comm.stats

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def bucket_cap_mb(self) -> float:
        return float(self.config.bucket_cap_mb)

    @property
    def in_flight(self) -> bool:
        """Whether a launched collective has not been applied yet."""
        return bool(self._in_flight)

    @property
    def anchor(self) -> Any:
        """A of a one-fragment algorithm: fp32 flat buckets, bit-identical on every rank."""
        assert self.num_fragments == 1, "use anchor_views or fragments[i].anchor"
        return self.fragments[0].anchor

    @property
    def fragment(self) -> AnyFragment:
        """The one fragment of a one-fragment algorithm."""
        assert self.num_fragments == 1, "use fragments[i]"
        return self.fragments[0]

    @property
    def anchor_views(self) -> list[torch.Tensor]:
        """A for every trainable parameter, in model order: the consensus model to evaluate."""
        by_id = {
            id(p): v for frag in self.fragments for p, v in zip(frag.params, frag.anchor.views)
        }
        return [by_id[id(p)] for p in self.params]

    def step(self) -> None:
        """Call once after every inner ``optimizer.step()``."""
        if self._unchecked is not None:
            self._check_consistency()
        self.local_step += 1
        with torch.no_grad():
            if self._to_advance:
                self._advance_due(self.local_step)
            self._on_step(self.local_step)
        if self.local_step % self.sync_every == 0:
            self.rounds += 1

    def _on_step(self, step: int) -> None:
        # Launch before applying: with τ = 0 (or τ = H) both concern this step's fragment.
        if (step + self.overlap) % self.interval == 0:
            self._launch((step + self.overlap) // self.interval)
        if step % self.interval == 0:
            k = step // self.interval
            if k in self._in_flight:
                self._apply(k)
            elif self._apply_unlaunched:
                # the first sync points of an overlapped schedule launched before step 1
                with record_function(f"{self._profile_tag}::outer"):
                    frag = self.fragments[self._choose_fragment(k)]
                    self._update(frag, None, None)
                    frag.anchor.copy_to(frag.params)

    def _launch(self, k: int) -> None:
        f = self._choose_fragment(k)
        assert f not in self._in_flight.values() or self.overlap >= self.sync_every
        with record_function(f"{self._profile_tag}::launch"):
            self._before_launch(f)
            label = (
                f"fragment {f}"
                if self.num_fragments > 1
                else f"round {math.ceil(self.local_step / self.sync_every)}"
            )
            sync = self.fragments[f].launch(label, self.local_step)
            # the second phase (PowerSGD's Q, a sharded update) goes out halfway to the apply
            if self.overlap > 0 and sync.needs_advance:
                self._to_advance.append((self.local_step + max(1, self.overlap // 2), sync))
        self._in_flight[k] = f

    def _advance_due(self, step: int) -> None:
        due = [s for at, s in self._to_advance if at <= step]
        self._to_advance = [(at, s) for at, s in self._to_advance if at > step]
        for sync in due:
            sync.advance()

    def _apply(self, k: int) -> None:
        f = self._in_flight.pop(k)
        frag = self.fragments[f]
        with record_function(f"{self._profile_tag}::outer"):
            if frag.complete():
                self._merge(f)
            else:
                frag.anchor.copy_to(frag.params)  # skipped: back to the unchanged anchor
        self.sync_points += 1

    def on_average(
        self,
        frag: AnyFragment,
        sync: Sync,
        anchor: list[torch.Tensor],
        avg: list[torch.Tensor],
        finite: bool | None,
    ) -> bool:
        """A sync's average has arrived (``finite``: already decided, else checked here):
        step the update rule on ``anchor``; returns whether it was applied."""
        if not (all_finite(avg) if finite is None else finite):
            self._on_non_finite(frag, sync)
            return False
        self._update(frag, sync, avg, anchor)
        return True

    def _update(
        self,
        frag: AnyFragment,
        sync: Sync | None,
        avg: list[torch.Tensor] | None,
        anchor: list[torch.Tensor] | None = None,
    ) -> None:
        delta = self._outer_input(frag, sync, avg)
        if delta is not None and frag.outer is not None:
            frag.outer.step(frag.anchor.views if anchor is None else anchor, delta)

    def finish(self) -> None:
        """Apply every collective still in flight; afterwards θ equals the anchor on every
        rank. Idempotent. Inner steps taken since the last round boundary are discarded (a
        warning says how many), except by LocalSGD, which averages them once more."""
        partial = self.local_step % self.sync_every
        if self._discards_partial_round and partial and self._warned_partial_at != self.local_step:
            self._warned_partial_at = self.local_step
            warnings.warn(
                f"{type(self).__name__}.finish() discards {partial} inner step(s) taken since "
                f"the last round boundary; make the number of steps a multiple of "
                f"sync_every={self.sync_every} to keep them",
                stacklevel=2,
            )
        if self._unchecked is not None:
            self._check_consistency()
        with torch.no_grad(), record_function(f"{self._profile_tag}::finish"):
            drained = bool(self._in_flight)
            for k in sorted(self._in_flight):
                self._apply(k)
            self._after_finish(drained)
            for frag in self.fragments:
                frag.anchor.copy_to(frag.params)

    # -- hook form -----------------------------------------------------------------------------

    def __enter__(self) -> OuterAlgorithm:
        """Register an inner-optimizer step post-hook so the loop needs no ``algo.step()``.

        The hook fires only when ``optimizer.step()`` runs. If a rank may skip a step (AMP's
        ``GradScaler`` skips steps with inf/NaN gradients, decided per rank without DDP), the
        ranks' step counts drift apart and their collectives no longer match: call
        :meth:`step` explicitly after every iteration instead.
        """
        if self._hook is not None:
            raise ValueError(f"{type(self).__name__} is already active as a context manager")
        self._hook = self.inner.register_step_post_hook(lambda *_: self.step())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        # On an exception the other ranks may be gone: waiting on a collective could hang.
        if exc_type is None:
            self.finish()

    # -- memory and state ----------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for the algorithm, beyond the model and inner optimizer,
        measured from tensor storage (each storage once): ``"state"`` — what persists between
        syncs (anchor, outer optimizer or momentum, statistics, error feedback) — and
        ``"buffers"`` — communication buffers (pseudo-gradients in flight, snapshots, gathered
        anchors). With ``shard_outer_state=True`` the state is 1/N of the unsharded one."""
        state: list[torch.Tensor] = []
        for c in self._compressors():
            state += [*c.residuals, *c.q.values()]
        buffers: list[torch.Tensor] = []
        for frag in self.fragments:
            state += frag.state_tensors()
            buffers += frag.buffer_tensors()
        return {"state": storage_nbytes(state), "buffers": storage_nbytes(buffers)}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: counters, anchors, outer state, in-flight results.

        In-flight collectives are waited for (not applied) so their result can be stored;
        resuming then gives the same numbers as not stopping.
        """
        state: dict[str, Any] = {
            "algorithm": self.name,
            "sync_every": self.sync_every,
            "world_size": self.world_size,
            "num_fragments": self.num_fragments,
            "overlap": self.overlap,
            "local_step": self.local_step,
            "rounds": self.rounds,
            "sync_points": self.sync_points,
            "skipped_updates": self.skipped_updates,
            "in_flight": [[k, f] for k, f in sorted(self._in_flight.items())],
        }
        if self._flat_state:
            state.update(self.fragment.state_dict())
        else:
            for i, frag in enumerate(self.fragments):
                state[f"fragment_{i}"] = frag.state_dict()
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; refuses state from another configuration."""
        for key, mine in (
            ("algorithm", self.name),
            ("sync_every", self.sync_every),
            ("world_size", self.world_size),
            ("num_fragments", self.num_fragments),
            ("overlap", self.overlap),
        ):
            if key in ("num_fragments", "overlap") and self._flat_state:
                state = {key: mine, **state}  # older one-fragment state_dicts lack them
            if key not in state:
                raise ValueError(f"not a {type(self).__name__} state_dict: missing {key!r}")
            if state[key] != mine:
                raise ValueError(
                    f"state_dict was saved with {key}={state[key]!r} but this "
                    f"{type(self).__name__} has {key}={mine!r}; resume with the same settings"
                )
        self._load_extra_state(state)
        if self._flat_state:
            self.fragment.load_state_dict(state)
        for i, frag in enumerate(self.fragments if not self._flat_state else []):
            key = f"fragment_{i}"
            if key not in state:
                raise ValueError(f"{type(self).__name__} state_dict is missing {key!r}")
            frag.load_state_dict(state[key])
        local_step = int(state["local_step"])
        if "in_flight" in state:
            in_flight = {int(k): int(f) for k, f in state["in_flight"]}
        else:  # older one-fragment state_dicts: the sync in flight is applied next
            k = (local_step + self.overlap) // self.interval
            in_flight = {k: 0} if self.fragment.pending else {}
        for f, frag in enumerate(self.fragments):
            if len(frag.pending) != sum(1 for g in in_flight.values() if g == f):
                raise ValueError(
                    f"state_dict lists fragment {f} in flight but holds no result for it (or "
                    "the other way round); the checkpoint is inconsistent"
                )
        # counters last: a state_dict refused half-way leaves them as they were
        self._in_flight = in_flight
        self._to_advance = []
        self.local_step = local_step
        self.rounds = int(state["rounds"])
        self.sync_points = int(state.get("sync_points", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        if self._unchecked is not None:
            # ranks resuming mid-round hold different values: compare the rest only
            self._unchecked = [e for e in self._unchecked if not e[0].startswith("values of")]

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    @classmethod
    def validate(cls, **kwargs: Any) -> None:
        """Raise :class:`~lowcomm.outer.hparams.HyperparameterError` (a ``ValueError``) for
        bad keyword arguments (the constructor's, less model, optimizer and process group).
        ``sync_every`` may be left out. The CLI calls this before launching workers."""
        kwargs = cls._complete(dict(kwargs))
        field = cls.Config.field("sync_every")
        if "sync_every" not in kwargs and field.default is dataclasses.MISSING:
            # any H the other keywords allow: only they are being checked
            p = kwargs.get("num_fragments") or 1
            tau = kwargs.get("overlap") or 0
            p = p if isinstance(p, int) and p > 0 else 1
            tau = tau if isinstance(tau, int) and tau > 0 else 0
            kwargs["sync_every"] = p * (tau + 1)
        try:
            cls.Config(**kwargs)
        except TypeError as e:
            raise HyperparameterError(None, f"{cls.__name__}: {e}") from None
