"""Elastic syncs of every outer algorithm (``fault_tolerance=``; an object the engine holds,
``engine.elastic_syncs``): the quorum each sync joins, the vote that commits it, what a donor
sends a replica it heals and how the healed replica continues, over
:class:`lowcomm.elastic.sync.FaultTolerance` (torchft's Manager), and what elastic syncs
refuse."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from lowcomm.outer.fragment import AnyFragment
from lowcomm.params import load_tensors

if TYPE_CHECKING:
    from lowcomm.comm import Communicator
    from lowcomm.compress.codecs import Codec
    from lowcomm.compress.feedback import Compressor
    from lowcomm.compress.lgreco import LGreCo
    from lowcomm.elastic.sync import FaultTolerance
    from lowcomm.outer.pace import Pace
    from lowcomm.schedules import Schedule

__all__ = ["ElasticEngine", "ElasticSyncs"]


class _Warm(Protocol):
    """What the elastic syncs read of the engine's warm start (its compressors)."""

    compressors: list[Compressor]


class ElasticEngine(Protocol):
    """What the elastic syncs ask of the engine that owns them
    (:class:`~lowcomm.outer.engine.OuterAlgorithm`)."""

    schedule: ClassVar[Schedule]
    elastic: ClassVar[bool]
    inner: torch.optim.Optimizer
    params: list[torch.Tensor]
    compression: Codec | LGreCo | None
    shard_outer_state: bool
    pace: Pace | None
    warmup: int
    warm: _Warm
    overlap: int
    interval: int

    comm: Communicator

    def compressors(self) -> list[Compressor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, _healing: bool = False) -> None: ...


class ElasticSyncs:
    """The elastic syncs of one engine (see the module docstring) over ``replica`` (a
    :func:`lowcomm.elastic.replica_manager` replica or torchft Manager), whose quorum replaces
    ``process_group``: ``None``, or an emulated link (an :class:`~lowcomm.link.EmulatedLink`,
    or its communicator, whose own group is then not used) that the quorum's collectives go
    through. :meth:`attach` once the engine is built."""

    def __init__(self, engine: ElasticEngine, replica: Any, process_group: Any) -> None:
        from lowcomm.elastic.sync import FaultTolerance
        from lowcomm.link import EmulatedCommunicator, EmulatedLink

        self.link: EmulatedLink | None = None
        """The emulated link the quorum's collectives go through (``None``: the real one)."""
        if isinstance(process_group, EmulatedCommunicator):
            self.link = process_group.link
        elif isinstance(process_group, EmulatedLink):
            self.link = process_group
        elif process_group is not None:
            raise ValueError(
                "pass fault_tolerance or process_group, not both: with fault tolerance the "
                "quorum of each sync is the group (the one process_group it takes is an "
                "emulated link, EmulatedLink or its communicator)"
            )
        self.engine = engine
        self.ft: FaultTolerance = FaultTolerance(replica)
        """The torchft Manager this replica's syncs go through."""
        from lowcomm.elastic.replica import check_dropped_residual

        self.dropped_residual = check_dropped_residual(getattr(replica, "dropped_residual", "keep"))
        """With compressed syncs, what a dropped sync leaves in the residuals: ``keep`` or
        ``reset`` (:data:`lowcomm.elastic.replica.DROPPED_RESIDUAL`)."""

    def attach(self) -> None:
        """Refuse what elastic syncs do not support yet (with the reason), then register what a
        donor sends a replica it heals."""
        self._refuse()
        self.ft.register("lowcomm", self._heal_state, self._load_heal_state)

    def _refuse(self) -> None:
        engine = self.engine
        name = type(engine).__name__
        refusals = [
            (
                engine.shard_outer_state,
                "shard_outer_state (each replica would own the shard its rank in the "
                "group names; a quorum that changes moves the owners, and a joiner heals from "
                "one donor, which holds only its own shard): leave it off",
            ),
            (
                engine.schedule.needs_fixed_group,
                f"{engine.schedule} groups (NoLoCo's pairs need a fixed group)",
            ),
            (
                not type(engine).elastic,
                "its class sets elastic = False (its syncs need a fixed group)",
            ),
            (
                engine.pace is not None,
                "local_steps='dynamic' (its plans assume a fixed group of ranks): use 'fixed'",
            ),
            (
                engine.overlap >= engine.interval,
                f"overlap {engine.overlap} >= sync_every / "
                f"num_fragments = {engine.interval}: a sync would be launched before the last "
                "one is applied, across a quorum that can rebuild the group; use a smaller "
                "overlap (the job's CO2 uses 1)",
            ),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"{name} with fault_tolerance: {why}")

    def join(self) -> bool:
        """This replica's first quorum (:meth:`FaultTolerance.join
        <lowcomm.elastic.sync.FaultTolerance.join>`); returns whether it was healed. Either way
        its compressors start as this replica's own: residuals 0 (a donor's are the donor's
        error, not the joiner's) and rounding noise seeded by its rank in the quorum."""
        healed = self.ft.join()
        self._restart_compressors()
        return healed

    def quorum(self) -> bool:
        """Before a sync is launched: join its quorum; returns whether this replica was healed
        in it (then it stands where its donor stood, at this same launch, and takes part in it
        without contributing, its compressors restarted as at :meth:`join`)."""
        healed = self.ft.quorum()
        if healed:
            self._restart_compressors()
        return healed

    def warm_quorum(self) -> bool:
        """Before a warm step's gradient mean (the warm start: one Manager step per inner
        step, as torchft's DDP takes): join its quorum (this replica's first: as
        :meth:`join`, but the warm step's own commit follows); returns whether this replica
        was healed in it. Healed from a donor inside the warm start, it stands where the donor
        stands, before that step's mean, which it takes without contributing; from a donor
        past it, at a sync's launch (the warm start then hands over to the engine's step)."""
        healed = self.ft.quorum(warm=True)
        if healed:
            self._restart_compressors()
        return healed

    def warm_commit(self, compressors: list[Compressor]) -> bool:
        """After a warm step's means were waited for: the vote. ``False``: the step is skipped
        on every replica of the quorum (``compressors``, the warm start's, reset where
        ``dropped_residual`` says so)."""
        ok = self.ft.commit()
        self.ft.contributing = True
        if ok:
            self.ft.warm_steps += 1
        if not ok and self.dropped_residual == "reset":
            for compressor in compressors:
                compressor.reset_residuals()
        return ok

    def _restart_compressors(self) -> None:
        rank = self.engine.comm.rank
        for compressor in [*self.engine.compressors(), *self.engine.warm.compressors]:
            compressor.restart(rank)

    def commit(self, frag: AnyFragment) -> bool:
        """Wait for the sync in flight, then vote; ``False``: drop it (popped, not applied;
        its compressor's residual kept or reset, as the replica's ``dropped_residual`` says)."""
        sync = frag.pending[0]
        sync.handle.wait()
        if self.ft.commit():
            return True
        frag.drop()
        if frag.compressor is not None and self.dropped_residual == "reset":
            frag.compressor.reset_residuals()
        return False

    def _heal_state(self) -> dict[str, Any]:
        """What a donor sends a replica it heals (in torchft's quorum thread, while this
        replica's loop waits in the quorum: nothing is in flight)."""
        engine = self.engine
        return {
            "algorithm": engine.state_dict(),
            "params": [p.detach().clone() for p in engine.params],
            "inner": engine.inner.state_dict(),
            "warm_steps": self.ft.warm_steps,
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        engine = self.engine
        engine.load_state_dict(state["algorithm"], _healing=True)
        with torch.no_grad():
            load_tensors({"params": state["params"]}, "params", engine.params)
        engine.inner.load_state_dict(state["inner"])
        self.ft.warm_steps = int(state.get("warm_steps", 0))
