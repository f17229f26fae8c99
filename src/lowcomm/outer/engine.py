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
NoLoCo        1 (sends θ)  0, < H   heavy ball to a group's mean  θ ← φ (per rank)
============  ===========  =======  ============================  =========================

With ``local_steps="dynamic"`` the positions stay and each rank steps at as many of a round's
H as its measured speed allows, the average weighted by the steps taken
(:mod:`lowcomm.outer.pace`; the loop asks :meth:`OuterAlgorithm.takes_step`).

Subclasses set their ``Config`` dataclass (the constructor's keywords) and override a few
hooks (``_outer_state``, ``_merge``, ``_choose_fragment``, ``_outer_input``, ``mean_async``
(the collective: NoLoCo's group exchange), …). The guards every
algorithm has are :mod:`lowcomm.outer.guards`; the engine's other bases hold its warm start
(:mod:`lowcomm.outer.warm`), elastic syncs (:mod:`lowcomm.outer.fault_tolerance`), the loop's
side of dynamic local steps (:mod:`lowcomm.outer.pace`) and its state and reports
(:mod:`lowcomm.outer.state`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from lowcomm.comm import Communicator, Handle
from lowcomm.compress.codecs import parse_compression
from lowcomm.device import CommStream, collective_device
from lowcomm.elastic.sync import ManagedCommunicator
from lowcomm.guard import Description, HostFlags, describe_tensors, explain_lost_collectives
from lowcomm.hparams import HyperparameterError, describe, signature
from lowcomm.outer.fault_tolerance import FaultTolerant
from lowcomm.outer.fragment import AnyFragment, Fragment, OuterState, ShardedFragment, Sync
from lowcomm.outer.guards import Guards
from lowcomm.outer.hparams import OuterConfig
from lowcomm.outer.pace import DynamicSteps, Pace
from lowcomm.outer.state import EngineState
from lowcomm.outer.warm import WARM_BUCKET_MB, WARM_STREAM, WarmStart
from lowcomm.params import check_partition, collect_params, split_by_blocks

if TYPE_CHECKING:
    from lowcomm.elastic.sync import FaultTolerance

__all__ = ["WARM_BUCKET_MB", "WARM_STREAM", "AnyFragment", "OuterAlgorithm"]

logger = logging.getLogger(__name__)


class _Healed(Exception):  # noqa: N818 - a signal, not an error
    """Raised out of a step whose quorum healed this replica: its counters are its donor's, and
    the step continues from there (:meth:`OuterAlgorithm._continue_healed`)."""


class OuterAlgorithm(WarmStart, DynamicSteps, FaultTolerant, EngineState, Guards):
    """The engine (see the module docstring); not used directly. Every algorithm takes an
    ``nn.Module`` or iterable of parameters, the inner optimizer whose ``step()`` drives the
    schedule, its ``Config``'s keywords, and ``process_group`` (``None``: WORLD; a subgroup runs
    it across node groups while DDP runs inside them)."""

    name: ClassVar[str] = "outer"
    Config: ClassVar[type[OuterConfig]] = OuterConfig  # the constructor's keywords
    schedule: ClassVar[str] = "blocking"  # how it communicates (lowcomm.registry.SCHEDULES)
    elastic: ClassVar[bool] = True  # whether its syncs run under torchft (fault_tolerance=)
    # finish() drops (and warns of) the steps since the last round boundary
    _discards_partial_round: ClassVar[bool] = True
    # syncs average θ itself, not Δ (LocalSGD: the anchor is the average)
    _averages_params: ClassVar[bool] = False
    # the one fragment's state is at the top of state_dict() (else fragment_0, fragment_1, …)
    _flat_state: ClassVar[bool] = True
    # a sync point whose launch would fall before step 1 still merges (CO2: θ ← A₀ at round 0)
    _apply_unlaunched: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        positional = ("model_or_params", "inner_optimizer")
        keywords = {"process_group": None, "fault_tolerance": None}
        cls.__signature__ = signature(cls.Config, positional, keywords)  # type: ignore[attr-defined]
        if cls.__doc__ and "Keywords (its" not in cls.__doc__:
            what = (
                "its ``Config``; ``process_group``, ``None`` for WORLD; and ``fault_tolerance``, "
                "a :func:`lowcomm.elastic.replica_manager` replica (or torchft Manager) whose "
                "quorum replaces the process group"
            )
            cls.__doc__ = f"{cls.__doc__.rstrip()}\n{describe(cls.Config, what)}"

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | Communicator | None = None,
        fault_tolerance: Any = None,
        **hyperparameters: Any,
    ) -> None:
        self.config = self.Config(**self._complete(hyperparameters))
        named = collect_params(model_or_params)
        self.params = [p for _, p in named]
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"inner_optimizer must be a torch.optim.Optimizer, got "
                f"{type(inner_optimizer).__name__}; pass the optimizer you call .step() on"
            )
        self.inner = inner_optimizer
        self.ft: FaultTolerance | None = None
        """The torchft Manager this replica's syncs go through (``fault_tolerance``)."""
        if fault_tolerance is not None:
            self.ft = self._fault_tolerance(fault_tolerance, process_group)
            self.comm: Communicator = ManagedCommunicator(self.ft)
        else:
            group = process_group
            self.comm = group if isinstance(group, Communicator) else Communicator(group)
        self.sync_every = int(self.config.sync_every)
        self.warmup = int(self.config.sync_warmup)
        """K: the first K inner steps average θ after every step (``sync_warmup``)."""
        self.nan_policy = self.config.nan_policy
        self._warm_hook: RemovableHandle | None = None
        self._peak_lr = 0.0
        self.compression = parse_compression(getattr(self.config, "compression", None))
        self.shard_outer_state = bool(getattr(self.config, "shard_outer_state", False))
        # inner steps taken; rounds of H completed; syncs applied; updates skipped (NaN/Inf)
        self.local_step = self.rounds = self.sync_points = self.skipped_updates = 0
        self._own_non_finite = 0  # times this rank's own pseudo-gradient was not finite
        self._steps_checked = -1  # the step count finish() last compared across the ranks
        self._hook: RemovableHandle | None = None
        self._warned_partial_at = -1
        self._profile_tag = f"lowcomm::{self.name}"
        self._to_advance: list[tuple[int, Sync]] = []
        self._pg_norm: torch.Tensor | None = None  # ‖A − θᵢ‖ of the fragment launched last
        self._unread_own: list[Sync] = []  # launched syncs whose own verdict is not read yet
        self._in_flight: dict[int, int] = {}  # sync point k -> fragment index
        self.overlap = self._overlap()
        """τ: inner steps between a fragment's launch and its apply."""
        device = self.params[0].device if self.params else torch.device("cpu")
        # one side stream for every fragment: launches leave in program order on every rank
        self.comm_stream = CommStream(device)
        """Where the syncs are prepared and launched (:class:`~lowcomm.device.CommStream`)."""
        groups = self._fragment_groups(model_or_params)
        self.fragments: list[AnyFragment] = [self._new_fragment(g, i) for i, g in enumerate(groups)]
        self.num_fragments = len(self.fragments)
        self.interval = self.sync_every // self.num_fragments
        """Inner steps between sync points: H / P."""
        self.pace: Pace | None = None
        """The dynamic local steps (``local_steps="dynamic"``: :mod:`lowcomm.outer.pace`)."""
        if self.config.local_steps == "dynamic":
            self.pace = Pace(self.comm, self.sync_every, self.num_fragments, device=device)
        # The model as built, compared across ranks at the first step (values hashed now).
        self._unchecked: Description | None = None
        if self.config.check_consistency and self.ft is None:
            # (with fault tolerance a joiner takes its donor's model and settings are checked
            # by the job; replicas have no fixed group to compare over)
            self._unchecked = describe_tensors(named)
        self._init_warm_start()
        if self.ft is not None:
            self._check_fault_tolerance()
            self.ft.register("lowcomm", self._heal_state, self._load_heal_state)

    # -- what an algorithm chooses -------------------------------------------------------------

    @classmethod
    def _complete(cls, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for ``Config`` (subclasses derive some from others): here
        ``num_fragments`` from explicit ``fragments`` (refused when both disagree)."""
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

    def _overlap(self) -> int:
        """τ: inner steps between a fragment's launch and its apply (the ``overlap`` keyword)."""
        return int(getattr(self.config, "overlap", 0))

    def _fragment_groups(
        self, model_or_params: nn.Module | Iterable[torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        """The fragments' parameters: the config's ``num_fragments`` strided by transformer
        block (:func:`~lowcomm.params.split_by_blocks`), or its explicit ``fragments`` (modules
        or parameter lists), checked to hold every trainable parameter once; by default the
        whole model, one fragment."""
        num_fragments = int(getattr(self.config, "num_fragments", 1))
        fragments: Sequence[Any] | None = getattr(self.config, "fragments", None)
        if fragments is None:
            if num_fragments == 1:
                return [self.params]
            if not isinstance(model_or_params, nn.Module):
                raise ValueError(
                    "automatic fragments (num_fragments > 1) need the model as an nn.Module; "
                    "pass the module, or fragments=[...]"
                )
            groups = split_by_blocks(model_or_params, num_fragments)
        else:
            groups = [
                [q for q in (f.parameters() if isinstance(f, nn.Module) else f) if q.requires_grad]
                for f in fragments
            ]
        return check_partition(groups, self.params)

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        """The update rule and its state over ``anchor`` (not called when
        ``_averages_params``: the average is the anchor)."""
        raise NotImplementedError

    def outer_lr_factor(self) -> float | None:
        """What the outer lr is multiplied by now: ``None`` (as set), or with
        ``outer_lr_schedule="inner"`` γ/γ₀ (the inner optimizer's first group: its lr over its
        ``initial_lr``, else over the highest lr seen so far)."""
        if getattr(self.config, "outer_lr_schedule", "constant") != "inner":
            return None
        group = self.inner.param_groups[0]
        lr = float(group["lr"])
        self._peak_lr = max(self._peak_lr, lr)
        base = float(group.get("initial_lr") or self._peak_lr)
        return lr / base if base > 0 else 1.0

    def _keeps_progress(self) -> bool:
        """Whether the merge keeps the progress made since the launch (θ ← Â + (θ − θ_s)): then
        at τ = H a fragment's sync is applied before the same fragment launches again."""
        return False

    @property
    def _apply_first(self) -> bool:
        """At τ = H, whether a sync point applies before it launches: with a merge that keeps
        the progress since the launch (the launch then measures Δ from the merged θ); else
        (CO2) it launches first, the reset θ ← A carrying that progress in the next Δ."""
        return self._keeps_progress() and self.overlap >= self.sync_every

    def _new_fragment(self, params: list[torch.Tensor], index: int) -> AnyFragment:
        depth = 2 if self.overlap >= self.sync_every and not self._apply_first else 1
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
            keep_own=bool(getattr(self.config, "eager", False)),
        )

    def mean_async(self, buffers: list[torch.Tensor]) -> Handle:
        """The collective a fragment's uncompressed sync launches over its send ``buffers``:
        the mean over every rank (a gossip algorithm's: over its group)."""
        return self.comm.all_reduce_mean_async(buffers)

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

    stats = property(lambda self: self.comm.stats, doc="This worker's communication counters.")
    world_size = property(lambda self: self.comm.world_size)
    bucket_cap_mb = property(lambda self: float(self.config.bucket_cap_mb))
    in_flight = property(lambda self: bool(self._in_flight), doc="A collective not applied yet.")
    outer_step = property(lambda self: self.sync_points, doc="Syncs applied so far.")

    @property
    def fragment(self) -> AnyFragment:
        """The one fragment of a one-fragment algorithm (``anchor``: its A, fp32 buckets)."""
        assert self.num_fragments == 1, "use fragments[i]"
        return self.fragments[0]

    anchor = property(lambda self: self.fragment.anchor)

    @property
    def anchor_views(self) -> list[torch.Tensor]:
        """A for every trainable parameter, in model order: the consensus model to evaluate."""
        by_id = {id(p): v for f in self.fragments for p, v in zip(f.params, f.anchor.views)}
        return [by_id[id(p)] for p in self.params]

    def step(self) -> None:
        """Call once after every inner ``optimizer.step()``, on every rank the same number of
        times (a collective that never completes names that as its likely cause). With
        ``local_steps="dynamic"``, once per position of the schedule instead: after the inner
        step when :meth:`takes_step` said to take one, else right away."""
        with explain_lost_collectives(type(self).__name__, "step()", lambda: self.local_step):
            try:
                self._step()
            finally:
                if self.pace is not None:
                    self.pace.end()

    @property
    def at_round_boundary(self) -> bool:
        """Whether the last :meth:`step` ended a round (of the warm start or after it)."""
        return self.local_step % self.sync_every == 0

    def _step(self) -> None:
        if self.ft is not None and not self.ft.joined and self.ft.join():
            self._continue_healed()
            return
        if self.pace is not None:
            # (first: a rank that passes a warm-start position takes its optimizer step here,
            # where the others took theirs before step(); the consistency check comes after)
            self._pace_position(self.pace, self.local_step + 1)
        if self._unchecked is not None:
            self._check_consistency()
        self.local_step += 1
        phase = self.local_step - self.warmup  # the schedule starts after the warm start
        with torch.no_grad():
            if phase <= 0:
                self._warm_step()
                return
            if self._to_advance:
                self._advance_due(self.local_step)
            try:
                self._on_step(phase)
            except _Healed:
                self._continue_healed()
                return
        if phase % self.sync_every == 0:
            self.rounds += 1

    def _on_step(self, step: int, *, quorum: bool = True) -> None:
        # Launch before applying: with τ = 0 (or τ = H) both concern this step's fragment;
        # at τ = H a merge that keeps the progress since launch applies first (_apply_first).
        if self._apply_first:
            self._apply_due(step)
        if (step + self.overlap) % self.interval == 0:
            if quorum and self._quorum():
                raise _Healed  # this step's schedule is the donor's now: start it again
            self._launch((step + self.overlap) // self.interval)
        if not self._apply_first:
            self._apply_due(step)

    def _apply_due(self, step: int) -> None:
        """Apply the sync point that falls at ``step``, if any."""
        if step % self.interval == 0:
            k = step // self.interval
            if k in self._in_flight:
                self._apply(k)
            elif self._apply_unlaunched and not self._keeps_progress():
                # the first sync points of an overlapped schedule launched before step 1
                with record_function(f"{self._profile_tag}::outer"):
                    frag = self.fragments[self._choose_fragment(k)]
                    self._update(frag, None, None)
                    frag.anchor.copy_to(frag.params)

    def _launch(self, k: int) -> None:
        f = self._choose_fragment(k)
        assert f not in self._in_flight.values() or self.overlap >= self.sync_every
        with record_function(f"{self._profile_tag}::launch"):
            if self._unread_own:  # earlier launches' verdicts: this rank recovers before its Δ
                self._read_own(before=self.local_step)
            self._before_launch(f)
            frag = self.fragments[f]
            rnd = math.ceil((self.local_step - self.warmup) / self.sync_every)
            label = f"fragment {f}" if self.num_fragments > 1 else f"round {rnd}"
            scale = 1.0
            if self.pace is not None:
                scale = self.pace.weight(f)
                if (k * self.interval) % self.sync_every == 0:  # applied at a round boundary
                    self.pace.measure(k)  # (before the sync: first on the link)
            sync = frag.launch(label, self.local_step, scale=scale)
            self._pg_norm = sync.norm
            self._unread_own.append(sync)
            # the second phase (PowerSGD's Q, a sharded update) goes out halfway to the apply
            if self.overlap > 0 and sync.handle.needs_advance:
                self._to_advance.append((self.local_step + max(1, self.overlap // 2), sync))
        self._in_flight[k] = f

    def _advance_due(self, step: int) -> None:
        due = [s for at, s in self._to_advance if at <= step]
        self._to_advance = [(at, s) for at, s in self._to_advance if at > step]
        for sync in due:
            sync.handle.advance()

    def _apply(self, k: int) -> None:
        f = self._in_flight.pop(k)
        frag = self.fragments[f]
        with record_function(f"{self._profile_tag}::outer"):
            applied = frag.pending[0] if frag.pending else None
            if self.ft is not None and not self._commit(frag):
                # not committed: the round is dropped. An outer step goes back to its anchor;
                # LocalSGD, whose anchor was the send buffer (now undefined), keeps its θ
                if self._averages_params:
                    frag.anchor.copy_from(frag.params)
                else:
                    frag.anchor.copy_to(frag.params)
            elif frag.complete():
                self._merge(f)
            else:
                frag.anchor.copy_to(frag.params)  # skipped: back to the unchanged anchor
            if self._unread_own:  # (its collective, waited for, went out after its verdict)
                self._read_own(before=self.local_step, applied=applied)
        self.sync_points += 1
        if self.pace is not None:
            self.pace.applied(k, self.local_step)
        if self.ft is not None:
            self.ft.contributing = True

    def on_average(
        self,
        frag: AnyFragment,
        sync: Sync,
        anchor: list[torch.Tensor],
        avg: list[torch.Tensor],
        finite: HostFlags,
    ) -> bool:
        """A sync's average has arrived (``finite``: whether it is finite, decided on the
        device; the host reads it here, where it has just waited for the collective): step
        the update rule on ``anchor``; returns whether it was applied."""
        if not finite.read()[0]:
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
        partial = max(0, self.local_step - self.warmup) % self.sync_every
        if self._discards_partial_round and partial and self._warned_partial_at != self.local_step:
            self._warned_partial_at = self.local_step
            message = f"{type(self).__name__}.finish() discards {partial} inner step(s) taken "
            message += "since the last round boundary; make the number of steps a multiple of "
            warnings.warn(f"{message}sync_every={self.sync_every} to keep them", stacklevel=2)
        with explain_lost_collectives(type(self).__name__, "finish()", lambda: self.local_step):
            if self._unchecked is not None:
                self._check_consistency()
            with torch.no_grad(), record_function(f"{self._profile_tag}::finish"):
                if self._unread_own:
                    self._read_own()
                drained = bool(self._in_flight)
                for k in sorted(self._in_flight):
                    self._apply(k)
                self._after_finish(drained)
                for frag in self.fragments:
                    frag.anchor.copy_to(frag.params)
                self.comm_stream.drain()
            self._check_same_steps()

    def _check_same_steps(self) -> None:
        """At :meth:`finish`: every rank took as many inner steps (one small all-gather, once
        per step count). Ranks that call :meth:`step` a different number of times would
        otherwise end apart without a word (when their rounds happen to line up) or wait for
        each other's collectives until they time out."""
        if self.ft is not None or self.comm.world_size == 1:
            return  # (replicas of an elastic job are kept in step by their quorums)
        if self._steps_checked == self.local_step:
            return
        self._steps_checked = self.local_step
        device = collective_device(self.comm)  # NCCL takes GPU tensors only
        counts = [
            torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.comm.world_size)
        ]
        mine = torch.tensor([self.local_step], dtype=torch.int64, device=device)
        dist.all_gather(counts, mine, group=self.comm.group)
        steps = [int(c) for c in counts]
        if len(set(steps)) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(steps))
            raise ValueError(
                f"{type(self).__name__}.finish(): the ranks called step() a different number "
                f"of times ({listed}); every rank must call step() once after every inner step"
            )

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
        if self.pace is not None:
            raise ValueError(
                f"{type(self).__name__} with local_steps='dynamic' cannot run as a context "
                "manager (a rank passes over some positions without an optimizer step): call "
                "takes_step() before, and step() after, every position"
            )
        self._hook = self.inner.register_step_post_hook(lambda *_: self.step())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        # On an exception the other ranks may be gone: waiting on a collective could hang.
        if exc_type is None:
            self.finish()

    @classmethod
    def validate(cls, **kwargs: Any) -> None:
        """Raise :class:`~lowcomm.outer.hparams.HyperparameterError` (a ``ValueError``) for
        bad keyword arguments (the constructor's, less model, optimizer and process group).
        ``sync_every`` may be left out. The CLI calls this before launching workers."""
        kwargs = cls._complete(dict(kwargs))
        field = cls.Config.field("sync_every")
        if "sync_every" not in kwargs and field.default is dataclasses.MISSING:
            # any H the other keywords allow: only they are being checked
            p, tau = kwargs.get("num_fragments"), kwargs.get("overlap")
            p = p if isinstance(p, int) and p > 0 else 1
            kwargs["sync_every"] = p * (1 + (tau if isinstance(tau, int) and tau > 0 else 0))
            warmup = kwargs.get("sync_warmup")
            if isinstance(warmup, int) and warmup > 0:
                kwargs["sync_warmup"] = kwargs["sync_every"] * warmup  # a multiple of that H
        try:
            cls.Config(**kwargs)
        except TypeError as e:
            raise HyperparameterError(None, f"{cls.__name__}: {e}") from None
