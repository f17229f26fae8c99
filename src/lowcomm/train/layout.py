"""The node layout of the ``lowcomm train`` job: ``workers``, ``nodes`` (K) and
``procs_per_node`` (M) resolved from each other. One node is the flat layout, ``workers``
processes; with K > 1, ``workers`` is K x M, and a ``workers`` that disagrees is refused."""

from __future__ import annotations

from lowcomm.registry import BASELINES
from lowcomm.train.errors import ConfigError, check_int

__all__ = ["DEFAULT_WORKERS", "NODE_SHARDING", "resolve_layout"]

DEFAULT_WORKERS = 2
"""Worker processes when neither ``workers`` nor ``procs_per_node`` is set (one node)."""

NODE_SHARDING = ("none", "zero")
"""Values of ``--node-sharding``: how the processes of a node hold the inner AdamW state."""


def resolve_layout(
    *, nodes: int, workers: int | None, procs_per_node: int | None, node_sharding: str, algo: str
) -> tuple[int, int | None]:
    """``(workers, procs_per_node)`` resolved from each other and ``nodes``, refusing values
    that conflict (:class:`~lowcomm.train.errors.ConfigError`): ``workers`` is the world size;
    with one node ``procs_per_node`` is ``None``."""
    check_int("nodes", nodes, low=1)
    if procs_per_node is not None:
        check_int("procs_per_node", procs_per_node, low=1)
    if workers is not None:
        check_int("workers", workers, low=1)
    if node_sharding not in NODE_SHARDING:
        raise ConfigError(
            "node_sharding",
            f"must be one of {', '.join(NODE_SHARDING)}, got {node_sharding!r}",
        )
    if nodes == 1:
        if procs_per_node is not None and workers not in (None, procs_per_node):
            raise ConfigError(
                "workers",
                f"({workers}) conflicts with procs_per_node ({procs_per_node}) on "
                "one node; drop one of them",
            )
        workers = workers or procs_per_node or DEFAULT_WORKERS
        procs_per_node = None
    else:
        if procs_per_node is None:
            if workers is None:
                raise ConfigError(
                    "nodes",
                    f"({nodes}) needs procs_per_node (--procs-per-node M, processes per "
                    f"node) or workers (--workers N, a multiple of {nodes})",
                )
            if workers % nodes:
                raise ConfigError(
                    "workers",
                    f"({workers}) is not a multiple of nodes ({nodes}); set "
                    "procs_per_node (--procs-per-node M) for nodes x M processes",
                )
            procs_per_node = workers // nodes
        total = nodes * procs_per_node
        if workers not in (None, total):
            raise ConfigError(
                "workers",
                f"({workers}) conflicts with nodes ({nodes}) x procs_per_node "
                f"({procs_per_node}) = {total} processes; drop workers or set it to "
                f"{total}",
            )
        workers = total
        if algo == "none":
            raise ConfigError(
                "nodes",
                f"({nodes}) does not apply to algo none, which trains every process "
                f"alone; use workers (--workers {total}) for {total} unsynchronised processes",
            )
        if algo == "demo":
            raise ConfigError(
                "nodes",
                f"({nodes}): algo demo runs over every process, with no node groups; "
                f"use workers (--workers {total})",
            )
    if node_sharding == "zero":
        hierarchical = nodes > 1 and algo not in BASELINES
        if nodes > 1:
            assert procs_per_node is not None
            node_size = procs_per_node
        else:
            node_size = workers if algo == "ddp" else 1
        if algo == "none":
            raise ConfigError(
                "node_sharding",
                "'zero' shards AdamW across processes that train one replica together; "
                "algo none has no such processes",
            )
        if not hierarchical and algo != "ddp":
            raise ConfigError(
                "node_sharding",
                f"'zero' shards AdamW across the processes of a node, which train one "
                f"replica with DDP; with algo {algo} that needs nodes >= 2 "
                "(--nodes 2 --procs-per-node 2), or use algo ddp",
            )
        if node_size < 2:
            raise ConfigError(
                "node_sharding",
                "'zero' needs at least 2 processes per node to shard across, got 1; set "
                "procs_per_node (--procs-per-node) to 2 or more, or node_sharding none",
            )
    return workers, procs_per_node
