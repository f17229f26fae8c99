"""Elastic syncs of every outer algorithm (``fault_tolerance=``; a base of the engine): the
quorum each sync joins, the vote that commits it, what a donor sends a replica it heals and how
the healed replica continues, over :class:`lowcomm.elastic.sync.FaultTolerance` (torchft's
Manager), and what elastic syncs refuse."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lowcomm.compress.codecs import Codec
from lowcomm.compress.lgreco import LGreCo
from lowcomm.outer.fragment import AnyFragment
from lowcomm.outer.pace import Pace
from lowcomm.params import load_tensors

if TYPE_CHECKING:
    from lowcomm.elastic.sync import FaultTolerance

__all__ = ["FaultTolerant"]


class FaultTolerant:
    """Fault tolerance, over the engine's state (see the module docstring)."""

    schedule: ClassVar[str]
    elastic: ClassVar[bool]
    ft: FaultTolerance | None
    inner: torch.optim.Optimizer
    params: list[torch.Tensor]
    compression: Codec | LGreCo | None
    shard_outer_state: bool
    pace: Pace | None
    sync_every: int
    warmup: int
    overlap: int
    interval: int
    local_step: int
    rounds: int

    if TYPE_CHECKING:

        def _on_step(self, step: int, *, quorum: bool = True) -> None: ...

        def state_dict(self) -> dict[str, Any]: ...

        def load_state_dict(self, state: dict[str, Any], *, _healing: bool = False) -> None: ...

    def _quorum(self) -> bool:
        """With fault tolerance, before a sync is launched: join its quorum; returns whether
        this replica was healed in it (then it stands where its donor stood, at this same
        launch, and takes part in it without contributing)."""
        return self.ft is not None and self.ft.quorum()

    def _fault_tolerance(self, replica: Any, process_group: Any) -> FaultTolerance:
        from lowcomm.elastic.sync import FaultTolerance

        if process_group is not None:
            raise ValueError(
                "pass fault_tolerance or process_group, not both: with fault tolerance the "
                "quorum of each sync is the group"
            )
        return FaultTolerance(replica)

    def _check_fault_tolerance(self) -> None:
        """Refuse what elastic syncs do not support yet, with the reason."""
        name = type(self).__name__
        refusals = [
            (
                self.warmup > 0,
                "sync_warmup > 0 (the warm start averages every step, and a "
                "quorum per inner step is not what fault tolerance here does): use sync_warmup=0",
            ),
            (
                self.compression is not None,
                "compression (its collectives are all-gathers, "
                "which torchft's Manager does not carry): leave compression unset",
            ),
            (
                self.shard_outer_state,
                "shard_outer_state (its reduce-scatter is not carried by "
                "torchft's Manager): leave it off",
            ),
            (self.schedule == "gossip", "gossip groups (NoLoCo's pairs need a fixed group)"),
            (
                not type(self).elastic,
                "its class sets elastic = False (its syncs need a fixed group)",
            ),
            (
                self.pace is not None,
                "local_steps='dynamic' (its plans assume a fixed group of ranks): use 'fixed'",
            ),
            (
                self.overlap >= self.interval,
                f"overlap {self.overlap} >= sync_every / "
                f"num_fragments = {self.interval}: a sync would be launched before the last one "
                "is applied, across a quorum that can rebuild the group; use a smaller overlap "
                "(the job's CO2 uses 1)",
            ),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"{name} with fault_tolerance: {why}")

    def _commit(self, frag: AnyFragment) -> bool:
        """Wait for the sync in flight, then vote; ``False``: drop it (popped, not applied)."""
        assert self.ft is not None
        sync = frag.pending[0]
        sync.handle.wait()
        if self.ft.commit():
            return True
        frag.drop()
        return False

    def _heal_state(self) -> dict[str, Any]:
        """What a donor sends a replica it heals (in torchft's quorum thread, while this
        replica's loop waits in the quorum: nothing is in flight)."""
        return {
            "algorithm": self.state_dict(),
            "params": [p.detach().clone() for p in self.params],
            "inner": self.inner.state_dict(),
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["algorithm"], _healing=True)
        with torch.no_grad():
            load_tensors({"params": state["params"]}, "params", self.params)
        self.inner.load_state_dict(state["inner"])

    def _continue_healed(self) -> None:
        """Right after this replica was healed at its first step: it stands where its donor
        stood, inside the step that launches the sync (its inner step just taken is dropped:
        its parameters are the donor's); finish that step as the donor does, without a second
        quorum."""
        phase = self.local_step - self.warmup
        with torch.no_grad():
            self._on_step(phase, quorum=False)
        if phase % self.sync_every == 0:
            self.rounds += 1
