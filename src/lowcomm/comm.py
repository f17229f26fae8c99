"""Communication layer: flat fp32 buckets, asynchronous all-reduce on a process group, counters.

Every algorithm in lowcomm sends through a :class:`Communicator`. It flattens tensors into a
few contiguous fp32 buckets (one collective per bucket, never one per parameter), launches
``all_reduce(SUM)`` asynchronously and divides by the group size when the caller waits, which is
reproducible on every backend. Algorithms own the buckets they pass in: a collective never
writes into live parameters.

Counters (:class:`CommStats`), per worker:

* ``payload_bytes``: bytes this rank hands to collectives (for compressed collectives, the
  compressed bytes it contributes: payloads, scales and indices);
* ``wire_bytes``: what the collective puts on the wire per rank: a ring all-reduce
  ``2 (N - 1) / N`` x payload, a ring all-gather ``(N - 1)`` x payload (each rank forwards the
  N - 1 other ranks' chunks);
* ``blocked_s``: time spent blocked in :meth:`Handle.wait`;
* ``in_flight_s``: time from launch to completion of each collective, summed;
* ``hidden_fraction``: ``1 - blocked / in_flight``, the share of communication time that was
  overlapped with compute.

The buckets are :mod:`lowcomm.buckets`'s, the counters and the wire bytes of each collective
:mod:`lowcomm.counters`' (all importable from here).

Example::

    comm = Communicator()                      # WORLD
    buckets = FlatBuckets.for_tensors(list(model.parameters()))
    buckets.copy_from(list(model.parameters()))
    handle = comm.all_reduce_mean_async(buckets.buffers)
    ...                                        # keep computing
    handle.wait()                              # buckets now hold the mean over ranks
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from lowcomm.buckets import DEFAULT_BUCKET_CAP_MB, FlatBuckets, storage_nbytes
from lowcomm.counters import (
    CommStats,
    DDPCommMeter,
    all_gather_wire_bytes,
    exchange_wire_bytes,
    reduce_scatter_wire_bytes,
    ring_wire_bytes,
)
from lowcomm.device import CollectiveTimer, collective_device, host_wait

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "host_store",
    "CommStats",
    "Communicator",
    "CompressedLauncher",
    "DDPCommMeter",
    "DoneWork",
    "FlatBuckets",
    "GroupMeanHandle",
    "Handle",
    "all_gather_wire_bytes",
    "exchange_wire_bytes",
    "reduce_scatter_wire_bytes",
    "ring_wire_bytes",
    "set_busy_wait",
    "spin_barrier",
    "storage_nbytes",
]

_BUSY_WAIT = False


def set_busy_wait(enabled: bool) -> None:
    """Make :meth:`Handle.wait` poll its collectives instead of sleeping in ``wait()``.

    For measurements with more workers than CPU cores: a worker sleeping in a collective gives
    its share of the cores to the others, which then run faster than they would on a device of
    their own; polling keeps every worker's share constant (one device per worker, emulated).
    """
    global _BUSY_WAIT
    _BUSY_WAIT = bool(enabled)


def _spin(works: Sequence[Any]) -> None:
    while not all(w.is_completed() for w in works):
        pass


def spin_barrier(group: dist.ProcessGroup | None = None) -> None:
    """A barrier (a one-element all-reduce) that polls when :func:`set_busy_wait` is on."""
    flag = torch.zeros(1, device=collective_device(group))  # NCCL takes GPU tensors only
    work = dist.all_reduce(flag, group=group, async_op=True)
    if _BUSY_WAIT:
        _spin([work])
    work.wait()


class Handle:
    """An in-flight mean all-reduce over a list of buffers. :meth:`wait` is idempotent.

    Its time in flight is the device's (:class:`~lowcomm.device.CollectiveTimer`) for the
    process group's own collectives on a GPU, whose futures complete when they are queued;
    elsewhere (the CPU, an emulated link) from launch to the futures' completion."""

    _device_timed: ClassVar[bool] = True
    """Whether its works may be timed on the device (waited on a timing stream at launch)."""

    def __init__(
        self,
        works: Sequence[dist.Work | DoneWork],
        buffers: list[torch.Tensor],
        divisor: int,
        stats: CommStats,
    ) -> None:
        self.works = works
        self.buffers = buffers
        self.divisor = divisor
        self.stats = stats
        self.t_launch = time.perf_counter()
        self._t_done: list[float] = []
        self._lock = threading.Lock()
        self._done = False
        self._device = buffers[0].device if buffers else None
        self._timer = CollectiveTimer(self._device or "cpu")
        if self._device_timed:
            self._timer.launched(works)
        for w in works:
            # Backends without futures are timed at wait() instead.
            with contextlib.suppress(RuntimeError, AttributeError):
                w.get_future().add_done_callback(self._on_done)

    def _on_done(self, _fut: object) -> None:
        with self._lock:
            self._t_done.append(time.perf_counter())

    def wait(self) -> list[torch.Tensor]:
        """Block until every bucket is reduced; divide by the group size; return the buffers."""
        if self._done:
            return self.buffers
        t0 = time.perf_counter()
        if _BUSY_WAIT:
            _spin(self.works)
        # on a GPU the host waits for the collectives alone, not for the compute queued
        # before this wait (which would count as time blocked)
        host_wait(self.works, self._device)
        t1 = time.perf_counter()
        on_device = self._timer.seconds()
        with self._lock:
            # A callback may still be queued when wait() returns; completion is then "now".
            t_done = max(self._t_done) if len(self._t_done) == len(self.works) else t1
        if self.divisor > 1:
            torch._foreach_div_(self.buffers, float(self.divisor))
        self.stats.blocked_s += t1 - t0
        if on_device is None:
            on_device = max(0.0, min(t_done, t1) - self.t_launch)
        self.stats.in_flight_s += on_device
        self._done = True
        return self.buffers

    def launch_tensors(self) -> list[torch.Tensor]:
        """Tensors made while the collective was launched (on the launching stream) that
        :meth:`wait` reads: to be handed over to the stream that waits
        (:meth:`lowcomm.device.CommStream.apply`). None for a plain all-reduce, whose buffers
        are its caller's."""
        return []

    @property
    def needs_advance(self) -> bool:
        """Whether :meth:`advance` would launch a second collective (two-phase compressed
        collectives such as PowerSGD's; never for a plain all-reduce)."""
        return False

    def advance(self) -> None:
        """Launch the next phase of a multi-phase collective, waiting for the first if needed.
        A no-op for single-phase collectives; :meth:`wait` advances by itself. Callers that
        advance early must do so at the same point of the schedule on every rank."""


class DoneWork:
    """A collective that has already completed (world size 1, or restored from a checkpoint)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


class GroupMeanHandle(Handle):
    """An in-flight group mean (:meth:`Communicator.group_mean_async`): on :meth:`wait` the
    buffers receive the members' tensors summed in rank order, then divided by the group size
    (the same bits on every member)."""

    def __init__(
        self,
        works: Sequence[dist.Work | DoneWork],
        buffers: list[torch.Tensor],
        members: dict[int, list[torch.Tensor]],
        stats: CommStats,
    ) -> None:
        super().__init__(works, buffers, 1, stats)
        self.members = members
        """The members' tensors by rank, in rank order (this rank's are ``buffers``)."""

    def wait(self) -> list[torch.Tensor]:
        if self._done:
            return self.buffers
        super().wait()
        ranks = sorted(self.members)
        for b, own in enumerate(self.buffers):
            total = self.members[ranks[0]][b]  # this rank's buffer, or a scratch copy received
            for r in ranks[1:]:
                total.add_(self.members[r][b])
            if total is not own:
                own.copy_(total)
            own.div_(float(len(ranks)))
        return self.buffers


class CompressedLauncher(Protocol):
    """What :meth:`Communicator.compressed_mean_async` launches through: compresses tensors with
    this rank's state and starts their collectives on a communicator (a
    :class:`lowcomm.compress.feedback.Compressor`). The transport knows no codec: compression
    is built on top of it."""

    def launch(
        self,
        comm: Communicator,
        views: Sequence[torch.Tensor],
        groups: Sequence[Sequence[int]],
        *,
        own: Sequence[torch.Tensor] | None = None,
        flat: Sequence[torch.Tensor] | None = None,
        own_flat: Sequence[torch.Tensor] | None = None,
    ) -> Handle: ...


class Communicator:
    """Mean all-reduce of flat buckets on one process group, with counters.

    Args:
        process_group: the group to reduce over; ``None`` means WORLD. Passing a subgroup is how
            hierarchical set-ups run lowcomm across nodes and DDP inside them.

    Subclasses may override :meth:`_launch` (one async collective on one tensor) to instrument
    or emulate the transport; everything else stays the same.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) before creating a lowcomm algorithm "
                "(or launch with torchrun / `lowcomm train`)"
            )
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ValueError(
                "this rank is not a member of process_group; create the algorithm only on the "
                "ranks of the group it should average over"
            )
        self.stats = CommStats()

    def _launch(self, tensor: torch.Tensor) -> dist.Work:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        return work

    def _launch_all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        """One async all-gather of ``tensor`` (the same size on every rank) into ``out``
        (N x its size, rank order). Subclasses override it as they do :meth:`_launch`."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, tensor, group=self.group, async_op=True)
        assert work is not None
        return work

    def _launch_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        """One async SUM reduce-scatter of ``tensor`` (N x ``out``'s size) into ``out`` (this
        rank's chunk, rank order). Subclasses override it as they do :meth:`_launch`."""
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = scatter(out, tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        return work

    def reduce_scatter_mean_async(
        self, inputs: Sequence[torch.Tensor], outputs: list[torch.Tensor]
    ) -> Handle:
        """Launch one SUM reduce-scatter per input (N x its output's size): rank r's output
        receives chunk r of the sum; :meth:`Handle.wait` divides by N. Counted: each input as
        payload, (N - 1) / N of it on the wire."""
        assert len(inputs) == len(outputs)
        payload = sum(t.numel() * t.element_size() for t in inputs)
        self.stats.collectives += len(inputs)
        self.stats.payload_bytes += payload
        self.stats.wire_bytes += sum(
            reduce_scatter_wire_bytes(t.numel() * t.element_size(), self.world_size) for t in inputs
        )
        works: list[dist.Work | DoneWork] = []
        for inp, out in zip(inputs, outputs):
            assert inp.numel() == out.numel() * self.world_size and inp.dtype == out.dtype
            if self.world_size == 1:
                out.copy_(inp)
                works.append(DoneWork())
            else:
                works.append(self._launch_reduce_scatter(out, inp))
        return Handle(works, outputs, self.world_size, self.stats)

    def all_gather_into_async(
        self, shards: Sequence[torch.Tensor], outputs: list[torch.Tensor]
    ) -> Handle:
        """Launch one all-gather per shard into its output (N x the shard's size, rank
        order); a :class:`Handle` with nothing to divide."""
        works = [self.all_gather_async(s, o) for s, o in zip(shards, outputs)]
        return Handle(works, outputs, 1, self.stats)

    def all_reduce_sum_async(self, tensor: torch.Tensor) -> dist.Work | DoneWork:
        """Launch one SUM all-reduce of ``tensor`` in place (counted: ring wire bytes)."""
        payload = tensor.numel() * tensor.element_size()
        self.stats.collectives += 1
        self.stats.payload_bytes += payload
        self.stats.wire_bytes += ring_wire_bytes(payload, self.world_size)
        if self.world_size == 1:
            return DoneWork()
        return self._launch(tensor)

    def all_gather_async(self, tensor: torch.Tensor, out: torch.Tensor) -> dist.Work | DoneWork:
        """Launch one all-gather of ``tensor`` into ``out`` (counted: ``tensor``'s bytes as
        payload, (N - 1) x payload on the wire)."""
        assert out.numel() == tensor.numel() * self.world_size and out.dtype == tensor.dtype
        payload = tensor.numel() * tensor.element_size()
        self.stats.collectives += 1
        self.stats.payload_bytes += payload
        self.stats.wire_bytes += all_gather_wire_bytes(payload, self.world_size)
        if self.world_size == 1:
            out.copy_(tensor.reshape(-1))
            return DoneWork()
        return self._launch_all_gather(out, tensor)

    def _launch_exchange(self, ops: list[dist.P2POp], wire_bytes: int) -> list[dist.Work]:
        """Launch point-to-point sends and receives together (``wire_bytes``: what this rank
        sends). Subclasses override it as they do :meth:`_launch`."""
        return list(dist.batch_isend_irecv(ops))

    def group_mean_async(
        self,
        buffers: list[torch.Tensor],
        members: Sequence[int],
        recv: Sequence[list[torch.Tensor]],
    ) -> GroupMeanHandle:
        """Launch the mean of ``buffers`` over ``members`` (ranks of this communicator's group,
        this rank among them) by point-to-point exchange: this rank sends its buffers to every
        other member and receives theirs into ``recv`` (one list of buffers per other member,
        in rank order). No other rank takes part. Counted: each bucket one collective, its
        bytes as payload, (n - 1) x payload on the wire; :meth:`GroupMeanHandle.wait` leaves
        the mean in ``buffers``."""
        ranks = sorted(set(members))
        assert self.rank in ranks, "this rank must be a member of its own group"
        peers = [r for r in ranks if r != self.rank]
        assert len(recv) >= len(peers)
        payload = sum(b.numel() * b.element_size() for b in buffers)
        wire = exchange_wire_bytes(payload, len(ranks))
        self.stats.collectives += len(buffers)
        self.stats.payload_bytes += payload
        self.stats.wire_bytes += wire
        tensors = {self.rank: buffers, **{p: list(recv[i]) for i, p in enumerate(peers)}}
        if not peers:
            return GroupMeanHandle([DoneWork()], buffers, tensors, self.stats)
        ops = []
        for b, own in enumerate(buffers):
            for p in peers:
                # one tag per bucket: a pair of ranks matches its messages bucket by bucket
                ops.append(dist.P2POp(dist.isend, own, group=self.group, group_peer=p, tag=b))
                into = tensors[p][b]
                ops.append(dist.P2POp(dist.irecv, into, group=self.group, group_peer=p, tag=b))
        works: list[dist.Work | DoneWork] = list(self._launch_exchange(ops, wire))
        return GroupMeanHandle(works, buffers, tensors, self.stats)

    def all_reduce_mean_async(self, buffers: list[torch.Tensor]) -> Handle:
        """Launch SUM all-reduces over ``buffers`` (in place); :meth:`Handle.wait` divides by N."""
        payload = sum(b.numel() * b.element_size() for b in buffers)
        self.stats.collectives += len(buffers)
        self.stats.payload_bytes += payload
        self.stats.wire_bytes += ring_wire_bytes(payload, self.world_size)
        works: list[dist.Work | DoneWork]
        if self.world_size == 1:
            works = [DoneWork() for _ in buffers]
        else:
            works = [self._launch(b) for b in buffers]
        return Handle(works, buffers, self.world_size, self.stats)

    def all_reduce_mean(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Blocking mean all-reduce (counted the same way)."""
        return self.all_reduce_mean_async(buffers).wait()

    def compressed_mean_async(
        self,
        buckets: FlatBuckets,
        compressor: CompressedLauncher,
        *,
        own: FlatBuckets | None = None,
    ) -> Handle:
        """Launch the compressed mean of ``buckets`` (one collective per bucket, or two for
        PowerSGD; see :mod:`lowcomm.compress.collectives`); after :meth:`Handle.wait` the
        buckets hold the mean of every rank's decoded contribution. ``compressor`` holds this
        rank's error-feedback residuals. ``own``, if given, receives this rank's decoded
        contribution (eager updates). Counted in :attr:`stats` with the compressed bytes."""
        return compressor.launch(
            self,
            buckets.views,
            buckets.groups(),
            flat=buckets.buffers,
            own_flat=None if own is None else own.buffers,
        )

    def completed(self, buffers: list[torch.Tensor]) -> Handle:
        """A handle whose result is already in ``buffers`` (restored from a checkpoint)."""
        h = Handle([DoneWork() for _ in buffers], buffers, 1, CommStats())
        h.wait()
        return h


def host_store(host: str, port: int = 0, **kwargs: Any) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host`` only, at ``port`` (0: a free port; read it
    back from ``store.port``); ``TCPStore(is_master=True)`` alone listens on every interface.
    ``kwargs`` go to ``TCPStore`` (``timeout``, ``multi_tenant``)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        store = dist.TCPStore(
            host,
            int(listener.getsockname()[1]),
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
            **kwargs,
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now and closes it
    return store
