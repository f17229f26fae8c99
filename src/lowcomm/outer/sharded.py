"""Sharded outer state (``shard_outer_state=True``): each rank keeps 1/N of the anchor and of
the outer optimizer's state, ZeRO-style.

The flat fp32 buckets of a fragment are padded to a multiple of N; rank r owns chunk r of every
bucket. A sync is two collectives around the owner's update:

1. **launch**: the parameters θᵢ are copied into a full snapshot buffer and reduce-scattered
   (SUM, then / N): rank r receives chunk r of the mean θ̄. One 4-byte all-reduce beside it
   counts the ranks whose parameters are not finite (the numeric guard, decided alike).
2. **advance** (:meth:`ShardedRound.advance`): the owner forms its chunk of the averaged
   pseudo-gradient Δ̄ = A − θ̄ (the mean of Aᵢ − θᵢ, up to rounding), steps the outer update on
   its chunk of A, and all-gathers the new anchor into a full buffer.
3. **wait**: the all-gather completes; the full anchor is what θ is set to.

A reduce-scatter and an all-gather put the same bytes on the wire as one ring all-reduce. The
algorithms keep their schedule: CO2 launches at the end of round t, advances half a round later
and waits at the end of round t + 1; Streaming DiLoCo launches τ steps before the sync point and
advances halfway; DiLoCo does all three at the round boundary, as it blocks anyway.

Results equal the unsharded algorithm up to floating-point rounding (≤ 1e-6 relative), not bit
for bit: Δ̄ is A − mean(θ) here, mean(A − θ) there. Every rank still holds the bit-identical
full anchor after each sync. The full snapshot and gathered buffers are communication buffers
(the unsharded algorithms hold the same); what is sharded is the state that persists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowcomm.comm import Communicator, FlatBuckets, Handle
from lowcomm.guard import optimizer_state_tensors
from lowcomm.outer.base import clone_views, outer_optimizer_step

__all__ = ["ShardUpdate", "ShardedFragment", "ShardedRound", "check_sharding"]

ShardUpdate = Callable[[list[torch.Tensor], list[torch.Tensor]], None]
"""The owner's outer update: ``update(anchor_chunks, avg_delta_chunks)`` steps the anchor
chunks in place (and whatever state the algorithm keeps for them)."""


class ShardedRound:
    """One sync of a :class:`ShardedFragment` in flight: reduce-scatter, then (at
    :meth:`advance`) the owner's update and the all-gather of the new anchor. Quacks like a
    :class:`~lowcomm.comm.Handle` for the schedules (``needs_advance``, ``advance``, ``wait``)."""

    def __init__(
        self,
        fragment: ShardedFragment,
        reduce: Handle | None,
        flag: Handle | None,
        on_skip: Callable[[], None],
    ) -> None:
        self.fragment = fragment
        self._reduce = reduce
        self._flag = flag
        self._on_skip = on_skip
        self._gather: Handle | None = None
        self.applied = True
        """Whether the outer update was applied (False: skipped by the numeric guard)."""
        self._advanced = reduce is None  # restored from a checkpoint: already complete

    @property
    def needs_advance(self) -> bool:
        return not self._advanced

    def advance(self) -> None:
        """Wait for the reduce-scatter, update this rank's chunk, launch the all-gather."""
        if self._advanced:
            return
        self._advanced = True
        assert self._reduce is not None and self._flag is not None
        self._reduce.wait()
        bad_ranks = round(float(self._flag.wait()[0]))
        if bad_ranks:
            self.applied = False
            self._on_skip()
        else:
            self.fragment.apply_update()
        # skipped or not, every rank gathers the anchor (the buffer may hold the snapshot)
        self._gather = self.fragment.gather()

    def wait(self) -> list[torch.Tensor]:
        """Advance if not done yet; wait for the all-gather; return the full anchor buffers."""
        self.advance()
        if self._gather is not None:
            self._gather.wait()
        return self.fragment.anchor.buffers


class ShardedFragment:
    """A fragment whose anchor and outer state are sharded: see the module docstring.

    Args:
        params: the fragment's parameters.
        comm: the group the anchor is sharded over (N = its size, this rank's chunk = its rank).
        bucket_cap_mb: size cap of one flat bucket (one reduce-scatter and all-gather each).
        factory: builds the outer optimizer over this rank's anchor chunks (DiLoCo, Streaming
            DiLoCo); it must be elementwise (SGD, Adam, …: no per-tensor norms), as chunks
            are not parameters.
        update: instead of ``factory``, the outer update on this rank's chunks
            (:data:`ShardUpdate`; CO2).
        scale: rescales Δ̄'s chunks in place before the optimizer step (SlowMo).
        reference: the anchor chunks Δ̄ is formed against, from the current ones (default:
            the current ones). CO2's round refers to the anchor it started from, which has
            moved by the time its average is applied: A_prev = A − (A − A_prev), from the last
            update it keeps anyway.
        gather_into_snapshot: all-gather the new anchor into the snapshot buffer (one full
            buffer instead of two; for blocking syncs, where nothing reads the anchor buffer
            while the snapshot is in flight).
    """

    compressor = None
    """Sharded syncs are not compressed."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        comm: Communicator,
        *,
        bucket_cap_mb: float,
        factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        update: ShardUpdate | None = None,
        scale: Callable[[list[torch.Tensor]], None] | None = None,
        reference: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
        gather_into_snapshot: bool = False,
    ) -> None:
        assert (factory is None) != (update is None), "pass an outer optimizer or an update"
        self.params = list(params)
        self.comm = comm
        self.world_size = comm.world_size
        self.rank = comm.rank
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
        # this rank's chunks: anchor, the reduce-scatter's output
        self.shard = [self._own(b).clone() for b in self.anchor.buffers]
        self.reference = reference
        self.reduced = [torch.zeros_like(s) for s in self.shard]
        self._flag = torch.zeros(1, device=device)
        self.scale = scale
        self.outer: torch.optim.Optimizer | None = None
        if factory is not None:
            self.outer = factory(self.shard)
            if not isinstance(self.outer, torch.optim.Optimizer):
                raise ValueError(
                    "outer_optimizer must return a torch.optim.Optimizer built over the params "
                    f"it is given, got {type(self.outer).__name__}"
                )
        self.update = update
        self.pending: ShardedRound | None = None

    def _own(self, buffer: torch.Tensor) -> torch.Tensor:
        size = buffer.numel() // self.world_size
        return buffer.narrow(0, self.rank * size, size)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def state_tensors(self) -> list[torch.Tensor]:
        """The persistent state this rank keeps: anchor chunks and the outer optimizer's state
        (both 1/N)."""
        out = list(self.shard)
        if self.outer is not None:
            out += optimizer_state_tensors(self.outer)
        return out

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Communication buffers: the full snapshot and gathered anchor, the reduced chunks."""
        return [*self.snapshot.buffers, *self.anchor.buffers, *self.reduced, self._flag]

    def launch(
        self,
        check: Callable[[list[torch.Tensor]], bool],
        on_skip: Callable[[], None],
    ) -> ShardedRound:
        """Snapshot θ and start its reduce-scatter (plus the guard's count); not waited for.
        ``check(θ)`` says whether this rank's parameters are finite (and recovers it if not);
        ``on_skip`` is called, alike on every rank, when some rank's were not. The previous
        sync, if still in flight, must have advanced (its reduce-scatter reads the snapshot)."""
        self.snapshot.copy_from(self.params)
        self._flag.fill_(0.0 if check(self.snapshot.views) else 1.0)
        reduce = self.comm.reduce_scatter_mean_async(self.snapshot.buffers, self.reduced)
        # a count of ranks (SUM), not a mean
        flag = Handle(
            [self.comm.all_reduce_sum_async(self._flag)], [self._flag], 1, self.comm.stats
        )
        self.pending = ShardedRound(self, reduce, flag, on_skip)
        return self.pending

    def apply_update(self) -> None:
        """Δ̄ = A_ref − θ̄ on this rank's chunks (A_ref: see ``reference``), then the outer
        update of the anchor chunks."""
        ref = self.shard if self.reference is None else self.reference(self.shard)
        # -(θ̄ − A), bitwise A − θ̄, as pseudo_gradient_ computes it
        torch._foreach_sub_(self.reduced, ref)
        torch._foreach_neg_(self.reduced)
        if self.update is not None:
            self.update(self.shard, self.reduced)
        else:
            assert self.outer is not None
            if self.scale is not None:
                self.scale(self.reduced)
            outer_optimizer_step(self.outer, self.shard, self.reduced)

    def gather(self) -> Handle:
        """Start the all-gather of the anchor chunks into the full anchor buffers."""
        return self.comm.all_gather_into_async(self.shard, self.anchor.buffers)

    def wait(self) -> bool:
        """Complete the latest sync (advancing it if needed): the anchor buffers then hold the
        new full anchor. Returns whether its outer update was applied."""
        assert self.pending is not None, "wait() without a launched sync"
        pending, self.pending = self.pending, None
        pending.wait()
        return pending.applied

    def finish_pending(self) -> None:
        """Complete the sync in flight, if any, without installing it: the anchor buffers then
        hold its result (state dicts store it so; resuming gives the same numbers)."""
        if self.pending is not None:
            self.pending.wait()

    def state_dict(self) -> dict[str, Any]:
        self.finish_pending()
        return {
            "sharded": {"world_size": self.world_size, "rank": self.rank},
            "outer_optimizer": None
            if self.outer is None
            else copy.deepcopy(self.outer.state_dict()),
            "anchor": clone_views(self.anchor),
            "shard": [s.clone() for s in self.shard],
            "pending": self.pending is not None,
        }

    def load_state_dict(self, state: dict[str, Any], *_: Any) -> None:
        saved = state.get("sharded")
        mine = {"world_size": self.world_size, "rank": self.rank}
        if saved != mine:
            raise ValueError(
                f"state_dict was saved with sharded outer state {saved!r} but this rank has "
                f"{mine!r}; resume with shard_outer_state and the same ranks"
            )
        src = state.get("shard")
        if src is None or [t.shape for t in src] != [t.shape for t in self.shard]:
            raise ValueError("sharded state_dict['shard'] does not fit this fragment")
        torch._foreach_copy_(self.shard, [t.to(d.device) for t, d in zip(src, self.shard)])
        if self.outer is not None:
            if state.get("outer_optimizer") is None:
                raise ValueError("sharded state_dict is missing 'outer_optimizer'")
            self.outer.load_state_dict(state["outer_optimizer"])
        torch._foreach_copy_(self.anchor.views, [t.to(self.anchor.device) for t in state["anchor"]])
        self.pending = (
            ShardedRound(self, None, None, lambda: None) if state.get("pending") else None
        )


def check_sharding(state: dict[str, Any], sharded: bool, name: str) -> None:
    """Refuse a state_dict saved with the other ``shard_outer_state`` setting."""
    if ("sharded" in state) != sharded:
        raise ValueError(
            f"state_dict was saved with shard_outer_state={not sharded} but this {name} has "
            f"shard_outer_state={sharded}; resume with the same settings"
        )
