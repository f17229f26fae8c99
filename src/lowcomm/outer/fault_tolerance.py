"""Elastic syncs of every outer algorithm (``fault_tolerance=``; an object the engine holds,
``engine.elastic_syncs``): the quorum each sync joins, the vote that commits it, what a donor
sends a replica it heals and how the healed replica continues, over
:class:`lowcomm.elastic.sync.FaultTolerance` (torchft's Manager), and what elastic syncs
refuse."""

from __future__ import annotations

import logging
import time
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

logger = logging.getLogger(__name__)


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
    local_step: int
    fragments: list[AnyFragment]
    interval: int

    comm: Communicator

    def compressors(self) -> list[Compressor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, _healing: bool = False) -> None: ...

    def replay_update(
        self, frag: AnyFragment, sync: Any, avg: list[torch.Tensor], lr_factor: float | None
    ) -> None: ...


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
        from lowcomm.elastic.transport import TensorTransport

        background = getattr(replica, "heal", "blocking") == "background"
        own = isinstance(getattr(replica, "transport", None), TensorTransport)
        self.background = background and own and getattr(replica, "group_size", 1) == 1
        """Whether heals past the warm start reach this replica in the background (the
        replica's ``heal``, over lowcomm's transport)."""
        self.heal_inner: str = getattr(replica, "heal_inner", "bf16")
        """What of the donor's inner optimizer state a heal past the warm start carries (the
        replica's ``heal_inner``: :data:`lowcomm.elastic.replica.HEAL_INNER`)."""
        self._pending: Any = None
        self._quiet_launch = False
        self._restart_after_quorum = False
        """A catch-up completed inside a quorum (this replica was asked to heal another): its
        compressors restart once that quorum has returned (:meth:`_after_quorum`)."""
        self._missed: list[tuple[AnyFragment, Any, list[torch.Tensor], float | None]] = []
        self.caught_up_at: list[float] = []
        """When each background heal of this replica completed (``time.time()``)."""

    def attach(self) -> None:
        """Refuse what elastic syncs do not support yet (with the reason), then register what a
        donor sends a replica it heals."""
        self._refuse()
        self.ft.register("lowcomm", self.heal_state, self.load_heal_state)

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
        self._after_quorum(True)  # (restarted either way)
        if self.catching_up:
            self.ft.contributing = False
        return healed

    def quorum(self) -> bool:
        """Before a sync is launched: join its quorum; returns whether this replica was healed
        in it (then it stands where its donor stood, at this same launch, and takes part in it
        without contributing, its compressors restarted as at :meth:`join`)."""
        healed = self.ft.quorum()
        self._after_quorum(healed)
        if self.catching_up or self._quiet_launch:
            self.ft.contributing = False
        self._quiet_launch = False
        return healed

    def warm_quorum(self, *, before_forward: bool = False) -> bool:
        """Before a warm step's gradient mean (the warm start: one Manager step per inner
        step, as torchft's DDP takes): join its quorum (this replica's first: as
        :meth:`join`, but the warm step's own commit follows); returns whether this replica
        was healed in it. Healed from a donor inside the warm start, it stands where the donor
        stands, before that step's mean, which it takes without contributing; from a donor
        past it, at a sync's launch (the warm start then hands over to the engine's step).
        ``before_forward``: joined before the step's forward (the warm start overlapping
        backward), where a replica healed from a donor inside the warm start computes the
        step's gradient on the donor's parameters: it contributes."""
        healed = self.ft.quorum(warm=True)
        self._after_quorum(healed)
        if healed:
            engine = self.engine
            self.ft.contributing = before_forward and engine.local_step < engine.warmup
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

    def _after_quorum(self, healed: bool) -> None:
        """A quorum has returned: restart the compressors where this replica was healed in it,
        or completed its catch-up inside it (as a donor), with its rank in this quorum."""
        if healed or self._restart_after_quorum:
            self._restart_after_quorum = False
            self._restart_compressors()

    def _restart_compressors(self) -> None:
        rank = self.engine.comm.rank
        for compressor in [*self.engine.compressors(), *self.engine.warm.compressors]:
            compressor.restart(rank)

    def commit(self, frag: AnyFragment) -> bool:
        """Wait for the sync in flight, then vote; ``False``: drop it (popped, not applied;
        its compressor's residual kept or reset, as the replica's ``dropped_residual`` says)."""
        sync = frag.pending[0]
        sync.handle.wait()
        if self._pending is not None and self._pending.failed():
            # the donor's state will not come (the donor died): vote this sync down, so that
            # this replica is behind at the next quorum and healed there again
            self._pending.error_to(self.ft.manager)
        if self.ft.commit():
            return True
        frag.drop()
        if frag.compressor is not None and self.dropped_residual == "reset":
            frag.compressor.reset_residuals()
        return False

    # -- healing ------------------------------------------------------------------------------

    @property
    def catching_up(self) -> bool:
        """Whether this replica was healed in the background and its donor's tensors have not
        been applied yet: it syncs without contributing and keeps the averages it took part in
        (:meth:`missed`), its own anchor and θ meaningless until :meth:`complete_heal`."""
        return self._pending is not None

    def heal_state(self) -> dict[str, Any]:
        """What a donor sends a replica it heals (in torchft's quorum thread, while this
        replica's loop waits in the quorum: nothing is in flight), no more than the joiner
        needs: the algorithm's state without what is this replica's own (error-feedback
        residuals: a joiner restarts its compressors; the merge's snapshots: dead between a
        sync's apply and the next launch, where every quorum is), the inner optimizer's state,
        and — inside the warm start, where every replica holds one θ — the parameters. Past
        the warm start the joiner's parameters are the anchor, the inner optimizer's moments
        travel in bf16, and with ``heal="background"`` everything but the counters goes in a
        :class:`~lowcomm.elastic.transport.Background` part (for algorithms with an outer
        state: LocalSGD's anchor is the average itself)."""
        if self.catching_up:
            # chosen as a donor before its own donor's state has arrived (torchft takes the
            # first up-to-date replica): catch up here, in the quorum, where the loop waits
            # and nothing is in flight, then send as any donor does (its own first sync after
            # it goes out without a contribution: it has no progress of its own yet)
            logger.info("asked to heal a replica while catching up: completing the catch-up first")
            # (its compressors restart once this quorum has returned: their rank is this
            # quorum's, and asking torchft for it here would wait for the very quorum this
            # thread is computing)
            self.complete_heal(in_quorum=True)
            self._quiet_launch = True
        engine = self.engine
        warm = engine.local_step < engine.warmup
        inner = engine.inner.state_dict()
        free = {"snapshots"}  # (the merge's: dead at every quorum)
        for frag in engine.fragments:
            free.update(getattr(frag.outer, "heal_free", list)())
        algorithm = _without_own(engine.state_dict(), free)
        state: dict[str, Any] = {"warm_steps": self.ft.warm_steps}
        if warm:
            params = [p.detach().clone() for p in engine.params]
            return {**state, "algorithm": algorithm, "inner": inner, "params": params}
        moments = _bf16_moments(inner) if self.heal_inner == "bf16" else None
        if not (self.background and all(f.outer is not None for f in engine.fragments)):
            return {**state, "algorithm": algorithm, "inner": moments}
        from lowcomm.elastic.transport import Background

        counters, tensors = _split_tensors(algorithm)
        bulk = Background({"algorithm": tensors, "inner": moments})
        return {**state, "algorithm": counters, "background": bulk}

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`heal_state` on the joiner: what the donor left out is this replica's own
        (taken from its own state); without parameters, θ is the anchor. With a background
        part, only the counters now: the rest when it has arrived (:meth:`complete_heal`)."""
        engine = self.engine
        self._pending, self._missed = None, []  # (healed again: an earlier transfer is dropped)
        algorithm = _filled(state["algorithm"], engine.state_dict())
        engine.load_state_dict(algorithm, _healing=True)
        self.ft.warm_steps = int(state.get("warm_steps", 0))
        if "background" in state:
            self._pending = state["background"]
            self.ft.contributing = False
            return
        with torch.no_grad():
            if "params" in state:
                load_tensors({"params": state["params"]}, "params", engine.params)
            else:
                for frag in engine.fragments:
                    frag.anchor.copy_to(frag.params)
        _load_inner(engine.inner, state["inner"])

    def missed(
        self, frag: AnyFragment, sync: Any, avg: list[torch.Tensor], lr_factor: float | None
    ) -> None:
        """While catching up: the average of a sync this replica took part in (finite), kept
        to be applied, with the outer lr factor of its time, once the donor's state is here."""
        self._missed.append((frag, sync, [t.clone() for t in avg], lr_factor))

    def catch_up(self) -> None:
        """Where nothing is in flight (after a sync point was applied, or any step between
        syncs): complete a background heal whose state has arrived."""
        pending = self._pending
        if pending is not None and pending.done() and not pending.failed():
            self.complete_heal()  # (a failed one is voted down at the next commit)

    def complete_heal(self, *, in_quorum: bool = False) -> None:
        """Wait for the background part of this replica's heal (if any), load it — the
        anchor and outer state as its donor had them at the heal, the counters staying this
        replica's — and apply the outer steps of the syncs it took part in since, in order;
        θ ← the anchor, the compressors restarted (``in_quorum``: called in torchft's quorum
        thread, where this replica sends a joiner its state: once that quorum has returned).
        A transfer that failed raises ``RuntimeError`` (the replica cannot go on: restarted,
        it is healed again)."""
        if self._pending is None:
            return
        received = self._pending.result()
        engine = self.engine
        with torch.no_grad():
            engine.load_state_dict(
                _filled(received["algorithm"], engine.state_dict()), _healing=True
            )
            _load_inner(engine.inner, received["inner"])
            for frag, sync, avg, lr_factor in self._missed:
                engine.replay_update(frag, sync, avg, lr_factor)
            for frag in engine.fragments:
                frag.anchor.copy_to(frag.params)
        missed = len(self._missed)
        self._pending, self._missed = None, []
        if in_quorum:
            self._restart_after_quorum = True
        else:
            self._restart_compressors()
        self.caught_up_at.append(time.time())
        logger.info("caught up: the donor's state arrived; %d missed outer steps applied", missed)


def _without_own(state: Any, free: set[str]) -> Any:
    """An algorithm's ``state_dict`` without this replica's own parts (every compressor's
    residuals) and the entries named in ``free`` (the merge's snapshots; the outer states'
    ``heal_free``), at any depth."""
    if isinstance(state, dict):
        return {
            k: _without_own(v, free)
            for k, v in state.items()
            if k not in free and not (k == "residuals" and "codec" in state)
        }
    if isinstance(state, list) and state and all(isinstance(v, dict) for v in state):
        return [_without_own(v, free) for v in state]
    return state


def _split_tensors(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``state_dict`` as (its counters and settings, its tensors): dicts split key by key
    (lists of dicts element by element), any other value that holds a tensor to the second."""

    def holds_tensor(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, (list, tuple)):
            return any(holds_tensor(x) for x in v)
        if isinstance(v, dict):
            return any(holds_tensor(x) for x in v.values())
        return False

    counters: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            counters[k], tensors[k] = _split_tensors(v)
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            pairs = [_split_tensors(x) for x in v]
            counters[k], tensors[k] = [p[0] for p in pairs], [p[1] for p in pairs]
        elif holds_tensor(v):
            tensors[k] = v
        else:
            counters[k] = v
    return counters, tensors


def _filled(received: Any, own: Any) -> Any:
    """``received`` with what :func:`_without_own` left out taken from ``own``."""
    if isinstance(received, dict) and isinstance(own, dict):
        return {**own, **{k: _filled(v, own.get(k)) for k, v in received.items()}}
    if (
        isinstance(received, list)
        and isinstance(own, list)
        and len(received) == len(own)
        and all(isinstance(v, dict) for v in received)
    ):
        return [_filled(r, o) for r, o in zip(received, own)]
    return received


def _load_inner(inner: Any, state: dict[str, Any] | None) -> None:
    """The inner optimizer's state a heal brought (moments cast back to the parameters'
    dtype), or, where it brought none (``heal_inner`` none), the optimizer's state cleared: it
    starts afresh, as at the job's start (its settings and learning rates stay)."""
    if state is None:
        state = {**inner.state_dict(), "state": {}}
    inner.load_state_dict(state)


def _bf16_moments(inner: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` whose floating-point state tensors (AdamW's moments) are
    bf16: ``load_state_dict`` casts them back to the parameters' dtype."""

    def half(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
            return v.to(torch.bfloat16)
        return v

    state = {i: {k: half(v) for k, v in s.items()} for i, s in inner["state"].items()}
    return {**inner, "state": state}
