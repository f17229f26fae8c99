"""Fragments: the pieces of the model the outer engine synchronises, with one interface whether
their outer state is whole on every rank or sharded across the ranks.

A fragment holds some parameters θ, their anchor A (fp32 flat buckets, bit-identical on every
rank after each sync) and the outer state stepped on A (:class:`OuterState`). A sync of it goes
through two phases (torchft's ``prepare_sync`` / ``perform_sync``):

* :meth:`Fragment.launch`: Δ = A − θ (LocalSGD: θ itself) into a send buffer; the collective
  starts; not waited for. Returns the :class:`Sync` in flight.
* :meth:`Fragment.complete`: wait for the oldest sync in flight; hand its average to the
  engine, which checks it and steps the outer state on A (``engine.on_average``). Returns
  whether the update was applied; the engine then merges A into θ.

With ``shard_outer_state`` (:class:`ShardedFragment`, ZeRO-style) each rank keeps 1/N of A and
of the outer state. The fragment's flat buckets are padded to a multiple of N; rank r owns
chunk r of every bucket. Launch snapshots θ and reduce-scatters it (SUM, then / N), with one
4-byte all-reduce beside it counting the ranks whose θ is not finite; the second phase
(:meth:`Sync.advance`, which the engine calls halfway to the apply step) forms the owner's chunk
of Δ̄ = A_ref − θ̄, steps the outer state on its chunk of A and all-gathers the new anchor;
complete waits for the all-gather. A_ref is the anchor θ was last merged from: this rank's
chunk of A, or, when the next sync is launched before the last is applied (CO2), the chunk as
it was before the last update, kept in one more chunk (that update ran early). A
reduce-scatter and an all-gather put the same bytes on the wire as one ring all-reduce. Results
equal the unsharded ones up to rounding (Δ̄ = A − mean θ here, mean(A − θ) there).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lowcomm.comm import Communicator, FlatBuckets, Handle
from lowcomm.compress.codecs import Codec
from lowcomm.compress.feedback import Compressor
from lowcomm.compress.lgreco import LGreCo
from lowcomm.guard import optimizer_state_tensors
from lowcomm.outer.functional import pseudo_gradient_

if TYPE_CHECKING:
    from lowcomm.outer.engine import OuterAlgorithm

__all__ = [
    "Fragment",
    "collect_params",
    "OptimizerState",
    "OuterState",
    "ShardedFragment",
    "Sync",
    "load_tensors",
    "outer_optimizer_step",
]

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class OuterState(Protocol):
    """The outer update of one fragment and the state it keeps, over the anchor tensors it was
    built for (per-parameter views, or this rank's chunks when sharded)."""

    def step(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def settings(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def outer_optimizer_step(
    optimizer: torch.optim.Optimizer,
    anchor: Sequence[torch.Tensor],
    avg_delta: Sequence[torch.Tensor],
) -> None:
    """One step of an outer optimizer built over ``anchor``, with ``A.grad = Δ̄``."""
    for a, d in zip(anchor, avg_delta):
        a.grad = d
    optimizer.step()
    for a in anchor:
        a.grad = None


def optimizer_settings(what: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's type and hyperparameters per group (not its parameters), for the
    consistency guard."""
    settings: dict[str, Any] = {what: type(optimizer).__name__}
    for i, group in enumerate(optimizer.param_groups):
        settings[f"{what} group {i} size"] = len(group["params"])
        for k, v in sorted(group.items()):
            if k != "params":
                settings[f"{what} group {i} {k}"] = v
    return settings


class OptimizerState:
    """An outer ``torch.optim.Optimizer`` built by ``factory`` over the anchor tensors, stepped
    with ``A.grad = Δ̄`` (DiLoCo, Streaming DiLoCo); ``scale(Δ̄, optimizer)`` may rescale Δ̄ in
    place and set the optimizer's lr first (SlowMo)."""

    def __init__(
        self,
        factory: OuterOptimizerFactory,
        anchor: list[torch.Tensor],
        scale: Callable[[list[torch.Tensor], torch.optim.Optimizer], None] | None = None,
    ) -> None:
        self.optimizer = factory(anchor)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(
                "outer_optimizer must return a torch.optim.Optimizer built over the params it "
                f"is given, got {type(self.optimizer).__name__}"
            )
        self.scale = scale

    def step(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None:
        if self.scale is not None:
            self.scale(avg_delta, self.optimizer)
        outer_optimizer_step(self.optimizer, anchor, avg_delta)

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


def load_tensors(state: dict[str, Any], key: str, into: Sequence[torch.Tensor]) -> None:
    """Copy ``state[key]`` (a list of tensors) into ``into``, refusing another model."""
    if state.get(key) is None:
        raise ValueError(f"outer state_dict is missing {key!r}")
    src = state[key]
    if len(src) != len(into):
        raise ValueError(
            f"state_dict[{key!r}] has {len(src)} tensors but the model has {len(into)} "
            "trainable parameters; load it into the same model"
        )
    for i, (s, d) in enumerate(zip(src, into)):
        if s.shape != d.shape:
            raise ValueError(
                f"state_dict[{key!r}][{i}] has shape {tuple(s.shape)} but parameter {i} "
                f"has shape {tuple(d.shape)}; load it into the same model"
            )
    torch._foreach_copy_(list(into), [s.to(d.device) for s, d in zip(src, into)])


def _clone(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class Sync:
    """One sync of a fragment in flight."""

    label: str
    """What the numeric guard calls it (``round 3``, ``fragment 1``)."""
    step: int
    """The inner step it was launched at."""
    own_ok: bool
    """Whether this rank's own contribution was finite at launch."""
    slot: int = 0
    """Which send buffer it uses."""
    handle: Any = None
    """The collective in flight (a :class:`~lowcomm.comm.Handle`; ``None`` when sharded: the
    fragment drives its collectives)."""
    applied: bool = True
    """Sharded: whether the owner's update was applied (False: skipped by the guard)."""
    _advanced: bool = field(default=True, repr=False)
    _gather: Handle | None = field(default=None, repr=False)
    _fragment: ShardedFragment | None = field(default=None, repr=False)

    @property
    def needs_advance(self) -> bool:
        if self._fragment is not None:
            return not self._advanced
        return bool(self.handle.needs_advance)

    def advance(self) -> None:
        """Launch the second phase (PowerSGD's second all-reduce; sharded: the owner's
        update and the all-gather). Every rank calls it at the same step."""
        if self._fragment is None:
            self.handle.advance()
        elif not self._advanced:
            self._advanced = True
            self._fragment.second_phase(self)

    def wait(self) -> None:
        """Complete the collective (advancing first if needed); nothing is merged."""
        if self._fragment is None:
            self.handle.wait()
            return
        self.advance()
        if self._gather is not None:
            self._gather.wait()
            self._gather = None


class Fragment:
    """A fragment with its whole outer state on every rank (see the module docstring).

    Args:
        params: the fragment's parameters.
        engine: the algorithm driving it (its ``check_own`` and ``on_average``).
        outer: builds the outer state over the anchor's views (``None``: the average is the
            anchor itself, LocalSGD).
        depth: how many syncs of this fragment may be in flight at once (2 when the next is
            launched before the last is applied, as in CO2).
        keep_own: keep this rank's own contribution of every sync (eager updates).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        engine: OuterAlgorithm,
        *,
        outer: Callable[[list[torch.Tensor]], OuterState] | None,
        bucket_cap_mb: float,
        depth: int = 1,
        compression: Codec | LGreCo | None = None,
        stream: int = 0,
        keep_own: bool = False,
    ) -> None:
        self.params = list(params)
        self.engine = engine
        self.comm: Communicator = engine.comm
        self.anchor = FlatBuckets.for_tensors(self.params, bucket_cap_mb=bucket_cap_mb)
        self.anchor.copy_from(self.params)
        # LocalSGD averages θ itself: its one send buffer is the anchor
        self._sends = [self.anchor] if outer is None else [self.anchor.like() for _ in range(depth)]
        self.outer = None if outer is None else outer(self.anchor.views)
        self._own = [self.anchor.like() for _ in range(depth)] if keep_own else []
        self.compressor = (
            None
            if compression is None
            else Compressor(
                compression,
                self.anchor.shapes,
                rank=self.comm.rank,
                device=self.anchor.device,
                stream=stream,
            )
        )
        self.pending: deque[Sync] = deque()
        self._next = 0

    @property
    def numel(self) -> int:
        return self.anchor.numel

    def own(self, sync: Sync) -> list[torch.Tensor]:
        """This rank's own contribution to ``sync`` (``keep_own``)."""
        return self._own[sync.slot].views

    def launch(self, label: str, step: int) -> Sync:
        slot, self._next = self._next, (self._next + 1) % len(self._sends)
        send = self._sends[slot]
        if self.outer is None:
            send.copy_from(self.params)
        else:
            pseudo_gradient_(send.views, self.anchor.views, self.params)
        own_ok = self.engine.check_own(send.views)
        own = self._own[slot] if self._own else None
        if self.compressor is not None:
            # eager: this rank's decoded contribution is what the others will receive
            handle = self.comm.compressed_mean_async(send, self.compressor, own=own)
        else:
            if own is not None:
                torch._foreach_copy_(own.views, send.views)
            handle = self.comm.all_reduce_mean_async(send.buffers)
        sync = Sync(label, step, own_ok, slot, handle)
        self.pending.append(sync)
        return sync

    def complete(self) -> bool:
        sync = self.pending.popleft()
        sync.wait()
        avg = self._sends[sync.slot].views
        return self.engine.on_average(self, sync, self.anchor.views, avg, None)

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
        state: dict[str, Any] = {}
        if self.outer is not None:  # LocalSGD's anchor is its buffer, refilled at each launch
            state["anchor"] = _clone(self.anchor.views)
            state.update(self.outer.state_dict())
        state["pending_avg_delta"] = state["pending_own_delta"] = None
        for sync in self.pending:
            sync.wait()
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
        if self.outer is not None:
            load_tensors(state, "anchor", self.anchor.views)
            self.outer.load_state_dict(state)
        _load_compression(self.compressor, state)
        self.pending.clear()
        self._next = 0
        if state.get("pending_avg_delta") is not None:
            load_tensors(state, "pending_avg_delta", self._sends[0].views)
            if self._own:
                load_tensors(state, "pending_own_delta", self._own[0].views)
            handle = self.comm.completed(self._sends[0].buffers)
            label, step = (
                state.get("pending_label", "the sync in flight"),
                state.get("pending_step", 0),
            )
            self.pending.append(Sync(label, int(step), True, 0, handle))
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
        engine: OuterAlgorithm,
        *,
        outer: Callable[[list[torch.Tensor]], OuterState],
        bucket_cap_mb: float,
        gather_into_snapshot: bool = False,
        keep_reference: bool = False,
    ) -> None:
        self.params = list(params)
        self.engine = engine
        self.comm: Communicator = engine.comm
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        device = self.params[0].device
        # full buffers: the snapshot θ (reduce-scatter input) and the gathered anchor
        self.snapshot = FlatBuckets(
            [p.shape for p in self.params],
            bucket_cap_mb=bucket_cap_mb,
            device=device,
            pad_to=self.world_size,
        )
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

    def launch(self, label: str, step: int) -> Sync:
        # the snapshot, reduced chunks and flag are shared: the sync before must have advanced
        for earlier in self.pending:
            earlier.advance()
        self.snapshot.copy_from(self.params)
        own_ok = self.engine.check_own(self.snapshot.views)
        self._flag.fill_(0.0 if own_ok else 1.0)
        self._reduce = self.comm.reduce_scatter_mean_async(self.snapshot.buffers, self.reduced)
        # a count of ranks (SUM), not a mean
        self._flag_handle = Handle(
            [self.comm.all_reduce_sum_async(self._flag)], [self._flag], 1, self.comm.stats
        )
        sync = Sync(label, step, own_ok, _advanced=False, _fragment=self)
        self.pending.append(sync)
        return sync

    def second_phase(self, sync: Sync) -> None:
        """Wait for the reduce-scatter; unless some rank was not finite, Δ̄ = A_ref − θ̄ on this
        rank's chunks and the outer update; then (skipped or not) all-gather the anchor."""
        assert self._reduce is not None and self._flag_handle is not None
        self._reduce.wait()
        finite = round(float(self._flag_handle.wait()[0])) == 0
        self._reduce = self._flag_handle = None
        # -(θ̄ − A), bitwise A − θ̄, as pseudo_gradient_ computes it
        torch._foreach_sub_(self.reduced, self.shard if self.reference is None else self.reference)
        torch._foreach_neg_(self.reduced)
        if self.reference is not None:
            # the next sync was launched from the anchor as it is before this update
            torch._foreach_copy_(self.reference, self.shard)
        sync.applied = self.engine.on_average(self, sync, self.shard, self.reduced, finite)
        sync._gather = self.comm.all_gather_into_async(self.shard, self.anchor.buffers)

    def complete(self) -> bool:
        sync = self.pending.popleft()
        sync.wait()
        return sync.applied

    def state_tensors(self) -> list[torch.Tensor]:
        """The persistent state this rank keeps: anchor chunks and outer state (both 1/N)."""
        return [*self.shard, *self.outer.tensors()]

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Communication buffers: the full snapshot and gathered anchor, and the chunks."""
        return [
            *self.snapshot.buffers,
            *self.anchor.buffers,
            *(self.reference or []),
            *self.reduced,
            self._flag,
        ]

    def state_dict(self) -> dict[str, Any]:
        assert len(self.pending) <= 1, "state_dict() between inner steps"
        applied = True
        for sync in self.pending:
            sync.wait()  # completed, not merged: the anchor buffer holds its result
            applied = sync.applied
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
            self.pending.append(
                Sync("the sync in flight", 0, True, applied=applied, _fragment=self)
            )


def _sharding_mismatch(saved_sharded: bool, engine: OuterAlgorithm) -> str:
    return (
        f"state_dict was saved with shard_outer_state={saved_sharded} but this "
        f"{type(engine).__name__} has shard_outer_state={not saved_sharded}; resume with the "
        "same settings"
    )


def _load_compression(compressor: Compressor | None, state: dict[str, Any]) -> None:
    """Restore a compressor from ``state["compression"]``; refuses a mismatch either way."""
    saved = state.get("compression")
    if compressor is None:
        if saved is not None:
            raise ValueError(
                f"state_dict was saved with compression={saved.get('codec')!r} but this run "
                "has none; resume with the same compression"
            )
        return
    if saved is None:
        raise ValueError(
            f"state_dict was saved without compression but this run has "
            f"compression={compressor.spec!r}; resume with the same compression"
        )
    compressor.load_state_dict(saved)


def collect_params(
    model_or_params: nn.Module | list[torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters with their names (``params[i]`` when not from a module)."""
    named: list[tuple[str, torch.Tensor]]
    if isinstance(model_or_params, nn.Module):
        named = [(n, p) for n, p in model_or_params.named_parameters() if p.requires_grad]
    elif isinstance(model_or_params, torch.Tensor):
        raise ValueError(
            "model_or_params must be an nn.Module or an iterable of parameters, got a single "
            "tensor; wrap it in a list: [param]"
        )
    else:
        try:
            named = [(f"params[{i}]", p) for i, p in enumerate(model_or_params) if p.requires_grad]
        except (TypeError, AttributeError) as e:
            raise ValueError(
                f"model_or_params must be an nn.Module or an iterable of parameters, got "
                f"{type(model_or_params).__name__}"
            ) from e
    if not named:
        raise ValueError(
            "no trainable parameters: model_or_params has no tensor with requires_grad=True"
        )
    # FSDP2 (fully_shard) parameters are DTensors: work on this rank's local shard, which
    # shares their storage (ranks with the same place in their node groups hold matching
    # shards, so averaging those across node groups averages the model)
    named = [(n, _local(p)) for n, p in named]
    params = [p for _, p in named]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"all parameters must be on one device, found {sorted(map(str, devices))}; "
            "pass the parameters of one device (one algorithm per device group)"
        )
    if any(not p.is_floating_point() for p in params):
        raise ValueError("all trainable parameters must be floating point")
    return named


def _local(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (same storage); any other tensor as it is."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param
