"""The ``lowcomm train`` configuration: one typed dataclass, filled from defaults, a TOML file and
command-line flags (in that order of precedence, lowest first).

Every key has a flag of the same name with dashes (``sync_every`` -> ``--sync-every``) and the
same key in a TOML file (flat, no tables)::

    # co2.toml
    algo = "co2"
    steps = 600
    sync_every = 12
    clip = "none"            # an outer hyperparameter: no outer momentum clipping

The keys are the job's fields and the outer algorithms' keywords (:func:`config_keys`). The
latter are held in one section, :attr:`TrainConfig.outer` (the keys given), and resolved once
into :attr:`TrainConfig.algorithm`, the algorithm's own ``Config``: the library's defaults <
the job's (:func:`~.outer_keys.job_outer_defaults`) < the file < the flags; ``--tune-link``
then chooses from the link what none of the file and flags gave. Only keys that apply to the
algorithm are passed to it (``--clip`` means nothing to DiLoCo: ignored with a warning, not
checked). Bad values raise :class:`ConfigError`, a ``ValueError`` that names the key, the
value and the fix.

The algorithms check their own keywords; this class checks the rest: the job's fields, and
what needs several settings (automatic fragments need enough transformer blocks; SlowMo an inner
learning rate > 0). Example: ``config_from_dict({"algo": "diloco", "outer_lr": 0.7})`` (flat,
as files and flags) is ``TrainConfig(algo="diloco", outer={"outer_lr": 0.7})``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib.util
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lowcomm.hparams import Hyperparameters, field_docstrings
from lowcomm.outer.diloco import SlowMo
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.registry import BASELINES, REGISTRY, names
from lowcomm.train.elastic_config import check_elastic_overlap, check_fault_tolerance
from lowcomm.train.errors import ConfigError, check_float, check_int, check_string, config_error
from lowcomm.train.layout import DEFAULT_WORKERS, NODE_SHARDING, resolve_layout
from lowcomm.train.outer_keys import (
    ALL_OUTER_KEYS,
    OUTER_FIELDS,
    OUTER_KEYS,
    job_outer_defaults,
    job_type,
    outer_doc,
)

__all__ = [
    "ALGORITHM_CHOICES",
    "DEFAULT_WORKERS",
    "DEVICES",
    "FASTEST_STEP_S",
    "MAX_STEPS",
    "NODE_SHARDING",
    "NO_OUTER_ALGORITHM",
    "OPTIMIZERS",
    "OUTER_KEYS",
    "PRECISIONS",
    "ConfigError",
    "TrainConfig",
    "config_from_dict",
    "config_keys",
    "field_docs",
    "key_type",
]

logger = logging.getLogger(__name__)

ALGORITHM_CHOICES = names()
"""Values of ``--algo`` (:mod:`lowcomm.registry`); ``ddp`` is the synchronous DDP baseline."""

NO_OUTER_ALGORITHM = BASELINES
"""``--algo`` values without a lowcomm algorithm: the DDP baseline, and ``none``, the no-sync
ceiling (the same workers training with no communication at all, for throughput comparisons)."""

DEVICES = ("auto", "cpu", "cuda")
"""Values of ``--device``: where the workers compute (:func:`.worker.place_workers`)."""

OPTIMIZERS = ("adamw", "muon")
PRECISIONS = ("fp32", "bf16")

FASTEST_STEP_S = 1e-3
"""A lower bound on one training step's time on any device (PyTorch launches dozens of kernels
per step): what :data:`MAX_STEPS` is derived from."""
MAX_STEPS = 31_557_600_000
"""The most ``steps`` a job accepts: a year of steps at :data:`FASTEST_STEP_S`."""

_BACKENDS = ("auto", "gloo", "nccl")
_LR_SCHEDULES = ("cosine", "constant")
_COST_MODELS = ("fit", "analytic")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``lowcomm train`` needs; see the module docstring for how it is filled."""

    # --- job -------------------------------------------------------------------------------
    algo: str = "co2"
    """The algorithm: a name of :data:`lowcomm.registry.REGISTRY` (``lowcomm train --help``
    lists them with a line each)."""
    workers: int | None = None
    """Local worker processes to launch (default 2; with nodes, nodes x procs_per_node). Under
    torchrun, which sets the world size, it is ignored (with nodes, checked against it)."""
    nodes: int = 1
    """K: node groups; from 2 on, each node's processes train one replica with DDP inside the
    node and the algorithm runs across nodes (1: every worker its own replica)."""
    procs_per_node: int | None = None
    """M: processes per node (ranks node-major: node n holds n*M ... n*M+M-1); unset: workers /
    nodes."""
    node_sharding: str = "none"
    """Inside a node: "none" (every process holds the whole AdamW state) or "zero" (AdamW state
    sharded across the node's processes with ZeroRedundancyOptimizer)."""
    steps: int = 960
    """Inner optimizer steps per worker."""
    sync_every: int = 12
    """H: inner steps per communication round (not used by ddp, which syncs every step)."""
    seed: int = 0
    """Seed for the model initialisation (same on every rank) and the data order (per rank)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl when every local worker has a GPU of its own, else
    gloo), gloo or nccl (GPU collectives on NCCL, the few CPU control tensors on gloo: process
    groups cpu:gloo,cuda:nccl). With fewer GPUs than workers, or gloo, worker k runs on GPU
    k mod G and gloo carries its CUDA tensors (through pinned host memory)."""
    device: str = "auto"
    """Where the workers compute: auto (the GPUs when CUDA is available, else the CPU), cuda
    or cpu (CPU workers on a machine with GPUs)."""
    bucket_cap_mb: float = 25.0
    """Size of the flat communication buckets, in MiB (one collective per bucket)."""

    link: str | None = None
    """Emulated slow link for every collective: a profile (rdma-800g, tcp-80g, 1gbit, 100mbit,
    10mbit, 1mbit) or RATE:LATENCY such as 100mbit:20ms; unset: the real network."""
    tune_link: str = "auto"
    """Choose the outer sync's codec and overlap (and the warm start's codec) from the link, for
    the settings not given: auto (the emulated --link; the real network measured under torchrun;
    nothing on one machine), measure (always time the real network), off, or a link profile or
    RATE:LATENCY to choose as if on that link without emulating it."""
    algo_from_link: bool = False
    """Let --tune-link run SparseLoCo where the algorithm cannot hide its syncs and SparseLoCo
    would reach its loss sooner: on when --algo and every outer setting are unset."""

    # --- data ------------------------------------------------------------------------------
    data: str | None = None
    """UTF-8 text file (a .jsonl file: one {"text": ...} document per line) or folder of such
    files (.txt, .md, .rst, .jsonl; byte-level tokens); unset: the embedded corpus."""
    batch_size: int = 16
    """Sequences per worker per inner step."""
    block_size: int = 64
    """Tokens per sequence (the model's context length)."""

    # --- documents (variable-length work; lowcomm.balance) -----------------------------------
    documents: bool = False
    """Train on whole documents instead of fixed windows: each step a worker draws exactly
    batch_size x block_size tokens of documents (pieces of at most block_size), packed with
    block-diagonal causal attention and assigned to ranks by --balance. --data: a folder (one
    document per file, one per line of its .jsonl files), a .jsonl file ("text" per line) or a
    text file (blank-line separated); unset: the Python standard library's source files."""
    balance: str = "cost"
    """With documents: how documents are assigned to ranks: sequential (each keeps what it
    drew), random, length (group by length), tokens (equal tokens), cost (equal predicted
    compute time), cost+split (also split a document whose cost exceeds the fair share over
    several ranks, where the link makes it pay) or remap (the linear layers on equal runs of
    tokens, attention on whole documents balanced by s², activations exchanged every layer;
    DDP on one node, no dropout). Outer algorithms balance a whole round, ddp
    every step. A comma-separated list is taken in turn per step or round (to compare them
    side by side: training does not depend on it)."""
    balance_paired: bool = False
    """With a list of assignments: give each assignment of a turn the same documents (every
    drawn step or round is trained once per assignment), so they are compared on identical
    work; for measurements."""
    balance_method: str = "lpt"
    """With documents: the partitioning of tokens and cost balancing: lpt or kk
    (Karmarkar-Karp)."""
    token_cap: int | None = None
    """With documents: most tokens one rank trains on in a step (memory); unset: twice
    batch_size x block_size. At least batch_size x block_size + block_size."""
    cost_model: str = "fit"
    """With documents: the cost model the planner balances: fit (time this model's forward and
    backward at several lengths on every rank at start-up) or analytic (FLOP counts)."""
    cost_refit: int = 8
    """With documents and the fitted cost model: refit it online after every plan unit from
    the compute times every rank measured in the last this-many units (with the start-up
    timings), the same fit on every rank; 0: fit once at start-up."""
    busy_wait: bool = False
    """Wait for collectives by polling instead of sleeping, so that a waiting worker keeps its
    share of a CPU shared by several workers (emulates one device per worker on an
    oversubscribed host; for measurements)."""
    speeds: str | list[float] | None = None
    """Emulate workers of unequal speed: one relative speed per worker, comma-separated
    (1,1,1,0.5: the last at half speed) or a TOML list. A worker slower than the fastest
    stretches each of its inner steps by computing (a busy loop) for (fastest / its speed - 1)
    times the step's own measured time, so that it keeps its share of the CPU as a slower
    device would; for measurements. Unset: every worker as it is."""

    # --- model -----------------------------------------------------------------------------
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (0 disables it)."""

    precision: str = "fp32"
    """Arithmetic of the forward and backward: "fp32", or "bf16" (torch.autocast: matrix
    multiplications and attention in bfloat16, reductions, norms and the loss in fp32; the
    weights, their gradients, the inner optimizer's state and every outer algorithm's anchors
    and pseudo-gradients stay fp32). Validation runs in fp32."""

    # --- inner optimizer (AdamW) -----------------------------------------------------------
    optimizer: str = "adamw"
    """Inner optimizer: "adamw", or "muon" (torch.optim.Muon on the blocks' weight matrices,
    its update scaled to AdamW's RMS so it takes the same lr and weight decay; AdamW on
    embeddings, biases and norm gains: lowcomm.optim.MuonAdamW)."""
    lr: float = 2e-3
    """Inner learning rate (after warm-up)."""
    warmup: int = 30
    """Inner steps of linear learning-rate warm-up from 0."""
    lr_schedule: str = "cosine"
    """After warm-up: "cosine" (decay to min_lr_ratio * lr at the last step) or "constant"."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices and embeddings only."""

    # --- the outer algorithm -----------------------------------------------------------------
    outer: dict[str, Any] = field(default_factory=dict)
    """The outer hyperparameters given, by keyword of the algorithms' ``Config`` dataclasses
    (outer_lr, overlap, clip, ...: :data:`~lowcomm.train.outer_keys.OUTER_KEYS`; flat keys in
    files and flags, ``--outer-lr``); unset: the algorithm's default (the job's, where it has
    one). Resolved into :attr:`algorithm`."""
    algorithm: Hyperparameters | None = field(init=False, default=None, repr=False, compare=False)
    """The algorithm's own ``Config`` (``CO2.Config``, ``DeMoConfig``; ``None`` for ddp and
    none), resolved once from the library's defaults < the job's < the file's and the flags'
    (:attr:`outer`) — the link's choice (``--tune-link``) takes the place of the first two only:
    a new configuration made with :meth:`replace`."""
    _kwargs: dict[str, Any] = field(init=False, default_factory=dict, repr=False, compare=False)

    # --- evaluation and output -------------------------------------------------------------
    eval_every: int = 60
    """Inner steps between validation evaluations, rounded up to a multiple of sync_every."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    log_every: int = 10
    """Inner steps per training-loss record (their mean) and progress-bar update."""
    out: str | None = None
    """Output folder; unset: runs/<name>/."""
    overwrite: bool = False
    """Replace the files of a previous run in the output folder (refused otherwise)."""
    tensorboard: str | None = None
    """Also write lowcomm's scalars (lowcomm/loss, val_loss, pseudo_grad_norm, bytes sent and
    received, time blocked, hidden fraction, skipped updates) as TensorBoard event files to
    this folder, with the outer step as their x-axis (rank 0's; needs lowcomm[tensorboard])."""
    quiet: bool = False
    """Workers log warnings only: no progress bar, no start-up or per-evaluation lines."""
    ceiling_steps: int = 0
    """Also time this many inner steps with no synchronisation at all, on a copy of the model in
    the same worker processes (in segments of 2 steps interleaved with training: the first
    before it, the last after it, the others spread over the run where no sync is in flight,
    each rank on its own; the slowest rank's time counts), and report throughput as a share of
    that ceiling (0: off)."""
    name: str | None = None
    """Run name; unset: <algo>-<YYYYmmdd-HHMMSS>."""

    # --- checkpoints and failures ----------------------------------------------------------
    checkpoint_every: int = 0
    """Inner steps between resumable checkpoints of every rank's state, written to
    <out>/checkpoints/step-NNNNNN/ (0: none)."""
    keep_checkpoints: int = 3
    """Complete checkpoints to keep, the newest (older ones are deleted)."""
    resume: str | None = None
    """Resume from a checkpoint: a step-NNNNNN folder, a run folder, or (--resume alone) the
    latest complete checkpoint under --out. The settings must match the checkpoint's."""
    max_restarts: int = 0
    """Restart the worker group this many times after a worker fails, each time from the latest
    complete checkpoint (local launch; under torchrun use its own --max-restarts)."""
    collective_timeout: float = 600.0
    """Seconds a collective may wait for a peer before the worker fails: bounds how long the
    others hang when a worker dies or stalls (raise it for big models on slow links)."""

    # --- elastic replicas (lowcomm[ft]) -------------------------------------------------------
    fault_tolerance: bool = False
    """Run every worker as a replica of its own on torchft: one that dies is left out of the
    next sync and restarted alone (up to max_restarts times each), then healed from a live one;
    the others keep training. Starts a Lighthouse on 127.0.0.1 unless lighthouse is given."""
    min_replicas: int = 1
    """With fault_tolerance: a sync needs at least this many replicas (fewer wait for more)."""
    lighthouse: str | None = None
    """With fault_tolerance: join the Lighthouse at this address (http://HOST:PORT) as the one
    replica replica_id, instead of starting a Lighthouse and every replica here."""
    replica_id: str | None = None
    """With lighthouse: this replica's name, the same when it is restarted (replica_3)."""
    dropped_residual: str = "keep"
    """With fault_tolerance and compression: what a replica's error-feedback residual keeps when
    its sync is dropped (a replica left during it): keep (what was not sent stays) or reset."""
    heal: str | None = None
    """With fault_tolerance: how a replica that (re)joins past the warm start is healed:
    blocking (everything in the quorum, which the next sync of every replica waits for) or
    background (its quorum brings the donor's counters; the tensors follow while every replica
    syncs on, and it catches up on the syncs it missed; see docs/fault-tolerance.md for what it
    risks). Not given: chosen with the settings from the link (background where a blocking heal
    would hold every replica for more than a round and the syncs leave the link mostly idle,
    :func:`lowcomm.train.tuning.choose_heal`), else blocking."""
    heal_inner: str | None = None
    """With fault_tolerance: what of its donor's inner optimizer state a replica healed past the
    warm start receives: bf16 (the donor's moments in bf16) or none (its inner optimizer starts
    afresh: a heal a third smaller on the default job). Not given: chosen with the heal, none
    for a heal in the background and bf16 for a blocking one
    (:func:`lowcomm.train.elastic_config.heal_inner_for`)."""

    @property
    def world_size(self) -> int:
        """Processes of the job on a local launch: ``workers`` (``nodes`` x ``procs_per_node``
        with several nodes); torchrun's world size must equal it when ``nodes`` > 1."""
        assert self.workers is not None, "resolved in __post_init__"
        return self.workers

    @property
    def replicas(self) -> int:
        """With fault_tolerance, the replicas ``lowcomm train`` starts: one per node with node
        groups (``nodes``), else one per worker."""
        return self.nodes if self.nodes > 1 else self.world_size

    @property
    def procs_per_replica(self) -> int:
        """With fault_tolerance, the processes that train one replica together (DDP inside
        it): ``procs_per_node`` with node groups, else 1."""
        return self.procs_per_node if self.nodes > 1 and self.procs_per_node else 1

    @property
    def hierarchical(self) -> bool:
        """Whether the job runs node groups: DDP inside each node, the algorithm across nodes
        (``nodes`` > 1 with an outer algorithm; ddp runs over every process)."""
        return self.nodes > 1 and self.algo not in NO_OUTER_ALGORITHM

    @property
    def node_size(self) -> int:
        """Processes that train one replica together (DDP, and ZeRO with ``node_sharding``):
        ``procs_per_node`` with node groups, every process for ddp on one node, else 1."""
        if self.nodes > 1 and self.algo != "none":
            assert self.procs_per_node is not None
            return self.procs_per_node
        return self.world_size if self.algo == "ddp" else 1

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHM_CHOICES:
            raise ConfigError(
                "algo", f"must be one of {', '.join(ALGORITHM_CHOICES)}, got {self.algo!r}"
            )
        self._check_outer_keys()
        self.workers, self.procs_per_node = resolve_layout(
            nodes=self.nodes,
            workers=self.workers,
            procs_per_node=self.procs_per_node,
            node_sharding=self.node_sharding,
            algo=self.algo,
        )
        if self.link is not None:
            from lowcomm.link import EmulatedLink

            try:
                EmulatedLink.parse(str(self.link))
            except ValueError as e:
                raise ConfigError("link", str(e).removeprefix("link ")) from None
        if self.tune_link not in ("auto", "measure", "off"):
            from lowcomm.link import EmulatedLink

            try:
                EmulatedLink.parse(str(self.tune_link))
            except ValueError as e:
                raise ConfigError(
                    "tune_link",
                    f"must be auto, measure, off or a link profile: {str(e).removeprefix('link ')}",
                ) from None
        for key in ("workers", "steps", "sync_every", "batch_size", "block_size"):
            check_int(key, getattr(self, key), low=1)
        for key in ("n_layer", "n_head", "n_embd", "eval_every", "eval_batches", "log_every"):
            check_int(key, getattr(self, key), low=1)
        if self.steps > MAX_STEPS:
            years = self.steps * FASTEST_STEP_S / (365.25 * 86400)
            raise ConfigError(
                "steps",
                f"({self.steps:,}) cannot be reached: even at {FASTEST_STEP_S * 1e3:g} ms per "
                f"step, faster than any device runs a training step, they take {years:,.1f} "
                f"years; use at most {MAX_STEPS:,}",
            )
        check_int("seed", self.seed, low=0)
        self._check_documents()
        check_int("warmup", self.warmup, low=0)
        check_int("ceiling_steps", self.ceiling_steps, low=0)
        check_int("checkpoint_every", self.checkpoint_every, low=0)
        check_int("keep_checkpoints", self.keep_checkpoints, low=1)
        check_int("max_restarts", self.max_restarts, low=0)
        check_fault_tolerance(self)
        self._check_speeds()
        check_float("collective_timeout", self.collective_timeout, low=0.0, low_open=True)
        if self.n_embd % self.n_head:
            raise ConfigError(
                "n_embd",
                f"({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"try n_embd {self.n_head * max(1, round(self.n_embd / self.n_head))}",
            )
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_float("weight_decay", self.weight_decay, low=0.0)
        self._check_optimizer()
        if self.lr_schedule not in _LR_SCHEDULES:
            raise ConfigError(
                "lr_schedule",
                f"must be one of {', '.join(_LR_SCHEDULES)}, got {self.lr_schedule!r}",
            )
        check_float("min_lr_ratio", self.min_lr_ratio, low=0.0)
        if self.min_lr_ratio > 1.0:
            raise ConfigError("min_lr_ratio", f"must be <= 1, got {self.min_lr_ratio}")
        check_float("dropout", self.dropout, low=0.0)
        if self.dropout >= 1.0:
            raise ConfigError("dropout", f"must be < 1, got {self.dropout}")
        check_float("bucket_cap_mb", self.bucket_cap_mb, low=0.0, low_open=True)
        if self.backend not in _BACKENDS:
            raise ConfigError(
                "backend", f"must be one of {', '.join(_BACKENDS)}, got {self.backend!r}"
            )
        if self.device not in DEVICES:
            raise ConfigError("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError(
                "backend",
                "'nccl' needs the workers on GPUs, and device is 'cpu'; use gloo or auto "
                "(or device cuda)",
            )
        for key in ("overwrite", "quiet", "algo_from_link"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, f"must be true or false, got {getattr(self, key)!r}")
        if self.data is not None:
            check_string("data", self.data)
            if not os.path.exists(os.path.expanduser(self.data)):
                raise ConfigError(
                    "data",
                    f"path {self.data!r} does not exist: pass a UTF-8 text file or a folder of "
                    "text files, or leave it unset for the embedded corpus",
                )
        self._check_paths()
        self._check_outer()
        check_elastic_overlap(self)

    def stretch(self, rank: int, world: int) -> float:
        """How many times its own compute each inner step of ``rank`` takes (``speeds``):
        the fastest worker's speed over this one's; 1.0 without ``speeds``."""
        if self.speeds is None:
            return 1.0
        speeds = [float(v) for v in str(self.speeds).split(",")]
        if len(speeds) != world:
            raise ConfigError(
                "speeds",
                f"gives {len(speeds)} speed(s) but the job has {world} worker processes; give "
                "one per worker",
            )
        return max(speeds) / speeds[rank]

    # --- outer hyperparameters -------------------------------------------------------------

    def _check_outer_keys(self) -> None:
        """:attr:`outer` holds known keys only (``None``: unset, dropped); ``clip`` may be
        spelled ``"none"`` in any case (no clipping; any other string is the algorithm's to
        check)."""
        if not isinstance(self.outer, Mapping):
            raise ConfigError("outer", f"must be a mapping of keys to values, got {self.outer!r}")
        unknown = [k for k in self.outer if k not in ALL_OUTER_KEYS]
        if unknown:
            raise ConfigError(
                None,
                f"unknown outer key {unknown[0]!r}; valid keys: {', '.join(ALL_OUTER_KEYS)}",
            )
        self.outer = {k: v for k, v in self.outer.items() if v is not None}
        clip = self.outer.get("clip")
        if isinstance(clip, str) and clip.lower() == "none":
            self.outer["clip"] = "none"

    def _check_outer(self) -> None:
        """Resolve :attr:`algorithm` (the algorithm checks its own keywords), then check what
        needs the job's other settings."""
        if self.algo == "ddp" and self.outer.get("compression") is not None:
            from lowcomm.compress import parse_compression

            try:
                parse_compression(self.outer["compression"])
            except ValueError as e:
                raise ConfigError("compression", f"is not usable: {e}") from None
        self._kwargs = kwargs = self._resolve_kwargs()
        entry = REGISTRY[self.algo]
        try:
            if entry.cls is not None:
                self.algorithm = self.algorithm_class().resolve(**kwargs)
            elif entry.options is not None:
                self.algorithm = entry.options(**kwargs)
        except ValueError as e:
            raise config_error(e, config_keys()) from None
        if entry.cls is None:
            return
        slowmo = issubclass(entry.cls, SlowMo)
        if slowmo and self.lr_schedule == "cosine" and self.min_lr_ratio == 0:
            raise ConfigError(
                "min_lr_ratio",
                "must be > 0 for slowmo with the cosine schedule: SlowMo divides its update by "
                "the inner learning rate, which would reach 0 at the last step; use e.g. "
                "min_lr_ratio 0.1 or lr_schedule constant",
            )
        if kwargs.get("local_steps") == "dynamic":
            refusals = (
                (
                    self.documents,
                    "documents (their steps hold unequal tokens; --balance "
                    "evens out the work instead)",
                ),
                (self.nodes > 1, "node groups (the processes of a node step together)"),
                (self.fault_tolerance, "fault_tolerance (its plans assume a fixed group)"),
            )
            for refused, why in refusals:
                if refused:
                    raise ConfigError("local_steps", f"'dynamic' cannot be combined with {why}")
        fragments = kwargs.get("num_fragments")
        if fragments is not None and fragments > self.n_layer:
            raise ConfigError(
                "num_fragments",
                f"({fragments}) exceeds n_layer ({self.n_layer}): fragments are made of whole "
                f"transformer blocks; use at most {self.n_layer} fragments or more layers",
            )

    def outer_keys_set(self) -> list[str]:
        """Outer hyperparameters the user set (not None), in field order."""
        return [k for k in ALL_OUTER_KEYS if k in self.outer]

    def ignored_outer_keys(self) -> list[str]:
        """Outer hyperparameters the user set that do not apply to ``algo``."""
        applies = OUTER_KEYS[self.algo]
        return [k for k in self.outer_keys_set() if k not in applies]

    def algorithm_class(self) -> type[OuterAlgorithm]:
        """The class that runs ``algo`` (its registry entry's; not for ``ddp``)."""
        entry = REGISTRY[self.algo]
        assert entry.cls is not None, f"{self.algo} runs no outer algorithm"
        return entry.cls

    def algorithm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``algorithm_class()(model, inner, **kwargs)`` (of
        :attr:`algorithm`: resolved once, a copy each call)."""
        return dict(self._kwargs)

    def _resolve_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`algorithm_kwargs`.

        ``sync_every`` and ``bucket_cap_mb`` always, the keywords the registry entry fixes
        (``co2-eager``: ``eager=True``), plus the outer hyperparameters the user set that apply
        to the algorithm (else the job's defaults, :func:`~.outer_keys.job_outer_defaults`);
        ``clip="none"`` becomes
        ``clip=None`` (no clipping).
        """
        entry = REGISTRY[self.algo]
        if entry.cls is None:
            # demo: its options as set (unset: the library's defaults)
            keys = OUTER_KEYS[self.algo] if entry.options is not None else ()
            return {k: self.outer[k] for k in keys if k in self.outer}
        kwargs: dict[str, Any] = {
            "sync_every": self.sync_every,
            "bucket_cap_mb": self.bucket_cap_mb,
            **entry.fixed,
        }
        job_defaults = job_outer_defaults(
            self.algo,
            steps=self.steps,
            sync_every=self.sync_every,
            n_layer=self.n_layer,
            fault_tolerance=self.fault_tolerance,
            overlap=self.outer.get("overlap"),
            local_steps=self.outer.get("local_steps"),
        )
        for key in OUTER_KEYS[self.algo]:
            value = self.outer.get(key)
            if value is None:
                if key not in job_defaults:
                    continue
                value = job_defaults[key]
            if key == "clip" and value == "none":
                value = None
            kwargs[key] = value
        return kwargs

    def sync_warmup_steps(self) -> int:
        """K: the steps of this job's synchronous warm start (0: none; ddp: every step is
        synchronous, and 0 here)."""
        if self.algo in NO_OUTER_ALGORITHM:
            return 0
        return int(self._kwargs.get("sync_warmup", 0))

    # --- derived values --------------------------------------------------------------------

    @property
    def eval_interval(self) -> int:
        """``eval_every`` rounded up to a multiple of ``sync_every`` (ddp: unchanged), so that
        every evaluation sees the consensus model right after a round boundary."""
        if self.algo in NO_OUTER_ALGORITHM:
            return self.eval_every
        return math.ceil(self.eval_every / self.sync_every) * self.sync_every

    def with_paths(self, now: datetime.datetime | None = None) -> TrainConfig:
        """A copy with ``name`` (default ``<algo>-<YYYYmmdd-HHMMSS>``) and ``out`` (default
        ``runs/<name>``; when resuming from a checkpoint path, the run folder that holds it)
        filled in (:func:`~lowcomm.train.paths.run_paths`)."""
        from lowcomm.train.paths import run_paths

        cfg = copy.copy(self)
        cfg.name, cfg.out = run_paths(self.algo, self.name, self.out, self.resume, now)
        cfg._check_paths()  # only the two paths change: check them rather than every field
        return cfg

    def value(self, key: str) -> Any:
        """The value of a flat key (:func:`config_keys`): a field's, or an outer
        hyperparameter's as given (``None``: unset)."""
        if key in OUTER_FIELDS:
            return self.outer.get(key)
        if key not in _JOB_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def replace(self, **values: Any) -> TrainConfig:
        """A copy with some flat keys changed (fields and outer hyperparameters alike), checked
        and resolved anew."""
        outer = {k: v for k, v in values.items() if k in OUTER_FIELDS}
        job = {k: v for k, v in values.items() if k not in OUTER_FIELDS}
        return dataclasses.replace(self, **job, outer={**self.outer, **outer})

    def to_dict(self) -> dict[str, Any]:
        """Every flat key and its value (:func:`config_keys`; unset outer hyperparameters
        ``None``), JSON- and ``torch.load(weights_only=True)``-safe: what
        :func:`config_from_dict` reads back."""
        return {key: copy.deepcopy(self.value(key)) for key in config_keys()}

    # --- checks that need several fields ---------------------------------------------------

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


_JOB_FIELDS = [f.name for f in dataclasses.fields(TrainConfig) if f.init and f.name != "outer"]


def config_keys() -> list[str]:
    """Every flat key of the job (its flags and TOML keys), in the order ``--help`` lists them:
    the fields, with the outer hyperparameters after ``weight_decay``."""
    at = _JOB_FIELDS.index("weight_decay") + 1
    return [*_JOB_FIELDS[:at], *ALL_OUTER_KEYS, *_JOB_FIELDS[at:]]


def key_type(key: str) -> str:
    """The annotation of a flat key (``int``, ``float | None``, ...): an outer hyperparameter's
    may always be ``None`` (unset)."""
    if key in OUTER_FIELDS:
        return job_type(OUTER_FIELDS[key])
    return str(next(f.type for f in dataclasses.fields(TrainConfig) if f.name == key))


def key_default(key: str) -> Any:
    """The default of a flat key (``None`` for the outer hyperparameters: unset)."""
    if key in OUTER_FIELDS:
        return None
    f = next(f for f in dataclasses.fields(TrainConfig) if f.name == key)
    return f.default


def config_from_dict(values: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
    """A :class:`TrainConfig` from flat keys (:func:`config_keys`, as in files and flags; unknown
    ones raise :class:`ConfigError`); ``algo_from_link`` unset: on when no ``algo`` or outer key."""
    keys = config_keys()
    unknown = [k for k in values if k not in keys]
    if unknown:
        raise ConfigError(
            None,
            f"unknown key {unknown[0]!r} in {source}; valid keys: {', '.join(keys)}",
        )
    outer = {k: v for k, v in values.items() if k in OUTER_FIELDS}
    job = {k: v for k, v in values.items() if k not in OUTER_FIELDS}
    job.setdefault("algo_from_link", "algo" not in job and all(v is None for v in outer.values()))
    return TrainConfig(**job, outer=outer)


def field_docs() -> dict[str, str]:
    """The one-line docstring of each flat key (used for ``--help``)."""
    docs = {k: v for k, v in field_docstrings(TrainConfig).items() if k in _JOB_FIELDS}
    docs.update({key: outer_doc(key) for key in ALL_OUTER_KEYS})
    return docs
