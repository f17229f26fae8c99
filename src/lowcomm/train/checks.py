"""The checks of the ``lowcomm train`` job's fields that need more than one value (a base of
:class:`~lowcomm.train.config.TrainConfig`, run by its ``__post_init__``): the node layout
(resolved here), documents and their balancing, elastic replicas, the inner optimizer, unequal
worker speeds and the output paths."""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

from lowcomm.registry import BASELINES
from lowcomm.train.errors import ConfigError, check_int, check_string
from lowcomm.train.fields import (
    DEFAULT_WORKERS,
    NODE_SHARDING,
    OPTIMIZERS,
    PRECISIONS,
    TrainFields,
)

__all__ = ["ConfigChecks"]

_COST_MODELS = ("fit", "analytic")


class ConfigChecks(TrainFields):
    """The job's checks over its fields (see the module docstring); they raise
    :class:`~lowcomm.train.errors.ConfigError`."""

    def _check_speeds(self) -> None:
        if self.speeds is None:
            return
        values: Any = self.speeds
        if isinstance(values, str):
            values = [v.strip() for v in values.split(",")]
        try:
            speeds = [float(v) for v in values]
        except (TypeError, ValueError):
            raise ConfigError(
                "speeds",
                f"must be positive numbers, one per worker, such as 1,1,1,0.5; got {self.speeds!r}",
            ) from None
        if not speeds or not all(math.isfinite(v) and v > 0 for v in speeds):
            raise ConfigError(
                "speeds", f"must be finite numbers > 0, one per worker; got {self.speeds!r}"
            )
        if self.workers is not None and len(speeds) != self.workers:
            raise ConfigError(
                "speeds",
                f"gives {len(speeds)} speed(s) for {self.workers} worker processes; give one "
                "per worker",
            )
        self.speeds = ",".join(f"{v:g}" for v in speeds)

    def _check_optimizer(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                "precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                "optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.optimizer == "adamw":
            return
        if self.algo == "demo":
            raise ConfigError(
                "optimizer",
                "muon cannot be combined with --algo demo (DeMo is the optimizer); use adamw",
            )
        if self.node_sharding == "zero":
            raise ConfigError(
                "optimizer",
                "muon cannot be combined with node_sharding zero (ZeroRedundancyOptimizer "
                "shards one torch optimizer); use adamw, or node_sharding none",
            )

    def _check_documents(self) -> None:
        from lowcomm.balance import METHODS, parse_assignments

        for key in ("documents", "balance_paired", "busy_wait"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, f"must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.balance, str):
            raise ConfigError("balance", f"must be a string such as 'cost', got {self.balance!r}")
        try:
            parse_assignments(self.balance)
        except ValueError as e:
            raise ConfigError("balance", str(e).removeprefix("assignment ")) from None
        for key, choices in (
            ("balance_method", METHODS),
            ("cost_model", _COST_MODELS),
        ):
            if getattr(self, key) not in choices:
                raise ConfigError(
                    key, f"must be one of {', '.join(choices)}, got {getattr(self, key)!r}"
                )
        check_int("cost_refit", self.cost_refit, low=0)
        if not self.documents:
            if self.token_cap is not None:
                raise ConfigError("token_cap", "applies to documents mode only: add --documents")
            if self.balance != "cost":
                raise ConfigError("balance", "applies to documents mode only: add --documents")
            if self.balance_paired:
                raise ConfigError(
                    "balance_paired", "applies to documents mode only: add --documents"
                )
            return
        if self.ceiling_steps:
            raise ConfigError(
                "ceiling_steps",
                "times fixed windows, not documents: run algo none with --documents for the "
                "no-sync ceiling of the same work",
            )
        if self.block_size < 16:
            raise ConfigError("block_size", "must be at least 16 with documents")
        if "remap" in parse_assignments(self.balance):
            if self.algo not in ("ddp", "none"):
                raise ConfigError(
                    "balance",
                    "remap balances every step (DDP, or none): an outer algorithm plans "
                    "whole rounds; use cost or cost+split",
                )
            if self.nodes > 1:
                raise ConfigError(
                    "balance",
                    "remap exchanges every layer's activations, inside one node only: with "
                    "nodes > 1 use cost+split (which splits inside a node)",
                )
            if self.dropout:
                raise ConfigError("balance", "remap needs dropout 0 (set dropout = 0)")
        need = self.batch_size * self.block_size + self.block_size
        if self.token_cap is not None:
            check_int("token_cap", self.token_cap, low=1)
            if self.token_cap < need:
                raise ConfigError(
                    "token_cap",
                    f"({self.token_cap}) is below a step's tokens plus the longest document "
                    f"(batch_size x block_size + block_size = {need}): raise it to {need}",
                )
        if self.nodes > 1 and self.algo not in BASELINES:
            raise ConfigError(
                "documents",
                "with node groups is supported for ddp only (an outer algorithm across nodes "
                "would need per-step balancing inside each node): drop --nodes or use ddp",
            )

    def _check_fault_tolerance(self) -> None:
        """Elastic replicas: what they run on, refused up front with the reason."""
        if not isinstance(self.fault_tolerance, bool):
            raise ConfigError(
                "fault_tolerance", f"must be true or false, got {self.fault_tolerance!r}"
            )
        check_int("min_replicas", self.min_replicas, low=1)
        if self.lighthouse is not None:
            check_string("lighthouse", self.lighthouse)
        if self.replica_id is not None:
            check_string("replica_id", self.replica_id)
        if not self.fault_tolerance:
            for key in ("lighthouse", "replica_id"):
                if getattr(self, key) is not None:
                    raise ConfigError(key, "needs fault_tolerance (--fault-tolerance)")
            return
        if self.lighthouse is not None and self.replica_id is None:
            raise ConfigError(
                "replica_id", "is needed with lighthouse: the name of this replica (replica_3)"
            )
        if self.replica_id is not None and self.lighthouse is None:
            raise ConfigError(
                "lighthouse",
                "is needed with replica_id: the address of the Lighthouse to join (without "
                "both, lowcomm train starts the Lighthouse and every replica itself)",
            )
        if self.lighthouse is None and self.min_replicas > self.replicas:
            flag = "--nodes" if self.nodes > 1 else "--workers"
            raise ConfigError(
                "min_replicas",
                f"({self.min_replicas}) is more than the {self.replicas} replicas started "
                f"({flag}); use at most {self.replicas}",
            )
        from lowcomm.registry import ELASTIC as supported

        if self.algo not in supported:
            raise ConfigError(
                "algo",
                f"{self.algo!r} does not run with fault_tolerance (elastic syncs are an outer "
                f"algorithm's, one in flight at a time); use one of {', '.join(supported)}",
            )
        refused = [
            (
                self.nodes > 1 and self.lighthouse is not None,
                "nodes",
                "with lighthouse this command is one replica; make it a node group of M "
                "processes by starting it under torchrun --nproc-per-node M instead",
            ),
            (
                self.node_sharding != "none",
                "node_sharding",
                "a replica's processes keep whole AdamW states, which a joiner takes from its "
                "donor; leave node_sharding none",
            ),
            (
                self.checkpoint_every > 0,
                "checkpoint_every",
                "replicas heal from each other, "
                "not from disk; disk checkpoints of an elastic job are not supported yet",
            ),
            (self.resume is not None, "resume", "an elastic job cannot resume from disk yet"),
            (
                self.compression is not None,
                "compression",
                "compressed syncs are not carried by torchft's Manager",
            ),
            (
                self.link is not None,
                "link",
                "the emulated link wraps a fixed process group; elastic syncs go through torchft's",
            ),
            (self.documents, "documents", "the document stream plans over a fixed group"),
            (self.ceiling_steps > 0, "ceiling_steps", "not measured in an elastic job"),
            (
                bool(self.sync_warmup),
                "sync_warmup",
                "the warm start averages every step, and "
                "elastic syncs take a quorum per sync, not per inner step: leave it unset (0 with "
                "fault_tolerance)",
            ),
        ]
        for bad, key, why in refused:
            if bad:
                raise ConfigError(key, f"is not supported with fault_tolerance: {why}")

    def _check_layout(self) -> None:
        """Resolve ``workers`` and ``procs_per_node`` from each other and ``nodes``, refusing
        values that conflict. Afterwards ``workers`` is the world size; with one node
        ``procs_per_node`` is ``None`` (one node is the flat layout, ``workers`` processes)."""
        check_int("nodes", self.nodes, low=1)
        if self.procs_per_node is not None:
            check_int("procs_per_node", self.procs_per_node, low=1)
        if self.workers is not None:
            check_int("workers", self.workers, low=1)
        if self.node_sharding not in NODE_SHARDING:
            raise ConfigError(
                "node_sharding",
                f"must be one of {', '.join(NODE_SHARDING)}, got {self.node_sharding!r}",
            )
        if self.nodes == 1:
            if self.procs_per_node is not None and self.workers not in (None, self.procs_per_node):
                raise ConfigError(
                    "workers",
                    f"({self.workers}) conflicts with procs_per_node ({self.procs_per_node}) on "
                    "one node; drop one of them",
                )
            self.workers = self.workers or self.procs_per_node or DEFAULT_WORKERS
            self.procs_per_node = None
        else:
            if self.procs_per_node is None:
                if self.workers is None:
                    raise ConfigError(
                        "nodes",
                        f"({self.nodes}) needs procs_per_node (--procs-per-node M, processes per "
                        f"node) or workers (--workers N, a multiple of {self.nodes})",
                    )
                if self.workers % self.nodes:
                    raise ConfigError(
                        "workers",
                        f"({self.workers}) is not a multiple of nodes ({self.nodes}); set "
                        "procs_per_node (--procs-per-node M) for nodes x M processes",
                    )
                self.procs_per_node = self.workers // self.nodes
            total = self.nodes * self.procs_per_node
            if self.workers not in (None, total):
                raise ConfigError(
                    "workers",
                    f"({self.workers}) conflicts with nodes ({self.nodes}) x procs_per_node "
                    f"({self.procs_per_node}) = {total} processes; drop workers or set it to "
                    f"{total}",
                )
            self.workers = total
            if self.algo == "none":
                raise ConfigError(
                    "nodes",
                    f"({self.nodes}) does not apply to algo none, which trains every process "
                    f"alone; use workers (--workers {total}) for {total} unsynchronised processes",
                )
            if self.algo == "demo":
                raise ConfigError(
                    "nodes",
                    f"({self.nodes}): algo demo runs over every process, with no node groups; "
                    f"use workers (--workers {total})",
                )
        if self.node_sharding == "zero":
            if self.algo == "none":
                raise ConfigError(
                    "node_sharding",
                    "'zero' shards AdamW across processes that train one replica together; "
                    "algo none has no such processes",
                )
            if not self.hierarchical and self.algo != "ddp":
                raise ConfigError(
                    "node_sharding",
                    f"'zero' shards AdamW across the processes of a node, which train one "
                    f"replica with DDP; with algo {self.algo} that needs nodes >= 2 "
                    "(--nodes 2 --procs-per-node 2), or use algo ddp",
                )
            if self.node_size < 2:
                raise ConfigError(
                    "node_sharding",
                    "'zero' needs at least 2 processes per node to shard across, got 1; set "
                    "procs_per_node (--procs-per-node) to 2 or more, or node_sharding none",
                )

    def _check_paths(self) -> None:
        for key in ("out", "name", "resume", "tensorboard"):
            if getattr(self, key) is not None:
                check_string(key, getattr(self, key))
        if self.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                "tensorboard",
                "needs the tensorboard package, which is not installed: "
                "pip install 'lowcomm[tensorboard]', or drop --tensorboard",
            )
        if self.resume is not None and self.overwrite:
            raise ConfigError(
                "resume",
                "cannot be combined with overwrite, which deletes the run and its checkpoints; "
                "drop one of them",
            )
        if self.name is not None and (os.sep in self.name or self.name in (".", "..")):
            raise ConfigError(
                "name", f"must be a plain folder name, got {self.name!r}; use --out for a path"
            )
