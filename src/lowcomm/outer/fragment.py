"""One synchronised piece of the model: its anchor, pseudo-gradient buffer and outer optimizer.

DiLoCo syncs one fragment (the whole model) every round; Streaming DiLoCo and CoCoDC sync one of
P fragments at each sync point. Both are schedules over the same two phases (torchft's
``prepare_sync`` / ``perform_sync``): :meth:`Fragment.launch` takes Δ = A − θ and starts its
all-reduce; :meth:`Fragment.outer_step` waits for it and steps the outer optimizer on A.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowcomm.comm import Communicator, FlatBuckets, Handle
from lowcomm.compress.codecs import Codec
from lowcomm.compress.feedback import Compressor
from lowcomm.compress.lgreco import LGreCo
from lowcomm.outer.base import clone_views, outer_optimizer_step
from lowcomm.outer.functional import pseudo_gradient_

__all__ = ["Fragment", "OuterOptimizerFactory", "load_compression"]


def load_compression(compressor: Compressor | None, state: dict[str, Any]) -> None:
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


OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class Fragment:
    """Anchor A (fp32 flat buckets), the Δ buffer the all-reduce runs in, and an outer optimizer
    built by ``factory`` over the anchor's per-parameter views. With ``compression``, Δ is
    averaged by a compressed collective with this rank's error feedback (``compressor``)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        factory: OuterOptimizerFactory,
        *,
        bucket_cap_mb: float,
        compression: Codec | LGreCo | None = None,
        rank: int = 0,
        stream: int = 0,
    ) -> None:
        self.params = list(params)
        self.anchor = FlatBuckets.for_tensors(self.params, bucket_cap_mb=bucket_cap_mb)
        self.anchor.copy_from(self.params)
        self.delta = self.anchor.like()
        self.outer = factory(self.anchor.views)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ValueError(
                "outer_optimizer must return a torch.optim.Optimizer built over the params it "
                f"is given, got {type(self.outer).__name__}"
            )
        self.pending: Handle | None = None
        self.compressor = (
            None
            if compression is None
            else Compressor(
                compression,
                self.delta.shapes,
                rank=rank,
                device=self.delta.device,
                stream=stream,
            )
        )

    @property
    def numel(self) -> int:
        return self.anchor.numel

    def launch(
        self, comm: Communicator, check: Callable[[list[torch.Tensor]], object] | None = None
    ) -> None:
        """Δ ← A − θ into the Δ buffer and start its mean all-reduce (not waited for).
        ``check(Δ)`` runs in between (the buffer is the collective's once launched)."""
        assert self.pending is None, "a fragment has at most one all-reduce in flight"
        pseudo_gradient_(self.delta.views, self.anchor.views, self.params)
        if check is not None:
            check(self.delta.views)
        if self.compressor is None:
            self.pending = comm.all_reduce_mean_async(self.delta.buffers)
        else:
            self.pending = comm.compressed_mean_async(self.delta, self.compressor)

    def outer_step(
        self,
        scale: Callable[[list[torch.Tensor]], None] | None = None,
        accept: Callable[[list[torch.Tensor]], bool] | None = None,
    ) -> bool:
        """Wait for the all-reduce, optionally rescale Δ̄ in place, then, unless ``accept(Δ̄)``
        is False (the numeric guard), set ``A.grad = Δ̄`` and step the outer optimizer:
        A ← Â. Returns whether the step was taken."""
        assert self.pending is not None, "outer_step() without a launched all-reduce"
        self.pending.wait()
        self.pending = None
        avg = self.delta.views
        if scale is not None:
            scale(avg)
        if accept is not None and not accept(avg):
            return False
        outer_optimizer_step(self.outer, self.anchor.views, avg)
        return True

    def state_dict(self) -> dict[str, Any]:
        """Anchor, outer optimizer and, if an all-reduce is in flight, its completed result."""
        pending = None
        if self.pending is not None:
            self.pending.wait()  # completed, not applied: resuming gives the same numbers
            pending = clone_views(self.delta)
        state = {
            "anchor": clone_views(self.anchor),
            # a snapshot: the optimizer's own state_dict refers to its live tensors
            "outer_optimizer": copy.deepcopy(self.outer.state_dict()),
            "pending_avg_delta": pending,
        }
        if self.compressor is not None:
            state["compression"] = self.compressor.state_dict()
        return state

    def load_state_dict(
        self,
        state: dict[str, Any],
        comm: Communicator,
        load_tensors: Callable[[dict[str, Any], str, Sequence[torch.Tensor]], None],
    ) -> None:
        load_tensors(state, "anchor", self.anchor.views)
        if "outer_optimizer" not in state:
            raise ValueError("fragment state_dict is missing 'outer_optimizer'")
        self.outer.load_state_dict(state["outer_optimizer"])
        load_compression(self.compressor, state)
        self.pending = None
        if state.get("pending_avg_delta") is not None:
            load_tensors(state, "pending_avg_delta", self.delta.views)
            self.pending = comm.completed(self.delta.buffers)
