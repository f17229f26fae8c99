"""A communicator that records the schedule of launches and waits, for schedule assertions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import CommStats, Communicator, Handle

__all__ = ["RecordingCommunicator"]


class _RecordingWork:
    """Wraps a ``dist.Work`` so that ``wait()`` is logged with the caller's clock."""

    def __init__(self, work: dist.Work, log: Callable[[str], None]) -> None:
        self._work = work
        self._log = log

    def wait(self) -> Any:
        self._log("wait")
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


class _RecordingHandle(Handle):
    """A compressed mean's handle whose later phases are logged under its own id."""

    def __init__(self, inner: Handle, comm: RecordingCommunicator, handle_id: int) -> None:
        super().__init__([], inner.buffers, 1, CommStats())
        self._inner = inner
        self._comm = comm
        self._id = handle_id

    @property
    def needs_advance(self) -> bool:
        return self._inner.needs_advance

    def advance(self) -> None:
        with self._comm._labelled(self._id):
            self._inner.advance()

    def wait(self) -> list[torch.Tensor]:
        with self._comm._labelled(self._id):
            return self._inner.wait()


class RecordingCommunicator(Communicator):
    """A :class:`~lowcomm.comm.Communicator` over a real process group that logs every
    collective launch and every wait as ``(event, handle_id, clock())``. A compressed mean's
    collectives (all-gathers, or PowerSGD's two all-reduces) share its handle id.

    ``clock`` is set by the test, typically ``lambda: algo.local_step``, so the log says at
    which inner step each event happened.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(process_group)
        self.events: list[tuple[str, int, int]] = []
        self.clock: Callable[[], int] = lambda: -1
        self._launched = 0
        self._current_id = -1

    def all_reduce_mean_async(self, buffers: list[torch.Tensor]) -> Handle:
        outer = self._current_id
        self._current_id = self._launched
        self._launched += 1
        try:
            return super().all_reduce_mean_async(buffers)
        finally:
            # an all-reduce nested in a compressed launch (L-GreCo's statistics) must not
            # relabel the compressed collectives launched after it
            self._current_id = outer

    def compressed_mean_async(self, buckets: Any, compressor: Any, *, own: Any = None) -> Handle:
        handle_id = self._current_id = self._launched
        self._launched += 1
        inner = super().compressed_mean_async(buckets, compressor, own=own)
        return _RecordingHandle(inner, self, handle_id)

    @contextlib.contextmanager
    def _labelled(self, handle_id: int) -> Iterator[None]:
        outer, self._current_id = self._current_id, handle_id
        try:
            yield
        finally:
            self._current_id = outer

    def _launch_all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        return self._record(super()._launch_all_gather(out, tensor))

    def _launch(self, tensor: torch.Tensor) -> dist.Work:
        return self._record(super()._launch(tensor))

    def _record(self, work: dist.Work) -> dist.Work:
        handle_id = self._current_id
        self.events.append(("launch", handle_id, self.clock()))

        def log(event: str) -> None:
            self.events.append((event, handle_id, self.clock()))

        return _RecordingWork(work, log)  # type: ignore[return-value]
