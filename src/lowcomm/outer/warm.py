"""The warm start of every outer algorithm (``sync_warmup``; an object the engine holds,
``engine.warm``): for the
first K inner steps every gradient is averaged over the ranks before the inner optimizer's step,
as DDP would, blocking (at the optimizer's step) or launched bucket by bucket during backward
(:meth:`WarmStart.during_backward`), fp32 or through a codec with error feedback
(``sync_warmup_compression``). With fault tolerance each warm step is one torchft Manager step:
the quorum before the mean (a replica behind is healed there), the vote after it
(:meth:`~lowcomm.outer.fault_tolerance.ElasticSyncs.warm_quorum`); overlapping backward, the
quorum of a warm step is joined before its forward where the loop calls
:meth:`WarmStart.before_forward` (as torchft's optimizer wrapper joins one at ``zero_grad``), so
that its means go out during backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from lowcomm.comm import FlatBuckets, Handle
from lowcomm.compress.feedback import Compressor
from lowcomm.guard import HostFlags, finite_flag

if TYPE_CHECKING:
    from lowcomm.comm import Communicator
    from lowcomm.compress.codecs import Codec
    from lowcomm.compress.lgreco import LGreCo
    from lowcomm.outer.fault_tolerance import ElasticSyncs
    from lowcomm.outer.fragment import AnyFragment
    from lowcomm.outer.guards import Guards
    from lowcomm.outer.hparams import OuterConfig
    from lowcomm.outer.pace import Pace

__all__ = [
    "WARM_BUCKET_MB",
    "WARM_STREAM",
    "WARM_TAIL_SPLIT",
    "WarmEngine",
    "WarmStart",
    "warm_buckets",
]

WARM_STREAM = 1 << 16
"""Stochastic-rounding stream of fragment i's warm-start compressor: WARM_STREAM + i (the
fragments' own compressors use i); of bucket i's when the warm start overlaps backward."""

WARM_BUCKET_MB = 1.0
"""Size (MB) of the first bucket of a warm start that overlaps backward
(:meth:`WarmStart.during_backward`), DDP's ``first_bucket_cap``, so that the last layers'
gradients go out early; the buckets after it are as large as the engine's (``bucket_cap_mb``,
25 MB by default, DDP's), and the last ``WARM_BUCKET_MB`` of gradients go out in buckets
:data:`WARM_TAIL_SPLIT` times smaller."""


WARM_TAIL_SPLIT = 4
"""The gradients backward produces last (its last bucket's worth) go out in buckets this many
times smaller (:func:`warm_buckets`)."""


def warm_buckets(nbytes: Sequence[int], cap: float, first: float | None = None) -> list[list[int]]:
    """The buckets of a warm start launched during backward, in launch order: indices into
    ``nbytes``, the sizes of the tensors in the order backward produces their gradients.
    The first bucket holds up to ``first`` bytes (``None``: ``cap``; never more than ``cap``)
    and the others up to ``cap`` (a tensor larger than its bucket's cap gets one of its own),
    except that the gradients backward produces last, its last ``first`` bytes, go out in
    buckets of about ``first / WARM_TAIL_SPLIT`` (each closed once it holds that much): the
    optimizer's step waits for the bucket launched last — its encoding, its transfer and the
    link's latency — so that one is small, the first one leaves early, and the ones between
    travel while backward computes the rest. Every bucket is a collective with its own
    encoding, so the number of buckets, not their size, sets the host's work on a GPU (DDP's
    layout: 1 MB first, 25 MB after). No tensors, no buckets."""
    if not nbytes:
        return []
    first = cap if first is None else min(first, cap)
    tail = sum(nbytes) - first
    groups: list[list[int]] = [[]]
    size = seen = 0.0
    for i, n in enumerate(nbytes):
        if seen >= tail:
            full = size >= first / WARM_TAIL_SPLIT
        else:
            full = size + n > (first if len(groups) == 1 else cap)
        if groups[-1] and full:
            groups.append([])
            size = 0.0
        groups[-1].append(i)
        size += n
        seen += n
    return groups


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


class WarmEngine(Protocol):
    """What the warm start asks of the engine that owns it
    (:class:`~lowcomm.outer.engine.OuterAlgorithm`)."""

    config: OuterConfig
    comm: Communicator
    inner: torch.optim.Optimizer
    params: list[torch.Tensor]
    fragments: list[AnyFragment]
    pace: Pace | None
    guards: Guards
    elastic_syncs: ElasticSyncs | None
    sync_every: int
    local_step: int
    profile_tag: str


class WarmStart:
    """The warm start of one engine (see the module docstring): its K steps (``steps``), the
    codec of its means (``codec``, ``None``: fp32), the inner optimizer's step pre-hook that
    takes them, and its compressors (one per fragment, or one per bucket once it overlaps
    backward). With K = 0 it does nothing."""

    def __init__(self, engine: WarmEngine, steps: int, codec: Codec | LGreCo | None) -> None:
        self.engine = engine
        self.steps = steps
        """K: the first K inner steps average the gradients (``sync_warmup``)."""
        self.codec = codec
        self.hook: RemovableHandle | None = None
        """The inner optimizer's step pre-hook that averages the gradients (``None``: the
        loop calls :meth:`before_inner_step`, or the warm start is over)."""
        self.compressors: list[Compressor] = []
        """The warm start's compressors, one per fragment (``sync_warmup_compression``), or one
        per bucket when it overlaps backward."""
        self.buckets: list[_WarmBucket] = []
        self._grad_hooks: list[RemovableHandle] = []
        self.healed_into_sync = False
        """With fault tolerance: this replica was healed at a warm step's quorum from a donor
        already past the warm start, at a sync's launch; the engine's next step continues
        that launch as the donor does."""
        self.quorum_taken = False
        """With fault tolerance, overlapping backward: the quorum of the step being computed
        was joined before its forward (:meth:`before_forward`), so its means go out during
        backward; else they wait for the optimizer's step, which joins it."""
        self._in_hook = False
        if steps > 0:
            self.hook = engine.inner.register_step_pre_hook(lambda *_: self._from_hook())
            if codec is not None:
                for i, frag in enumerate(engine.fragments):
                    buf = frag.warm_buffer()
                    self.compressors.append(
                        Compressor(
                            codec,
                            buf.shapes,
                            rank=engine.comm.rank,
                            device=buf.device,
                            stream=WARM_STREAM + i,
                        )
                    )

    def _from_hook(self) -> None:
        self._in_hook = True
        try:
            self.average_grads()
        finally:
            self._in_hook = False

    @property
    def active(self) -> bool:
        """Whether the next inner step is one of the warm start's."""
        return self.engine.local_step < self.steps

    def by_caller(self) -> None:
        """The gradient mean is taken by :meth:`before_inner_step` instead of the inner
        optimizer's step pre-hook (:meth:`OuterAlgorithm.warm_start_by_caller`)."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def during_backward(
        self, bucket_cap_mb: float | None = None, first_bucket_mb: float = WARM_BUCKET_MB
    ) -> None:
        """Launch the means during backward, a bucket at a time
        (:meth:`OuterAlgorithm.warm_start_during_backward`). With fault tolerance a bucket
        goes out during backward only where its step's quorum was joined before the forward
        (:meth:`before_forward`): a quorum may heal this replica, replacing the parameters
        backward reads, so it is never joined during backward."""
        if not self.active or self.buckets:
            return
        engine = self.engine
        cap = engine.config.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb
        for name, value in (("bucket_cap_mb", cap), ("first_bucket_mb", first_bucket_mb)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}; e.g. 25.0 and 1.0")
        order = list(reversed(engine.params))  # the order backward produces the gradients
        mb = 1024 * 1024
        index = warm_buckets([4 * p.numel() for p in order], cap * mb, first_bucket_mb * mb)
        groups = [[order[j] for j in idx] for idx in index]
        for i, params in enumerate(groups):
            comp = None
            if self.codec is not None:
                comp = Compressor(
                    self.codec,
                    [p.shape for p in params],
                    rank=engine.comm.rank,
                    device=params[0].device,
                    stream=WARM_STREAM + i,
                )
            bucket = _WarmBucket(params, comp)
            self.buckets.append(bucket)
            for p in params:
                hook = p.register_post_accumulate_grad_hook(
                    lambda _p, b=bucket: self._grad_ready(b)
                )
                self._grad_hooks.append(hook)
        self.compressors = [b.compressor for b in self.buckets if b.compressor]

    def _grad_ready(self, bucket: _WarmBucket) -> None:
        """A parameter of ``bucket`` has its gradient: launch the bucket's mean once all have."""
        if not self.active:
            return
        bucket.ready += 1
        # (with fault tolerance once this step's quorum is joined: else at the optimizer's step)
        quorum = self.engine.elastic_syncs is None or self.quorum_taken
        if bucket.ready == len(bucket.params) and bucket.handle is None and quorum:
            self._launch(bucket)

    def _factor(self) -> float:
        """This rank's factor in the warm-start mean of the current step (dynamic local steps:
        0 where it passed the position; else 1)."""
        pace = self.engine.pace
        return 1.0 if pace is None else pace.warm_factor(self.engine.local_step + 1)

    def _launch(self, bucket: _WarmBucket) -> None:
        comm = self.engine.comm
        with torch.no_grad():
            bucket.buf.copy_from(
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            )
            factor = self._factor()
            if factor != 1.0:
                torch._foreach_mul_(bucket.buf.views, factor)
            if bucket.compressor is not None:
                bucket.handle = comm.compressed_mean_async(bucket.buf, bucket.compressor)
            else:
                bucket.handle = comm.all_reduce_mean_async(bucket.buf.buffers)

    def before_inner_step(self) -> None:
        """Inside the warm start, average the gradients over the ranks; a no-op after it."""
        if self.active:
            self.average_grads()

    def after_step(self) -> None:
        """After a warm-start step: the anchor follows θ (the same on every rank)."""
        engine = self.engine
        for frag in engine.fragments:
            frag.anchor_from_params()
        pace = engine.pace
        if pace is not None and engine.local_step % engine.sync_every == 0:
            pace.measure_now(engine.local_step)
        if not self.active:
            if pace is not None:
                pace.schedule_starts()
            self.end()

    def before_forward(self) -> None:
        """With fault tolerance, overlapping backward, inside the warm start: join this step's
        quorum now, before its forward and after the loop set its learning rate (a donor's
        optimizer state carries it). Healed in it, this replica stands where its donor
        stands, before the same step, and computes its gradient as its own (it contributes);
        healed from a donor past the warm start, its inner step changes nothing and the
        engine's step continues that sync's launch (:attr:`healed_into_sync`)."""
        elastic = self.engine.elastic_syncs
        if elastic is None or not self.buckets or not self.active or self.quorum_taken:
            return
        healed = elastic.warm_quorum(before_forward=True)
        if healed and not self.active:
            self.healed_into_sync = True
        else:
            self.quorum_taken = True

    def end(self) -> None:
        """The warm start is over: its hooks are removed and its residuals dropped. (Inside
        the inner optimizer's step pre-hook — a replica healed there — the hook stays until
        the engine's next step ends it: torch's hooks may not change while they run.)"""
        if self.hook is not None and not self._in_hook:
            self.hook.remove()
            self.hook = None
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []
        self.buckets = []
        self.compressors = []  # their residuals are no longer needed

    def average_grads(self) -> None:
        """The warm start (``sync_warmup``), before each of the first K inner steps: every
        gradient ← its mean over the ranks, blocking, as DDP would, so the inner optimizers
        take DDP's steps and stay equal. Post-local SGD: Lin et al., ICLR 2020
        (https://arxiv.org/abs/1808.07217), synchronous through the fast-moving start, local
        after it. A mean holding NaN or Inf skips the step alike on every rank (gradients set
        to None) or raises (``nan_policy="raise"``)."""
        if self.healed_into_sync:  # (at the quorum before this step's forward)
            self._no_inner_step()
            return
        if not self.active:
            self.end()
            return
        if self.buckets:
            self._average_launched()
            return
        engine = self.engine
        elastic = engine.elastic_syncs
        if elastic is not None and elastic.warm_quorum() and not self.active:
            # healed from a donor past the warm start, at a sync's launch: this step's inner
            # step changes nothing (the parameters are the donor's), the engine's step
            # continues the launch
            self.healed_into_sync = True
            self._no_inner_step()
            return
        with torch.no_grad(), record_function(f"{engine.profile_tag}::warm_start"):
            grads = [
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in f.params]
                for f in engine.fragments
            ]
            bufs = [f.warm_buffer() for f in engine.fragments]
            # Every fragment's mean is launched before any is waited on: one link round trip a
            # step, not one per fragment (the same collectives in the same order on every rank).
            handles = []
            factor = self._factor()
            for i, (buf, g) in enumerate(zip(bufs, grads)):
                buf.copy_from(g)
                if factor != 1.0:
                    torch._foreach_mul_(buf.views, factor)
                if self.compressors:
                    # the mean of every rank's decoded g + e; e keeps what the codec dropped
                    handles.append(engine.comm.compressed_mean_async(buf, self.compressors[i]))
                else:
                    handles.append(engine.comm.all_reduce_mean_async(buf.buffers))
            t0 = self._clock()
            for handle in handles:
                handle.wait()
            self._waited_since(t0)
            if elastic is not None and not elastic.warm_commit(self.compressors):
                # voted down (a replica left while the means were in flight): the step is
                # skipped alike on every replica of the quorum
                self._no_inner_step()
                return
            # one verdict for every mean, read where the host has just waited for them
            if not HostFlags(finite_flag([b for buf in bufs for b in buf.buffers])).read()[0]:
                engine.guards.skip_warm_step(self.compressors)
                return
            for frag, buf, g in zip(engine.fragments, bufs, grads):
                buf.copy_to(g)
                for p, gp in zip(frag.params, g):
                    p.grad = gp

    def _average_launched(self) -> None:
        """The warm start overlapping backward, at the optimizer's step: launch what backward
        did not (parameters without a gradient, or every bucket where this step's quorum is
        joined only now), wait for every bucket, vote (with fault tolerance), set the means."""
        engine = self.engine
        elastic = engine.elastic_syncs
        taken, self.quorum_taken = self.quorum_taken, False
        if elastic is not None and not taken and elastic.warm_quorum() and not self.active:
            self.healed_into_sync = True  # (as in average_grads)
            for bucket in self.buckets:
                bucket.ready = 0
            self._no_inner_step()
            return
        with torch.no_grad(), record_function(f"{engine.profile_tag}::warm_start"):
            for bucket in self.buckets:  # in the same order on every rank
                if bucket.handle is None:
                    self._launch(bucket)
            again = any(b.ready > len(b.params) for b in self.buckets)
            t0 = self._clock()
            for bucket in self.buckets:
                assert bucket.handle is not None
                bucket.handle.wait()
                bucket.handle, bucket.ready = None, 0
            self._waited_since(t0)
            if again:
                raise ValueError(
                    f"{type(engine).__name__}.warm_start_during_backward(): gradients were "
                    "accumulated again after their mean was launched (more than one backward "
                    "in an inner step); leave the warm start at the optimizer's step for loops "
                    "that accumulate gradients"
                )
            if elastic is not None and not elastic.warm_commit(self.compressors):
                self._no_inner_step()  # voted down: skipped alike on every replica
                return
            means = [b for bucket in self.buckets for b in bucket.buf.buffers]
            if not HostFlags(finite_flag(means)).read()[0]:
                engine.guards.skip_warm_step(self.compressors)
                return
            grads, views = [], []
            for bucket in self.buckets:
                for p, mean in zip(bucket.params, bucket.buf.views):
                    if p.grad is None:
                        p.grad = mean.clone()
                    else:
                        grads.append(p.grad)
                        views.append(mean)
            torch._foreach_copy_(grads, views)

    def _no_inner_step(self) -> None:
        """This step's inner optimizer step changes nothing: every gradient set to None."""
        for p in self.engine.params:
            p.grad = None

    def _waited_since(self, t0: float) -> None:
        """Dynamic local steps: the time since ``t0`` was spent waiting for a warm-start mean,
        not computing."""
        pace = self.engine.pace
        if pace is not None:
            pace.waited += pace.clock() - t0

    def _clock(self) -> float:
        pace = self.engine.pace
        return pace.clock() if pace is not None else 0.0

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> list[dict[str, Any]]:
        """Its compressors' residuals (empty outside the warm start or without a codec)."""
        return [c.state_dict() for c in self.compressors]

    def check_loadable(self, saved: list[Any] | None, saved_step: int) -> None:
        """Refuse a state saved inside the warm start with another codec than this one's."""
        if saved_step < self.steps and len(saved or []) != len(self.compressors):
            raise ValueError(
                "state_dict was saved inside the warm start with another "
                f"sync_warmup_compression than this run's "
                f"({self.engine.config.sync_warmup_compression!r}); resume with the same settings"
            )

    def load_state_dict(self, saved: list[Any]) -> None:
        for comp, state in zip(self.compressors, saved):
            comp.load_state_dict(state)
