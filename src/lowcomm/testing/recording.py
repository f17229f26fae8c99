"""A communicator that records the schedule of launches and waits, for schedule assertions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import Communicator, Handle

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


class RecordingCommunicator(Communicator):
    """A :class:`~lowcomm.comm.Communicator` over a real process group that logs every
    collective launch and every wait as ``(event, handle_id, clock())``.

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
        self._current_id = self._launched
        self._launched += 1
        return super().all_reduce_mean_async(buffers)

    def _launch(self, tensor: torch.Tensor) -> dist.Work:
        handle_id = self._current_id
        self.events.append(("launch", handle_id, self.clock()))

        def log(event: str) -> None:
            self.events.append((event, handle_id, self.clock()))

        return _RecordingWork(super()._launch(tensor), log)  # type: ignore[return-value]
