"""Fragments: the pieces of the model the outer engine synchronises, with one interface whether
their outer state is whole on every rank (:class:`Fragment`) or sharded (:class:`ShardedFragment`).

A fragment holds parameters θ, their anchor A (fp32 flat buckets, bit-identical on every rank
after each sync) and the outer state stepped on A (:class:`OuterState`). A sync has two phases
(torchft's ``prepare_sync`` / ``perform_sync``): ``launch`` puts Δ = A − θ (LocalSGD: θ) in a
send buffer and starts the collective; ``complete`` waits for the oldest sync in flight and
hands its average to the engine (``engine.on_average``: check, update A), returning whether it
was applied; the engine then merges A into θ.

Sharded (ZeRO-style) each rank keeps 1/N of A and of the outer state: buckets are padded to a
multiple of N and rank r owns chunk r of each. Launch reduce-scatters θ (with a 4-byte count of
ranks whose θ is not finite); the second phase, halfway to the apply step, forms the owner's
chunk of Δ̄ = A_ref − θ̄, steps the outer state on it and all-gathers the new anchor. A_ref is
the anchor θ was last merged from: this rank's chunk, or, when the next sync launches before
the last applies (CO2), the chunk from before that update, kept in one more chunk. Same bytes
on the wire as one ring all-reduce; results equal the unsharded ones up to rounding.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lowcomm.comm import Communicator, FlatBuckets, Handle
from lowcomm.compress.codecs import Codec
from lowcomm.compress.feedback import Compressor, load_compression_state
from lowcomm.compress.lgreco import LGreCo
from lowcomm.device import CommStream, Launch
from lowcomm.guard import HostFlags, finite_flag, optimizer_settings, optimizer_state_tensors
from lowcomm.outer.functional import flat_norm, pseudo_gradient_, pseudo_gradient_norm
from lowcomm.params import load_tensors

__all__ = [
    "AnyFragment",
    "Engine",
    "Fragment",
    "OptimizerState",
    "OuterState",
    "ShardedFragment",
    "Sync",
]

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
Scale = Callable[[list[torch.Tensor], torch.optim.Optimizer], None]


class OuterState(Protocol):
    """The outer update of one fragment and the state it keeps, over the anchor tensors it was
    built for (per-parameter views, or this rank's chunks when sharded)."""

    def step(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def settings(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class OptimizerState:
    """An outer ``torch.optim.Optimizer`` built by ``factory`` over the anchor tensors, stepped
    with ``A.grad = Δ̄`` (DiLoCo, Streaming DiLoCo); ``scale(Δ̄, optimizer)`` may rescale Δ̄ in
    place and set the optimizer's lr first (SlowMo); a ``lr_factor()`` that returns a number
    sets every group's lr to its ``initial_lr`` (its lr when built) times it."""

    def __init__(
        self,
        factory: OuterOptimizerFactory,
        anchor: list[torch.Tensor],
        scale: Scale | None = None,
        lr_factor: Callable[[], float | None] | None = None,
    ) -> None:
        self.optimizer = factory(anchor)
        self.lr_factor = lr_factor
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(
                "outer_optimizer must return a torch.optim.Optimizer built over the params it "
                f"is given, got {type(self.optimizer).__name__}"
            )
        self.scale = scale

    def step(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None:
        if self.scale is not None:
            self.scale(avg_delta, self.optimizer)
        factor = None if self.lr_factor is None else self.lr_factor()
        if factor is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
        for a, d in zip(anchor, avg_delta):
            a.grad = d
        self.optimizer.step()
        for a in anchor:
            a.grad = None

    def tensors(self) -> list[torch.Tensor]:
        return optimizer_state_tensors(self.optimizer)

    def settings(self) -> dict[str, Any]:
        return optimizer_settings("outer optimizer", self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        # a snapshot: the optimizer's own state_dict refers to its live tensors
        return {"outer_optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("outer_optimizer") is None:
            raise ValueError("fragment state_dict is missing 'outer_optimizer'")
        self.optimizer.load_state_dict(state["outer_optimizer"])


def _clone(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class Sync:
    """One sync of a fragment in flight."""

    label: str
    """What the numeric guard calls it (``round 3``, ``fragment 1``)."""
    step: int
    """The inner step it was launched at."""
    own: HostFlags
    """Whether this rank's own contribution was finite at launch, decided on the device and
    read by the host later (:attr:`own_ok`)."""
    slot: int = 0
    """Which send buffer it uses."""
    handle: Any = None
    """The collectives in flight: ``needs_advance``, ``advance()`` (the second phase, launched
    at the same step on every rank) and ``wait()`` (advancing first if needed; idempotent)."""
    applied: bool = True
    """Sharded: whether the owner's update was applied (False: skipped by the guard)."""
    launched: Launch | None = None
    """Its launch on the engine's :class:`~lowcomm.device.CommStream` (``None``: restored
    from a checkpoint, or launched on the compute stream)."""
    own_flag: torch.Tensor | None = None
    """The same verdict as a 0-dim bool tensor on the device (``None``: restored), for
    decisions taken on the device."""
    norm: torch.Tensor | None = None
    """‖A − θᵢ‖ of this rank at the launch (0-dim, on the device; ``None``: restored)."""

    @property
    def own_ok(self) -> bool:
        """Whether this rank's own contribution was finite at launch (the host reads the
        device's verdict once, on first use)."""
        return self.own.read()[0]


class Engine(Protocol):
    """What a fragment asks of the engine that owns it
    (:class:`~lowcomm.outer.engine.OuterAlgorithm`): its communicator, the collective of an
    uncompressed sync, and what to do with an average once it has arrived (``finite``: the
    average's verdict, decided on the device); its side stream, on which syncs are launched."""

    comm: Communicator
    comm_stream: CommStream

    def mean_async(self, buffers: list[torch.Tensor]) -> Handle: ...

    def on_average(
        self,
        frag: AnyFragment,
        sync: Sync,
        anchor: list[torch.Tensor],
        avg: list[torch.Tensor],
        finite: HostFlags,
    ) -> bool: ...


class _ShardedPhases:
    """The handle of a sharded sync: ``second_phase()`` once (it returns the all-gather), then
    the all-gather waited for. ``None``: already complete (restored from a checkpoint)."""

    def __init__(self, second_phase: Callable[[], Handle] | None) -> None:
        self._second = second_phase
        self._gather: Handle | None = None

    @property
    def needs_advance(self) -> bool:
        return self._second is not None

    def advance(self) -> None:
        if self._second is not None:
            second, self._second = self._second, None
            self._gather = second()

    def wait(self) -> None:
        self.advance()
        if self._gather is not None:
            self._gather.wait()
            self._gather = None


class Fragment:
    """A fragment with its whole outer state on every rank (see the module docstring).
    ``outer`` builds the outer state over the anchor's views (``None``: the average is the
    anchor itself, LocalSGD); ``depth`` syncs may be in flight at once (2 for CO2, whose next
    launches before the last applies); ``keep_own`` keeps this rank's own contribution (eager).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        engine: Engine,
        *,
        outer: Callable[[list[torch.Tensor]], OuterState] | None,
        bucket_cap_mb: float,
        depth: int = 1,
        compression: Codec | LGreCo | None = None,
        stream: int = 0,
        keep_own: bool = False,
        send_params: bool = False,
        feedback_decay: float = 1.0,
    ) -> None:
        self.params = list(params)
        self.send_params = send_params or outer is None
        self.engine = engine
        self.comm: Communicator = engine.comm
        self.anchor = FlatBuckets.for_tensors(self.params, bucket_cap_mb=bucket_cap_mb)
        self.anchor.copy_from(self.params)
        # LocalSGD averages θ itself: its one send buffer is the anchor
        self._sends = [self.anchor] if outer is None else [self.anchor.like() for _ in range(depth)]
        self.outer = None if outer is None else outer(self.anchor.views)
        self._own = [self.anchor.like() for _ in range(depth)] if keep_own else []
        self.compressor: Compressor | None = None
        if compression is not None:
            rank, device = self.comm.rank, self.anchor.device
            shapes = self.anchor.shapes
            self.compressor = Compressor(
                compression,
                shapes,
                rank=rank,
                device=device,
                stream=stream,
                feedback_decay=feedback_decay,
            )
        self.pending: deque[Sync] = deque()
        self._next = 0

    @property
    def numel(self) -> int:
        return self.anchor.numel

    def own(self, sync: Sync) -> list[torch.Tensor]:
        """This rank's own contribution to ``sync`` (``keep_own``), ready on the current
        stream (eager CO2 reads it at the step that launched it)."""
        return self.own_buckets(sync).views

    def own_buckets(self, sync: Sync) -> FlatBuckets:
        """:meth:`own` as the flat buckets that hold it."""
        self.engine.comm_stream.wait_for(sync.launched)
        return self._own[sync.slot]

    def launch(self, label: str, step: int, *, scale: float = 1.0) -> Sync:
        """Launch this rank's pseudo-gradient (or parameters) times ``scale`` (the weight of
        dynamic local steps: :mod:`lowcomm.outer.pace`), on the engine's side stream: the
        fill of the send buffer, the encoding and the collective run beside the next inner
        steps (:class:`~lowcomm.device.CommStream`; inline on the CPU)."""
        if self.compressor is not None:
            # a compressor finishes its mean in flight before it launches the next (CO2's last
            # round, due at this step): here, where the compute stream that reads the result
            # decodes it, not on the side stream inside the launch
            self.wait_in_flight()
        slot, self._next = self._next, (self._next + 1) % len(self._sends)
        send = self._sends[slot]
        own_buf = self._own[slot] if self._own else None
        # LocalSGD's send buffer is its anchor, read until the next launch refills it
        writes = [] if self.outer is None else send.buffers
        writes = writes + (own_buf.buffers if own_buf is not None else [])
        with self.engine.comm_stream.launch(writes=writes) as launched:
            if self.send_params:
                norm = pseudo_gradient_norm(self.anchor.views, self.params)
                send.copy_from(self.params)
            else:
                pseudo_gradient_(send.views, self.anchor.views, self.params)
                norm = flat_norm(send.buffers)
            if scale != 1.0:
                torch._foreach_mul_(send.buffers, scale)
            # this rank's verdict on its own contribution, decided on the device and read by
            # the host at this sync's apply or the next launch (the engine recovers a diverged
            # rank then): nothing here waits for the device
            own = finite_flag(send.buffers)
            launched.inputs_read()  # θ and A are read: the next inner step may write θ
            if self.compressor is not None:
                # eager: this rank's decoded contribution is what the others will receive
                handle = self.comm.compressed_mean_async(send, self.compressor, own=own_buf)
            else:
                if own_buf is not None:
                    torch._foreach_copy_(own_buf.buffers, send.buffers)
                handle = self.engine.mean_async(send.buffers)
        sync = Sync(
            label, step, HostFlags(own), slot, handle, launched=launched, own_flag=own, norm=norm
        )
        self.pending.append(sync)
        return sync

    def _settle(self, sync: Sync) -> None:
        """The compute stream takes over ``sync``'s launch: it waits for what the launch
        queued on the side stream (the encoding: payloads, residuals) before the handle's
        wait decodes it there, and the tensors made during the launch are recorded on it, so
        that the allocator does not hand their memory to the next launch while they are read.
        Its send buffers may be written again."""
        self.engine.comm_stream.apply(sync.launched, hand_over=sync.handle.launch_tensors())

    def drop(self) -> None:
        """Forget the oldest sync in flight without applying it (an elastic sync that was not
        committed)."""
        self._settle(self.pending.popleft())

    def wait_in_flight(self) -> None:
        """Wait for every sync in flight to complete, without applying it: afterwards no
        collective writes into this fragment's buffers."""
        for sync in self.pending:
            self._settle(sync)
            sync.handle.wait()

    def warm_buffer(self) -> FlatBuckets:
        """A full fp32 buffer for the warm start (LocalSGD's is the anchor: refilled before use)."""
        return self._sends[0]

    def anchor_from_params(self) -> None:
        """A ← θ (after a warm-start step, when θ is the same on every rank)."""
        self.anchor.copy_from(self.params)

    def complete(self) -> bool:
        sync = self.pending.popleft()
        self._settle(sync)
        sync.handle.wait()
        send = self._sends[sync.slot]
        finite = HostFlags(finite_flag(send.buffers))
        return self.engine.on_average(self, sync, self.anchor.views, send.views, finite)

    def state_tensors(self) -> list[torch.Tensor]:
        if self.outer is None:
            return []
        return [*self.anchor.buffers, *self.outer.tensors()]

    def buffer_tensors(self) -> list[torch.Tensor]:
        if self.outer is None:
            return list(self.anchor.buffers)
        return [b for fb in (*self._sends, *self._own) for b in fb.buffers]

    def state_dict(self) -> dict[str, Any]:
        """Anchor, outer state and the completed (not applied) result of the sync in flight:
        resuming gives the same numbers as not stopping."""
        assert len(self.pending) <= 1, "state_dict() between inner steps"
        # LocalSGD's anchor (no outer state) is its send buffer, refilled at each launch; it is
        # saved too, as the consensus evaluated and healed before the next launch
        state: dict[str, Any] = {"anchor": _clone(self.anchor.views)}
        if self.outer is not None:
            state.update(self.outer.state_dict())
        state["pending_avg_delta"] = state["pending_own_delta"] = None
        self.wait_in_flight()
        for sync in self.pending:
            state["pending_avg_delta"] = _clone(self._sends[sync.slot].views)
            state["pending_own_delta"] = _clone(self.own(sync)) if self._own else None
            state["pending_label"] = sync.label
            state["pending_step"] = sync.step
        if self.compressor is not None:
            state["compression"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sharded" in state:
            raise ValueError(_sharding_mismatch(True, self.engine))
        if self.outer is not None or state.get("anchor") is not None:
            load_tensors(state, "anchor", self.anchor.views)
        if self.outer is not None:
            self.outer.load_state_dict(state)
        load_compression_state(self.compressor, state)
        self.pending.clear()
        self.engine.comm_stream.drain()  # the syncs in flight are dropped (or restored)
        self._next = 0
        if state.get("pending_avg_delta") is not None:
            load_tensors(state, "pending_avg_delta", self._sends[0].views)
            if self._own:
                load_tensors(state, "pending_own_delta", self._own[0].views)
            handle = self.comm.completed(self._sends[0].buffers)
            label = state.get("pending_label", "the sync in flight")
            step = int(state.get("pending_step", 0))
            self.pending.append(Sync(label, step, HostFlags.known(True), 0, handle))
            self._next = 1 % len(self._sends)


class ShardedFragment:
    """A fragment whose anchor and outer state are sharded across the ranks (see the module
    docstring). ``keep_reference``: syncs overlap (see A_ref there). ``gather_into_snapshot``
    all-gathers the new anchor into the snapshot buffer
    (one full buffer instead of two; for blocking syncs, where nothing reads the anchor
    between launch and apply). The outer state must be elementwise (SGD, Adam, CO2's rule: no
    per-tensor norms), as chunks are not parameters."""

    compressor = None
    """Sharded syncs are not compressed."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        engine: Engine,
        *,
        outer: Callable[[list[torch.Tensor]], OuterState],
        bucket_cap_mb: float,
        gather_into_snapshot: bool = False,
        keep_reference: bool = False,
    ) -> None:
        self.params = list(params)
        self.engine = engine
        self.comm: Communicator = engine.comm
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        device = self.params[0].device
        # full buffers: the snapshot θ (reduce-scatter input) and the gathered anchor
        shapes = [p.shape for p in self.params]
        cap, n = bucket_cap_mb, self.world_size
        self.snapshot = FlatBuckets(shapes, bucket_cap_mb=cap, device=device, pad_to=n)
        self.anchor = self.snapshot if gather_into_snapshot else self.snapshot.like()
        self.anchor.copy_from(self.params)
        # this rank's chunks: the anchor, A_ref where it differs (keep_reference), and the
        # reduce-scatter's output
        self.shard = [self._chunk(b).clone() for b in self.anchor.buffers]
        self.reference = [s.clone() for s in self.shard] if keep_reference else None
        self.reduced = [torch.zeros_like(s) for s in self.shard]
        self._flag = torch.zeros(1, device=device)
        self._reduce: Handle | None = None
        self._flag_handle: Handle | None = None
        self.outer = outer(self.shard)
        self.pending: deque[Sync] = deque()

    def _chunk(self, buffer: torch.Tensor) -> torch.Tensor:
        size = buffer.numel() // self.world_size
        return buffer.narrow(0, self.rank * size, size)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def launch(self, label: str, step: int, *, scale: float = 1.0) -> Sync:
        # the snapshot, reduced chunks and flag are shared: the sync before must have advanced
        for earlier in self.pending:
            earlier.handle.advance()
        norm = pseudo_gradient_norm(self.anchor.views, self.params)
        self.snapshot.copy_from(self.params)
        if scale != 1.0:  # the weighted mean of θ: A minus it is the weighted mean of Δ
            torch._foreach_mul_(self.snapshot.buffers, scale)
        own = finite_flag(self.snapshot.buffers)
        self._flag.copy_(own.logical_not())  # 1 where this rank is not finite
        self._reduce = self.comm.reduce_scatter_mean_async(self.snapshot.buffers, self.reduced)
        # a count of ranks (SUM), not a mean
        self._flag_handle = Handle(
            [self.comm.all_reduce_sum_async(self._flag)], [self._flag], 1, self.comm.stats
        )
        sync = Sync(label, step, HostFlags(own), own_flag=own, norm=norm)
        sync.handle = _ShardedPhases(lambda: self.second_phase(sync))
        self.pending.append(sync)
        return sync

    def second_phase(self, sync: Sync) -> Handle:
        """Wait for the reduce-scatter; unless some rank was not finite, Δ̄ = A_ref − θ̄ on this
        rank's chunks and the outer update; then (skipped or not) all-gather the anchor."""
        assert self._reduce is not None and self._flag_handle is not None
        self._reduce.wait()
        # no rank's contribution was non-finite (a count of ranks, exact in fp32)
        finite = HostFlags(self._flag_handle.wait()[0] < 0.5)
        self._reduce = self._flag_handle = None
        # -(θ̄ − A), bitwise A − θ̄, as pseudo_gradient_ computes it
        torch._foreach_sub_(self.reduced, self.shard if self.reference is None else self.reference)
        torch._foreach_neg_(self.reduced)
        if self.reference is not None:
            # the next sync was launched from the anchor as it is before this update
            torch._foreach_copy_(self.reference, self.shard)
        sync.applied = self.engine.on_average(self, sync, self.shard, self.reduced, finite)
        return self.comm.all_gather_into_async(self.shard, self.anchor.buffers)

    def warm_buffer(self) -> FlatBuckets:
        """A full fp32 buffer for the warm start (it may be the anchor: refilled before use)."""
        return self.snapshot

    def anchor_from_params(self) -> None:
        """A ← θ (after a warm-start step, when θ is the same on every rank): the full anchor,
        this rank's chunk and A_ref."""
        self.anchor.copy_from(self.params)
        torch._foreach_copy_(self.shard, [self._chunk(b) for b in self.anchor.buffers])
        if self.reference is not None:
            torch._foreach_copy_(self.reference, self.shard)

    def complete(self) -> bool:
        sync = self.pending.popleft()
        sync.handle.wait()
        return sync.applied

    def drop(self) -> None:
        """Forget the oldest sync in flight without applying it."""
        self.pending.popleft()

    def wait_in_flight(self) -> None:
        """Wait for every sync in flight to complete, without merging it."""
        for sync in self.pending:
            sync.handle.wait()

    def state_tensors(self) -> list[torch.Tensor]:
        """The persistent state this rank keeps: anchor chunks and outer state (both 1/N)."""
        return [*self.shard, *self.outer.tensors()]

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Communication buffers: the full snapshot and gathered anchor, and the chunks."""
        full = [*self.snapshot.buffers, *self.anchor.buffers]
        return [*full, *(self.reference or []), *self.reduced, self._flag]

    def state_dict(self) -> dict[str, Any]:
        assert len(self.pending) <= 1, "state_dict() between inner steps"
        self.wait_in_flight()  # completed, not merged: the anchor buffer holds its result
        applied = all(sync.applied for sync in self.pending)
        return {
            "sharded": {"world_size": self.world_size, "rank": self.rank},
            "anchor": _clone(self.anchor.views),
            "shard": _clone(self.shard),
            "reference": None if self.reference is None else _clone(self.reference),
            "pending": bool(self.pending),
            "pending_applied": applied,
            **self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("sharded")
        if saved is None:
            raise ValueError(_sharding_mismatch(False, self.engine))
        mine = {"world_size": self.world_size, "rank": self.rank}
        if saved != mine:
            raise ValueError(
                f"state_dict was saved with sharded outer state {saved!r} but this rank has "
                f"{mine!r}; resume with shard_outer_state and the same ranks"
            )
        chunks = [("shard", self.shard)]
        if self.reference is not None:
            chunks.append(("reference", self.reference))
        for key, into in chunks:
            src = state.get(key)
            if src is None or [t.shape for t in src] != [t.shape for t in into]:
                raise ValueError(f"sharded state_dict[{key!r}] does not fit this fragment")
        self.outer.load_state_dict(state)
        for key, into in chunks:
            torch._foreach_copy_(into, [t.to(d.device) for t, d in zip(state[key], into)])
        load_tensors(state, "anchor", self.anchor.views)
        self.pending.clear()
        if state.get("pending"):
            applied = bool(state.get("pending_applied", True))
            restored = Sync("the sync in flight", 0, HostFlags.known(True), applied=applied)
            restored.handle = _ShardedPhases(None)
            self.pending.append(restored)


def _sharding_mismatch(saved_sharded: bool, engine: Engine) -> str:
    return (
        f"state_dict was saved with shard_outer_state={saved_sharded} but this "
        f"{type(engine).__name__} has shard_outer_state={not saved_sharded}; resume with the "
        "same settings"
    )


AnyFragment = Fragment | ShardedFragment
"""A fragment, whole or sharded: what the engine and the guards hold."""
