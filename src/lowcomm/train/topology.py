"""The replica topology of a ``lowcomm train`` job: where this process stands and which group
each of the job's collectives runs over, made once from the configuration and the initialised
process group (:meth:`Topology.create`).

The job has three shapes, and only this part tells them apart:

* **flat**: every process trains a replica of its own; the outer algorithm (or ddp) runs over
  WORLD;
* **node groups** (``nodes`` K > 1, :mod:`lowcomm.train.nodes`): the M processes of a node train
  one replica with ``DistributedDataParallel`` over the node's group; the outer algorithm runs
  over the cross-node group of this process's local index, through ``--link``;
* **an elastic replica** (``fault_tolerance``, :mod:`lowcomm.train.elastic`): WORLD is one
  replica of an elastic job — one process, or a node group of M processes training it with
  DDP over WORLD — and the outer algorithm's syncs go through torchft's Manager, whose quorum
  is the group of each sync.

The other parts of the job ask it what differs: the group DDP inside a replica runs over, where
the outer algorithm's collectives go, which stream a step's batch comes from, which process a
test's fault is meant for, and how the layout reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.data import make_generator
from lowcomm.link import EmulatedLink
from lowcomm.train.config import TrainConfig
from lowcomm.train.faults import ELASTIC_MODES, FAULT_ENV, fault_point
from lowcomm.train.nodes import NodeGroups, describe_layout, node_groups, node_link
from lowcomm.train.replica import ElasticReplica

__all__ = ["Topology"]


@dataclasses.dataclass
class Topology:
    """This process's place in the job (see the module docstring)."""

    cfg: TrainConfig
    rank: int
    """This process's rank in WORLD (in an elastic job: in its replica)."""
    world: int
    """WORLD's size (in an elastic job: its replica's processes)."""
    groups: NodeGroups
    """The node and cross-node groups (both ``None``: WORLD, or an elastic replica)."""
    elastic: ElasticReplica | None = None
    """This process group as a replica of an elastic job (``fault_tolerance``)."""

    @classmethod
    def create(cls, cfg: TrainConfig) -> Topology:
        """The topology of ``cfg`` on the initialised default process group (creates the node
        groups, or this replica's torchft Manager)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if cfg.fault_tolerance:
            elastic = ElasticReplica(cfg, group_rank=rank, group_size=world)
            return cls(cfg, rank, world, NodeGroups(node=None, cross=None), elastic)
        return cls(cfg, rank, world, node_groups(cfg, world))

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run folder (rank 0; an elastic replica's group rank
        0, into the replica's own folder)."""
        return self.rank == 0

    @property
    def replica_ddp(self) -> bool:
        """Whether this process trains one replica together with others, with DDP over
        :attr:`node_group`, under an outer algorithm (node groups; a node group replica)."""
        return self.cfg.hierarchical or (self.elastic is not None and self.world > 1)

    @property
    def node_group(self) -> dist.ProcessGroup | None:
        """The processes that train one replica (DDP inside it; ZeRO shards over it);
        ``None``: WORLD."""
        return self.groups.node

    def outer_place(self) -> dict[str, Any]:
        """Where the outer algorithm's collectives go, as its keyword: torchft's Manager
        (``fault_tolerance``), else the cross-node group (WORLD without node groups), through
        the emulated link when there is one (each of a node's processes getting its share)."""
        if self.elastic is not None:
            if self.elastic.link is not None:  # the quorum's collectives through the link
                return {"fault_tolerance": self.elastic.replica, "process_group": self.elastic.link}
            return {"fault_tolerance": self.elastic.replica}
        group: Any = self.groups.cross
        link = self.emulated_link()
        if link is not None:
            group = link.communicator(group)
        return {"process_group": group}

    def emulated_link(self) -> EmulatedLink | None:
        """The emulated ``--link`` as one of this process's outer syncs sees it (with node
        groups, its share of the node's link); ``None`` without one."""
        if self.cfg.link is None:
            return None
        return node_link(EmulatedLink.parse(self.cfg.link), self.cfg)

    def batches(self, step: int, gen: torch.Generator) -> torch.Generator:
        """The generator the batch of ``step`` is drawn from: ``gen``, this process's own
        stream (:meth:`generator`), or in an elastic job one that is a function of the step
        (a replica healed to any step draws what it would have drawn there)."""
        if self.elastic is None:
            return gen
        return self.elastic.generator(step)

    def generator(self) -> torch.Generator:
        """This process's own batch stream, seeded by (seed, rank)."""
        return make_generator(self.cfg.seed, self.rank)

    @property
    def tokens_per_step(self) -> int:
        """Tokens every process of WORLD trains in one step together."""
        return self.cfg.batch_size * self.cfg.block_size * self.world

    def describe(self) -> str:
        """``"4 workers"``, ``"4 workers (2 nodes x 2)"``; an elastic replica's processes."""
        if self.elastic is not None:
            return f"replica {self.elastic.replica_id} of {self.world} process(es)"
        return describe_layout(self.cfg, self.world)

    def holds_zero_root(self) -> bool:
        """Whether this process is in the ZeRO group of rank 0 (node 0, or every process for
        ddp on one node), which gathers the whole AdamW state for ``checkpoint.pt``."""
        return self.rank < (self.cfg.procs_per_node or self.world)

    def fault(self, algo: Any) -> tuple[int, str] | None:
        """The fault :data:`~lowcomm.train.faults.FAULT_ENV` asks this process to inject after
        a step (tests and benchmarks): ``(step, mode)``, or ``None``; an elastic fault (a death
        in a sync or while donating) is armed on the replica here and not returned. In an
        elastic job a process is named by its replica's number times the replica's processes
        plus its group rank (the replica's number, for replicas of one process)."""
        if self.elastic is None:
            found = fault_point(self.rank)
        else:
            found = fault_point(self.elastic.stream, attempt=self.elastic.attempt)
        if found is None or found[1] not in ELASTIC_MODES:
            return found
        if self.elastic is None or algo is None:
            raise ValueError(f"{FAULT_ENV}: {found[1]} faults are an elastic job's")
        self.elastic.arm(algo, *found)
        return None

    def close(self) -> None:
        """An elastic replica's heartbeats stop: the others' next quorum leaves it out."""
        if self.elastic is not None:
            self.elastic.close()
