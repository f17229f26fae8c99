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
algorithm has are :mod:`lowcomm.outer.guards`.
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

from lowcomm.comm import Communicator, FlatBuckets, Handle, storage_nbytes
from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.feedback import Compressor
from lowcomm.elastic.sync import ManagedCommunicator
from lowcomm.guard import (
    Description,
    NonFiniteError,
    all_finite,
    describe_tensors,
    explain_lost_collectives,
)
from lowcomm.hparams import HyperparameterError, describe, signature
from lowcomm.outer.fragment import (
    Fragment,
    OuterState,
    ShardedFragment,
    Sync,
)
from lowcomm.outer.functional import pseudo_gradient_norm
from lowcomm.outer.guards import Guards, log_repeated
from lowcomm.outer.hparams import OuterConfig
from lowcomm.outer.pace import Pace
from lowcomm.params import check_partition, collect_params, load_tensors, split_by_blocks

if TYPE_CHECKING:
    from lowcomm.elastic.sync import FaultTolerance

__all__ = ["OuterAlgorithm"]

logger = logging.getLogger(__name__)

AnyFragment = Fragment | ShardedFragment


class _Healed(Exception):  # noqa: N818 - a signal, not an error
    """Raised out of a step whose quorum healed this replica: its counters are its donor's, and
    the step continues from there (:meth:`OuterAlgorithm._continue_healed`)."""


WARM_STREAM = 1 << 16
"""Stochastic-rounding stream of fragment i's warm-start compressor: WARM_STREAM + i (the
fragments' own compressors use i); of bucket i's when the warm start overlaps backward."""

WARM_BUCKET_MB = 1.0
"""Bucket size (MB) of a warm start that overlaps backward
(:meth:`OuterAlgorithm.warm_start_during_backward`): DDP's first bucket's, so that the last
layers' gradients go out early."""


class _WarmBucket:
    """Parameters whose gradients a warm start overlapping backward averages together: their
    flat buffer, its compressor (or None: fp32), how many of them have their gradient, and the
    mean in flight."""

    def __init__(self, params: list[torch.Tensor], compressor: Compressor | None) -> None:
        self.params = params
        shapes = [p.shape for p in params]
        nbytes = 4 * sum(p.numel() for p in params)
        cap_mb = nbytes / 2**20 + 1  # one buffer: the bucket is one collective
        self.buf = FlatBuckets(shapes, bucket_cap_mb=cap_mb, device=params[0].device)
        self.compressor = compressor
        self.ready = 0
        self.handle: Handle | None = None


class OuterAlgorithm(Guards):
    """The engine (see the module docstring); not used directly. Every algorithm takes an
    ``nn.Module`` or iterable of parameters, the inner optimizer whose ``step()`` drives the
    schedule, its ``Config``'s keywords, and ``process_group`` (``None``: WORLD; a subgroup runs
    it across node groups while DDP runs inside them)."""

    name: ClassVar[str] = "outer"
    Config: ClassVar[type[OuterConfig]] = OuterConfig  # the constructor's keywords
    schedule: ClassVar[str] = "blocking"  # how it communicates (lowcomm.registry.SCHEDULES)
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
        self._in_flight: dict[int, int] = {}  # sync point k -> fragment index
        self.overlap = self._overlap()
        """τ: inner steps between a fragment's launch and its apply."""
        groups = self._fragment_groups(model_or_params)
        self.fragments: list[AnyFragment] = [self._new_fragment(g, i) for i, g in enumerate(groups)]
        self.num_fragments = len(self.fragments)
        self.interval = self.sync_every // self.num_fragments
        """Inner steps between sync points: H / P."""
        self.pace: Pace | None = None
        """The dynamic local steps (``local_steps="dynamic"``: :mod:`lowcomm.outer.pace`)."""
        if self.config.local_steps == "dynamic":
            self.pace = Pace(self.comm, self.sync_every, self.num_fragments)
        # The model as built, compared across ranks at the first step (values hashed now).
        self._unchecked: Description | None = None
        if self.config.check_consistency and self.ft is None:
            # (with fault tolerance a joiner takes its donor's model and settings are checked
            # by the job; replicas have no fixed group to compare over)
            self._unchecked = describe_tensors(named)
        self._warm_compressors: list[Compressor] = []
        """The warm start's compressors, one per fragment (``sync_warmup_compression``), or one
        per bucket when it overlaps backward."""
        self._warm_buckets: list[_WarmBucket] = []
        self._warm_grad_hooks: list[RemovableHandle] = []
        warm_codec = parse_compression(self.config.sync_warmup_compression)
        if self.warmup > 0:
            self._warm_hook = self.inner.register_step_pre_hook(lambda *_: self._average_grads())
            if warm_codec is not None:
                for i, frag in enumerate(self.fragments):
                    buf = frag.warm_buffer()
                    self._warm_compressors.append(
                        Compressor(
                            warm_codec,
                            buf.shapes,
                            rank=self.comm.rank,
                            device=buf.device,
                            stream=WARM_STREAM + i,
                        )
                    )
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

    def _pace_position(self, pace: Pace, q: int) -> None:
        """Dynamic local steps at position ``q``: time this rank's inner step (if it took one),
        count every rank's; inside the warm start a rank that passed the position takes the
        optimizer step with the others' mean (its pre-hook averages), like DDP's ranks."""
        here = pace.steps_here(q)
        pace.begin(here)
        if q <= self.warmup and not here:
            self.inner.step()
            self.inner.zero_grad(set_to_none=True)
            pace.waited = 0.0  # (waited inside step(): not in the next step's time)
        pace.advance(q)

    def warm_start_by_caller(self) -> None:
        """For loops whose ``optimizer.step()`` may not run on every rank (a ``GradScaler``
        skips it on a rank whose gradients overflowed): the warm start's gradient mean is no
        longer taken in a step pre-hook of the inner optimizer, but by
        :meth:`before_inner_step`, which the loop then calls before every inner step on every
        rank. The trainer integrations do this."""
        if self._warm_hook is not None:
            self._warm_hook.remove()
            self._warm_hook = None

    def warm_start_during_backward(self, bucket_cap_mb: float = WARM_BUCKET_MB) -> None:
        """Launch the warm start's gradient means during backward, a bucket as soon as its
        gradients are accumulated (buckets of ``bucket_cap_mb`` in reverse parameter order, the
        order backward produces them, as DDP's), instead of all at the optimizer's step, which
        then only waits: the link carries the first buckets while backward computes the rest.
        The same means bit for bit (every codec encodes each tensor on its own), except that
        stochastic rounding draws per bucket. Only for loops that run exactly one backward per
        inner step and leave the gradients alone between it and ``optimizer.step()`` (no
        gradient accumulation, no clipping); call before :meth:`load_state_dict`. A no-op
        without a warm start."""
        if self.warmup == 0 or self.local_step >= self.warmup or self._warm_buckets:
            return
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}; e.g. 1.0")
        codec = parse_compression(self.config.sync_warmup_compression)
        cap = bucket_cap_mb * 1024 * 1024
        groups: list[list[torch.Tensor]] = [[]]
        size = 0.0
        for p in reversed(self.params):  # a tensor larger than the cap gets a bucket of its own
            nbytes = p.numel() * 4
            if groups[-1] and size + nbytes > cap:
                groups.append([])
                size = 0.0
            groups[-1].append(p)
            size += nbytes
        for i, params in enumerate(groups):
            comp = None
            if codec is not None:
                comp = Compressor(
                    codec,
                    [p.shape for p in params],
                    rank=self.comm.rank,
                    device=params[0].device,
                    stream=WARM_STREAM + i,
                )
            bucket = _WarmBucket(params, comp)
            self._warm_buckets.append(bucket)
            for p in params:
                hook = p.register_post_accumulate_grad_hook(
                    lambda _p, b=bucket: self._warm_grad_ready(b)
                )
                self._warm_grad_hooks.append(hook)
        self._warm_compressors = [b.compressor for b in self._warm_buckets if b.compressor]

    def _warm_grad_ready(self, bucket: _WarmBucket) -> None:
        """A parameter of ``bucket`` has its gradient: launch the bucket's mean once all have."""
        if self.local_step >= self.warmup:
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and bucket.handle is None:
            self._launch_warm(bucket)

    def _warm_factor(self) -> float:
        """This rank's factor in the warm-start mean of the current step (dynamic local steps:
        0 where it passed the position; else 1)."""
        return 1.0 if self.pace is None else self.pace.warm_factor(self.local_step + 1)

    def _launch_warm(self, bucket: _WarmBucket) -> None:
        with torch.no_grad():
            bucket.buf.copy_from(
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            )
            factor = self._warm_factor()
            if factor != 1.0:
                torch._foreach_mul_(bucket.buf.views, factor)
            if bucket.compressor is not None:
                bucket.handle = self.comm.compressed_mean_async(bucket.buf, bucket.compressor)
            else:
                bucket.handle = self.comm.all_reduce_mean_async(bucket.buf.buffers)

    def before_inner_step(self) -> None:
        """Inside the warm start (``sync_warmup``), average the gradients over the ranks (see
        :meth:`warm_start_by_caller`); a no-op after it."""
        if self.local_step < self.warmup:
            self._average_grads()

    def _warm_step(self) -> None:
        """After a warm-start step: the anchor follows θ (the same on every rank)."""
        for frag in self.fragments:
            frag.anchor_from_params()
        if self.pace is not None and self.local_step % self.sync_every == 0:
            self.pace.measure_now(self.local_step)
        if self.local_step >= self.warmup:
            if self.pace is not None:
                self.pace.schedule_starts()
            self._end_warmup()

    def _end_warmup(self) -> None:
        if self._warm_hook is not None:
            self._warm_hook.remove()
            self._warm_hook = None
        for hook in self._warm_grad_hooks:
            hook.remove()
        self._warm_grad_hooks = []
        self._warm_buckets = []
        self._warm_compressors = []  # their residuals are no longer needed

    def _average_grads(self) -> None:
        """The warm start (``sync_warmup``), before each of the first K inner steps: every
        gradient ← its mean over the ranks, blocking, as DDP would, so the inner optimizers
        take DDP's steps and stay equal. Post-local SGD: Lin et al., ICLR 2020
        (https://arxiv.org/abs/1808.07217), synchronous through the fast-moving start, local
        after it. A mean holding NaN or Inf skips the step alike on every rank (gradients set
        to None) or raises (``nan_policy="raise"``)."""
        if self.local_step >= self.warmup:
            self._end_warmup()
            return
        if self._warm_buckets:
            self._average_grads_launched()
            return
        with torch.no_grad(), record_function(f"{self._profile_tag}::warm_start"):
            grads = [
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in f.params]
                for f in self.fragments
            ]
            bufs = [f.warm_buffer() for f in self.fragments]
            # Every fragment's mean is launched before any is waited on: one link round trip a
            # step, not one per fragment (the same collectives in the same order on every rank).
            handles = []
            factor = self._warm_factor()
            for i, (buf, g) in enumerate(zip(bufs, grads)):
                buf.copy_from(g)
                if factor != 1.0:
                    torch._foreach_mul_(buf.views, factor)
                if self._warm_compressors:
                    # the mean of every rank's decoded g + e; e keeps what the codec dropped
                    handles.append(self.comm.compressed_mean_async(buf, self._warm_compressors[i]))
                else:
                    handles.append(self.comm.all_reduce_mean_async(buf.buffers))
            t0 = self._clock()
            for handle in handles:
                handle.wait()
            self._waited_since(t0)
            if not all(all_finite(buf.views) for buf in bufs):
                self._skip_warm_step()
                return
            for frag, buf, g in zip(self.fragments, bufs, grads):
                buf.copy_to(g)
                for p, gp in zip(frag.params, g):
                    p.grad = gp

    def _average_grads_launched(self) -> None:
        """The warm start overlapping backward, at the optimizer's step: launch what backward
        did not (parameters without a gradient), wait for every bucket, set the means."""
        with torch.no_grad(), record_function(f"{self._profile_tag}::warm_start"):
            for bucket in self._warm_buckets:  # in the same order on every rank
                if bucket.handle is None:
                    self._launch_warm(bucket)
            again = any(b.ready > len(b.params) for b in self._warm_buckets)
            t0 = self._clock()
            for bucket in self._warm_buckets:
                assert bucket.handle is not None
                bucket.handle.wait()
                bucket.handle, bucket.ready = None, 0
            self._waited_since(t0)
            if again:
                raise ValueError(
                    f"{type(self).__name__}.warm_start_during_backward(): gradients were "
                    "accumulated again after their mean was launched (more than one backward "
                    "in an inner step); leave the warm start at the optimizer's step for loops "
                    "that accumulate gradients"
                )
            if not all(all_finite(b.buf.views) for b in self._warm_buckets):
                self._skip_warm_step()
                return
            for bucket in self._warm_buckets:
                for p, mean in zip(bucket.params, bucket.buf.views):
                    if p.grad is None:
                        p.grad = mean.clone()
                    else:
                        p.grad.copy_(mean)

    def _waited_since(self, t0: float) -> None:
        """Dynamic local steps: the time since ``t0`` was spent waiting for a warm-start mean,
        not computing."""
        if self.pace is not None:
            self.pace.waited += self.pace.clock() - t0

    def _clock(self) -> float:
        return self.pace.clock() if self.pace is not None else 0.0

    def _skip_warm_step(self) -> None:
        """A warm-start mean holds NaN or Inf: skip the step alike on every rank (gradients set
        to None), or raise (``nan_policy="raise"``)."""
        self.skipped_updates += 1
        message = (
            f"{type(self).__name__}: the averaged gradient of warm-start step "
            f"{self.local_step + 1} holds NaN or Inf (rank {self.comm.rank})"
        )
        if self.nan_policy == "raise":
            raise NonFiniteError(
                f"{message}; lower the learning rate, check the data, or use "
                "nan_policy='skip' to drop such steps"
            )
        if self.comm.rank == 0:  # the same event on every rank: told once
            log_repeated(
                self.skipped_updates,
                "%s: step skipped alike on every rank (%d skipped so far)",
                message,
                self.skipped_updates,
            )
        for p in self.params:
            p.grad = None
        for comp in self._warm_compressors:
            comp.drop_non_finite()  # a non-finite residual would poison every mean

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

    def _quorum(self) -> bool:
        """With fault tolerance, before a sync is launched: join its quorum; returns whether
        this replica was healed in it (then it stands where its donor stood, at this same
        launch, and takes part in it without contributing)."""
        return self.ft is not None and self.ft.quorum()

    def _launch(self, k: int) -> None:
        f = self._choose_fragment(k)
        assert f not in self._in_flight.values() or self.overlap >= self.sync_every
        with record_function(f"{self._profile_tag}::launch"):
            self._before_launch(f)
            frag = self.fragments[f]
            self._pg_norm = pseudo_gradient_norm(frag.anchor.views, frag.params)
            rnd = math.ceil((self.local_step - self.warmup) / self.sync_every)
            label = f"fragment {f}" if self.num_fragments > 1 else f"round {rnd}"
            scale = 1.0
            if self.pace is not None:
                scale = self.pace.weight(f)
                if (k * self.interval) % self.sync_every == 0:  # applied at a round boundary
                    self.pace.measure(k)  # (before the sync: first on the link)
            sync = frag.launch(label, self.local_step, scale=scale)
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
        self.sync_points += 1
        if self.pace is not None:
            self.pace.applied(k, self.local_step)
        if self.ft is not None:
            self.ft.contributing = True

    # -- fault tolerance (lowcomm.elastic.sync) ------------------------------------------------

    def _fault_tolerance(self, replica: Any, process_group: Any) -> FaultTolerance:
        from lowcomm.elastic.sync import FaultTolerance

        if process_group is not None:
            raise ValueError(
                "pass fault_tolerance or process_group, not both: with fault tolerance the "
                "quorum of each sync is the group"
            )
        return FaultTolerance(replica)

    def _check_fault_tolerance(self) -> None:
        """Refuse what elastic syncs do not support yet, with the reason."""
        name = type(self).__name__
        refusals = [
            (
                self.warmup > 0,
                "sync_warmup > 0 (the warm start averages every step, and a "
                "quorum per inner step is not what fault tolerance here does): use sync_warmup=0",
            ),
            (
                self.compression is not None,
                "compression (its collectives are all-gathers, "
                "which torchft's Manager does not carry): leave compression unset",
            ),
            (
                self.shard_outer_state,
                "shard_outer_state (its reduce-scatter is not carried by "
                "torchft's Manager): leave it off",
            ),
            (self.schedule == "gossip", "gossip groups (NoLoCo's pairs need a fixed group)"),
            (
                self.pace is not None,
                "local_steps='dynamic' (its plans assume a fixed group of ranks): use 'fixed'",
            ),
            (
                self.overlap >= self.interval,
                f"overlap {self.overlap} >= sync_every / "
                f"num_fragments = {self.interval}: a sync would be launched before the last one "
                "is applied, across a quorum that can rebuild the group; use a smaller overlap "
                "(the job's CO2 uses 1)",
            ),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"{name} with fault_tolerance: {why}")

    def _commit(self, frag: AnyFragment) -> bool:
        """Wait for the sync in flight, then vote; ``False``: drop it (popped, not applied)."""
        assert self.ft is not None
        sync = frag.pending[0]
        sync.handle.wait()
        if self.ft.commit():
            return True
        frag.pending.popleft()
        return False

    def _heal_state(self) -> dict[str, Any]:
        """What a donor sends a replica it heals (in torchft's quorum thread, while this
        replica's loop waits in the quorum: nothing is in flight)."""
        return {
            "algorithm": self.state_dict(),
            "params": [p.detach().clone() for p in self.params],
            "inner": self.inner.state_dict(),
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["algorithm"], _healing=True)
        with torch.no_grad():
            load_tensors({"params": state["params"]}, "params", self.params)
        self.inner.load_state_dict(state["inner"])

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
                drained = bool(self._in_flight)
                for k in sorted(self._in_flight):
                    self._apply(k)
                self._after_finish(drained)
                for frag in self.fragments:
                    frag.anchor.copy_to(frag.params)
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
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.comm.world_size)]
        dist.all_gather(counts, torch.tensor([self.local_step]), group=self.comm.group)
        steps = [int(c) for c in counts]
        if len(set(steps)) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(steps))
            raise ValueError(
                f"{type(self).__name__}.finish(): the ranks called step() a different number "
                f"of times ({listed}); every rank must call step() once after every inner step"
            )

    # -- metrics -------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float | int | None]:
        """This rank's numbers for loggers (:mod:`lowcomm.integrations.loggers`):

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

    # -- memory and state ----------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds beyond the model and inner optimizer (each storage once):
        ``"state"`` persists between syncs (anchor, outer state, error feedback; 1/N sharded),
        ``"buffers"`` are for communication (pseudo-gradients in flight, snapshots)."""
        state: list[torch.Tensor] = []
        for c in self._compressors():
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
            "skipped_updates": self.skipped_updates,
            "in_flight": [[k, f] for k, f in sorted(self._in_flight.items())],
        }
        if self._flat_state:
            state.update(self.fragment.state_dict())
        else:
            for i, frag in enumerate(self.fragments):
                state[f"fragment_{i}"] = frag.state_dict()
        state.update(self._extra_state())
        if self.pace is not None:
            state["pace"] = self.pace.state_dict()
        if self._warm_compressors:
            state["warm_compression"] = [c.state_dict() for c in self._warm_compressors]
        return state

    def load_state_dict(self, state: dict[str, Any], *, _healing: bool = False) -> None:
        """Restore :meth:`state_dict` output; refuses state from another configuration."""
        for key, mine in self._identity().items():
            if _healing and key == "world_size":
                continue  # a donor's quorum is this replica's too
            if key in ("num_fragments", "overlap") and self._flat_state:
                state = {key: mine, **state}  # older one-fragment state_dicts lack them
            if key == "sync_warmup" and mine == 0:
                state = {key: mine, **state}  # and state_dicts from before the warm start
            if key == "local_steps" and mine == "fixed":
                state = {key: mine, **state}  # and from before dynamic local steps
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
        if inside_warmup and len(warm or []) != len(self._warm_compressors):
            raise ValueError(
                "state_dict was saved inside the warm start with another "
                f"sync_warmup_compression than this run's "
                f"({self.config.sync_warmup_compression!r}); resume with the same settings"
            )
        self._load_extra_state(state)
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
        for comp, saved in zip(self._warm_compressors, warm or []):
            comp.load_state_dict(saved)
        # counters last: a state_dict refused half-way leaves them as they were
        self._in_flight = in_flight
        self._to_advance = []
        self.local_step = local_step
        if local_step >= self.warmup:
            self._end_warmup()
        self.rounds = int(state["rounds"])
        self.sync_points = int(state.get("sync_points", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        if self._unchecked is not None:
            # ranks resuming mid-round hold different values: compare the rest only
            self._unchecked = [e for e in self._unchecked if not e[0].startswith("values of")]

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
        }

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
