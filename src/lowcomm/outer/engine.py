"""The outer engine: one launch → wait → update schedule that every outer algorithm is.

A *fragment* (some parameters with their anchor A, send buffer and outer state:
:mod:`lowcomm.outer.fragment`) is **launched** at an inner step (Δ = A − θ into its buffer, the
collective started) and **applied** ``overlap`` inner steps later (wait, outer update of A,
merge into θ). With H = ``sync_every`` and P fragments there is a sync point every H/P inner
steps; the k-th (k = 1, 2, …) applies the fragment chosen when its collective was launched,
``overlap`` (τ) steps earlier (an algorithm with early rounds, ``early_steps`` W and
``early_every`` H₀, has one every H₀ steps for the first W: one fragment, τ < H₀). An algorithm
is a choice of:

============  ===========  =======  ============================  =========================
algorithm     fragments    τ        update rule                   merge
============  ===========  =======  ============================  =========================
LocalSGD      1            0        A ← mean θ                    θ ← A
DiLoCo        1            0        outer optimizer (Nesterov)    θ ← A
SlowMo        1            0        heavy ball, Δ̄/γ, lr α·γ       θ ← A
CO2           1            H        penalty, momentum, clip       θ ← A (eager: own fresh Δ;
                                                                  or delay-corrected)
Streaming     P            τ < H    outer optimizer per fragment  θ ← (1 − mix)·A + mix·θ
CoCoDC        P (chosen)   τ < H    outer optimizer per fragment  delay compensation
NoLoCo        1 (sends θ)  0, < H   heavy ball to a group's mean  θ ← φ (per rank)
SparseLoCo    1            0 … H    SGD on sparse Δ̂, e ← β·e + Δ  θ ← A (or delay-corrected)
============  ===========  =======  ============================  =========================

With ``local_steps="dynamic"`` the positions stay and each rank steps at as many of a round's
H as its measured speed allows, the average weighted by the steps taken
(:mod:`lowcomm.outer.pace`; the loop asks :meth:`OuterAlgorithm.takes_step`).

Subclasses set their ``Config`` dataclass (the constructor's keywords) and override a few
hooks (``_outer_state``, ``_merge``, ``_choose_fragment``, ``_outer_input``, ``mean_async``
(the collective: NoLoCo's group exchange), …). The engine holds its features as objects, each
with its own state: ``fragments`` (:mod:`lowcomm.outer.fragment`), ``guards``
(:mod:`lowcomm.outer.guards`), ``warm`` (the warm start, :mod:`lowcomm.outer.warm`), ``pace``
(dynamic local steps, :mod:`lowcomm.outer.pace`) and ``elastic_syncs`` (fault tolerance,
:mod:`lowcomm.outer.fault_tolerance`); what it keeps and reports (``state_dict()``,
``memory_report()``, ``metrics()``) is at the end of this module.
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

from lowcomm.comm import Communicator, Handle, storage_nbytes
from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.feedback import Compressor
from lowcomm.device import CommStream
from lowcomm.elastic.sync import ManagedCommunicator
from lowcomm.guard import HostFlags, describe_tensors, explain_lost_collectives
from lowcomm.hparams import HyperparameterError, describe, signature
from lowcomm.link import EmulatedLink
from lowcomm.outer.fault_tolerance import ElasticSyncs
from lowcomm.outer.fragment import AnyFragment, Fragment, OuterState, ShardedFragment, Sync
from lowcomm.outer.guards import Guards
from lowcomm.outer.hparams import OuterConfig
from lowcomm.outer.merge import KeepProgress
from lowcomm.outer.pace import Pace
from lowcomm.outer.warm import WARM_BUCKET_MB, WARM_STREAM, WarmStart
from lowcomm.params import check_partition, collect_params, split_by_blocks
from lowcomm.schedules import BLOCKING, Schedule

if TYPE_CHECKING:
    from lowcomm.elastic.sync import FaultTolerance

__all__ = ["WARM_BUCKET_MB", "WARM_STREAM", "AnyFragment", "OuterAlgorithm"]

logger = logging.getLogger(__name__)


class _Healed(Exception):  # noqa: N818 - a signal, not an error
    """Raised out of a step whose quorum healed this replica: its counters are its donor's, and
    the step continues from there (:meth:`OuterAlgorithm._continue_healed`)."""


class OuterAlgorithm:
    """The engine (see the module docstring); not used directly. Every algorithm takes an
    ``nn.Module`` or iterable of parameters, the inner optimizer whose ``step()`` drives the
    schedule, its ``Config``'s keywords, and ``process_group`` (``None``: WORLD; a subgroup runs
    it across node groups while DDP runs inside them)."""

    name: ClassVar[str] = "outer"
    Config: ClassVar[type[OuterConfig]] = OuterConfig  # the constructor's keywords
    schedule: ClassVar[Schedule] = BLOCKING  # how it communicates (lowcomm.schedules)
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
                "quorum replaces the process group (with it, ``process_group`` may be an "
                ":class:`~lowcomm.link.EmulatedLink` the quorum's collectives go through)"
            )
            cls.__doc__ = f"{cls.__doc__.rstrip()}\n{describe(cls.Config, what)}"

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | Communicator | EmulatedLink | None = None,
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
        self.elastic_syncs: ElasticSyncs | None = None
        """The elastic syncs (``fault_tolerance``: :mod:`lowcomm.outer.fault_tolerance`)."""
        self._replay_lr_factor: float | None = None
        if fault_tolerance is not None:
            self.elastic_syncs = ElasticSyncs(self, fault_tolerance, process_group)
            self.comm: Communicator = ManagedCommunicator(
                self.elastic_syncs.ft, self.elastic_syncs.link
            )
        else:
            group = process_group
            if isinstance(group, EmulatedLink):  # over WORLD, through the link
                group = group.communicator()
            self.comm = group if isinstance(group, Communicator) else Communicator(group)
        self.sync_every = int(self.config.sync_every)
        self.warmup = int(self.config.sync_warmup)
        """K: the first K inner steps average θ after every step (``sync_warmup``)."""
        self.nan_policy = self.config.nan_policy
        self._peak_lr = 0.0
        self.compression = parse_compression(getattr(self.config, "compression", None))
        self.shard_outer_state = bool(getattr(self.config, "shard_outer_state", False))
        # inner steps taken; rounds of H completed; syncs applied
        self.local_step = self.rounds = self.sync_points = 0
        self._hook: RemovableHandle | None = None
        self._warned_partial_at = -1
        self.profile_tag = f"lowcomm::{self.name}"
        """The prefix of the engine's torch.profiler ranges."""
        self._to_advance: list[tuple[int, Sync]] = []
        self._pg_norm: torch.Tensor | None = None  # ‖A − θᵢ‖ of the fragment launched last
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
        self.keep_progress: KeepProgress | None = None
        """The merge θ ← Â + (θ − θ_s) and its snapshots, where the algorithm keeps the progress
        made while a sync was in flight (:mod:`lowcomm.outer.merge`)."""
        if self._keeps_progress():
            lambda0 = float(getattr(self.config, "lambda0", 0.0))
            self.keep_progress = KeepProgress(self.fragments, lambda0=lambda0)
        self.interval = self.sync_every // self.num_fragments
        """Inner steps between sync points: H / P."""
        self.early_steps = int(getattr(self.config, "early_steps", 0))
        """W: the first W steps of the schedule sync every ``early_every`` steps (0: none)."""
        self.early_every = int(getattr(self.config, "early_every", 0)) if self.early_steps else 0
        """H₀: inner steps per round in those first W steps."""
        self.pace: Pace | None = None
        """The dynamic local steps (``local_steps="dynamic"``: :mod:`lowcomm.outer.pace`)."""
        if self.config.local_steps == "dynamic":
            self.pace = Pace(self.comm, self.sync_every, self.num_fragments, device=device)
        # The model as built, compared across ranks at the first step (values hashed now);
        # with fault tolerance a joiner takes its donor's model and settings are checked by
        # the job (replicas have no fixed group to compare over)
        compare = self.config.check_consistency and self.elastic_syncs is None
        self.guards = Guards(self, describe_tensors(named) if compare else None)
        """Consistency at start and the numeric guard (:mod:`lowcomm.outer.guards`)."""
        warm_codec = parse_compression(self.config.sync_warmup_compression)
        self.warm = WarmStart(self, self.warmup, warm_codec)
        """The warm start (``sync_warmup``: :mod:`lowcomm.outer.warm`)."""
        if self.elastic_syncs is not None:
            self.elastic_syncs.attach()

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
        if self._replay_lr_factor is not None:
            return self._replay_lr_factor
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
            feedback_decay=self.feedback_decay,
        )

    @property
    def feedback_decay(self) -> float:
        """β of the compressors' error feedback (M = Δ + β·e): 1, nothing fades (SparseLoCo's
        accumulator decays)."""
        return 1.0

    def mean_async(self, buffers: list[torch.Tensor]) -> Handle:
        """The collective a fragment's uncompressed sync launches over its send ``buffers``:
        the mean over every rank (a gossip algorithm's: over its group)."""
        return self.comm.all_reduce_mean_async(buffers)

    def _choose_fragment(self, k: int) -> int:
        """The fragment the k-th sync point syncs (round-robin)."""
        return (k - 1) % self.num_fragments

    def _before_launch(self, f: int) -> None:
        """Called just before fragment ``f``'s pseudo-gradient is taken."""
        if self.keep_progress is not None:
            self.keep_progress.launched(f)

    def _outer_input(
        self, frag: AnyFragment, sync: Sync | None, avg: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """What the update rule is stepped with: the average (``None``: no update)."""
        return avg

    def _merge(self, f: int) -> None:
        """θ_p ← A_p after fragment ``f``'s update was applied (θ_p ← A_p + (θ_p − θ_s) where
        the progress since the launch is kept)."""
        if self.keep_progress is not None:
            self.keep_progress.merge(f)
            return
        frag = self.fragments[f]
        frag.anchor.copy_to(frag.params)

    def _after_finish(self, drained: bool) -> None:
        """Called by :meth:`finish` after applying what was in flight (``drained``: any)."""

    def _on_non_finite(self, frag: AnyFragment, sync: Sync) -> None:
        """The average of ``sync`` holds NaN or Inf (decided alike on every rank)."""
        self.guards.skip(sync.label)

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
    def ft(self) -> FaultTolerance | None:
        """The torchft Manager this replica's syncs go through (``fault_tolerance``)."""
        return None if self.elastic_syncs is None else self.elastic_syncs.ft

    @property
    def skipped_updates(self) -> int:
        """Updates skipped because their average held NaN or Inf (the numeric guard)."""
        return self.guards.skipped

    def compressors(self) -> list[Compressor]:
        """The fragments' compressors (their error-feedback residuals)."""
        return [f.compressor for f in self.fragments if f.compressor is not None]

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
                elastic = self.elastic_syncs
                if elastic is not None and elastic.catching_up and not self._in_flight:
                    elastic.catch_up()  # (nothing in flight: catch up as soon as it can)
            finally:
                if self.pace is not None:
                    self.pace.end()

    @property
    def at_round_boundary(self) -> bool:
        """Whether the last :meth:`step` ended a round (of the warm start or after it)."""
        return self.local_step % self.sync_every == 0

    def _step(self) -> None:
        ft = self.ft
        if self.warm.healed_into_sync:  # (healed at a warm step's quorum: see WarmStart)
            self.warm.healed_into_sync = False
            self.warm.end()
            self._continue_healed()
            return
        if ft is not None and not ft.joined and self._join():
            self._continue_healed()
            return
        if self.pace is not None:
            # (first: a rank that passes a warm-start position takes its optimizer step here,
            # where the others took theirs before step(); the consistency check comes after)
            self.pace.position(self.local_step + 1, self.inner, self.warmup)
        if self.guards.unchecked is not None:  # (the first step only: the inner step's path)
            self.guards.check_consistency()
        self.local_step += 1
        phase = self.local_step - self.warmup  # the schedule starts after the warm start
        with torch.no_grad():
            if phase <= 0:
                self.warm.after_step()
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

    def _join(self) -> bool:
        assert self.elastic_syncs is not None
        return self.elastic_syncs.join()

    def _quorum(self) -> bool:
        """With fault tolerance, before a sync is launched: join its quorum; returns whether
        this replica was healed in it (:meth:`ElasticSyncs.quorum
        <lowcomm.outer.fault_tolerance.ElasticSyncs.quorum>`)."""
        return self.elastic_syncs is not None and self.elastic_syncs.quorum()

    def _continue_healed(self) -> None:
        """Right after this replica was healed at its first step: it stands where its donor
        stood, inside the step that launches the sync (its inner step just taken is dropped:
        its parameters are the donor's); finish that step as the donor does, without a second
        quorum."""
        phase = self.local_step - self.warmup
        with torch.no_grad():
            self._on_step(phase, quorum=False)
        if phase % self.sync_every == 0:
            self.rounds += 1

    def _on_step(self, step: int, *, quorum: bool = True) -> None:
        # Launch before applying: with τ = 0 (or τ = H) both concern this step's fragment;
        # at τ = H a merge that keeps the progress since launch applies first (_apply_first).
        if self._apply_first:
            self._apply_due(step)
        launch = self._sync_point(step + self.overlap)
        if launch is not None:
            if quorum and self._quorum():
                raise _Healed  # this step's schedule is the donor's now: start it again
            self._launch(launch)
        if not self._apply_first:
            self._apply_due(step)

    def _apply_due(self, step: int) -> None:
        """Apply the sync point that falls at ``step``, if any."""
        k = self._sync_point(step)
        if k is not None:
            if k in self._in_flight:
                self._apply(k)
            elif self._apply_unlaunched and not self._keeps_progress():
                # the first sync points of an overlapped schedule launched before step 1
                with record_function(f"{self.profile_tag}::outer"):
                    frag = self.fragments[self._choose_fragment(k)]
                    self._update(frag, None, None)
                    frag.anchor.copy_to(frag.params)

    def _sync_point(self, position: int) -> int | None:
        """k, the sync point at ``position`` of the schedule (inner steps after the warm start;
        the k-th since), or ``None`` where there is none: every H / P steps; with early rounds
        every H₀ steps up to W, then every H (one fragment, τ < H₀: one sync in flight)."""
        w = self.early_steps
        if w and 0 < position <= w:
            return position // self.early_every if position % self.early_every == 0 else None
        if position % self.interval:
            return None
        if w:
            return w // self.early_every + (position - w) // self.interval
        return position // self.interval

    def _launch(self, k: int) -> None:
        f = self._choose_fragment(k)
        assert f not in self._in_flight.values() or self.overlap >= self.sync_every
        with record_function(f"{self.profile_tag}::launch"):
            # earlier launches' verdicts: this rank recovers before its Δ
            self.guards.read_own(before=self.local_step)
            self._before_launch(f)
            frag = self.fragments[f]
            rnd = math.ceil((self.local_step - self.warmup) / self.sync_every)
            label = f"fragment {f}" if self.num_fragments > 1 else f"round {rnd}"
            if self.early_steps:
                label = f"sync {k}"  # (rounds of H₀ steps, then of H)
            scale = 1.0
            if self.pace is not None:
                scale = self.pace.weight(f)
                if (k * self.interval) % self.sync_every == 0:  # applied at a round boundary
                    self.pace.measure(k)  # (before the sync: first on the link)
            sync = frag.launch(label, self.local_step, scale=scale)
            self._pg_norm = sync.norm
            self.guards.launched(sync)
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
        with record_function(f"{self.profile_tag}::outer"):
            applied = frag.pending[0] if frag.pending else None
            if self.elastic_syncs is not None and not self.elastic_syncs.commit(frag):
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
            # (its collective, waited for, went out after its verdict)
            self.guards.read_own(before=self.local_step, applied=applied)
        self.sync_points += 1
        if self.pace is not None:
            self.pace.applied(k, self.local_step)
        if self.elastic_syncs is not None:
            self.elastic_syncs.ft.contributing = not self.elastic_syncs.catching_up
            self.elastic_syncs.catch_up()

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
        elastic = self.elastic_syncs
        if elastic is not None and elastic.catching_up:  # (kept, applied once it has caught up)
            elastic.missed(frag, sync, avg, self.outer_lr_factor())
            return True
        self._update(frag, sync, avg, anchor)
        return True

    def replay_update(
        self, frag: AnyFragment, sync: Sync, avg: list[torch.Tensor], lr_factor: float | None
    ) -> None:
        """Step ``frag``'s update rule with a past sync's average, as at its time (its outer lr
        factor): how a replica healed in the background catches up."""
        self._replay_lr_factor = lr_factor
        try:
            self._update(frag, sync, avg)
        finally:
            self._replay_lr_factor = None

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
            self.guards.check_consistency()
            with torch.no_grad(), record_function(f"{self.profile_tag}::finish"):
                self.guards.read_own()
                drained = bool(self._in_flight)
                for k in sorted(self._in_flight):
                    self._apply(k)
                if self.elastic_syncs is not None:
                    self.elastic_syncs.complete_heal()  # (healed in the background: caught up)
                self._after_finish(drained)
                for frag in self.fragments:
                    frag.anchor.copy_to(frag.params)
                self.comm_stream.drain()
            self.guards.check_same_steps(elastic=self.ft is not None)

    # -- the warm start and dynamic local steps, for the loop ----------------------------------

    def warm_start_by_caller(self) -> None:
        """For loops whose ``optimizer.step()`` may not run on every rank (a ``GradScaler``
        skips it on a rank whose gradients overflowed): the warm start's gradient mean is no
        longer taken in a step pre-hook of the inner optimizer, but by
        :meth:`before_inner_step`, which the loop then calls before every inner step on every
        rank. The trainer integrations do this."""
        self.warm.by_caller()

    def warm_start_during_backward(
        self, bucket_cap_mb: float | None = None, first_bucket_mb: float = WARM_BUCKET_MB
    ) -> None:
        """Launch the warm start's gradient means during backward, a bucket as soon as its
        gradients are accumulated, instead of all at the optimizer's step, which then only
        waits. Buckets in the order backward produces them, laid out as DDP's: the first of
        up to ``first_bucket_mb``, the others of up to ``bucket_cap_mb`` (``None``: this
        algorithm's, 25 MB by default), the last ``first_bucket_mb`` of gradients in smaller
        ones (:func:`~lowcomm.outer.warm.warm_buckets`). The same means bit for bit, except
        that stochastic rounding draws per bucket. Only for loops that run one backward per
        inner step and leave the gradients alone until ``optimizer.step()`` (no accumulation,
        no clipping); call before :meth:`load_state_dict`. With fault tolerance, see
        :meth:`before_forward`. A no-op without a warm start."""
        self.warm.during_backward(bucket_cap_mb, first_bucket_mb)

    def before_forward(self) -> None:
        """Call at each inner step's start (lr set, before forward): with fault tolerance, a
        warm step that overlaps backward joins its quorum here (else at the optimizer step)."""
        self.warm.before_forward()

    def before_inner_step(self) -> None:
        """Inside the warm start (``sync_warmup``), average the gradients over the ranks (see
        :meth:`warm_start_by_caller`); a no-op after it."""
        self.warm.before_inner_step()

    def takes_step(self) -> bool:
        """Whether this rank takes an inner step before its next :meth:`step` call: always with
        ``local_steps="fixed"``; with ``"dynamic"``, at H_j of each round's H positions
        (:mod:`lowcomm.outer.pace`). A loop with dynamic local steps asks before every step::

            if algo.takes_step():
                loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
            algo.step()
        """
        return self.pace is None or self.pace.steps_here(self.local_step + 1)

    def steps_done(self, *, including_next: bool = False) -> float:
        """Inner steps per rank taken so far (``including_next``: once the next position's are
        taken too): the step count with fixed local steps; with dynamic ones every rank's steps
        since the start over N — what a learning-rate schedule that follows the tokens reads,
        equal to the step count, exactly, when every rank steps at every position."""
        if self.pace is None:
            return float(self.local_step + int(including_next))
        pace = self.pace
        work = pace.work_through(self.local_step + 1) if including_next else sum(pace.taken)
        return work / self.world_size

    def set_total_steps(self, steps: int) -> None:
        """With dynamic local steps, the job's length: ``steps`` inner steps per rank at equal
        speeds, i.e. steps × N taken by all ranks together; the plan of the round that reaches
        it is cut to what is left (each rank in proportion), so that the job ends at a round
        boundary with exactly that many tokens. A no-op with fixed local steps."""
        if self.pace is not None:
            self.pace.budget = int(steps) * self.world_size

    @property
    def inner_steps(self) -> int:
        """Inner steps this rank took (with dynamic local steps, fewer than :meth:`step` calls
        on a slower rank)."""
        if self.pace is None:
            return self.local_step
        return self.pace.taken[self.comm.rank]

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
        kwargs = dict(kwargs)
        field = cls.Config.field("sync_every")
        if "sync_every" not in kwargs and field.default is dataclasses.MISSING:
            # any H the other keywords allow: only they are being checked
            p, tau = kwargs.get("num_fragments"), kwargs.get("overlap")
            p = p if isinstance(p, int) and p > 0 else 1
            kwargs["sync_every"] = p * (1 + (tau if isinstance(tau, int) and tau > 0 else 0))
            warmup = kwargs.get("sync_warmup")
            if isinstance(warmup, int) and warmup > 0:
                kwargs["sync_warmup"] = kwargs["sync_every"] * warmup  # a multiple of that H
        cls.resolve(**kwargs)

    @classmethod
    def resolve(cls, **kwargs: Any) -> OuterConfig:
        """The ``Config`` the constructor makes of these keyword arguments (less model,
        optimizer and process group); raises
        :class:`~lowcomm.outer.hparams.HyperparameterError` (a ``ValueError``) for bad ones."""
        try:
            return cls.Config(**cls._complete(dict(kwargs)))
        except TypeError as e:
            raise HyperparameterError(None, f"{cls.__name__}: {e}") from None

    # -- what it keeps and reports ---------------------------------------------------------------

    def metrics(self) -> dict[str, float | int | None]:
        """This rank's numbers for loggers (:mod:`lowcomm.loggers`):

        * ``outer_step``: syncs applied (the x-axis of lowcomm's scalars), ``inner_step``:
          inner steps taken, ``rounds``: rounds of H completed;
        * ``pseudo_grad_norm``: ‖A − θᵢ‖, this rank's pseudo-gradient at its last launch (of the
          fragment launched, the whole model unless ``num_fragments`` > 1), before any
          compression; ``None`` before the first;
        * :meth:`CommStats.metrics <lowcomm.comm.CommStats.metrics>` (bytes sent and received,
          time blocked, hidden fraction), and ``skipped_updates`` (non-finite averages dropped).

        Reading ``pseudo_grad_norm`` waits for the device (once per call)."""
        return {
            "outer_step": self.sync_points,
            "inner_step": self.local_step,
            "rounds": self.rounds,
            "pseudo_grad_norm": None if self._pg_norm is None else float(self._pg_norm),
            **self.comm.stats.metrics(),
            "skipped_updates": self.skipped_updates,
        }

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds beyond the model and inner optimizer (each storage once):
        ``"state"`` persists between syncs (anchor, outer state, error feedback; 1/N sharded),
        ``"buffers"`` are for communication (pseudo-gradients in flight, snapshots)."""
        state: list[torch.Tensor] = []
        for c in self.compressors():
            state += [*c.residuals, *c.q.values()]
        buffers: list[torch.Tensor] = []
        for frag in self.fragments:
            state += frag.state_tensors()
            buffers += frag.buffer_tensors()
        return {"state": storage_nbytes(state), "buffers": storage_nbytes(buffers)}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: counters, anchors, outer state, and the results of
        collectives in flight (waited for, not applied: resuming gives the same numbers)."""
        state: dict[str, Any] = {
            **self._identity(),
            "local_step": self.local_step,
            "rounds": self.rounds,
            "sync_points": self.sync_points,
            "skipped_updates": self.guards.skipped,
            "in_flight": [[k, f] for k, f in sorted(self._in_flight.items())],
        }
        if self._flat_state:
            state.update(self.fragment.state_dict())
        else:
            for i, frag in enumerate(self.fragments):
                state[f"fragment_{i}"] = frag.state_dict()
        state.update(self._extra_state())
        if self.keep_progress is not None:
            state["snapshots"] = self.keep_progress.state_dict()
        if self.pace is not None:
            state["pace"] = self.pace.state_dict()
        if self.warm.compressors:
            state["warm_compression"] = self.warm.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], *, _healing: bool = False) -> None:
        """Restore :meth:`state_dict` output; refuses state from another configuration.

        Into a freshly built algorithm or one in use: the syncs this rank has in flight are
        waited for (not applied) before its buffers are refilled, so every rank must load at
        the same point of the schedule, as for any collective."""
        for key, mine in self._identity().items():
            if _healing and key == "world_size":
                continue  # a donor's quorum is this replica's too
            if key in ("num_fragments", "overlap") and self._flat_state:
                state = {key: mine, **state}  # older one-fragment state_dicts lack them
            if key == "sync_warmup" and mine == 0:
                state = {key: mine, **state}  # and state_dicts from before the warm start
            if key == "local_steps" and mine == "fixed":
                state = {key: mine, **state}  # and from before dynamic local steps
            if key == "merge" and mine == "reset":
                state = {key: mine, **state}  # and from before the delay-corrected merge
            if key == "early_rounds":
                state = {key: None, **state}  # state_dicts from before early rounds had none
            if key not in state:
                raise ValueError(f"not a {type(self).__name__} state_dict: missing {key!r}")
            if state[key] != mine:
                raise ValueError(
                    f"state_dict was saved with {key}={state[key]!r} but this "
                    f"{type(self).__name__} has {key}={mine!r}; resume with the same settings"
                )
        # inside the warm start, its compressors' residuals (one per fragment) must come along
        inside_warmup = int(state["local_step"]) < self.warmup
        warm = state.get("warm_compression") if inside_warmup else None
        self.warm.check_loadable(warm, int(state["local_step"]))
        if not _healing:
            # an algorithm already in use: what it has in flight finishes before the buffers
            # are refilled (every rank launched it, so every rank can wait for it here); a
            # healing replica's collectives in flight belong to the quorum that failed
            for frag in self.fragments:
                frag.wait_in_flight()
        self._load_extra_state(state)
        if self.keep_progress is not None:
            if "snapshots" not in state:
                raise ValueError(f"{type(self).__name__} state_dict is missing 'snapshots'")
            self.keep_progress.load_state_dict(state["snapshots"])
        if self.pace is not None:
            self.pace.load_state_dict(state["pace"])
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
            k = (local_step - self.warmup + self.overlap) // self.interval
            in_flight = {k: 0} if self.fragment.pending else {}
        for f, frag in enumerate(self.fragments):
            if len(frag.pending) != sum(1 for g in in_flight.values() if g == f):
                raise ValueError(
                    f"state_dict lists fragment {f} in flight but holds no result for it (or "
                    "the other way round); the checkpoint is inconsistent"
                )
        self.warm.load_state_dict(warm or [])
        # counters last: a state_dict refused half-way leaves them as they were
        self.comm_stream.drain()  # what was in flight is dropped (or restored, complete)
        self._in_flight = in_flight
        self._to_advance = []
        self.local_step = local_step
        if local_step >= self.warmup:
            self.warm.end()
        self.rounds = int(state["rounds"])
        self.sync_points = int(state.get("sync_points", 0))
        self.guards.skipped = int(state.get("skipped_updates", 0))
        self.guards.resumed()

    def _identity(self) -> dict[str, Any]:
        """What a state_dict must have been saved with to load here."""
        return {
            "algorithm": self.name,
            "sync_every": self.sync_every,
            "world_size": self.world_size,
            "num_fragments": self.num_fragments,
            "overlap": self.overlap,
            "sync_warmup": self.warmup,
            "local_steps": self.config.local_steps,
            "early_rounds": [self.early_every, self.early_steps] if self.early_steps else None,
            **({"merge": self.config.merge} if hasattr(self.config, "merge") else {}),
        }

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass
