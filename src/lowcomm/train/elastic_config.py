"""The checks of an elastic job's settings (``fault_tolerance``): what elastic replicas run on,
refused up front with the reason (:class:`~lowcomm.train.config.TrainConfig` calls them on
itself, ``cfg``; this module does not import it)."""

from __future__ import annotations

from typing import Any

from lowcomm.elastic.replica import DROPPED_RESIDUAL, HEAL_INNER, HEALS
from lowcomm.train.errors import ConfigError, check_int, check_string

__all__ = [
    "check_elastic_overlap",
    "check_fault_tolerance",
    "heal_inner_for",
    "heal_of",
    "why_blocking",
]


def heal_inner_for(heal: str | None, heal_inner: str | None) -> str:
    """What of its donor's inner optimizer state a healed replica receives: ``heal_inner`` where
    it is given, else chosen with the heal (``heal``; not given: blocking): ``none`` for a heal
    in the background, ``bf16`` for a blocking one. In the background a returning replica
    trains nothing until its transfer has arrived, which shares the link with the syncs, so
    the smaller heal brings it back sooner: in every paired run of docs/fault-tolerance.md it
    kept at least the fault-free goodput share of ``bf16``, its loss no further from it. A
    blocking heal, which every replica waits for, was mixed between the two, and keeps the
    donor's moments. ``heal`` is the heal as it runs (:func:`heal_of`)."""
    if heal_inner is not None:
        return heal_inner
    return "none" if heal == "background" else "bf16"


def why_blocking(cfg: Any) -> str | None:
    """Why a heal past the warm start cannot reach a replica of the elastic job ``cfg`` in the
    background, whatever its ``heal`` says, or ``None`` where it can: a replica of several
    processes (they must take one θ at one sync, their transfers would arrive at different
    ones) or an algorithm that keeps no outer state beside its anchor (LocalSGD: the anchor is
    the average itself) heals blocking."""
    from lowcomm.registry import REGISTRY

    if cfg.procs_per_replica > 1:
        return f"a replica of {cfg.procs_per_replica} processes heals blocking"
    cls = REGISTRY[cfg.algo].cls
    if cls is not None and getattr(cls, "_averages_params", False):
        return f"{cfg.algo} keeps no outer state beside its anchor: its heals block"
    return None


def heal_of(cfg: Any) -> str:
    """The heal a replica of the elastic job ``cfg`` receives past the warm start: its
    ``heal`` (not given: blocking), blocking where :func:`why_blocking` says so."""
    heal = cfg.heal or "blocking"
    return "blocking" if heal == "background" and why_blocking(cfg) is not None else heal


def check_fault_tolerance(cfg: Any) -> None:
    """Elastic replicas: what they run on, refused up front with the reason."""
    if not isinstance(cfg.fault_tolerance, bool):
        raise ConfigError("fault_tolerance", f"must be true or false, got {cfg.fault_tolerance!r}")
    check_int("min_replicas", cfg.min_replicas, low=1)
    if cfg.dropped_residual not in DROPPED_RESIDUAL:
        raise ConfigError(
            "dropped_residual",
            f"must be one of {', '.join(DROPPED_RESIDUAL)}, got {cfg.dropped_residual!r}",
        )
    if cfg.heal is not None and cfg.heal not in HEALS:
        raise ConfigError("heal", f"must be one of {', '.join(HEALS)}, got {cfg.heal!r}")
    if cfg.heal_inner is not None and cfg.heal_inner not in HEAL_INNER:
        raise ConfigError(
            "heal_inner", f"must be one of {', '.join(HEAL_INNER)}, got {cfg.heal_inner!r}"
        )
    if cfg.lighthouse is not None:
        check_string("lighthouse", cfg.lighthouse)
    if cfg.replica_id is not None:
        check_string("replica_id", cfg.replica_id)
    if not cfg.fault_tolerance:
        for key in ("lighthouse", "replica_id"):
            if getattr(cfg, key) is not None:
                raise ConfigError(key, "needs fault_tolerance (--fault-tolerance)")
        return
    if cfg.lighthouse is not None and cfg.replica_id is None:
        raise ConfigError(
            "replica_id", "is needed with lighthouse: the name of this replica (replica_3)"
        )
    if cfg.replica_id is not None and cfg.lighthouse is None:
        raise ConfigError(
            "lighthouse",
            "is needed with replica_id: the address of the Lighthouse to join (without "
            "both, lowcomm train starts the Lighthouse and every replica itself)",
        )
    if cfg.lighthouse is None and cfg.min_replicas > cfg.replicas:
        flag = "--nodes" if cfg.nodes > 1 else "--workers"
        raise ConfigError(
            "min_replicas",
            f"({cfg.min_replicas}) is more than the {cfg.replicas} replicas started "
            f"({flag}); use at most {cfg.replicas}",
        )
    from lowcomm.registry import ELASTIC as supported

    if cfg.algo not in supported:
        raise ConfigError(
            "algo",
            f"{cfg.algo!r} does not run with fault_tolerance (elastic syncs are an outer "
            f"algorithm's, one in flight at a time); use one of {', '.join(supported)}",
        )
    refused = [
        (
            cfg.nodes > 1 and cfg.lighthouse is not None,
            "nodes",
            "with lighthouse this command is one replica; make it a node group of M "
            "processes by starting it under torchrun --nproc-per-node M instead",
        ),
        (
            cfg.node_sharding != "none",
            "node_sharding",
            "a replica's processes keep whole AdamW states, which a joiner takes from its "
            "donor; leave node_sharding none",
        ),
        (
            cfg.checkpoint_every > 0,
            "checkpoint_every",
            "replicas heal from each other, "
            "not from disk; disk checkpoints of an elastic job are not supported yet",
        ),
        (cfg.resume is not None, "resume", "an elastic job cannot resume from disk yet"),
        (
            bool(cfg.value("shard_outer_state")),
            "shard_outer_state",
            "each replica would own the shard of the outer state its rank in the group "
            "names; a quorum that changes moves the owners, and a joiner heals from one "
            "donor, which holds only its own shard",
        ),
        (cfg.documents, "documents", "the document stream plans over a fixed group"),
        (cfg.ceiling_steps > 0, "ceiling_steps", "not measured in an elastic job"),
    ]
    for bad, key, why in refused:
        if bad:
            raise ConfigError(key, f"is not supported with fault_tolerance: {why}")


def check_elastic_overlap(cfg: Any) -> None:
    """With fault_tolerance, refuse a sync in flight across the next sync point (CO2 at
    full overlap): once the algorithm's keywords are resolved."""
    kwargs = cfg.algorithm_kwargs()
    if not cfg.fault_tolerance or ("overlap" not in kwargs and cfg.algo != "co2"):
        return
    overlap = kwargs.get("overlap")
    if overlap is None:  # CO2's own default: the paper's schedule, H
        overlap = cfg.sync_every
    if int(overlap) >= cfg.sync_every // int(kwargs.get("num_fragments") or 1):
        raise ConfigError(
            "overlap",
            f"({overlap}) is not supported with fault_tolerance: a sync would be launched "
            "before the last one is applied, while torchft's Manager holds one quorum at a "
            "time; use an overlap below sync_every / num_fragments (the job's CO2 uses 1)",
        )
