"""Compressed mean collectives: what goes on the wire for each codec, and when.

Quantised payloads cannot be summed in flight (gloo and NCCL add numbers, not codes), so the
collective is chosen per codec. Per rank, with N ranks and c the compressed bytes one rank
contributes for a bucket (:meth:`~lowcomm.compress.formats.Codec.wire_nbytes` summed over its
tensors):

* **bf16, int8/int4/int2, top-k, fp32** — *all-gather* of the compressed payloads, one per
  bucket. Every rank decodes all N payloads in rank order, sums them in fp32 in rank order and
  divides by N, so every rank computes the same bits and the only compression error is the one
  each sender's error feedback keeps. Wire bytes (ring all-gather): ``(N − 1)·c``. One
  collective, launched with the round and decoded at :meth:`CompressedHandle.wait`: fully
  asynchronous, like the uncompressed all-reduce. (The alternative, reduce-scatter of
  compressed chunks — an all-to-all — then an all-gather of the re-compressed averaged
  chunks, sends ``2(N − 1)/N·c`` but adds a second, unfed-back quantisation and a dependent
  second collective; it equals the all-gather at N = 2 and is not implemented.)
* **PowerSGD** — two *all-reduces* (SUM, then divided by N), which PowerSGD's linearity allows:
  phase 1 all-reduces P = M·Q of every compressed matrix together with the bucket's raw
  tensors (1-D, or too small to gain) in one flat fp32 buffer; phase 2 all-reduces
  Qᵢ = Mᵀ·P̂ (P̂ the orthogonalised mean P). Wire bytes: ``2(N − 1)/N × 4·(Σ n₀·r + raw)`` and
  ``2(N − 1)/N × 4·Σ m·r``. Phase 2 needs phase 1's result, so it is launched by
  :meth:`CompressedHandle.advance` from the main thread at a point of the schedule that every
  rank reaches in the same order (launching it from a completion callback could interleave it
  differently with other collectives on different ranks). The algorithms advance at the middle
  of their overlap window (CO2: H/2 inner steps after the launch; Streaming DiLoCo / CoCoDC:
  τ/2), so what blocks is waiting for phase 1 at that point and for phase 2 at the apply point,
  each with half the window to hide in; DiLoCo is blocking anyway. Without an early
  ``advance()``, :meth:`CompressedHandle.wait` runs both phases.

Error feedback (per rank, per tensor; :class:`~lowcomm.compress.feedback.Compressor`): the
tensor sent is M = x + e, and e ← M − C(M) with C(M) this rank's decoded contribution (for
PowerSGD, P̂·Qᵢᵀ with this rank's own Qᵢ; the mean of the contributions is P̂·Q̄ᵀ). Hence, on
every rank, Σ contributions + e = Σ raw inputs, exactly up to fp32 rounding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lowcomm.comm import Communicator, DoneWork, Handle
from lowcomm.compress.flat import FlatLayout
from lowcomm.compress.formats import PowerSGD, orthogonalize
from lowcomm.device import CollectiveTimer, host_wait

__all__ = ["CompressedHandle", "ErrorFeedback", "QuorumMean"]

Work = dist.Work | DoneWork


class QuorumMean(Protocol):
    """What a compressed mean over a changing quorum (elastic syncs) asks before it decodes."""

    def failed(self) -> bool:
        """Whether a collective of the sync failed (a replica left: the sync is voted down and
        what came is not decoded)."""

    def scale(self) -> float:
        """The factor the decoded mean is multiplied by: N / the replicas that contributed
        (a replica healed at this sync's quorum sends zeros and does not count)."""

    def senders(self) -> torch.Tensor:
        """A weight per rank of the quorum, in the all-gather's order: 1 for a replica that
        contributed, 0 for one that did not (a sparse mean over the ranks that sent each
        element leaves the zeros of the latter out)."""


class ErrorFeedback(Protocol):
    """What a :class:`CompressedHandle` reports back to the rank's error-feedback state while it
    finishes (a :class:`lowcomm.compress.feedback.Compressor`): the collectives know no
    residuals, the compressor knows no wire."""

    def record_contribution(self, i: int, m: torch.Tensor, contribution: torch.Tensor) -> None:
        """e ← M − C(M) for tensor ``i``, C(M) this rank's decoded contribution."""

    def set_warm_start(self, i: int, q_mean: torch.Tensor) -> None:
        """PowerSGD: the mean Q of tensor ``i`` starts its next round."""

    def release(self, handle: CompressedHandle) -> None:
        """``handle`` is finished: no mean is in flight any more."""


@dataclass
class GatherGroup:
    """One bucket sent by all-gather: tensor indices and their payload layout."""

    index: list[int]
    layout: FlatLayout  # codecs, and the byte range of each tensor in one rank's payload
    payload: torch.Tensor  # this rank's bytes
    gathered: torch.Tensor  # N × payload, rank order
    work: Work | None = None
    out: torch.Tensor | None = None  # the bucket's flat fp32 values the mean is decoded into
    target: torch.Tensor | None = None  # a flat bucket of another dtype it is then cast into
    copy_back: bool = False  # the mean is copied back into the views (not one bucket)


@dataclass
class LowRankGroup:
    """One bucket sent by PowerSGD: compressed matrices and raw tensors."""

    compressed: list[int]
    raw: list[int]
    codecs: dict[int, PowerSGD]
    m: dict[int, torch.Tensor]  # M = x + e, as (n₀ × m) matrices
    q: dict[int, torch.Tensor]  # the Q this round started from
    flat_p: torch.Tensor  # [P of each compressed matrix, raw tensors]
    work_p: Work | None = None
    p_hat: dict[int, torch.Tensor] = field(default_factory=dict)
    flat_q: torch.Tensor | None = None
    work_q: Work | None = None


def time_launch(timer: CollectiveTimer, work: Work | None) -> None:
    """Mark on ``timer`` the launch of ``work`` if it went on the wire (right after it did, on
    the launching stream): a collective complete at once (one rank) has no time in flight."""
    if work is not None and not isinstance(work, DoneWork):
        timer.launched([work])


class CompressedHandle(Handle):
    """An in-flight compressed mean over a list of tensors (one or two collectives per
    bucket). :meth:`advance` launches PowerSGD's second phase; :meth:`wait` finishes everything,
    writes the mean into the tensors and returns them. Both are idempotent. ``timer``: the
    :class:`~lowcomm.device.CollectiveTimer` the launch marked its collectives on (else they
    are marked here, after the whole encoding)."""

    def __init__(
        self,
        comm: Communicator,
        compressor: ErrorFeedback,
        views: Sequence[torch.Tensor],
        gather: list[GatherGroup],
        low_rank: list[LowRankGroup],
        *,
        t_launch: float | None = None,
        timer: CollectiveTimer | None = None,
    ) -> None:
        super().__init__([], list(views), 1, comm.stats)
        if t_launch is not None:
            self.t_launch = t_launch  # when the first collective went out
        if timer is None:
            timer = CollectiveTimer(self._device or "cpu")
            for work in [g.work for g in gather] + [lr.work_p for lr in low_rank]:
                time_launch(timer, work)
        self._timer = timer
        self.comm = comm
        self.compressor = compressor
        self.views = list(views)
        self.gather = gather
        self.low_rank = low_rank
        self._advanced = not any(g.compressed for g in low_rank)
        self.quorum: QuorumMean | None = None
        """Set by a communicator over a changing quorum (elastic syncs): whether the
        collectives failed (nothing is decoded) and the factor the mean is rescaled by."""
        self._wait_lock = threading.RLock()
        self._watched = 0  # collectives whose completion is timed by a callback
        self._unwatched = 0  # collectives without a future (the quorum's): timed at wait()
        self._t_done: list[float] = []
        for g in gather:
            self._watch(g.work)
        for lr in low_rank:
            self._watch(lr.work_p)

    def _watch(self, work: Work | None) -> None:
        if work is None or isinstance(work, DoneWork):
            return
        try:
            work.get_future().add_done_callback(self._on_done)
        except (RuntimeError, AttributeError):  # backends without futures: timed at wait()
            self._unwatched += 1
            return
        self._watched += 1

    def _on_done(self, _fut: object) -> None:
        with self._lock:
            self._t_done.append(time.perf_counter())

    def _block_on(self, work: Work | None) -> None:
        if work is None:
            return
        t0 = time.perf_counter()
        host_wait([work], self._device)  # the collective alone, not the compute queued before
        self.stats.blocked_s += time.perf_counter() - t0

    @property
    def needs_advance(self) -> bool:
        return not self._advanced and not self._done

    def launch_tensors(self) -> list[torch.Tensor]:
        """Tensors made during the launch (on the launching stream) that :meth:`advance`,
        :meth:`wait` and the decode read: this rank's payloads and the gathered buffers,
        PowerSGD's flat P, M and Q."""
        out = [t for g in self.gather for t in (g.payload, g.gathered)]
        for g in self.low_rank:
            out += [g.flat_p, *g.m.values(), *g.q.values()]
        return out

    def last_phase_future(self) -> torch.futures.Future:
        """Completes when every collective of the last launched phase has (for callers that
        chain work instead of blocking, like the DDP hook)."""
        works: list[Work | None] = [g.work for g in self.gather]
        works += [lr.work_q if lr.compressed else lr.work_p for lr in self.low_rank]
        futs = [w.get_future() for w in works if w is not None]
        return torch.futures.collect_all(futs)

    def advance(self) -> None:
        """PowerSGD phase 2: wait for the P all-reduce, orthogonalise, take this rank's
        Qᵢ = Mᵀ·P̂, update the residual and launch the Q all-reduce."""
        with self._wait_lock:
            if self._advanced:
                return
            self._advanced = True
            n = float(self.comm.world_size)
            for g in self.low_rank:
                if not g.compressed:
                    continue
                self._block_on(g.work_p)
                if self.quorum is not None and self.quorum.failed():
                    continue  # the sync is voted down: no second phase on what did not come
                g.flat_p.div_(n)
                qs = []
                off = 0
                for i in g.compressed:
                    rows, r = g.m[i].shape[0], g.q[i].shape[1]
                    p = g.flat_p[off : off + rows * r].view(rows, r)
                    off += rows * r
                    p_hat = orthogonalize(p)
                    g.p_hat[i] = p_hat
                    q_own = g.m[i].t() @ p_hat
                    self.compressor.record_contribution(i, g.m[i], p_hat @ q_own.t())
                    qs.append(q_own.reshape(-1))
                g.flat_q = torch.cat(qs)
                g.work_q = self.comm.all_reduce_sum_async(g.flat_q)
                time_launch(self._timer, g.work_q)
                self._watch(g.work_q)

    def wait(self) -> list[torch.Tensor]:
        """Finish every phase; the tensors then hold the mean of the ranks' contributions."""
        return self._finish(block=True)

    def finish_completed(self) -> list[torch.Tensor]:
        """Decode a handle whose last phase is known to be complete, without waiting on its
        collectives: for completion callbacks (:meth:`last_phase_future`), where waiting on the
        collective that runs the callback would deadlock."""
        assert self._advanced, "finish_completed() before the second phase was launched"
        return self._finish(block=False)

    def _finish(self, *, block: bool) -> list[torch.Tensor]:
        with self._wait_lock:
            if self._done:
                return self.views
            self.advance()
            n = self.comm.world_size
            if block:
                for g in self.gather:
                    self._block_on(g.work)
                for lr in self.low_rank:
                    self._block_on(lr.work_q if lr.compressed else lr.work_p)
            t1 = time.perf_counter()
            # (not from a completion callback: reading the device timer would block the
            # thread that runs it, on NCCL the one that launched the collective)
            on_device = self._timer.seconds() if block else None
            with self._lock:
                # a callback may still be queued after wait(): completion is then "now"
                if not self._watched and not self._unwatched:
                    t_done = self.t_launch  # nothing went on the wire (one rank)
                elif not self._unwatched and len(self._t_done) == self._watched:
                    t_done = max(self._t_done)
                else:
                    t_done = t1
            if on_device is None:
                on_device = max(0.0, min(t_done, t1) - self.t_launch)
            self.stats.in_flight_s += on_device
            failed = self.quorum is not None and self.quorum.failed()
            scale, senders = 1.0, None
            if self.quorum is not None and not failed:
                scale, senders = self.quorum.scale(), self.quorum.senders()
            with record_function("lowcomm::compress::decode"):
                for g in self.gather if not failed else []:
                    self._decode_gather(g, n, senders, scale)
                for lr in self.low_rank if not failed else []:
                    self._decode_low_rank(lr, n)
            if scale != 1.0 and self.low_rank:  # (the gathered means are scaled as decoded)
                low_rank = [self.views[i] for g in self.low_rank for i in [*g.compressed, *g.raw]]
                torch._foreach_mul_(low_rank, scale)
            self._done = True
            self.compressor.release(self)
            return self.views

    def _decode_gather(
        self, g: GatherGroup, n: int, senders: torch.Tensor | None = None, scale: float = 1.0
    ) -> None:
        assert g.out is not None
        g.layout.decode_mean(g.gathered, n, out=g.out, senders=senders, scale=scale)
        if g.target is not None:
            g.target.copy_(g.out)
        elif g.copy_back:
            views = [self.views[i] for i in g.index]
            parts = g.out.split([v.numel() for v in views])
            torch._foreach_copy_(views, [p.view_as(v) for p, v in zip(parts, views)])

    def _decode_low_rank(self, g: LowRankGroup, n: int) -> None:
        if not g.compressed:
            g.flat_p.div_(float(n))
        off = sum(g.m[i].shape[0] * g.q[i].shape[1] for i in g.compressed)
        for i in g.raw:
            numel = self.views[i].numel()
            self.views[i].copy_(g.flat_p[off : off + numel].view(self.views[i].shape))
            off += numel
        if not g.compressed:
            return
        assert g.flat_q is not None
        g.flat_q.div_(float(n))
        off = 0
        for i in g.compressed:
            cols, r = g.q[i].shape
            q_mean = g.flat_q[off : off + cols * r].view(cols, r)
            off += cols * r
            self.views[i].copy_((g.p_hat[i] @ q_mean.t()).view(self.views[i].shape))
            self.compressor.set_warm_start(i, q_mean)
