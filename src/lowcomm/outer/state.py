"""What the engine keeps and reports (a base of the engine): ``state_dict()`` and
``load_state_dict()`` (checkpoints, and what a healing donor sends), the bytes it holds
(``memory_report()``) and its numbers for loggers (``metrics()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lowcomm.comm import Communicator, storage_nbytes
from lowcomm.compress.feedback import Compressor
from lowcomm.device import CommStream
from lowcomm.guard import Description
from lowcomm.outer.fragment import AnyFragment, Sync
from lowcomm.outer.hparams import OuterConfig
from lowcomm.outer.pace import Pace

__all__ = ["EngineState"]


class EngineState:
    """State and reports, over the engine's attributes (see the module docstring)."""

    name: ClassVar[str]
    _flat_state: ClassVar[bool]
    config: OuterConfig
    comm: Communicator
    comm_stream: CommStream
    fragments: list[AnyFragment]
    pace: Pace | None
    sync_every: int
    warmup: int
    overlap: int
    interval: int
    num_fragments: int
    local_step: int
    rounds: int
    sync_points: int
    skipped_updates: int
    _pg_norm: torch.Tensor | None
    _in_flight: dict[int, int]
    _to_advance: list[tuple[int, Sync]]
    _unchecked: Description | None
    _warm_compressors: list[Compressor]

    if TYPE_CHECKING:

        @property
        def fragment(self) -> AnyFragment: ...

        @property
        def world_size(self) -> int: ...

        def _compressors(self) -> list[Compressor]: ...

        def _end_warmup(self) -> None: ...

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
        if not _healing:
            # an algorithm already in use: what it has in flight finishes before the buffers
            # are refilled (every rank launched it, so every rank can wait for it here); a
            # healing replica's collectives in flight belong to the quorum that failed
            for frag in self.fragments:
                frag.wait_in_flight()
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
        self.comm_stream.drain()  # what was in flight is dropped (or restored, complete)
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
