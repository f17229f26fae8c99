"""Communication counters (defined in :mod:`lowcomm.comm`'s docstring): the bytes each
collective puts on the wire per rank, the per-worker :class:`CommStats`, and
:class:`DDPCommMeter`, which counts a ``DistributedDataParallel`` model's own gradient
all-reduces the same way."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from lowcomm.device import device_future, host_wait

__all__ = [
    "BlockedTimer",
    "CommStats",
    "DDPCommMeter",
    "all_gather_wire_bytes",
    "exchange_wire_bytes",
    "reduce_scatter_wire_bytes",
    "ring_wire_bytes",
]


def ring_wire_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``payload_bytes``: 2 (N - 1) / N x payload."""
    if world_size <= 1:
        return 0
    return int(round(2 * (world_size - 1) * payload_bytes / world_size))


def reduce_scatter_wire_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring reduce-scatter of ``payload_bytes`` (the full input):
    (N - 1) / N x payload, half a ring all-reduce."""
    if world_size <= 1:
        return 0
    return payload_bytes * (world_size - 1) // world_size


def all_gather_wire_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-gather of ``payload_bytes`` each: (N - 1) x payload."""
    if world_size <= 1:
        return 0
    return (world_size - 1) * payload_bytes


def exchange_wire_bytes(payload_bytes: int, group_size: int) -> int:
    """Bytes each member sends in a group exchange of ``payload_bytes`` each (every member
    sends its tensor to every other member): (n - 1) x payload, whatever the world size."""
    return max(0, group_size - 1) * payload_bytes


@dataclass
class CommStats:
    """Per-worker communication counters. See :mod:`lowcomm.comm`'s docstring for the
    definitions."""

    collectives: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    blocked_s: float = 0.0
    in_flight_s: float = 0.0

    @property
    def hidden_fraction(self) -> float | None:
        """``1 - blocked / in_flight``; ``None`` before anything was communicated."""
        if self.in_flight_s <= 0.0:
            return None
        return min(1.0, max(0.0, 1.0 - self.blocked_s / self.in_flight_s))

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = asdict(self)
        out["hidden_fraction"] = self.hidden_fraction
        return out

    def metrics(self) -> dict[str, float | int | None]:
        """The counters under the names loggers show: ``bytes_sent`` and ``bytes_received``
        (wire bytes: every collective lowcomm runs, ring all-reduce, all-gather,
        reduce-scatter and group exchange, receives as much as it sends), ``payload_bytes``,
        ``blocked_s``, ``in_flight_s`` and ``hidden_fraction``."""
        return {
            "bytes_sent": self.wire_bytes,
            "bytes_received": self.wire_bytes,
            "payload_bytes": self.payload_bytes,
            "blocked_s": self.blocked_s,
            "in_flight_s": self.in_flight_s,
            "hidden_fraction": self.hidden_fraction,
        }


class _LinkSchedule(Protocol):
    def schedule(self, now: float, wire_bytes: int) -> float: ...


class BlockedTimer:
    """The time a step is blocked at the end of backward: from the last bucket's launch until
    backward returns. On the CPU the host's clock (it waits there). On a GPU the host does not
    wait (backward only queues work): the device's time from the launch to the end of what
    backward queued, by CUDA events that are read once complete — at a later step, or at
    :meth:`settle` — never waited for inside a step."""

    def __init__(self) -> None:
        self._launch: float | None = None
        self._event: torch.cuda.Event | None = None
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def launched(self, device: torch.device) -> None:
        """A bucket was launched (the last one of a step is what counts)."""
        self._launch = time.perf_counter()
        if device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record(torch.cuda.current_stream(device))

    def backward_done(self, stats: CommStats) -> None:
        """Backward returned: count the time since the last launch into ``stats``."""
        if self._event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._event, end))
            self._event = self._launch = None
            self._count(stats, wait=False)
        elif self._launch is not None:
            stats.blocked_s += max(0.0, time.perf_counter() - self._launch)
            self._launch = None

    def settle(self, stats: CommStats) -> None:
        """Count every step's time still measured on the device (waits for it)."""
        self._count(stats, wait=True)

    def _count(self, stats: CommStats, *, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][1].query()):
            start, end = self._pending.popleft()
            end.synchronize()
            stats.blocked_s += max(0.0, start.elapsed_time(end) / 1e3)


class DDPCommMeter:
    """Counts the gradient all-reduces of a ``DistributedDataParallel`` model, for comparison.

    Registers a communication hook that does what DDP's default hook does (divide by N, then
    all-reduce SUM asynchronously) and records payload and ring wire bytes, and each bucket's
    time in flight. DDP overlaps bucket all-reduces with the rest of backward; after the last
    bucket is launched backward only waits, so the time blocked is measured as the time from the
    last launch until ``backward()`` returns: call :meth:`backward_done` right after it. With
    ``link`` (a :class:`lowcomm.link.LinkModel`) each bucket completes no earlier than the
    emulated link could have carried it: a thread of the meter's own waits for each bucket's
    all-reduce (on a GPU until it has run on the device), sleeps until the link's completion
    time and then completes the future DDP waits for, so that backward goes on meanwhile.
    """

    def __init__(self, *, link: _LinkSchedule | None = None) -> None:
        self.stats = CommStats()
        self.link = link
        self._blocked = BlockedTimer()
        self._world_size = 1
        self._group: dist.ProcessGroup | None = None
        self._queue: deque[tuple[dist.Work, torch.Tensor, float, float, torch.futures.Future]]
        self._queue = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        self._group = ddp_model.process_group
        self._world_size = dist.get_world_size(self._group)
        ddp_model.register_comm_hook(self, DDPCommMeter._hook)

    # No annotations: DDP's register_comm_hook compares them with the real types, and this
    # module's postponed (string) annotations would not compare equal.
    @staticmethod
    def _hook(meter, bucket):
        tensor = bucket.buffer()
        n = meter._world_size
        payload = tensor.numel() * tensor.element_size()
        meter.stats.collectives += 1
        meter.stats.payload_bytes += payload
        meter.stats.wire_bytes += ring_wire_bytes(payload, n)
        tensor.div_(n)
        t_launch = time.perf_counter()
        meter._blocked.launched(tensor.device)
        done_at = None
        if meter.link is not None:
            done_at = meter.link.schedule(time.monotonic(), ring_wire_bytes(payload, n))
        work = dist.all_reduce(tensor, group=meter._group, async_op=True)
        if done_at is not None:
            return meter._through_link(work, tensor, t_launch, done_at)

        def _done(f: torch.futures.Future) -> torch.Tensor:
            meter.stats.in_flight_s += time.perf_counter() - t_launch
            return f.value()[0]

        return work.get_future().then(_done)

    def _through_link(
        self, work: dist.Work, tensor: torch.Tensor, t_launch: float, done_at: float
    ) -> torch.futures.Future:
        """A future completed with ``tensor`` by the meter's link thread, no earlier than
        ``done_at`` (``time.monotonic``) and than the all-reduce itself. Not a callback of the
        all-reduce's own future: on NCCL that runs at once, when the collective is queued,
        in the thread that launched it (backward's), which the sleep would then block."""
        fut = device_future(tensor)
        with self._cv:
            self._queue.append((work, tensor, t_launch, done_at, fut))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run_link, name="lowcomm-ddp-link", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        return fut

    def _run_link(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                work, tensor, t_launch, done_at, fut = self._queue.popleft()
            try:
                host_wait([work], tensor.device)
                delay = done_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # not complete before the link could have carried it
                self.stats.in_flight_s += time.perf_counter() - t_launch
                fut.set_result(tensor)
            except Exception as e:  # surface the collective's failure to DDP
                fut.set_exception(e)

    def backward_done(self) -> None:
        """Record the time blocked at the end of this step's backward (:class:`BlockedTimer`:
        on a GPU by events, read later; nothing waits here)."""
        self._blocked.backward_done(self.stats)

    def settle(self) -> None:
        """Count the blocked time still measured on the device (before reading ``stats``)."""
        self._blocked.settle(self.stats)
