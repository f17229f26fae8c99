"""The warm start of every outer algorithm (``sync_warmup``; a base of the engine): for the
first K inner steps every gradient is averaged over the ranks before the inner optimizer's step,
as DDP would, blocking (at the optimizer's step) or launched bucket by bucket during backward
(:meth:`WarmStart.warm_start_during_backward`), fp32 or through a codec with error feedback
(``sync_warmup_compression``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from lowcomm.comm import Communicator, FlatBuckets, Handle
from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.feedback import Compressor
from lowcomm.guard import HostFlags, NonFiniteError, finite_flag
from lowcomm.outer.fragment import AnyFragment
from lowcomm.outer.guards import log_repeated
from lowcomm.outer.hparams import OuterConfig
from lowcomm.outer.pace import Pace

__all__ = ["WARM_BUCKET_MB", "WARM_STREAM", "WARM_TAIL_SPLIT", "WarmStart", "warm_buckets"]

WARM_STREAM = 1 << 16
"""Stochastic-rounding stream of fragment i's warm-start compressor: WARM_STREAM + i (the
fragments' own compressors use i); of bucket i's when the warm start overlaps backward."""

WARM_BUCKET_MB = 1.0
"""Bucket size (MB) of a warm start that overlaps backward
(:meth:`OuterAlgorithm.warm_start_during_backward`): DDP's first bucket's, so that the last
layers' gradients go out early."""


WARM_TAIL_SPLIT = 4
"""The gradients backward produces last (its last bucket's worth) go out in buckets this many
times smaller (:func:`warm_buckets`)."""


def warm_buckets(nbytes: Sequence[int], cap: float) -> list[list[int]]:
    """The buckets of a warm start launched during backward, in launch order: indices into
    ``nbytes``, the sizes of the tensors in the order backward produces their gradients.
    Buckets of up to ``cap`` bytes (a tensor larger than the cap gets one of its own), except
    that the gradients backward produces last, its last ``cap`` bytes, go out in buckets of
    about ``cap / WARM_TAIL_SPLIT`` (each closed once it holds that much): the optimizer's step
    waits for the bucket launched last — its encoding, its transfer and the link's latency —
    so that one is small, and the ones before it travel while backward computes the rest.
    No tensors, no buckets."""
    if not nbytes:
        return []
    tail = sum(nbytes) - cap
    groups: list[list[int]] = [[]]
    size = seen = 0.0
    for i, n in enumerate(nbytes):
        full = size + n > cap if seen < tail else size >= cap / WARM_TAIL_SPLIT
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


class WarmStart:
    """The warm start, over the engine's state (see the module docstring)."""

    config: OuterConfig
    comm: Communicator
    inner: torch.optim.Optimizer
    params: list[torch.Tensor]
    fragments: list[AnyFragment]
    pace: Pace | None
    nan_policy: str
    sync_every: int
    warmup: int
    local_step: int
    skipped_updates: int
    _profile_tag: str
    _warm_hook: RemovableHandle | None
    _warm_compressors: list[Compressor]
    """The warm start's compressors, one per fragment (``sync_warmup_compression``), or one
    per bucket when it overlaps backward."""
    _warm_buckets: list[_WarmBucket]
    _warm_grad_hooks: list[RemovableHandle]

    def _init_warm_start(self) -> None:
        """At construction, once the fragments exist: with a warm start, the inner optimizer's
        step pre-hook that averages the gradients, and the warm start's compressors."""
        self._warm_compressors = []
        self._warm_buckets = []
        self._warm_grad_hooks = []
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
        order backward produces them, as DDP's; the last ``bucket_cap_mb`` of them in smaller
        ones: :func:`warm_buckets`), instead of all at the optimizer's step, which then only
        waits: the link carries the first buckets while backward computes the rest.
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
        order = list(reversed(self.params))  # the order backward produces the gradients
        index = warm_buckets([4 * p.numel() for p in order], bucket_cap_mb * 1024 * 1024)
        groups = [[order[j] for j in idx] for idx in index]
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
            # one verdict for every mean, read where the host has just waited for them
            if not HostFlags(finite_flag([b for buf in bufs for b in buf.buffers])).read()[0]:
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
            means = [b for bucket in self._warm_buckets for b in bucket.buf.buffers]
            if not HostFlags(finite_flag(means)).read()[0]:
                self._skip_warm_step()
                return
            grads, views = [], []
            for bucket in self._warm_buckets:
                for p, mean in zip(bucket.params, bucket.buf.views):
                    if p.grad is None:
                        p.grad = mean.clone()
                    else:
                        grads.append(p.grad)
                        views.append(mean)
            torch._foreach_copy_(grads, views)

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
