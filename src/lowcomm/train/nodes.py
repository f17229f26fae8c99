"""Node groups of a ``lowcomm train`` job: ``nodes`` K > 1 emulated or real nodes of
``procs_per_node`` M processes each.

The M processes of a node train one replica with ``DistributedDataParallel`` over the node's
group, and the outer algorithm runs across nodes over the cross-node group of the ranks with
this rank's local index; ``--link`` is each node's link to the others, shared by its M
processes. See :mod:`lowcomm.train.loop`.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from lowcomm.link import EmulatedLink
from lowcomm.train.config import TrainConfig

__all__ = ["NodeGroups", "describe_layout", "node_groups", "node_link"]


@dataclasses.dataclass
class NodeGroups:
    """This rank's process groups under ``nodes`` > 1 (``None``: WORLD, the flat layout)."""

    node: dist.ProcessGroup | None
    """The M ranks of this rank's node: DDP (with node groups) and ZeRO run inside it."""
    cross: dist.ProcessGroup | None
    """The K ranks with this rank's local index, one per node: the outer algorithm's group."""


def node_groups(cfg: TrainConfig, world: int) -> NodeGroups:
    """Create the node groups and the cross-node groups of ``cfg``'s layout.

    Ranks are node-major (node n holds ranks n*M ... n*M+M-1, as torchrun numbers them), so
    local index j's cross group is {j, M+j, 2M+j, ...}. Every rank creates every group, in the
    same order, as torch.distributed requires.
    """
    if cfg.nodes == 1 or not (cfg.hierarchical or cfg.node_sharding == "zero"):
        return NodeGroups(node=None, cross=None)
    k, m = cfg.nodes, cfg.procs_per_node
    assert m is not None and k * m == world, (k, m, world)
    timeout = datetime.timedelta(seconds=cfg.collective_timeout)
    node, _ = dist.new_subgroups_by_enumeration(
        [[n * m + j for j in range(m)] for n in range(k)], timeout=timeout
    )
    cross = None
    if cfg.hierarchical:
        cross, _ = dist.new_subgroups_by_enumeration(
            [[n * m + j for n in range(k)] for j in range(m)], timeout=timeout
        )
    return NodeGroups(node=node, cross=cross)


def node_link(link: EmulatedLink, cfg: TrainConfig) -> EmulatedLink:
    """The emulated link one process of a node sees. ``--link`` is the node's link to the
    others; with node groups each of its M processes runs the same schedule and sends its own
    full copy at the same time, so each gets 1/M of the bandwidth (the latency is the same)."""
    if not cfg.hierarchical or cfg.procs_per_node in (None, 1):
        return link
    m = cfg.procs_per_node
    return EmulatedLink(link.bandwidth_bps / m, link.latency_s)


def describe_layout(cfg: TrainConfig, world: int) -> str:
    """``"4 workers"``, or ``"4 workers (2 nodes x 2)"`` with node groups."""
    if cfg.nodes == 1:
        return f"{world} workers"
    return f"{world} workers ({cfg.nodes} nodes x {cfg.procs_per_node})"
