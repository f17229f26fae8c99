"""The synchronisation of a ``lowcomm train`` job: how this rank's replica keeps in step with the
others, made once from the configuration and the topology (:meth:`Synchronisation.create`).

* ``ddp``: ``DistributedDataParallel`` over every process (gradients all-reduced every step),
  counted by a :class:`~lowcomm.comm.DDPCommMeter` or carried by a compressed hook;
* ``none``: nothing (every worker alone: the no-sync ceiling);
* ``demo``: the inner optimizer communicates itself;
* an outer algorithm: over the place the topology gives (a process group, through the
  emulated link, or torchft's Manager), with DDP inside the replica when several processes
  train it (node groups; a node group replica of an elastic job).

An elastic replica's syncs also leave a record each (whether committed, the quorum, the
anchor's checksum), and a replica healed at a sync continues from its donor's step
(:meth:`Synchronisation.after_step`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowcomm.comm import CommStats, DDPCommMeter
from lowcomm.link import EmulatedLink
from lowcomm.optim import DeMo
from lowcomm.train.config import TrainConfig
from lowcomm.train.resume import restore_stats
from lowcomm.train.topology import Topology

if TYPE_CHECKING:
    from lowcomm.outer.engine import OuterAlgorithm

__all__ = ["Synchronisation"]


@dataclasses.dataclass
class Synchronisation:
    """How this rank's replica keeps in step with the others (see the module docstring)."""

    model: nn.Module
    """What the steps call: the GPT, or its ``DistributedDataParallel`` wrapper."""
    stats: Any
    """The communication counters ``summary.json`` reports (a :class:`~lowcomm.comm.CommStats`):
    with node groups, those of the cross-node group."""
    topology: Topology | None = None
    algo: OuterAlgorithm | None = None
    """The outer algorithm; ``None`` for ddp, none and demo."""
    demo: DeMo | None = None
    """DeMo, the inner optimizer that communicates."""
    meter: Any = None
    """Told when each backward pass is done: ddp's traffic meter (or its compressed hook)."""
    node_meter: DDPCommMeter | None = None
    """DDP inside the replica (node groups)."""
    ddp_compression: Any = None
    """The compressed DDP hook's state (its residuals), when used."""

    @classmethod
    def create(
        cls,
        cfg: TrainConfig,
        topology: Topology,
        gpt: nn.Module,
        inner: torch.optim.Optimizer,
        state: dict[str, Any] | None,
        device: torch.device,
    ) -> Synchronisation:
        """Wrap ``gpt`` for ``cfg.algo``, restoring ``state``'s part of it. ``inner`` is the
        optimizer the algorithm drives: with ZeRO, this rank's local AdamW, whose state is the
        one it zeroes on a non-finite average (the wrapper's own ``state`` stays empty)."""
        ddp_kwargs: dict[str, Any] = {"bucket_cap_mb": cfg.bucket_cap_mb}
        if device.type == "cuda":
            ddp_kwargs["device_ids"] = [device.index]
        if cfg.algo == "ddp":
            sync = cls._ddp(cfg, gpt, state, ddp_kwargs)
        elif cfg.algo == "none":
            sync = cls(model=gpt, stats=CommStats())  # the no-sync ceiling: every worker alone
        elif cfg.algo == "demo":
            # the optimizer itself communicates (inner_optimizer): no DDP, no outer algorithm
            assert isinstance(inner, DeMo)
            sync = cls(model=gpt, stats=inner.stats, demo=inner)
        else:
            sync = cls(model=gpt, stats=None)
            if topology.replica_ddp:
                # one replica per node: its processes average gradients every step (the fast
                # local network, never the emulated link)
                sync.model = nn.parallel.DistributedDataParallel(
                    gpt, process_group=topology.node_group, **ddp_kwargs
                )
                sync.node_meter = DDPCommMeter()
                sync.node_meter.register(sync.model)
            # The model itself, not its parameters: streaming builds its fragments from its
            # blocks.
            algo = cfg.algorithm_class()(
                gpt, inner, **topology.outer_place(), **cfg.algorithm_kwargs()
            )
            if not topology.replica_ddp and not cfg.documents:
                # one backward a step, nothing between it and the optimizer's step: the warm
                # start's means go out during backward (documents accumulate micro-batches;
                # inside a node DDP sets the gradients only when backward ends)
                algo.warm_start_during_backward()
            if state is not None:
                algo.load_state_dict(state["algorithm"])
            sync.algo, sync.stats = algo, algo.stats
        sync.topology = topology
        if state is not None:
            restore_stats(sync.stats, state.get("comm_stats") or {})
            if sync.node_meter is not None:
                restore_stats(sync.node_meter.stats, state.get("intra_node_stats") or {})
        return sync

    @classmethod
    def _ddp(
        cls,
        cfg: TrainConfig,
        gpt: nn.Module,
        state: dict[str, Any] | None,
        ddp_kwargs: dict[str, Any],
    ) -> Synchronisation:
        # with nodes, still DDP over every process: the layout sets their number (and the
        # group ZeRO shards over), not what is synchronised
        link = EmulatedLink.parse(cfg.link) if cfg.link is not None else None
        ddp = nn.parallel.DistributedDataParallel(gpt, **ddp_kwargs)
        sync = cls(model=ddp, stats=None)
        compression = cfg.value("compression")
        if compression is not None:
            from lowcomm.compress import ddp_hook

            hook_state, hook = ddp_hook(
                compression, process_group=link.communicator() if link is not None else None
            )
            ddp.register_comm_hook(hook_state, hook)
            if state is not None and state.get("ddp_hook") is not None:
                hook_state.load_state_dict(state["ddp_hook"])
            sync.ddp_compression = sync.meter = hook_state
        else:
            sync.meter = DDPCommMeter(link=link.model() if link is not None else None)
            sync.meter.register(ddp)
        sync.stats = sync.meter.stats
        return sync

    # --- every step ---------------------------------------------------------------------------

    def backward_done(self) -> None:
        """This rank's backward pass is done (the traffic meters time what follows)."""
        if self.meter is not None:
            self.meter.backward_done()
        if self.node_meter is not None:
            self.node_meter.backward_done()

    def before_forward(self, step: int) -> int:
        """At the start of ``step``, its learning rate set: an elastic warm step's quorum
        (:meth:`~lowcomm.outer.engine.OuterAlgorithm.before_forward`). Returns the step the
        loop stands at: ``step``, or the donor's right after this replica was healed there."""
        if self.algo is None:
            return step
        self.algo.before_forward()
        elastic = self.topology.elastic if self.topology is not None else None
        if elastic is None or self.algo.warm.healed_into_sync:
            return step  # (healed into a sync's launch: followed at the step's end, as ever)
        return elastic.healed_to(self.algo.local_step + 1, step)

    def after_step(self, step: int) -> tuple[int, dict[str, Any] | None]:
        """After the inner optimizer's step of ``step``: the outer algorithm's step. Returns the
        step the loop stands at afterwards — ``step``, or in an elastic job the donor's step
        right after this replica was healed — and the record of the sync it applied, if an
        elastic replica applied one."""
        if self.algo is None:
            return step, None
        self.algo.step()
        elastic = self.topology.elastic if self.topology is not None else None
        if elastic is None:
            return step, None
        record = elastic.synced(self.algo)
        return elastic.follow(self.algo.local_step, step), record

    # --- what the job reads -------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Whether nothing is in flight between steps: no outer sync launched and not applied,
        no gathered DeMo update pending (the same on every rank: it follows the schedule)."""
        if self.algo is not None and self.algo.in_flight:
            return False
        return self.demo is None or not self.demo.in_flight

    @property
    def consensus(self) -> list[torch.Tensor] | None:
        """The model to evaluate in place of the live parameters: the outer algorithm's anchor
        (its consensus), or ``None`` (the live model is the consensus)."""
        return self.algo.anchor_views if self.algo is not None else None

    @property
    def rounds(self) -> int:
        return int(getattr(self.algo, "rounds", 0)) if self.algo is not None else 0

    @property
    def outer_source(self) -> Any:
        """What lowcomm's logged scalars come from: the outer algorithm, or DeMo (``None``:
        neither; every step is a sync)."""
        return self.algo if self.algo is not None else self.demo

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (waits for in-flight all-reduces, not applying
        them, before the counters are read)."""
        self.settle()
        return {
            "algorithm": self.algo.state_dict() if self.algo is not None else None,
            "ddp_hook": (
                self.ddp_compression.state_dict() if self.ddp_compression is not None else None
            ),
            "comm_stats": dataclasses.asdict(self.stats),
            "intra_node_stats": (
                dataclasses.asdict(self.node_meter.stats) if self.node_meter is not None else None
            ),
        }

    def finish(self) -> None:
        """Apply what is still in flight: the outer algorithm's last syncs, DeMo's last
        gathered update (with overlap)."""
        if self.algo is not None:
            self.algo.finish()
        if self.demo is not None:
            self.demo.finish()
        self.settle()

    def settle(self) -> None:
        """Count the DDP meters' time blocked still measured on the device (GPU events read
        once, before the counters are read or saved)."""
        for meter in (self.meter, self.node_meter):
            if meter is not None:
                meter.settle()

    def steps_done(self, step: int) -> float:
        """Inner steps per worker done after ``step`` (with dynamic local steps, all workers'
        steps over their number: what the tokens trained are counted from)."""
        if self.algo is None or self.algo.pace is None:
            return float(step)
        return self.algo.steps_done()

    def per_rank(self) -> dict[str, Any]:
        """This rank's counters for ``summary.json``."""
        return {
            "inner_steps": self.algo.inner_steps if self.algo is not None else None,
            "positions": self.algo.local_step if self.algo is not None else None,
            "rounds": self.rounds,
            "skipped_updates": int(getattr(self.algo, "skipped_updates", 0)),
            **self.stats.as_dict(),
            # an elastic replica's waits for its quorums (not collectives: not in blocked_s)
            "quorum_wait_s": (
                ft.quorum_wait_s if (ft := getattr(self.algo, "ft", None)) is not None else None
            ),
            "intra_node": self.node_meter.stats.as_dict() if self.node_meter is not None else None,
        }
