"""An emulated slow link around a process group, for experiments and tests.

:class:`EmulatedLink` is a :class:`~lowcomm.comm.Communicator` whose collectives run for real on
the process group but are not reported complete before the link could have carried them: a
collective started at t with w wire bytes completes no earlier than

    start + latency + w / bandwidth,   start = max(t, the time the link is free)

and the link is busy for w / bandwidth from ``start`` (first in, first out; latency is
propagation, so it overlaps with the next transfer). Figures measured through it are emulated
and every report says so.

Example::

    link = EmulatedLink.parse("100mbit:20ms")          # or a profile name: "100mbit"
    algo = lowcomm.CO2(model, inner, sync_every=12, process_group=link.communicator())
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import (
    Communicator,
    all_gather_wire_bytes,
    reduce_scatter_wire_bytes,
    ring_wire_bytes,
)
from lowcomm.device import host_wait

__all__ = ["PROFILES", "EmulatedLink", "LinkModel", "LinkedWork", "wait_until"]

PROFILES: dict[str, tuple[float, float]] = {
    "rdma-800g": (800e9, 5e-6),
    "tcp-80g": (80e9, 50e-6),
    "1gbit": (1e9, 1e-3),
    "100mbit": (100e6, 10e-3),
    "10mbit": (10e6, 30e-3),
    "1mbit": (1e6, 100e-3),
}
"""Link profiles: name → (bandwidth in bits/s, latency in s)."""

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(r"^([0-9]*\.?[0-9]+)([kmgt]?)(bit|bps)$")  # bits per second
_TIME = re.compile(r"^([0-9]*\.?[0-9]+)(us|ms|s)$")
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass
class LinkModel:
    """FIFO completion times of transfers on one link (pure: times are passed in). Threads may
    book transfers on one model (a replica's syncs and a heal it serves in the background)."""

    bandwidth_bps: float
    latency_s: float
    free_at: float = float("-inf")
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def schedule(self, now: float, wire_bytes: int) -> float:
        """Book a transfer of ``wire_bytes`` started at ``now``; return its completion time."""
        with self._lock:
            start = max(now, self.free_at)
            busy = 8.0 * wire_bytes / self.bandwidth_bps
            self.free_at = start + busy
            return start + busy + self.latency_s


_SHARED_LOCK = threading.Lock()


def wait_until(
    done_at: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Sleep until ``clock()`` reaches ``done_at`` (a transfer's completion time on the link);
    at once if it has."""
    delay = done_at - clock()
    if delay > 0:
        sleep(delay)


class EmulatedLink:
    """A link of ``bandwidth_bps`` bits/s and ``latency_s`` seconds (one way), emulated.

    Args:
        bandwidth_bps: link bandwidth in bits per second (> 0).
        latency_s: latency per collective in seconds (≥ 0).
        name: how reports name it (default ``RATE:LATENCY``).
    """

    def __init__(self, bandwidth_bps: float, latency_s: float, *, name: str | None = None) -> None:
        if not bandwidth_bps > 0:
            raise ValueError(f"bandwidth must be > 0 bits/s, got {bandwidth_bps!r}")
        if not latency_s >= 0:
            raise ValueError(f"latency must be >= 0 s, got {latency_s!r}")
        self.bandwidth_bps = float(bandwidth_bps)
        self.latency_s = float(latency_s)
        self.name = name or f"{_fmt_rate(self.bandwidth_bps)}:{self.latency_s * 1e3:g}ms"
        self._shared: LinkModel | None = None

    @classmethod
    def parse(cls, spec: str) -> EmulatedLink:
        """A profile name (see :data:`PROFILES`) or ``RATE:LATENCY`` such as ``100mbit:20ms``."""
        key = spec.strip().lower()
        if key in PROFILES:
            bw, lat = PROFILES[key]
            return cls(bw, lat, name=key)
        rate, _, latency = key.partition(":")
        m_rate, m_time = _RATE.match(rate.strip()), _TIME.match(latency.strip())
        if not m_rate or not m_time:
            raise ValueError(
                f"link {spec!r} is neither a profile ({', '.join(PROFILES)}) nor RATE:LATENCY "
                "such as 100mbit:20ms (rates in bit, kbit, mbit, gbit, tbit; latency in us, ms, s)"
            )
        bw = float(m_rate.group(1)) * _UNITS[m_rate.group(2)]
        lat = float(m_time.group(1)) * _SECONDS[m_time.group(2)]
        if bw <= 0:
            raise ValueError(f"link {spec!r}: the bandwidth must be > 0")
        return cls(bw, lat, name=key)

    def model(self) -> LinkModel:
        """A fresh completion-time model of this link."""
        return LinkModel(self.bandwidth_bps, self.latency_s)

    def shared_model(self) -> LinkModel:
        """The one completion-time model of this link that everything of this process going
        through it books on (an elastic replica's syncs and the heals it sends or receives:
        they queue behind each other, as on one network link)."""
        with _SHARED_LOCK:
            if self._shared is None:
                self._shared = self.model()
            return self._shared

    def communicator(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> EmulatedCommunicator:
        """A communicator on ``process_group`` whose collectives go through this link."""
        return EmulatedCommunicator(self, process_group, clock=clock, sleep=sleep)

    def __repr__(self) -> str:
        return f"EmulatedLink({self.name}, emulated)"


class _EmulatedWork:
    """A collective that completes when the real one has and the link could have carried it."""

    def __init__(self, future: torch.futures.Future) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class LinkedWork:
    """A collective (``real``) that completes no earlier than ``done_at`` (a time of ``clock``),
    without a thread: :meth:`wait` waits for the real one, then sleeps what is left. For
    collectives whose handles must be waited on the caller's thread (torchft's Manager, whose
    works record their own failures when waited on); it has no future, so a handle times it
    at its wait."""

    def __init__(
        self,
        real: Any,
        done_at: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.real = real
        self.done_at = done_at
        self._clock = clock
        self._sleep = sleep

    def wait(self, *args: Any) -> bool:
        self.real.wait(*args)
        wait_until(self.done_at, self._clock, self._sleep)
        return True

    def is_completed(self) -> bool:
        return bool(self.real.is_completed()) and self._clock() >= self.done_at


class _AllOf:
    """Several works waited for as one."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class EmulatedCommunicator(Communicator):
    """A :class:`~lowcomm.comm.Communicator` whose collectives complete on the emulated link.

    A link thread takes collectives in launch order (FIFO), waits for the real one, then sleeps
    until the model's completion time and marks it complete. On a GPU it waits for the real
    collective to have run on the device (:func:`lowcomm.device.host_wait`), not only to be
    queued: a transfer never completes before the real one, and the waiter, which then waits
    on the host alone, may use the result on any stream. Each collective occupies the link
    for its wire bytes per rank: a ring all-reduce ``2 (N - 1) / N`` x payload, an all-gather
    (compressed payloads, sharded anchors) ``(N - 1)`` x payload, a reduce-scatter
    ``(N - 1) / N`` x payload, a group exchange (NoLoCo) ``(n - 1)`` x payload for a group of n.
    """

    def __init__(
        self,
        link: EmulatedLink,
        process_group: dist.ProcessGroup | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(process_group)
        self.link = link
        self.model = link.model()
        self._clock = clock
        self._sleep = sleep
        self._queue: list[tuple[float, dist.Work, torch.device, torch.futures.Future]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def _launch(self, tensor: torch.Tensor) -> dist.Work:
        real = super()._launch(tensor)
        wire = ring_wire_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        return self._through_link(real, wire, tensor.device)

    def _launch_all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        real = super()._launch_all_gather(out, tensor)
        wire = all_gather_wire_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        return self._through_link(real, wire, tensor.device)

    def _launch_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        real = super()._launch_reduce_scatter(out, tensor)
        wire = reduce_scatter_wire_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        return self._through_link(real, wire, tensor.device)

    def _launch_exchange(self, ops: list[dist.P2POp], wire_bytes: int) -> list[dist.Work]:
        # the sends and receives of one exchange occupy the link together, for what this
        # rank sends
        real = _AllOf(super()._launch_exchange(ops, wire_bytes))
        device = ops[0].tensor.device if ops else torch.device("cpu")
        return [self._through_link(real, wire_bytes, device)]  # type: ignore[arg-type]

    def _through_link(self, real: dist.Work, wire: int, device: torch.device) -> dist.Work:
        """Complete ``real`` (on tensors on ``device``) no earlier than the link could have
        carried ``wire`` bytes."""
        done_at = self.model.schedule(self._clock(), wire)
        fut: torch.futures.Future = torch.futures.Future()
        with self._cv:
            self._queue.append((done_at, real, device, fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lowcomm-link", daemon=True)
                self._thread.start()
            self._cv.notify()
        return _EmulatedWork(fut)  # type: ignore[return-value]

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                done_at, real, device, fut = self._queue.pop(0)
            try:
                host_wait([real], device)
                wait_until(done_at, self._clock, self._sleep)
                fut.set_result(None)
            except Exception as e:  # surface the collective's failure to the waiter
                fut.set_exception(e)


def _fmt_rate(bps: float) -> str:
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"
